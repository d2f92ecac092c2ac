"""The benchmark tools' parsing and bookkeeping (pallas_kernels/bench/ptx.py, ncu.py; hcfjax/bench/common.py,
hlo_names.py), on canned reports and tiny CPU programs."""

from __future__ import annotations

import os
import re

import jax
import jax.numpy as jnp
import pytest


def test_ptx_report_parsing():
    """bench.ptx's summary of a ptxas -v report and a SASS listing (the numbers the offline analysis rests on)."""
    from pallas_kernels.bench.ptx import ptxas_report, sass_counts, tiling_overrides

    text = """ptxas info    : (C7517) wgmma.wait_group is injected in around line 1220 by compiler
ptxas info    : (C7517) wgmma.wait_group is injected in around line 1300 by compiler
ptxas info    : (C7519) warpgroup.arrive is injected in around line 642 by compiler
    112 bytes stack frame, 136 bytes spill stores, 156 bytes spill loads
ptxas info    : Used 168 registers, used 16 barriers, 112 bytes cumulative stack size, 1 bytes smem"""
    assert ptxas_report(text) == dict(
        registers=168, spill_stores=136, spill_loads=156, injected_waits=2, injected_arrives=1
    )
    assert ptxas_report("")["registers"] is None
    sass = """/*3510*/ IGMMA.64x16x32.S8.S8 R72, R24, gdesc[UR44], R72 ;
/*3550*/ IGMMA.64x16x32.S8.S8 R72, R28, gdesc[UR24], R72, gsb0 ;
/*36b0*/ WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
/*47d0*/ HGMMA.64x256x16.F32.BF16 R24, gdesc[UR56].tnspB, R24 ;
/*47a0*/ WARPGROUP.ARRIVE ;"""
    assert sass_counts(sass) == dict(wgmma=3, wgmma_waits=1)
    assert tiling_overrides("wgs=1+bm=64") == dict(wgs=1, bm=64)  # a moe spec's fifth field
    with pytest.raises(ValueError, match="override"):
        tiling_overrides("stages=4")


def test_ncu_raw_parsing():
    """bench.ncu's summary of Nsight Compute's raw CSV page: units converted, short launches dropped, the largest
    stall reasons first, metrics missing from the report left blank."""
    from pallas_kernels.bench.ncu import parse_raw

    names = [
        "ID",
        "Kernel Name",
        "gpu__time_duration.sum",
        "dram__throughput.avg.pct_of_peak_sustained_elapsed",
        "smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio",
        "smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio",
        "smsp__average_warps_issue_stalled_wait_per_issue_active.ratio",
        "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active",
        "sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active",
        "sm__pipe_tensor_op_imma_cycles_active.avg.pct_of_peak_sustained_active",
    ]
    text = "\n".join(
        [
            '"==PROF== Connected to process"',
            ",".join(f'"{n}"' for n in names),
            '"","","usecond","%","ratio","ratio","ratio","%","%","%"',
            '"0","mosaic_gpu_kernel","84.20","71.5","0.50","3.25","1,250.00","0","61.25","72.50"',
            '"1","convert_fusion","2.10","10.0","0","0","0","0","0","0"',
        ]
    )
    (row,) = parse_raw(text, min_us=5.0, top=2)
    assert row["kernel"] == "mosaic_gpu_kernel" and row["us"] == 84.2 and row["DRAM %"] == 71.5
    assert row["tensor %"] == 72.5  # the busiest tensor sub-pipe (int8 wgmmas count as "imma" on the H200)
    assert row["SM %"] == "" and row["top stalls (warps per issue)"] == "wait 1250.00, long_scoreboard 3.25"
    assert parse_raw("no table here") == []
    odd = text.replace('"usecond","%"', '"usecond","%"').replace(
        "dram__throughput.avg.pct_of_peak_sustained_elapsed", "dram__bytes.sum.per_second"
    )
    odd = odd.replace('"","","usecond","%"', '"","","usecond","Kbyte/second"')
    (row,) = parse_raw(odd, min_us=5.0)
    assert row["DRAM TB/s"] == "? 71.5 Kbyte/second"  # a unit it does not know is shown, not scaled as TB/s


