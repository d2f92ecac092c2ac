"""The prefill/decode disaggregated servers `hcfjax.bench.serve --pd` and the simulator's PD validation run: a
prefill worker, a decode worker and the router, each `hcfjax serve --role ...` in a process of its own, started
with the benchmark's settings and stopped together."""

from __future__ import annotations

import os
import sys
import threading
import time
from concurrent.futures import Future


def pd_configs(args):
    """(the prefill worker's PrefillConfig, the decode worker's EngineConfig) for the benchmark's settings: the
    prefill worker takes prompts whole, up to 4096 tokens a batch; the decode worker is the colocated engine but for
    the prefill chunk settings, which it does not use."""
    from hcfjax.engine import EngineConfig
    from hcfjax.pd.prefill import PrefillConfig

    prefill = PrefillConfig(
        page_size=args.page_size,
        max_rows=args.prefill_rows,
        token_budget=max(args.token_budget, 4096),
        min_bucket=args.min_bucket,
        transfer_timeout_s=60.0,  # the decode worker's (hcfjax serve's default --transfer-timeout)
    )
    decode = EngineConfig(
        max_slots=args.max_slots,
        page_size=args.page_size,
        token_budget=args.token_budget,
        max_model_len=args.max_model_len,
        max_queue=args.requests + 8,
    )
    return prefill, decode


def pd_role_args(args, prefill, decode) -> tuple[list[str], list[str]]:
    """The `hcfjax serve` arguments of the prefill and decode workers that run with these configs (pd_configs)."""
    import hcfjax
    from hcfjax.serving.config import engine_flags, prefill_flags

    model = ["--preset", args.preset] if args.preset else ["--model", args.model or str(hcfjax.DEFAULT_MODEL)]
    scheme = ["--scheme", args.scheme] if args.scheme else []
    common = [*model, *scheme, "--transport", args.pd, "--port", "0"]
    # the prefill worker compiles its shapes up to the decode worker's context length
    pre = ["--role", "prefill", *common, "--max-model-len", str(decode.max_model_len), *prefill_flags(prefill)]
    return pre, ["--role", "decode", *common, *engine_flags(decode)]


def pd_gpus(spec: str | None) -> tuple[str, str] | None:
    """--pd-gpus 'P,D': the GPU of the prefill worker and of the decode worker."""
    if not spec:
        return None
    gpus = [g.strip() for g in spec.split(",")]
    if len(gpus) != 2 or not all(g.isdigit() for g in gpus):
        raise SystemExit(f"--pd-gpus takes two GPU indices, prefill's and decode's (e.g. 0,1), got {spec!r}")
    return gpus[0], gpus[1]


def role_env(gpu: str | None = None, mem_fraction: float | None = None, **extra) -> dict:
    """A worker process's environment: on `gpu` only (CUDA_VISIBLE_DEVICES) with `mem_fraction` of its memory."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **extra}
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpu
    if mem_fraction is not None:
        env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = str(mem_fraction)
    return env


def launch_role(role_args: list[str], env: dict, procs: list) -> Future:
    """Starts `hcfjax serve ROLE_ARGS` (appended to procs) and echoes its output from a thread; -> a future of the
    address it listens on, once it says so (an error if it exits before)."""
    import re
    import subprocess

    cmd = [sys.executable, "-m", "hcfjax.cli", "serve", *role_args]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    procs.append(p)
    address: Future = Future()

    def echo() -> None:
        for line in p.stdout:
            print("  |", line.rstrip(), flush=True)
            m = re.search(r"listening on (\S+)", line)
            if m and not address.done():
                address.set_result(m.group(1))
        if not address.done():
            address.set_exception(SystemExit(f"{role_args[:2]} exited before listening"))

    threading.Thread(target=echo, daemon=True).start()
    return address


def address_of(role: Future, procs: list) -> str:
    """The address a launched role (launch_role) listens on, once it says so; if it exits first, every process in
    procs is stopped and the error raised."""
    try:
        return role.result()
    except BaseException:
        stop_pd(procs)
        raise


def launch_router(prefill: str, decode: str, procs: list) -> int:
    """Starts the router over the two workers; -> its port, once its health says SERVING: it listens before it has
    heard the workers, and answers UNAVAILABLE until then."""
    import grpc

    from hcfjax.serving.client import wait_serving

    router = launch_role(
        ["--role", "router", "--prefill", prefill, "--decode", decode, "--port", "0"],
        role_env(JAX_PLATFORMS="cpu"),
        procs,
    )
    port = int(address_of(router, procs).rsplit(":", 1)[1])
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        try:
            wait_serving(channel, timeout=120.0)
        except TimeoutError:
            stop_pd(procs)
            raise
    return port


def start_pd(args) -> tuple[list, int, float]:
    """The three PD processes (`hcfjax serve --role ...`), the workers warmed up and the router serving; ->
    (processes, the router's port, seconds to start). With --pd-gpus each worker sees only its GPU; without, both
    share the default device, each with 45% of its memory. The two workers load and compile side by side."""
    t0 = time.perf_counter()
    gpus = pd_gpus(args.pd_gpus)
    shared = gpus is None or gpus[0] == gpus[1]
    fraction = 0.45 if shared else None
    pre_args, dec_args = pd_role_args(args, *pd_configs(args))
    procs: list = []
    pre = launch_role(pre_args, role_env(gpus and gpus[0], fraction), procs)
    dec = launch_role(dec_args, role_env(gpus and gpus[1], fraction), procs)
    port = launch_router(address_of(pre, procs), address_of(dec, procs), procs)
    return procs, port, time.perf_counter() - t0


def stop_pd(procs) -> None:
    import signal

    for p in procs:
        p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(20)
        except Exception:  # noqa: BLE001 - a stuck worker is killed
            p.kill()
