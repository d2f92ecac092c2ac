"""The PD half of `python -m hcfjax.bench.sim_validate --pd KIND`: the prefill worker's step times, the KV link, the PD
serving run, and the 1P1D deployment that simulates it (the simulator's PD path: a decode instance in remote-prefill
mode, a prefill instance batching as hcfjax's PrefillWorker does).

- Workers: `hcfjax serve --role prefill|decode|router` processes with hcfjax.bench.serve's configs (pd_configs).
  The prefill worker starts first, since it compiles every batch shape for a minute or two while this process
  calibrates the colocated engine; the decode worker and the router start once this process's device work is done.
  With --pd-gpus P,D the prefill worker sees only GPU P, the decode worker (and this process) only GPU D.
- Prefill calibration: a PrefillWorker in this process, with the prefill role's own PrefillConfig, times every
  batch shape the workload's prompts can take (rows x chunk, on rows that write nothing).
- KV link: timed transfers of this model's per-request cache (whole pages, every layer) to a receiver process
  (hcfjax.bench.pd_transfer's) over the run's transport, fitted as latency + bytes / bandwidth.
- Serving: the benchmark's client (hcfjax.bench.serve_clients.run_clients) against the router, measured as the benchmark
  measures.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import numpy as np

from hcfjax import trace
from hcfjax.bench.serve_clients import run_clients, warm_pd
from hcfjax.bench.serve_pd import address_of, launch_role, launch_router, pd_role_args, role_env, stop_pd
from hcfjax.sim.deployment import Deployment, Pool

PREFILL_MEM_FRACTION = 0.85  # the prefill worker has its GPU to itself
DECODE_MEM_FRACTION = 0.4  # the decode worker shares its GPU with this process (which takes 0.5)


class Workers:
    """The PD processes, running with configs (the prefill worker's PrefillConfig, the decode worker's
    EngineConfig; hcfjax.bench.serve_pd.pd_configs): the prefill worker starts at once (in the background), the rest
    with start_decode()."""

    def __init__(self, args, configs: tuple, gpus: tuple[str, str] | None, env: dict):
        self.configs, self.gpus, self.env = configs, gpus, env
        self.procs: list = []
        self.pre_args, self.dec_args = pd_role_args(args, *configs)
        pre_env = role_env(gpus and gpus[0], PREFILL_MEM_FRACTION if gpus else None, **env)
        self._prefill = launch_role(self.pre_args, pre_env, self.procs)

    def prefill_ready(self) -> str:
        """The prefill worker's address, once it listens."""
        return address_of(self._prefill, self.procs)

    def start_decode(self) -> int:
        """Starts the decode worker and the router; -> the router's port, once it serves."""
        dec_env = role_env(self.gpus and self.gpus[1], DECODE_MEM_FRACTION if self.gpus else None, **self.env)
        dec = launch_role(self.dec_args, dec_env, self.procs)
        return launch_router(self.prefill_ready(), address_of(dec, self.procs), self.procs)

    def stop(self) -> None:
        stop_pd(self.procs)  # a prefill worker still starting exits too


def calibrate_prefill(model, config, longest: int, reps: int) -> list[tuple[tuple[int, int, int, int], float]]:
    """[(batch shape (rows, chunk, padded length, table width), median seconds)] for every shape prompts up to
    `longest` tokens take, on a PrefillWorker of this config in this process (compiled first)."""
    import jax

    from hcfjax.pd.prefill import PrefillWorker

    worker = PrefillWorker(model, None, config)
    points = []
    try:
        for shape in worker.shapes(longest):
            jax.block_until_ready(worker.run_empty(shape))
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                jax.block_until_ready(worker.run_empty(shape))
                times.append(time.perf_counter() - t0)
            points.append((shape, statistics.median(times)))
    finally:
        worker.shutdown()
    return points