def test_repeats_exactly_tells_a_changing_output():
    """The benches' race check: outputs (any pytree) equal bit for bit over further runs, or not; a changed leaf of
    one run, or a different tree, is a difference."""
    from hcfjax.bench.common import repeats_exactly

    x = jnp.arange(6.0).reshape(2, 3)
    same = lambda x: (x * 2, {"s": x.sum()})  # noqa: E731
    assert repeats_exactly(same, (x,), same(x))
    runs = iter(range(1, 10))
    drifting = lambda x: (x * 2, {"s": x.sum() + (next(runs) == 2) * 1e-6})  # noqa: E731 - the second rerun differs
    assert not repeats_exactly(drifting, (x,), same(x))
    assert not repeats_exactly(lambda x: x * 2, (x,), same(x))
    nan = lambda x: x.at[0, 0].set(jnp.nan)  # noqa: E731 - the same NaN every run is not a race
    assert repeats_exactly(nan, (x,), nan(x))
    assert not repeats_exactly(lambda x: -0.0 * x, (x,), 0.0 * x)  # -0 and 0 differ in their bits


def test_kernel_seconds_from_trace_planes():
    """bench.moe --kernel-time's reading of a profiler trace: the GPU plane's stream lines summed per kernel name and
    call; the "XLA Ops" line (the same time under the ops' names), host planes, copies and memsets left out. And
    kernel_times is empty on a backend without a GPU."""
    from types import SimpleNamespace as NS

    import jax.numpy as jnp

    from hcfjax.bench.common import kernel_seconds, kernel_time, kernel_times

    ev = lambda name, us: NS(name=name, duration_ns=us * 1e3)  # noqa: E731
    gpu = NS(
        name="/device:GPU:0",
        lines=[
            NS(name="Stream #14(Compute)", events=[ev("fused_gemm", 70), ev("fused_gemm", 74), ev("MemcpyD2D", 9)]),
            NS(name="Stream #15(Compute)", events=[ev("quantize_fusion", 4), ev("memset32", 1)]),
            NS(name="XLA Ops", events=[ev("custom-call.1", 144)]),
        ],
    )
    host = NS(name="/host:CPU", lines=[NS(name="python", events=[ev("fused_gemm", 1000)])])
    per = kernel_seconds([gpu, host], reps=2)
    assert per == pytest.approx({"fused_gemm": 72e-6, "quantize_fusion": 2e-6})
    # Another device's plane with less kernel time is not added in (one call's time is one device's); a plane
    # without stream lines gives nothing (its other lines repeat kernel time under op names)
    other = NS(name="/device:GPU:1", lines=[NS(name="Stream #3(Compute)", events=[ev("fused_gemm", 20)])])
    assert kernel_seconds([other, gpu, host], reps=2) == pytest.approx(per)
    bare = NS(
        name="/device:GPU:0",
        lines=[NS(name="XLA Modules", events=[ev("jit_f", 9)]), NS(name="Framework Ops", events=[ev("k", 3)])],
    )
    assert kernel_seconds([bare]) == {}
    if jax.default_backend() == "cpu":
        assert kernel_times(jax.jit(lambda x: x * 2), jnp.ones(8), reps=2) == {}
        with pytest.raises(RuntimeError, match="no GPU kernels"):
            kernel_time(jax.jit(lambda x: x * 2), jnp.ones(8), reps=2)


def test_hlo_names_finds_a_fusions_source(tmp_path):
    """bench.hlo_names resolves a profile's kernel name (`loop_..._fusion_N`, HLO's `%..fusion.N`) in an XLA dump to the
    jax op at its root, the source line that made it (through the module's stack-frame tables) and the ops inside."""
    import subprocess
    import sys

    from hcfjax.bench.hlo_names import describe, fusion_sources

    script = tmp_path / "make_fusion.py"
    script.write_text(
        "import jax, jax.numpy as jnp\n"
        "def scaled_max(x):\n"
        "    return jnp.max(jnp.exp(x) * 2, axis=1) + 1\n"
        "jax.jit(scaled_max)(jnp.ones((4, 8)))\n"
    )
    env = dict(os.environ, XLA_FLAGS=f"--xla_dump_to={tmp_path / 'dump'} --xla_dump_hlo_as_text", JAX_PLATFORMS="cpu")
    subprocess.run([sys.executable, str(script)], env=env, check=True, timeout=120)
    text = "\n".join(p.read_text() for p in (tmp_path / "dump").glob("*jit_scaled_max*after_optimizations.txt"))
    (name,) = {m.replace(".", "_") for m in re.findall(r"%(\w*fusion[\w.]*) = ", text)}
    (hit,) = fusion_sources(tmp_path / "dump", [name])[name]
    assert hit.startswith("jit_scaled_max: f32[4]")
    assert "make_fusion.py:3 (scaled_max)" in hit
    assert "ops: add, exp, mul, reduce_max" in hit
    assert describe(tmp_path / "dump", ["no_such_fusion"]) == [
        "no_such_fusion:",
        "  (not in any *after_optimizations.txt)",
    ]


