"""The capacity simulator: the event logic with constant step times, PD handoff, the sweep, the YAML config and the
CLI (its cost model: test_sim_cost.py)."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

from hcfjax.bench.sim_validate_pd import breakdown
from hcfjax.engine.scheduler import SchedulerConfig
from hcfjax.sim import SLO, Deployment, Pool, Workload, simulate
from hcfjax.sim.config import from_mapping, load_config
from hcfjax.sim.cost import CostModel
from hcfjax.sim.deployment import model_config
from hcfjax.sim.gpus import Efficiency, gpu
from hcfjax.sim.instances import Clock, DecodeInstance, EngineInstance, Host, PrefillInstance, new_request
from hcfjax.sim.sweep import Search, candidates, max_rate
from hcfjax.sim.work import PrefillShapes
from hcfjax.sim.workload import workload

CONFIGS = Path(__file__).parent.parent / "hcfjax" / "sim" / "configs"


# -- the event logic, with constant step times -------------------------------------------------------------------------
def _engine(step_s, host=None, budget=256, **kw):
    clock, done = Clock(), []
    cfg = SchedulerConfig(max_slots=4, num_pages=64, page_size=16, token_budget=budget, **kw)
    inst = EngineInstance(clock, "e", cfg, lambda plan: step_s, host or Host(), on_finish=lambda r, i: done.append(r))
    return clock, inst, done


def test_engine_loop_constant_steps_gives_exact_ttft_and_tpot():
    clock, inst, done = _engine(0.02)
    req = new_request("r", 100, 5, 1.0)
    clock.at(1.0, lambda: inst.submit(req))
    clock.run()
    assert done == [req]
    assert req.first_token_time - req.arrival == pytest.approx(0.02)  # the prefill step
    assert (req.last_token_time - req.first_token_time) / 4 == pytest.approx(0.02)  # one token per step
    assert inst.steps == 6  # 1 prefill + 5 decode: the engine learns of the end one step late


def test_engine_loop_chunks_and_host_bound_steps():
    clock, inst, _ = _engine(0.01, budget=64)
    req = new_request("r", 200, 2, 0.0)  # 200 tokens in chunks of 64: 4 steps to the first token
    clock.at(0.0, lambda: inst.submit(req))
    clock.run()
    assert req.first_token_time == pytest.approx(0.04)
    # the host takes longer than the device: steps come every dispatch + process seconds
    clock, inst, _ = _engine(0.001, Host(0.003, 0.002))
    req = new_request("r", 10, 4, 0.0)
    clock.at(0.0, lambda: inst.submit(req))
    clock.run()
    assert (req.last_token_time - req.first_token_time) / 3 == pytest.approx(0.005)


def test_preemption_recomputes_and_everything_finishes():
    dep = Deployment(
        model="tiny-v3",
        gpu="H200",
        quant=None,
        mode="colocated",
        colocated=Pool(max_slots=8, page_size=16, num_pages=16, token_budget=128),
    )
    res = simulate(dep, Workload(requests=60, rate=100.0, scale=0.05, max_model_len=160))
    assert res.finished == 60 and res.preemptions > 0
    with pytest.raises(ValueError, match="pages"):  # a request no rank can ever hold is refused, as the engine does
        simulate(dep, Workload(requests=30, rate=100.0, scale=0.05, max_model_len=512))


def test_mixed_token_budget_reaches_the_simulated_scheduler():
    """A colocated pool's mixed_token_budget is its scheduler's (the engine's code plans the simulated steps); a
    PD decode pool, which prefills nothing, has none."""
    pool = Pool(max_slots=8, page_size=16, num_pages=64, token_budget=128, mixed_token_budget=48)
    dep = Deployment(model="tiny-v3", gpu="H200", quant=None, mode="colocated", colocated=pool)
    assert dep.scheduler_config(pool, "colocated", 64).mixed_token_budget == 48
    assert dep.scheduler_config(pool, "decode", 64).mixed_token_budget is None
    assert simulate(dep, Workload(requests=20, rate=50.0, scale=0.05, max_model_len=160)).finished == 20


def test_pd_handoff_with_constant_times():
    clock, done = Clock(), []
    decode_cfg = SchedulerConfig(max_slots=4, num_pages=64, page_size=16, remote_prefill=True)
    prefills = []
    send = lambda req, epoch, target: prefills[0].submit(req, epoch, target)
    dec = DecodeInstance(clock, "d", decode_cfg, lambda plan: 0.01, on_finish=lambda r, i: done.append(r), send=send)
    pre_cfg = SchedulerConfig(max_slots=4, num_pages=64, page_size=16, token_budget=256)
    prefills.append(PrefillInstance(clock, "p", pre_cfg, lambda plan: 0.1, lambda job, first, end: end + 0.05))
    req = new_request("r", 100, 5, 0.0)
    late = new_request("late", 50, 3, 0.165)  # admitted while `req` decodes: its prompt still goes to the prefill
    clock.at(0.0, lambda: dec.submit(req))
    clock.at(late.arrival, lambda: dec.submit(late))
    clock.run()
    assert done == [req, late] and req.output == [0] * 5 and late.output == [0] * 3
    assert late.first_token_time - late.arrival >= 0.15
    assert req.first_token_time == pytest.approx(0.15)  # prefill 0.1 + transfer 0.05
    assert (req.last_token_time - req.first_token_time) / 4 == pytest.approx(0.01)
    assert not dec.sched.running and all(a.num_free == 64 for a in dec.sched.alloc)
    assert not prefills[0].sched.running and prefills[0].sched.alloc[0].num_free == 64


def test_pd_deployment_runs_and_attributes_time():
    dep = Deployment(
        model="v2-lite",
        gpu="H200",
        quant=None,
        acceptance=(0.8,),
        prefill=Pool(tp=2, ep=2, max_slots=8, token_budget=2048),
        decode=Pool(dp=2, ep=2, max_slots=16),
    )
    res = simulate(dep, Workload(requests=40, rate=4.0, scale=0.1))
    assert res.finished == 40 and res.ttft[50] > 0 and res.tpot[50] > 0
    assert set(res.parts) == {"prefill", "decode"} and res.parts["decode"]["attn_decode"] > 0
    assert 0 < res.utilisation["decode0"] <= 1 and 0 < res.utilisation["prefill0"] <= 1


def test_prefill_shapes_are_the_workers():
    """The simulator's copy of PrefillWorker._shape (the sim does not import the model code) gives its shapes."""
    from types import SimpleNamespace

    from hcfjax.pd.prefill import PrefillConfig, PrefillWorker

    worker = SimpleNamespace(config=PrefillConfig(page_size=16, chunk=128, min_bucket=64))
    shapes = PrefillShapes(page_size=16, chunk=128, min_bucket=64)
    for rows, longest in [(1, 1), (1, 64), (2, 65), (3, 300), (4, 1000)]:
        assert shapes.shape(rows, longest) == PrefillWorker._shape(worker, rows, longest)
    assert shapes.shape(2, 300) == (2, 128, 384, 32)  # three chunks of 128, a table of 24 pages -> 32
    (w,) = shapes.shape_works(2, 128, 384, 32)
    assert (w.tokens, w.logits, w.pre_pairs) == (768, 2, 768 * 512)
    assert w.pre_kv == w.pre_expand == 2 * 512 * 3  # each chunk of each row reads the whole table


def _profile(path: Path, eff: Efficiency) -> str:
    path.write_text(json.dumps(dataclasses.asdict(eff)))
    return str(path)


def test_pd_engine_shapes_by_hand(tmp_path):
    """1P1D as bench.sim_validate builds it, each pool with its own profile: the prefill instance batches whole prompts
    in the worker's shapes, the cache moves over a measured link in whole pages, the decode instance steps every
    slot. A lone request's TTFT is the prefill host's dispatch + its batch's step + the transfer, its TPOT the
    decode step; two prompts arriving together are one prefill batch, and the second transfer waits for the first."""
    pre = Efficiency(1, 1, 1, 1, 1, 1, 1, 1, 0.0, step_overhead_s=0.05, host_dispatch_s=0.003)
    dec = Efficiency(1, 1, 1, 1, 1, 1, 1, 1, 0.0, step_overhead_s=0.01, transfer_gbs=1.0, transfer_latency_s=0.02)
    dep = Deployment(
        model="tiny-v3",
        gpu="H200",
        quant=None,
        mode="pd",
        engine_shapes=True,
        max_model_len=512,
        prefill=Pool(page_size=16, min_bucket=64, chunk=128, max_prefill_rows=2, token_budget=4096, num_pages=64),
        decode=Pool(max_slots=4, page_size=16),
    )
    dep = dep.replace(
        prefill=dataclasses.replace(dep.prefill, efficiency=_profile(tmp_path / "pre.json", pre)),
        decode=dataclasses.replace(dep.decode, efficiency=_profile(tmp_path / "dec.json", dec)),
    )
    cfg = model_config("tiny-v3")
    pc, dc = CostModel(cfg, gpu("H200"), pre), CostModel(cfg, gpu("H200"), dec)
    shapes = PrefillShapes(16, 128, 64)
    step = lambda n_rows, longest: pc.step(shapes.shape_works(*shapes.shape(n_rows, longest))).seconds
    link = lambda tokens: 0.02 + dc.kv_bytes(-(-tokens // 16) * 16) / 1e9  # whole pages of 16
    decode = dc.step(dep.engine_shapes_for(dep.decode, cfg).shape_works(0, 0, 4)).seconds  # 4 slots, min 8 rows

    trace = tmp_path / "one.csv"
    trace.write_text("arrival_s,input,output\n0.0,100,5\n")
    marks: dict[str, dict[str, float]] = {}
    res = simulate(
        dep, Workload(requests=0, trace=str(trace)), trace=lambda ev, r, t: marks.setdefault(r, {}).setdefault(ev, t)
    )
    assert res.finished == 1
    assert res.ttft[50] == pytest.approx(0.003 + step(1, 100) + link(100))
    assert res.tpot[50] == pytest.approx(decode)
    # the same request's marks, as bench.sim_validate's breakdown lays them beside the workers' (hcfjax.trace)
    (m,) = marks.values()
    assert m["arrive"] == m["remote"] == 0.0 and m["batch"] == pytest.approx(0.003)
    assert m["computed"] - m["batch"] == pytest.approx(step(1, 100))
    assert m["received"] - m["computed"] == pytest.approx(link(100)) and m["first"] == m["received"]
    table = breakdown({}, marks)
    assert f"| TTFT | - | {res.ttft[50] * 1e3:.1f} |" in "\n".join(table)

    # a transfer landing while the decode instance steps: at the first iteration after its bytes arrived, or (the
    # jax transport as measured) when the step in flight ends, installed one iteration (one step) later
    trace.write_text("arrival_s,input,output\n0.0,100,60\n0.2,100,5\n")
    for waits in (False, True):
        marks = {}
        simulate(
            dep.replace(transfer_waits_for_step=waits),
            Workload(requests=0, trace=str(trace)),
            trace=lambda ev, r, t, marks=marks: marks.setdefault(r, {}).setdefault(ev, t),
        )
        m = marks["r1"]
        bytes_in = m["computed"] + link(100)
        if waits:
            assert bytes_in < m["received"] < bytes_in + decode
            assert m["first"] - m["received"] == pytest.approx(decode)
        else:
            assert m["received"] == pytest.approx(bytes_in) and m["first"] - m["received"] < decode
    assert marks["r0"]["first"] < 0.2 < marks["r0"]["received"] + 60 * decode  # r1 came while r0 decoded

    trace.write_text("arrival_s,input,output\n0.0,100,5\n0.0,300,5\n")
    res = simulate(dep, Workload(requests=0, trace=str(trace)))
    assert sum(res.parts["prefill"].values()) == pytest.approx(step(2, 300))  # one batch of (2, 128, 384, 32)
    spread = (res.ttft[99] - res.ttft[50]) / 0.49  # two requests: percentiles interpolate between them
    a, b = res.ttft[50] - spread / 2, res.ttft[50] + spread / 2
    assert a == pytest.approx(0.003 + step(2, 300) + link(100))
    assert a + link(300) <= b < a + link(300) + decode  # after its transfer, which waited for the first one's


def test_validate_builds_the_workers_deployment():
    """bench.sim_validate's 1P1D deployment has the PD workers' configs (bench.serve's), and the workers' command
    lines make `hcfjax serve` build exactly those configs."""
    import argparse

    from hcfjax.bench.serve_pd import pd_configs, pd_gpus, pd_role_args, role_env
    from hcfjax.bench.sim_validate_pd import deployment
    from hcfjax.cli import build_parser
    from hcfjax.serving.config import engine_config, prefill_config

    args = argparse.Namespace(
        preset="v2-lite", scheme="w4a8c8", model=None, pd="jax", page_size=64, max_model_len=4096, token_budget=256,
        prefill_rows=2, min_bucket=64, max_slots=32, requests=48,
    )  # fmt: skip
    pre, dec = pd_configs(args)
    pre_args, dec_args = pd_role_args(args, pre, dec)
    parse = lambda role_args: build_parser().parse_args(["serve", *role_args])
    worker = engine_config(parse(dec_args))
    assert worker.executable_cache.endswith("steps")  # each worker keeps its compiled steps under its own cache
    assert prefill_config(parse(pre_args)).executable_cache == worker.executable_cache
    assert dataclasses.replace(prefill_config(parse(pre_args)), executable_cache=None) == pre
    assert dataclasses.replace(worker, executable_cache=None) == dec
    assert parse(pre_args).role == "prefill" and parse(dec_args).model is None
    assert {(parse(a).preset, parse(a).scheme) for a in (pre_args, dec_args)} == {("v2-lite", "w4a8c8")}
    assert (pre.token_budget, pre.max_rows, pre.chunk, pre.min_bucket, pre.page_size) == (4096, 2, 2048, 64, 64)
    assert (dec.max_slots, dec.page_size, dec.max_model_len, dec.token_budget) == (32, 64, 4096, 256)
    dep = deployment("v2-lite", "H200", pre, dec, {"prefill": "a.json", "decode": "b.json"})
    assert dep.prefill.efficiency == "a.json" and dep.decode.efficiency == "b.json" and dep.engine_shapes
    cfg = model_config("v2-lite")
    assert dep.engine_limits(dep.decode, cfg) == (4096, 65, 1040)  # Engine: 65 pages a request, 32 x 65 / 2
    sched = dep.scheduler_config(dep.prefill, "prefill", pre.num_pages)
    assert sched.whole_prompts and sched.spf_window_s == 0 and sched.token_budget == 4096
    assert pd_gpus("0,1") == ("0", "1") and pd_gpus(None) is None
    with pytest.raises(SystemExit, match="two GPU indices"):
        pd_gpus("0")
    env = role_env("1", 0.4, JAX_PLATFORMS="cpu")
    assert env["CUDA_VISIBLE_DEVICES"] == "1" and env["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.4"


# -- workloads, sweep, config, CLI -------------------------------------------------------------------------------------
def test_workload_is_the_benchmarks():
    wl = Workload(requests=16, rate=1.0, seed=3, scale=0.125, max_model_len=4096, vocab=1000)
    ins, outs, _, arrivals = workload(3, 16, 1.0, 0.125, 4096, 1000)
    assert wl.requests_list() == [(float(a), int(i), int(o)) for a, i, o in zip(arrivals, ins, outs, strict=True)]
    # outputs scaled apart from inputs: the same requests (draws and arrivals), longer outputs only
    ins4, outs4, _, arrivals4 = workload(3, 16, 1.0, 0.125, 4096, 1000, output_scale=0.5, max_input=4000)
    assert (ins4 == ins).all() and (arrivals4 == arrivals).all() and (outs4 >= 4 * outs - 2).all()


def test_max_rate_and_candidates():
    cfg = load_config(CONFIGS / "tiny.yaml")
    slo = dataclasses.replace(cfg.slo, ttft_s=0.01)  # tiny-v3 steps take about a millisecond: queueing decides
    best, points = max_rate(cfg.deployment, cfg.workload.replace(requests=40), slo, Search(1.0, 4000.0, 3))
    assert best is not None and best.result.meets_slo
    assert any(not p.result.meets_slo and p.rate > best.rate for p in points)  # the search bracketed it
    h200 = load_config(CONFIGS / "reference-h200.yaml")
    layouts = candidates(h200.deployment, h200.grid, h200.total_gpus)
    assert layouts and all(dep.gpus <= 16 for _, dep, _ in layouts)
    assert not any(dep.prefill.tp == 4 and dep.decode.dp == 12 and dep.prefill.instances == 2 for _, dep, _ in layouts)


def test_refinement_walks_to_the_finer_optimum(monkeypatch):
    """The pattern search after the grid: with throughput peaking at 22 slots, the grid [8, 32, 64] finds 32; the
    refinement rates it again on the lattice, then steps of 32, 16, 8, 4, 2 reach 22, each layout rated once."""
    from types import SimpleNamespace

    from hcfjax.sim import sweep as sweep_mod

    grid_calls, fine_calls = [], []

    def fake(calls):
        def rate(dep, wl, slo, search, *start):
            calls.append(dep.colocated.max_slots)
            result = SimpleNamespace(output_tok_s=1000.0 - (dep.colocated.max_slots - 22) ** 2, meets_slo=True)
            point = sweep_mod.Point(search.lo, result)
            return point, [point]

        return rate

    monkeypatch.setattr(sweep_mod, "max_rate", fake(grid_calls))
    monkeypatch.setattr(sweep_mod, "max_rate_on_lattice", fake(fine_calls))
    cfg = load_config(CONFIGS / "tiny.yaml")
    out = sweep_mod.sweep(
        cfg.deployment, cfg.workload, cfg.slo, {"max_slots": [8, 32, 64]}, None, log=lambda s: None,
        refine={"max_slots": 2},
    )  # fmt: skip
    assert out[0].values["max_slots"] == 22 and out[0].tok_s == 1000.0
    assert grid_calls == [8, 32, 64] and fine_calls == [32, 64, 16, 48, 8, 24, 20, 28, 22, 26]
    assert len(out) == 10  # the grid's layouts were rated again on the lattice: those replace their grid rates


def test_lattice_rate_search(monkeypatch):
    """Rates on search.lo x 1.03^i: from a start next to the answer a few runs find the highest rate meeting the
    SLO; from far away more; the range's top, or None, at the ends."""
    from types import SimpleNamespace

    from hcfjax.sim import sweep as sweep_mod

    runs, limit = [], [2.0]
    monkeypatch.setattr(sweep_mod, "simulate", lambda dep, wl, slo: runs.append(wl.rate) or SimpleNamespace(
        meets_slo=wl.rate <= limit[0]))  # fmt: skip
    search, wl = Search(0.25, 16.0), Workload(requests=1)
    top, points = sweep_mod.max_rate_on_lattice(None, wl, SLO(), search, start=1.9)
    assert top.rate <= 2.0 < top.rate * 1.03 and len(runs) == len(points) <= 4
    far, _ = sweep_mod.max_rate_on_lattice(None, wl, SLO(), search, start=0.3)
    assert far.rate == top.rate and len(runs) <= 4 + 16
    limit[0] = 100.0
    assert sweep_mod.max_rate_on_lattice(None, wl, SLO(), search, start=1.0)[0].rate == pytest.approx(16.0, rel=0.03)
    limit[0] = 0.1
    assert sweep_mod.max_rate_on_lattice(None, wl, SLO(), search, start=1.0)[0] is None


def test_config_errors_name_the_key():
    with pytest.raises(ValueError, match="colocatd"):
        from_mapping({"deployment": {"mode": "colocated", "colocatd": {}}})
    with pytest.raises(ValueError, match="a colocated deployment needs"):
        from_mapping({"deployment": {"mode": "colocated"}})
    for path in CONFIGS.glob("*.yaml"):
        load_config(path)  # every shipped config parses


def test_cli_tiny_config(tmp_path, capsys):
    from hcfjax.cli import main

    assert main(["sim", "--config", str(CONFIGS / "tiny.yaml")]) == 0
    out = capsys.readouterr().out
    assert "| QPM |" in out and "colocated step time" in out
    png = tmp_path / "sweep.png"
    assert main(["sim", "--config", str(CONFIGS / "tiny.yaml"), "--sweep", "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert out.count("slots") >= 2 and png.stat().st_size > 0
    assert main(["sim", "--config", str(tmp_path / "missing.yaml")]) == 2
    assert math.isfinite(load_config(CONFIGS / "tiny.yaml").slo.tpot_s)


def test_cli_search_says_when_the_upper_bound_was_hit(tmp_path, capsys):
    """A best rate equal to search.hi is the search's limit, not the deployment's: the output says so."""
    from hcfjax.cli import main

    text = (CONFIGS / "tiny.yaml").read_text()
    assert main(["sim", "--config", str(CONFIGS / "tiny.yaml"), "--search"]) == 0
    assert "upper bound (400.00 requests/s" in capsys.readouterr().out
    below = tmp_path / "below.yaml"  # a TTFT SLO that a burst of arrivals misses: the search ends below its top
    below.write_text(
        text.replace(
            "search: {lo: 10, hi: 400, iters: 2}", "search: {lo: 10, hi: 1000000.0, iters: 2}\nslo: {ttft_s: 0.01}"
        )
    )
    assert main(["sim", "--config", str(below), "--search"]) == 0
    out = capsys.readouterr().out
    assert "Best within the SLO" in out and "upper bound" not in out