def measure_link(kind: str, model, page_size: int, tokens: list[int], reps: int, env: dict):
    """Timed transfers of a request's whole cache (every layer of ceil(n / page_size) pages) for n in `tokens`,
    from this process to a receiver process holding it on its device; -> (latency s, bytes/s, [(tokens, bytes,
    median s)]) with seconds = latency + bytes / bandwidth fitted by least squares."""
    import jax.numpy as jnp

    from hcfjax.bench.pd_transfer import Decode
    from hcfjax.pd.transport import Piece, make_transport
    from hcfjax.quantize import default_cache_dtype

    cfg = model.cfg
    layers, width = cfg.num_hidden_layers, cfg.kv_lora_rank + cfg.qk_rope_head_dim
    dtype = default_cache_dtype(model, None)
    receiver = Decode(kind, env)
    tx = make_transport(kind, timeout=120.0).sender()
    rows, n = [], 0
    try:
        for t in tokens:
            kv = jnp.ones((layers, -(-t // page_size), page_size, width), dtype).block_until_ready()
            times = []
            for i in range(reps + 1):  # the first warms the path up
                n += 1
                key = f"link{n}"
                receiver.expect(key)
                t0 = time.monotonic()
                tx.send(receiver.address, Piece(key, (0, layers), kv, None, layers))
                tx.flush(key, timeout=120)
                if i:
                    times.append(receiver.done_at(key) - t0)
                else:
                    receiver.done_at(key)
            rows.append((t, int(kv.nbytes), statistics.median(times)))
    finally:
        tx.close()
        receiver.close()
    if len(rows) > 1:
        slope, latency = np.polyfit([b for _, b, _ in rows], [s for _, _, s in rows], 1)
    else:
        slope, latency = rows[0][2] / rows[0][1], 0.0
    return max(float(latency), 0.0), 1 / slope if slope > 0 else float("inf"), rows


def link_bytes(model, page_size: int, tokens: int) -> int:
    """Bytes a whole-cache send of a `tokens`-token prompt moves: every layer of its pages."""
    from hcfjax.quantize import default_cache_dtype

    cfg = model.cfg
    width = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    pages = -(-tokens // page_size)
    return cfg.num_hidden_layers * pages * page_size * width * np.dtype(default_cache_dtype(model, None)).itemsize


def serve_pd(port: int, ins, outs, prompts, arrivals, limit: int, rows: int, probe: int, reps: int):
    """The workload through the router, as hcfjax.bench.serve's client runs it, after its warm-up prompts and
    `reps` requests of `probe` prompt tokens one at a time (their TTFT: the handoff's cost when nothing queues);
    -> (records of the requests that finished, how many did not, the run's seconds, the probes' TTFTs)."""
    from hcfjax.serving.client import connect, generate, generate_stream

    channel, stub = connect("127.0.0.1", port, ready_timeout=60)
    try:
        generate(stub, [1, 2, 3], max_new_tokens=4, ignore_eos=True)  # the path answers
        warm_pd(stub, ins, limit, rows)
        probes = []
        for _ in range(reps):
            t0, first = time.perf_counter(), None
            for chunk in generate_stream(stub, [1] * probe, max_new_tokens=2, ignore_eos=True, timeout=60):
                first = first or (time.perf_counter() - t0 if chunk.token_ids else None)
            if first is not None:
                probes.append(first)
            time.sleep(0.1)
        record, wall = run_clients(stub, prompts, outs, arrivals)
    finally:
        channel.close()
    failed = len(prompts) - sum(r["finish"] == "length" for r in record)
    return [r for r in record if r["finish"] == "length"], failed, wall, probes


# Where a PD request's time to first token goes, from hcfjax.trace's marks: (stage, from event, to event). The
# simulator's segments group them: it has no client, router or gRPC hops (a lone request's share of those is in its
# transfer latency, as the handoff) and submits straight to the prefill queue.
STAGES = [
    ("client -> router", "send", "route"),
    ("router -> decode worker", "route", "arrive"),
    ("admission: the decode worker's next step", "arrive", "remote"),
    ("decode -> prefill worker (gRPC)", "remote", "submit"),
    ("prefill queue", "submit", "batch"),
    ("prefill compute", "batch", "computed"),
    ("KV transfer", "computed", "flushed"),
    ("prefill reply (gRPC)", "flushed", "prefilled"),
    ("cache taken from the receiver", "prefilled", "received"),
    ("landing: the decode worker's next step", "received", "first"),
    ("decode worker -> router", "first", "relay_first"),
    ("router -> client", "relay_first", "client_first"),
]
SEGMENTS = [  # (segment, measured from, to, simulated from, to)
    ("ingress (client, router)", "send", "arrive", None, None),
    ("admission", "arrive", "remote", "arrive", "remote"),
    ("to prefill and its queue", "remote", "batch", "remote", "batch"),
    ("prefill compute", "batch", "computed", "batch", "computed"),
    ("transfer and hand-off", "computed", "received", "computed", "received"),
    ("landing", "received", "first", "received", "first"),
    ("egress (router, client)", "first", "client_first", None, None),
    ("TTFT", "send", "client_first", "arrive", "first"),
]


def request_marks(events: list[dict], prefix: str) -> dict[str, dict[str, float]]:
    """{request id: {event: seconds}} for the requests whose id starts with `prefix`, the serving path's marks and
    the remote prefill's (keyed id#epoch) together; a request prefilled twice (preempted) keeps its first."""
    from hcfjax.trace import by_key

    out: dict[str, dict[str, float]] = {}
    for key, marks in by_key(events).items():
        rid = key.split("#", 1)[0]
        if rid.startswith(prefix):
            for ev, t in marks.items():
                out.setdefault(rid, {}).setdefault(ev, t)
    return out


def _spans(marks: dict[str, dict[str, float]], a: str, b: str) -> list[float]:
    return [m[b] - m[a] for m in marks.values() if a in m and b in m]


def breakdown(measured: dict[str, dict[str, float]], simulated: dict[str, dict[str, float]]) -> list[str]:
    """The TTFT breakdown tables (markdown lines): every measured stage, then the simulator's segments beside the
    measured ones (median and mean over requests, ms)."""
    ms = lambda xs, f: f"{f(xs) * 1e3:.1f}" if xs else "-"
    lines = ["| stage | requests | p50 ms | mean ms | max ms |", "|---|---|---|---|---|"]
    for name, a, b in STAGES:
        xs = _spans(measured, a, b)
        lines.append(
            f"| {name} | {len(xs)} | {ms(xs, statistics.median)} | {ms(xs, statistics.mean)} | {ms(xs, max)} |"
        )
    lines += ["", "| segment | measured p50 ms | simulated p50 ms | measured mean ms | simulated mean ms |"]
    lines.append("|---|---|---|---|---|")
    for name, a, b, sa, sb in SEGMENTS:
        xs = _spans(measured, a, b)
        ys = _spans(simulated, sa, sb) if sa else [0.0]
        lines.append(
            f"| {name} | {ms(xs, statistics.median)} | {ms(ys, statistics.median)} | {ms(xs, statistics.mean)} | "
            f"{ms(ys, statistics.mean)} |"
        )
    return lines


def deployment(
    model: str, gpu: str, prefill_config, engine_config, profiles: dict[str, str], transport: str = "jax"
) -> Deployment:
    """The 1P1D deployment of the run: pools with the workers' own settings and each role's fitted profile; with
    the jax transport a transfer completes with the decode step in flight (Deployment.transfer_waits_for_step, as
    this run's trace breakdown shows)."""
    p, e = prefill_config, engine_config
    prefill = Pool(
        max_slots=p.num_pages,  # the worker holds no slots: a prompt needs only scratch pages
        page_size=p.page_size,
        token_budget=p.token_budget,
        max_prefill_rows=p.max_rows,
        num_pages=p.num_pages,
        min_bucket=p.min_bucket,
        chunk=p.chunk,
        efficiency=profiles["prefill"],
    )
    decode = Pool(
        dp=e.dp,
        max_slots=e.max_slots,
        page_size=e.page_size,
        token_budget=e.token_budget,
        max_prefill_rows=e.max_prefill_rows,
        num_pages=e.num_pages,
        balance=e.balance,
        spf_window_s=e.spf_window_s,
        max_wait_s=e.max_wait_s,
        min_bucket=e.min_prefill_bucket,
        min_decode_rows=e.min_decode_rows,
        efficiency=profiles["decode"],
    )
    return Deployment(
        model=model,
        gpu=gpu,
        quant=None,
        efficiency=profiles["decode"],
        mode="pd",
        prefill=prefill,
        decode=decode,
        layerwise_threshold=p.layerwise_threshold,
        transfer_waits_for_step=transport == "jax",
        engine_shapes=True,
        max_model_len=e.max_model_len,
    )


def run_pd(args, stage, workers: Workers, gpus, model, model_name: str, requests, wl, points, host):
    """Step 4 of hcfjax.bench.sim_validate, after the colocated run: `requests` are the workload's (ins, outs, prompts,
    arrivals), `points` the colocated calibration (its decode-only steps fit the decode profile), `host` the
    engine loop's measured host seconds. -> (the table's row, the description's PD part, the report's tables)."""
    from hcfjax.bench.sim_profile import fit, fitted, metrics, predicted, write_profile
    from hcfjax.sim.cost import CostModel
    from hcfjax.sim.gpus import Efficiency, gpu
    from hcfjax.sim.simulator import simulate
    from hcfjax.sim.work import PrefillShapes

    ins, outs, prompts, arrivals = requests
    cfg = model.cfg
    pre_cfg, dec_cfg = workers.configs
    longest = int(ins.max())
    stage(f"timing the prefill worker's batch shapes for prompts up to {longest} tokens (in process)")
    pre_points = calibrate_prefill(model, pre_cfg, longest, args.reps)
    sizes = sorted({int(ins.min()), int(np.median(ins)), longest})
    stage(f"timing KV transfers of {sizes} tokens over {args.pd} to a receiver process")
    rx_env = role_env(gpus and gpus[1], None, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    latency, bw, link = measure_link(args.pd, model, pre_cfg.page_size, sizes, args.reps, rx_env)
    stage(f"starting the decode worker{f' on GPU {gpus[1]}' if gpus else ''} and the router")
    t0 = time.perf_counter()
    port = workers.start_decode()
    t_dec = time.perf_counter() - t0
    probe = int(np.median(ins))
    stage(f"serving {args.reps} lone requests of {probe} tokens, then {len(ins)} through the router (PD, {args.pd})")
    served = serve_pd(port, ins, outs, prompts, arrivals, wl.max_model_len, args.prefill_rows, probe, args.reps)
    record, failed, wall, probes = served
    workers.stop()

    stage("fitting and simulating PD (1P1D)")
    base = Efficiency(gemm_memory=0.86, moe_memory=0.86)
    stem = str(Path(args.profile).with_suffix(""))
    profiles = {"prefill": f"{stem}-prefill.json", "decode": f"{stem}-decode.json"}
    ps = PrefillShapes(pre_cfg.page_size, pre_cfg.chunk, pre_cfg.min_bucket)
    pre_eff = fit(cfg, args.gpu, [(ps.shape_works(*shape), s) for shape, s in pre_points], base)
    dec_points = [(shp.shape_works(0, 0, d), s) for shp, b, _, d, s in points if d and not b]
    # the handoff beyond the link (gRPC hops, threads, the first token's way out): a lone request's TTFT less its
    # prefill step and its transfer, as timed above
    lone = dict(pre_points)[ps.shape(1, probe)] + latency + link_bytes(model, pre_cfg.page_size, probe) / bw
    lone_ttft = statistics.median(probes) if probes else float("nan")
    handoff = max(lone_ttft - lone, 0.0) if probes else 0.0
    dec_eff = fit(cfg, args.gpu, dec_points, base).replace(
        host_dispatch_s=host["dispatch"],
        host_process_s=host["process"],
        transfer_gbs=bw / 1e9,
        transfer_latency_s=latency + handoff,
    )
    write_profile(profiles["prefill"], pre_eff)
    write_profile(profiles["decode"], dec_eff)
    dep = deployment(model_name, args.gpu, pre_cfg, dec_cfg, profiles, args.pd)
    sim_marks: dict[str, dict[str, float]] = {}
    mark = lambda ev, rid, t: sim_marks.setdefault(rid, {}).setdefault(ev, t)
    row = (f"PD 1P1D ({args.pd})", metrics(record, wall), predicted(simulate(dep, wl, trace=mark)))

    where = f"prefill worker on GPU {gpus[0]}, decode worker on GPU {gpus[1]}" if gpus else "both workers here"
    desc = (
        f" PD: {where}, KV over {args.pd}; prefill batches of up to {pre_cfg.max_rows} prompts and "
        f"{pre_cfg.token_budget} tokens; {len(pre_points)} prefill shapes timed; link {bw / 1e9:.2f} GB/s + "
        f"{latency * 1e3:.1f} ms; lone {probe}-token requests: TTFT {lone_ttft * 1e3:.1f} ms, of which "
        f"{handoff * 1e3:.1f} ms beyond prefill and link (added to the link's latency); decode worker started in "
        f"{t_dec:.0f} s" + (f"; {failed} requests did not finish" if failed else "") + "."
    )
    pm, dm = CostModel(cfg, gpu(args.gpu), pre_eff), CostModel(cfg, gpu(args.gpu), dec_eff)
    tables = ["", "Prefill worker calibration (batch shapes: rows x chunk, padded length, page-table width):", ""]
    tables += ["| rows x chunk | length | table pages | measured ms | model ms |", "|---|---|---|---|---|"]
    for (b, tc, t, m), s in pre_points:
        model_s = pm.step(ps.shape_works(b, tc, t, m)).seconds
        tables.append(f"| {b} x {tc} | {t} | {m} | {s * 1e3:.2f} | {model_s * 1e3:.2f} |")
    tables += ["", f"KV link ({args.pd}, this model's cache in pages of {pre_cfg.page_size}):", ""]
    tables += ["| prompt tokens | MB | measured ms | model ms |", "|---|---|---|---|"]
    for t, nbytes, s in link:
        tables.append(f"| {t} | {nbytes / 1e6:.1f} | {s * 1e3:.2f} | {dm.transfer_seconds(nbytes) * 1e3:.2f} |")
    trace_dir = trace.directory()
    if trace_dir:
        from hcfjax.trace import read

        tables += ["", "Where PD's time to first token went (hcfjax.trace marks of the served requests; the simulated"]
        tables += ["requests are the same workload's):", ""]
        tables += breakdown(request_marks(read(trace_dir), "bench-"), sim_marks)
    tables += ["", f"Fitted prefill profile ({profiles['prefill']}): {fitted(pre_eff)}."]
    tables += ["", f"Fitted decode profile ({profiles['decode']}, the decode-only steps above): {fitted(dec_eff)}."]
    return row, desc, tables