def test_ncu_keeps_what_it_did_not_write(tmp_path):
    """bench.ncu works in a fresh folder of its own under --out and removes only that: files already there stay
    (an --out of the repository once would have been packed and deleted), and the archive holds its logs."""
    import tarfile

    from pallas_kernels.bench.ncu import main

    (tmp_path / "keep.txt").write_text("mine")
    main(["--out", str(tmp_path), "--ncu", "false", "--kernels", "mla:bf16"])  # an ncu that fails at once
    assert (tmp_path / "keep.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.txt", "ncu.tar.gz"]
    with tarfile.open(tmp_path / "ncu.tar.gz") as tar:
        assert tar.getnames() == ["ncu/mla_bf16.log"]


def test_bench_generate_formats_for_a_cpu():
    """Parameter counts in a unit that shows them; without a GPU's ceilings the floors say n/a, not a number derived
    from a CPU's (or a missing) copy rate."""
    from hcfjax.bench.common import count
    from hcfjax.bench.generate import ceilings_line, floor_cells

    assert [count(n) for n in (12, 4_560, 2_340_000, 15_700_000_000)] == ["12", "4.56K", "2.34M", "15.7B"]
    assert "n/a on CPU" in ceilings_line(None, None, None) and "TB/s" not in ceilings_line(None, None, None)
    assert floor_cells(None, 0.01, ".2f") == "n/a | n/a"
    assert floor_cells(0.005, 0.01, ".2f") == "5.00 ms | 50%"
    gpu = ceilings_line(3.3e12, 3.0e12, 7.0e14)
    assert "copy 3.30 TB/s (torch copy_" in gpu and "700 TFLOP/s" in gpu


def test_bench_help_shows_defaults_and_where_it_runs(capsys):
    from hcfjax.cli import main

    with pytest.raises(SystemExit):
        main(["bench", "generate", "--help"])
    assert "(default: v2-lite)" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "run on any backend" in out and "need a GPU" in out


def test_engine_step_cases_and_floors():
    """bench.engine_step's case syntax (RxT@C prefill, B@C decode, joined by +) and its floor: prefill FLOPs grow
    with the cached context the chunk attends over, a mixed case adds the decode part's bytes."""
    import argparse

    from hcfjax.bench.engine_step import Case, floor_s
    from hcfjax.random_model import preset_config, random_model

    assert Case.parse("2x2048@4096") == Case(rows=2, tokens=2048, before=4096)
    assert Case.parse("1x512@0+14@3860") == Case(1, 512, 0, 14, 3860)
    assert str(Case.parse("14@3860")) == "14@3860" and str(Case(1, 512, 0, 14, 3860)) == "1x512@0 + 14@3860"
    for bad in ("2x@0", "14", "0@10", "1x64@0+x"):
        with pytest.raises(argparse.ArgumentTypeError):
            Case.parse(bad)
    model = random_model(preset_config("tiny-v3"), seed=0)
    f = lambda case: floor_s(model.cfg, model.params, case, jnp.bfloat16, 1e15, 1e12)  # noqa: E731
    assert f(Case(1, 512, 4096)) > f(Case(1, 512, 0)) > 0
    assert f(Case(1, 512, 0, 14, 3860)) == pytest.approx(f(Case(1, 512, 0)) + f(Case(batch=14, context=3860)))
    assert floor_s(model.cfg, model.params, Case(1, 512, 0), jnp.bfloat16, None, None) is None


def test_kernel_differences_rank_by_size_either_way():
    """engine_loop's engine-against-offline list: the largest differences first whichever side is longer, a kernel
    only one side runs counted whole, and both sides' sums."""
    from hcfjax.bench.engine_loop import kernel_differences

    engine = {"mla": 1.45e-3, "gemm_24_rows": 0.1e-3, "moe": 1.65e-3}
    offline = {"mla": 1.3e-3, "wmma_23_rows": 0.5e-3, "moe": 1.65e-3}
    said = kernel_differences(engine, offline, n=3)
    assert said == "wmma_23_rows -0.500, mla +0.150, gemm_24_rows +0.100; all kernels 3.20 against 3.45"


def test_engine_loop_times_a_decoding_batch():
    """bench.engine_loop drives the engine's own loop: every request of the batch decodes in the timed steps, the
    host's parts add up to no more than the wall time, and the engine is empty again for the next batch."""
    import numpy as np

    from hcfjax.bench.engine_loop import Timings, loop_case
    from hcfjax.engine import Engine, EngineConfig
    from hcfjax.random_model import preset_config, random_model

    model = random_model(preset_config("tiny-v3"), seed=0)
    engine = Engine(model, EngineConfig(max_slots=4, num_pages=64, page_size=16, max_model_len=256, token_budget=64))
    timings = Timings(engine)
    for batch in (3, 4):
        row = loop_case(engine, timings, batch, 40, 6, False, np.random.default_rng(0))
        assert row["batch"] == batch and row["kernels"] is None
        assert 0 < sum(row[k] for k in Timings.PARTS) <= row["wall"] * 1.05
        assert not engine.has_work() and engine.snapshot()["running"] == 0


@pytest.mark.parametrize("batch,budget", [(64, 512), (128, 512), (256, 512), (12, 16)])
def test_engine_loop_output_room_outlasts_the_last_prefill(batch, budget):
    """bench.engine_loop's requests may produce output_room tokens each: under the engine's own scheduler (the
    simulator's instance, one step a second) none finishes before the last prompt has prefilled and the settling,
    timed and profiled steps have run, though decode rows take budget from the prompts' chunks."""
    import math

    from hcfjax.bench.engine_loop import output_room
    from hcfjax.engine.scheduler import SchedulerConfig
    from hcfjax.engine.shapes import StepShapes
    from hcfjax.sim.instances import Clock, EngineInstance, new_request

    context, steps, page = 2048 if batch > 12 else 160, 24, 64
    room = output_room(batch, context, steps, budget)
    pages = math.ceil((context + room) / page)  # as bench.engine_loop's EngineConfig: each slot its whole context
    shapes = StepShapes(budget, 4, 64, False, pages * page)
    cfg = SchedulerConfig(
        max_slots=batch, num_pages=batch * pages, page_size=page, token_budget=budget, max_prefill_rows=4, shapes=shapes
    )
    clock, finished = Clock(), []
    inst = EngineInstance(clock, "e", cfg, lambda plan: 1.0, on_finish=lambda req, _: finished.append(req))
    reqs = [new_request(str(i), context, room, 0.0) for i in range(batch)]
    for req in reqs:
        inst.submit(req)
    clock.run()
    assert len(finished) == batch
    last_start = max(r.first_token_time for r in reqs)  # the last prompt's first token: every request decodes
    first_end = min(r.last_token_time for r in reqs)
    assert first_end - last_start >= 9 + 2 * steps, (last_start, first_end)  # settling, profiler warm-up, timed
    with pytest.raises(ValueError, match="must exceed the largest batch"):
        output_room(budget, context, steps, budget)


def test_moe_peers_pad_each_expert_to_the_alignment():
    """The torch peers' layout: every token row once, in its expert's range, in order; each expert's range a
    multiple of the alignment (empty experts included, as zero rows)."""
    import numpy as np

    from pallas_kernels.bench.moe_peers import padded_rows

    sizes = [5, 0, 17, 16, 3]
    rows, ends = padded_rows(sizes, 16)
    assert ends.tolist() == [16, 16, 48, 64, 80] and len(rows) == 80
    starts = [0, *ends[:-1]]
    first = np.cumsum(sizes) - sizes
    for e, n in enumerate(sizes):
        assert rows[starts[e] : starts[e] + n].tolist() == list(range(first[e], first[e] + n))
        assert (rows[starts[e] + n : ends[e]] == -1).all()
    assert sorted(rows[rows >= 0].tolist()) == list(range(sum(sizes)))


def test_moe_check_lines_name_our_tiling_and_the_peers():
    """The report's checks hold the int4 kernels' rows (tiling, shared memory) and the others' (the torch peers, the
    fp8 kernel: no tiling)."""
    from pallas_kernels.bench.moe import check_lines

    ok = dict(ok=True, max_rel=1e-3, rel=5e-4)
    rows = [
        dict(name="w4a8 kernel", check=dict(ok, tiling="bm=64", smem=1024)),
        dict(name="torch _grouped_mm bf16 (peer)", check=dict(ok, ok=False)),
        dict(name="bf16 ragged_dot (XLA)"),
    ]
    lines = check_lines({"16x128x7168x2048": {"rows": rows}}, [(16, 128, 7168, 2048)])
    assert len(lines) == 2
    assert "w4a8 kernel: ok" in lines[0] and "(bm=64, smem 1024 B)" in lines[0]
    assert "(peer): FAIL" in lines[1] and lines[1].endswith("norm rel 5.00e-04")


def test_moe_bench_grouped_reference_equals_numpy():
    """The MoE bench's f32 reference (one expert at a time, not XLA's dense masked ragged_dot) against numpy,
    empty groups included."""
    import jax
    import numpy as np

    from pallas_kernels.bench.moe_worker import grouped_reference

    rng = np.random.default_rng(0)
    gs = np.array([3, 0, 11, 1, 0, 6], np.int32)
    a = rng.standard_normal((int(gs.sum()), 24)).astype(np.float32)
    b = rng.standard_normal((len(gs), 24, 10)).astype(np.float32)
    want = np.concatenate([a[s : s + g] @ b[e] for e, (s, g) in enumerate(zip(np.cumsum(gs) - gs, gs, strict=True))])
    got = np.asarray(grouped_reference(jax.numpy.asarray(a), jax.numpy.asarray(b), jax.numpy.asarray(gs)))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_startup_settle_reads_the_runners_background_lines():
    """bench.startup --settle waits for the runner's log line that ends the background compiles (or says they
    failed): the patterns match what the runner writes."""
    import inspect

    from hcfjax.bench.startup import BACKGROUND_DONE, BACKGROUND_FAILED
    from hcfjax.engine import runner

    src = inspect.getsource(runner)
    done = "compiled %d more step shapes in the background in %.1f s"
    assert done in src and BACKGROUND_DONE.search("hcfjax serve: " + done % (9, 17.7))
    assert BACKGROUND_FAILED in src


def test_gpu_gaps_from_trace_planes():
    """bench.engine_loop's idle reading: time with nothing running on any stream between the first record and the
    last, with the wider gaps summed per call by the records either side; overlapping records on two streams leave
    no gap, and a copy counts as the GPU at work; `record_counts` counts the kernels and copies per call."""
    from types import SimpleNamespace as NS

    from hcfjax.bench.common import gpu_gaps, record_counts

    ev = lambda name, start, us: NS(name=name, start_ns=start * 1e3, duration_ns=us * 1e3)  # noqa: E731
    gpu = NS(
        name="/device:GPU:0",
        lines=[
            # call 1: a 0..10, b 12..20 (2 us gap), call 2: a 50..60 (30 us gap), b 60..70
            NS(name="Stream #1(Compute)", events=[ev("a", 0, 10), ev("b", 12, 8), ev("a", 50, 10), ev("b", 60, 10)]),
            # a copy at 20..30 closes part of the 30 us gap; c overlaps b on another stream
            NS(name="Stream #2(Copy)", events=[ev("MemcpyH2D", 20, 10), ev("c", 61, 4)]),
        ],
    )
    idle, pairs = gpu_gaps([gpu], reps=2, min_us=5)
    assert idle == pytest.approx((2 + 20) * 1e-6 / 2)
    assert pairs == pytest.approx({("MemcpyH2D", "a"): 10e-6})
    assert gpu_gaps([NS(name="/host:CPU", lines=[])]) == (0.0, {})
    # the same records counted per call: 5 kernels over 2 calls, one 10 us copy
    assert record_counts([gpu], reps=2) == pytest.approx({"kernels": 2.5, "copies": 0.5, "copy_s": 5e-6})


def test_host_records_per_call_from_trace_planes():
    """bench.engine_loop's host reading: the host plane's records by name, count and seconds per call, nested ones
    counted under their own names too; the GPU planes are not the host's. The busiest come first, and XLA's command
    buffer records are always shown, however short."""
    from types import SimpleNamespace as NS

    from hcfjax.bench.common import busiest_host, host_seconds

    ev = lambda name, us: NS(name=name, start_ns=0, duration_ns=us * 1e3)  # noqa: E731
    python = NS(name="python", events=[ev("$engine.py:340 step", 900), ev("$engine.py:340 step", 700)])
    pjrt = NS(name="tf_pjrt", events=[ev("Execute", 300), ev("command_buffer::update", 40), ev("Execute", 100)])
    gpu = NS(name="/device:GPU:0", lines=[NS(name="Stream #1", events=[ev("kernel", 5000)])])
    host = host_seconds([NS(name="/host:CPU", lines=[python, pjrt]), gpu], reps=2)
    assert host == {
        "$engine.py:340 step": pytest.approx((1.0, 800e-6)),
        "Execute": pytest.approx((1.0, 200e-6)),
        "command_buffer::update": pytest.approx((0.5, 20e-6)),
    }
    assert busiest_host(host, n=1) == "$engine.py:340 step 1.0 x 0.800, command_buffer::update 0.5 x 0.020"
    assert busiest_host({}) == "none"


def test_layer_scan_bench_runs_every_program(capsys):
    """The layer-scan bench compiles and times each GEMM choice and the unrolled loop, and they compute the same."""
    from hcfjax.bench import layer_scan

    layer_scan.main(["--layers", "2", "--rows", "4"])
    rows = [
        line.split(" | ") for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and " s | " in line
    ]
    assert [r[0][2:] for r in rows] == list(layer_scan.VARIANTS)
    assert all(float(r[-1].rstrip(" |")) < 0.05 for r in rows)


def test_records_summary_per_kernel_and_gaps(tmp_path, capsys):
    """bench.records: launches and busy time per name and step, each gap charged to the launch after it, and the
    host's long gaps between steps apart."""
    from hcfjax.bench import records

    path = tmp_path / "rec.tsv"
    step = [("a", 0.0, 10.0), ("memcpy128", 12.0, 2.0), ("a", 15.0, 10.0), ("b", 25.0, 5.0)]  # gaps 2 and 1 us
    rows = step + [(n, s + 1000.0, d) for n, s, d in step]  # 970 us of host between the steps
    path.write_text("".join(f"{n}\t{s}\t{d}\n" for n, s, d in reversed(rows)))
    per, between = records.summarise(records.read_records(str(path)), max_gap_us=50)
    assert {n: (e.count, e.busy_us, e.gap_us) for n, e in per.items()} == {
        "a": (4, 40.0, 2.0),
        "memcpy128": (2, 4.0, 4.0),
        "b": (2, 10.0, 0.0),
    }
    assert between == 970.0
    records.main([str(path), "--steps", "2"])
    out = capsys.readouterr().out
    assert "per step: 4 launches, 0.027 ms busy, 0.003 ms of gaps between them; 0.485 ms idle" in out
    assert "| a | 2.0 | 20.0 | 74.1% | 1.0 |" in out
    # one span from a record named like "a" to the next, the middle one of three spans; the first launch's idle
    # is not counted (it follows the span before), the host's 970 us shows as 0
    assert records.span(records.read_records(str(path)), "a") == [("a", 0.0, 10.0), ("b", 0.0, 5.0)]
    assert records.span(rows, "b") == [("b", 0.0, 5.0), ("a", 0.0, 10.0), ("memcpy128", 2.0, 2.0), ("a", 1.0, 10.0)]
    assert records.span(rows, "none") == []
    records.main([str(path), "--steps", "2", "--between", "memcpy"])
    out = capsys.readouterr().out
    assert "from one memcpy to the next: 4 launches, 27.0 us busy, 1.0 us idle" in out
    assert "| 1 | a | 10.0 | 1.0 |" in out
    path.write_text("a 1 2\n")
    with pytest.raises(ValueError, match="rec.tsv:1: expected name, start and duration"):
        records.read_records(str(path))


def test_dense8_bench_checks_each_row_against_the_exact_product(capsys):
    """bench.dense8 on a CPU: XLA's int8 path (the model without the kernel) is checked against the exact int32
    product with both scales, one weight and gate/up with SiLU; the kernel rows (the product's, the tokens'
    quantisation's) report the GPU they need instead of a time."""
    from pallas_kernels.bench import dense8

    dense8.main(["--cases", "a:16x256x128g,b:24x256x128"])
    rows = [
        line.split(" | ")
        for line in capsys.readouterr().out.splitlines()
        if line.startswith("| a ") or line.startswith("| b ")
    ]
    xla = [r for r in rows if r[1].startswith("XLA")]
    assert len(xla) == 2 and all("FAILS" not in r[-1] and float(r[-1].rstrip(" |")) < dense8.TOL for r in xla)
    assert all(r[2].startswith("error") for r in rows if r[1].startswith(("kernel", "  tokens' quantisation")))
    xla_quant = [r for r in rows if r[1] == "  the same in XLA"]  # the quantisation alone, its own reference
    assert len(xla_quant) == 2 and all(r[-1].strip(" |") == "0.0e+00" for r in xla_quant)


def test_route_bench_checks_the_kernel_against_the_models_routing(capsys):
    """bench.route on a CPU: the routing kernels (interpreted) against XLA's routing as the model runs it, V3's gate
    (bias, groups) with padding rows; no times without a GPU. Its check names what differs."""
    import numpy as np

    from pallas_kernels.bench import route

    route.main(["--tokens", "20", "--gates", "tiny-v3"])
    rows = [line.split(" | ") for line in capsys.readouterr().out.splitlines() if line.startswith("| tiny-v3 ")]
    assert [r[2] for r in rows[:2]] == ["kernels, 4 warps", "XLA (the model without it)"]
    assert rows[0][-1] == "ok |" and rows[0][3] == "n/a (no GPU)"
    w, ids, sizes, pos, token = np.arange(3.0), np.arange(3), np.ones(2), np.arange(4), np.arange(4)
    want = (w, ids, sizes, pos, token, ([1, 2], np.asarray([0.5, 0.25])))
    tail = ([1, 2], np.asarray([0.5, 0.25, 0.0, 0.0]))  # the kernels' scales with their zero tail
    assert route.check(want, want) == "ok" and route.check((*want[:5], tail), want) == "ok"
    assert route.check((*want[:5], ([1, 2], np.asarray([0.5, 0.5, 0.0]))), want) == "DIFFERS: rows"
    per = {"moe_route_choose": 4.12, "moe_route_place": 4.5, "loop_convert_fusion": 1.0}
    assert route.kernels_label(8, per) == "kernels, 8 warps (choose 4.1 + place 4.5)"
    got = (w * (1 + 1e-5), ids, sizes, pos[::-1], token, ([2, 2], want[5][1]))
    assert route.check(got, want) == "DIFFERS: weights, places, rows"


def test_latent_write_bench_compares_the_whole_cache_with_xlas_path(capsys, monkeypatch):
    """bench.latent_write on a CPU: the kernel (interpreted) against XLA's norm, rope and cache.write, every byte of
    the cache compared; a planted difference is counted; a size the kernel's offsets cannot reach runs XLA only."""
    import numpy as np

    from hcfjax import cache as kvcache
    from pallas_kernels.bench import latent_write

    latent_write.main(["--preset", "tiny-v3", "--tokens", "8", "--cache-gib", "0.0002"])
    rows = [line.split(" | ") for line in capsys.readouterr().out.splitlines() if line.startswith("| 0.00")]
    assert [r[1] for r in rows[:2]] == ["XLA (the model without it)", "kernel"]
    assert rows[1][-1] == "identical |" and rows[1][2] == "n/a"
    a = kvcache.KVCache(jnp.zeros((2, 3, 4, 8), jnp.int8), jnp.ones((2, 3, 2, 4)))
    b = kvcache.KVCache(a.kv.at[1, 2, 3, :2].set(-3), a.scale.at[0, 0, 1, 1].set(2.0))
    assert latent_write.differences(a, a) == "identical"
    assert latent_write.differences(b, a) == "2 bytes differ (by at most 3), 1 scales"
    monkeypatch.setattr(latent_write, "addressable", lambda size: False)
    rows = latent_write.run_case("tiny-v3", 8, 0.0002, np.random.default_rng(0))
    assert rows[1][1:] == ["kernel", "n/a", "n/a", "refused: 32-bit offsets would wrap (2-4 GiB)"]
