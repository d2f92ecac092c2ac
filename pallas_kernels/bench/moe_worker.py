"""The MoE bench's worker (`python -m pallas_kernels.bench.moe --worker`, started by the driver in moe.py): imports
jax, runs many cases in one process and prints one event line per row (BEGIN, ROW, CEIL, DONE, LOST) for the driver."""

from __future__ import annotations

import functools
import json
import os
import sys
import time

from pallas_kernels.bench.moe_cases import CHECK_TOL, swept_tilings, tiling_label


def _timed(fn, *args, min_time: float = 0.1, max_reps: int = 50, wait=None) -> float:
    """Seconds per call: calls issued back to back and waited for once (best of 3 rounds). wait(outputs):
    jax.block_until_ready, or a torch peer's synchronize."""
    import jax

    wait = wait or jax.block_until_ready
    wait(fn(*args))
    t0 = time.perf_counter()
    wait(fn(*args))
    once = time.perf_counter() - t0
    reps = int(min(max_reps, max(3, min_time / max(once, 1e-6))))
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        out = None
        for _ in range(reps):
            out = fn(*args)
        wait(out)
        best = min(best, (time.perf_counter() - t0) / reps)
    return best


def _ceilings() -> dict:
    from hcfjax.bench.common import copy_bandwidth, header, matmul_flops, torch_copy_bandwidth

    torch_bw = torch_copy_bandwidth()  # before jax allocates its pool
    import jax
    import jax.numpy as jnp

    n = 8192
    a = jax.random.randint(jax.random.key(1), (n, n), -127, 127, jnp.int8)
    b = jax.random.randint(jax.random.key(2), (n, n), -127, 127, jnp.int8)
    i8 = 2 * n**3 / _timed(jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.int32)), a, b)
    del a, b
    return dict(header=header(), torch_copy=torch_bw, xla_copy=copy_bandwidth(), int8=i8, bf16=matmul_flops())


def problem(e: int, m: int, k: int, n: int, seed: int = 0):
    import jax
    import jax.numpy as jnp

    kw, kx, kg = jax.random.split(jax.random.key(seed), 3)
    w = (jax.random.normal(kw, (e, k, n), jnp.float32) / k**0.5).astype(jnp.bfloat16)  # [E, K, N]
    x = jax.random.normal(kx, (m, k), jnp.float32).astype(jnp.bfloat16)  # [M, K]
    gs = jnp.bincount(jax.random.randint(kg, (m,), 0, e), length=e).astype(jnp.int32)  # [E]
    return w, x, gs


def grouped_reference(a, b, gs):
    """The grouped product in f32 at full precision: rows of a [M, K] in groups of gs [E] (in order) times b [E, K,
    N], one expert at a time over a window of the largest group's rows. XLA's own f32 ragged_dot is a masked dense
    product over every expert ([M, E * K] at 256 experts: more memory than a GPU has)."""
    import numpy as np

    window = max(8, -(-int(np.max(np.asarray(gs))) // 8) * 8)
    return _grouped_program(window)(a, b, gs)


@functools.cache
def _grouped_program(window: int):
    """grouped_reference's program for groups of at most `window` rows, compiled once per shape for all of a
    case's references (the operands are arguments: closed over, jit would embed them as constants)."""
    import jax
    import jax.numpy as jnp

    def product(a, b, gs):
        m, k = a.shape
        starts = jnp.cumsum(gs) - gs
        a = jnp.pad(a.astype(jnp.float32), ((0, window), (0, 0)))

        def one(out, e):
            rows = jax.lax.dynamic_slice(a, (starts[e], 0), (window, k))
            y = jnp.dot(rows, b[e].astype(jnp.float32), precision="highest")
            held = jax.lax.dynamic_slice(out, (starts[e], 0), y.shape)
            y = jnp.where((jnp.arange(window) < gs[e])[:, None], y, held)
            return jax.lax.dynamic_update_slice(out, y, (starts[e], 0)), None

        out = jnp.zeros((m + window, b.shape[-1]), jnp.float32)
        return jax.lax.scan(one, out, jnp.arange(b.shape[0]))[0][:m]

    return jax.jit(product)


def _errors(y, ref) -> dict:
    import jax.numpy as jnp

    y, ref = y.astype(jnp.float32), ref.astype(jnp.float32)
    d = y - ref
    return dict(
        max_rel=float(jnp.abs(d).max() / jnp.abs(ref).max()),
        rel=float(jnp.linalg.norm(d) / jnp.linalg.norm(ref)),
        finite=bool(jnp.isfinite(y).all()),
    )


def _emit(kind: str, spec: str, **data) -> None:
    """One event line for the driver; each event also restarts the worker's own hang timer."""
    import faulthandler

    print(f"{kind} " + json.dumps(dict(spec=spec, **data)), flush=True)
    faulthandler.dump_traceback_later(float(os.environ.get("MOE_BENCH_STALL", "45")) - 3, exit=True)


def _given_x_q(fn):
    """fn with the tokens' int8 quantisation given by the caller as its last argument (x_q), as the model calls the
    kernels; x then only gives the shape."""
    return lambda *args: fn(*args[:-1], x_q=args[-1])


def _case(spec: str, sweep: bool, interpret: bool, skip: dict, jnp_refs: bool, done: list) -> None:
    import jax
    import jax.numpy as jnp

    from hcfjax import quant
    from hcfjax.bench.common import repeats_exactly
    from hcfjax.cache import quantize_int8
    from hcfjax.quant import dequantize_int8_groups, quantize_int8_groups
    from pallas_kernels.moe_int4 import (
        _hs_rows,
        int4_gated_ragged_dot,
        int4_gated_ragged_dot_digits,
        int4_ragged_dot,
        int4_ragged_dot_digits,
        kernel_operands,
    )
    from pallas_kernels.moe_int4_tiling import default_tiling, digits_pay, smem_bytes

    e, m, k, n = map(int, spec.split("x"))
    w, x, gs = problem(e, m, k, n)
    q4 = quant.quantize(w, 4, "bf16")
    touched = int((gs > 0).sum()) / e  # the experts with rows: all of them unless M is small (64 experts x 6 rows)
    nb_bf16, nb_int4 = w.size * 2 * touched, (q4.q.nbytes + q4.scale.nbytes) * touched

    # The exactly-quantised function in f32 (dequantised weights; w4a8: dequantised int8 tokens too).
    wf = quant.dequantize(q4, jnp.bfloat16).astype(jnp.float32)
    f32_dot = grouped_reference
    x_rows = quantize_int8(x)  # per row, as the model quantises the tokens before gathering their copies
    x_rows_f32 = x_rows[0].astype(jnp.float32) * x_rows[1][:, None]
    # x in 128-channel groups, as the gate/up kernel's quant_out writes it (scales padded as that kernel leaves them)
    xg, xgs = quantize_int8_groups(x)
    x_groups = (xg, jnp.pad(xgs, ((0, 0), (0, _hs_rows(m) - m))))
    _emit("BEGIN", spec, what="f32 references")  # (each event restarts the hang timer: the first compile is long)
    refs = {
        "bf16": f32_dot(x.astype(jnp.float32), wf, gs),
        "int8": f32_dot(x_rows_f32, wf, gs),
        "int8 groups": f32_dot(dequantize_int8_groups(xg, xgs), wf, gs),
    }
    del wf, xg, xgs

    rounds = int(os.environ.get("MOE_BENCH_ROUNDS", "1"))
    pending = []

    def row(name, fn, *args, nbytes=0, int8=False, act=None, tiling=None, ref=None, mult=1, nw=1, needs=(), post=None):
        """One timed row; kernels (act given) are first checked against ref (default: the plain product's). mult=0:
        a row that is not a matmul (only its time is shown). A kernel that hung or hit a CUDA error earlier in the
        run is skipped (by row name; a CUDA error by row name and token block), as is a row that needs it (the
        gate/up rows share the default kernel's code); rows a lost worker already reported for this case (done) are
        not rerun. post: what turns the output into the product to check (a quantised output: dequantised)."""
        key = f"{name} bm={tiling.bm}" if tiling is not None else None
        if name in done:
            return
        if why := next((skip[k] for k in (name, key, *needs) if k in skip), None):
            _emit("ROW", spec, row=dict(name=name, error=f"skipped: {why}"))
            return
        r = dict(name=name, nbytes=nbytes, int8=int8, mult=mult)
        _emit("BEGIN", spec, what=name)
        try:
            f = jax.jit(fn)
            if act is not None:  # a kernel: checked on this device before it is timed
                checked = (lambda *a: post(f(*a))) if post else f  # what is compared (quant_out: not its pad rows)
                y = checked(*args)
                r["check"] = c = _errors(y, refs[act] if ref is None else ref)
                c["repeats"] = repeats_exactly(checked, args, y)  # a race shows as outputs that change between runs
                ok = c["finite"] and c["max_rel"] < CHECK_TOL and c["repeats"]
                c["ok"] = ok
                if act != "fp8":  # (the fp8 kernel's tiling is its own: moe_fp8.default_tiling)
                    c.update(tiling=tiling_label(tiling), smem=smem_bytes(act, tiling, nw=nw))
            timers = (f, _device_timer(f, args))  # jitted: an unjitted row (XLA-only, unfused) ran op by op
            _time_row(r, *timers, args)
        except Exception as ex:  # noqa: BLE001 - reported in its row, the others still run
            r["error"] = f"{type(ex).__name__}: {str(ex)[:1500]}"
            if _device_lost(r["error"]):  # the CUDA context is unusable: nothing later in this process can run
                _emit("ROW", spec, row=r)
                _lost(spec, name, key)
        _emit("ROW", spec, row=r)
        if rounds > 1 and "error" not in r:
            pending.append((r, *timers, args))  # timed again in the later rounds, each reporting its row again

    kg = k // 128
    default_bm = {act: default_tiling(act, m, n, kg, e).bm for act in ("bf16", "int8")}
    for act in ("bf16", "int8"):  # the default tilings first: the rows that matter most if the run is cut short
        name = "w4a16" if act == "bf16" else "w4a8"
        t = default_tiling(act, m, n, kg, e)
        fn = functools.partial(int4_ragged_dot, act=act, interpret=interpret, tiling=t)
        row(f"{name} kernel", fn, x, q4.q, q4.scale, gs, nbytes=nb_int4, int8=act == "int8", act=act, tiling=t)
        if act == "int8":  # the kernel alone: x quantised per row by the caller (the "w4a8 kernel" row quantises
            # it in its wrapper, one XLA pass inside the row's time), as the fused kernel's row of that name
            given = _given_x_q(fn)
            kw = dict(nbytes=nb_int4, int8=True, act=act, tiling=t, needs=(f"{name} kernel",))
            row(f"{name} kernel, x quantised by the caller", given, x, q4.q, q4.scale, gs, x_rows, **kw)
        if act == "int8" and k % 128 == 0:  # as the down projection gets x from the gate/up kernel's quant_out
            label = f"{name} kernel, x in 128-channel groups by the producer"
            kw = dict(nbytes=nb_int4, int8=True, act=act, tiling=t, ref=refs["int8 groups"], needs=(f"{name} kernel",))
            row(label, given, x, q4.q, q4.scale, gs, x_groups, **kw)
    # w4a16 as two int8 digits a value on the w4a8 kernel: where digits_pay (the default int4_ragged_dot then takes),
    # or everywhere with MOE_BENCH_DIGITS=1
    if digits_pay(m, n, 128, kg, e) or os.environ.get("MOE_BENCH_DIGITS"):
        t = default_tiling("int8", 2 * m, n, kg, e, splits=1)
        fn = functools.partial(int4_ragged_dot_digits, interpret=interpret, tiling=t)
        kw = dict(nbytes=nb_int4, act="int8", tiling=t, ref=refs["bf16"])
        default = " (int4_ragged_dot's default here)" if digits_pay(m, n, 128, kg, e) else ""
        row(f"w4a16 as int8 digits{default}", fn, x, q4.q, q4.scale, gs, **kw)
    for act in ("bf16", "int8"):
        name = "w4a16" if act == "bf16" else "w4a8"
        alternatives = swept_tilings(act, e, m, k, n) if sweep else []
        for t in alternatives:
            fn = functools.partial(int4_ragged_dot, act=act, interpret=interpret, tiling=t)
            label = f"{name} kernel, {tiling_label(t)}"
            row(label, fn, x, q4.q, q4.scale, gs, nbytes=nb_int4, int8=act == "int8", act=act, tiling=t)
    if k > n:  # a gate/up shape: the fused gate + up + SiLU kernel against two kernel calls and XLA's SiLU
        qu, su = (q4.q + jnp.uint8(0x35)), q4.scale * 0.5  # a second, different weight for "up"
        wu = quant.dequantize(quant.QWeight(qu, su, 4, "bf16"), jnp.bfloat16).astype(jnp.float32)
        for act in ("bf16", "int8"):
            name = "w4a16" if act == "bf16" else "w4a8"
            xr = x_rows_f32 if act == "int8" else x.astype(jnp.float32)
            ref = jax.nn.silu(refs[act]) * f32_dot(xr, wu, gs)
            t = default_tiling(act, m, n, kg, e, nw=2)
            fused = functools.partial(int4_gated_ragged_dot, act=act, interpret=interpret, tiling=t)
            weights = (x, (q4.q, q4.scale), (qu, su), gs)
            needs = (f"{name} kernel", f"{name} kernel bm={default_bm[act]}")  # the same code, and the unfused row's
            kw = dict(nbytes=2 * nb_int4, int8=act == "int8", mult=2, needs=needs)
            row(f"{name} gate+up+SiLU fused", fused, *weights, act=act, tiling=t, ref=ref, nw=2, **kw)
            if act == "int8":  # as the model calls it: tokens quantised before their top-k copies are gathered
                label = f"{name} gate+up+SiLU fused, x quantised by the caller"
                row(label, _given_x_q(fused), *weights, x_rows, act=act, tiling=t, ref=ref, nw=2, **kw)
                # the product written as int8 + per-(row, 128-channel) scales for the down projection (quant_out)
                tq = default_tiling(act, m, n, kg, e, nw=2, bn=max(128, t.bn), wgs=1)
                qfn = functools.partial(int4_gated_ragged_dot, act=act, interpret=interpret, tiling=tq, quant_out=True)
                label = f"{name} gate+up+SiLU fused, x quantised by the caller, output quantised (quant_out)"
                deq = lambda y: dequantize_int8_groups(*y)  # noqa: E731
                row(label, _given_x_q(qfn), *weights, x_rows, act=act, tiling=tq, ref=ref, nw=2, post=deq, **kw)
            for ts in swept_tilings(act, e, m, k, n, nw=2) if sweep else []:
                fn = functools.partial(int4_gated_ragged_dot, act=act, interpret=interpret, tiling=ts)
                if act == "int8":  # as the model calls it (the row to compare: "x quantised by the caller")
                    label = f"{name} gate+up+SiLU fused, x quantised by the caller, {tiling_label(ts)}"
                    row(label, _given_x_q(fn), *weights, x_rows, act=act, tiling=ts, ref=ref, nw=2, **kw)
                else:
                    label = f"{name} gate+up+SiLU fused, {tiling_label(ts)}"
                    row(label, fn, *weights, act=act, tiling=ts, ref=ref, nw=2, **kw)
            if act == "bf16" and (digits_pay(m, n, 128, kg, e) or os.environ.get("MOE_BENCH_DIGITS")):
                td = default_tiling("int8", 2 * m, n, kg, e, nw=2, splits=1)
                fn = functools.partial(int4_gated_ragged_dot_digits, interpret=interpret, tiling=td)
                default = " (int4_gated_ragged_dot's default here)" if digits_pay(m, n, 128, kg, e) else ""
                row(f"w4a16 gate+up+SiLU fused as int8 digits{default}", fn, *weights, act="int8", tiling=td, ref=ref,
                    nw=2, **kw)  # fmt: skip
            two = functools.partial(int4_ragged_dot, act=act, interpret=interpret)
            unfused = lambda x, g, u, gs, two=two: jax.nn.silu(two(x, *g, gs)) * two(x, *u, gs)  # noqa: E731
            row(f"{name} gate, up kernels + SiLU", unfused, *weights, **kw)
            del ref
        del wu
    refs.clear()  # free the f32 references (and the dequantised tokens) before the bf16 rows
    del x_rows_f32
    _emit("BEGIN", spec, what="fp8 weights and reference")
    _fp8_rows(row, x, w, gs, f32_dot, touched, interpret, refs)

    def passes(x, q, sc, gs):  # w4a8's quantised tokens and scales (w4a16's wrapper does no XLA work)
        return kernel_operands(x, ((q, sc),), gs, "int8", default_tiling("int8", m, n, kg, e).bm)[3:]

    row("w4a8 wrapper's XLA passes only", passes, x, q4.q, q4.scale, gs, mult=0)
    row("bf16 ragged_dot (XLA)", jax.lax.ragged_dot, x, w, gs, nbytes=nb_bf16)
    _peers(spec, x, w, gs, done)
    del w
    if jnp_refs:
        row("w4a16 jnp reference", quant.ragged_dot_reference, x, q4, gs, nbytes=nb_int4)
        q8 = quant.QWeight(q4.q, q4.scale, 4, "int8")
        row("w4a8 jnp reference", quant.ragged_dot_reference, x, q8, gs, nbytes=nb_int4, int8=True)
    for k in range(1, rounds):  # rounds 2..N over every row in turn: a slow spell of the device hits rows alike
        for r, f, timer, args in pending:
            _emit("BEGIN", spec, what=f"{r['name']} (round {k + 1})")
            _time_row(r, f, timer, args)
            _emit("ROW", spec, row=r)  # replaces the row's earlier report


def _fp8_rows(row, x, w, gs, f32_dot, touched: float, interpret: bool, refs: dict) -> None:
    """DeepSeek's fp8 layout (e4m3 weights with 128 x 128 block scales, tokens in 1 x 128 groups, quantised by the
    caller) on pallas_kernels.moe_fp8, checked against its exactly-quantised product in f32; gate/up shapes also
    run the fused gate + up + SiLU kernel. The weights' bytes count e4m3 values and f32 block scales."""
    import jax
    import jax.numpy as jnp

    from hcfjax import fp8
    from pallas_kernels.moe_fp8 import fp8_gated_ragged_dot, fp8_ragged_dot

    # an expert at a time in one compiled loop: XLA took over 42 s to compile fp8.quantize for 256 experts at once
    quantize = functools.partial(jax.lax.map, fp8.quantize)
    dequantize = functools.partial(jax.lax.map, fp8.dequantize)
    k = x.shape[1]
    wq = quantize(w)
    xq, xs = fp8.quantize_act(x)
    xf = xq.astype(jnp.float32) * jnp.repeat(xs, 128, axis=1)
    refs["fp8"] = f32_dot(xf, dequantize(wq), gs)
    nbytes = fp8.nbytes(wq) * touched
    one = functools.partial(fp8_ragged_dot, interpret=interpret)
    row("fp8 block-scaled kernel, x quantised by the caller", one, xq, xs.T, wq.q, wq.scale_inv, gs, nbytes=nbytes,
        int8=True, act="fp8")  # fmt: skip
    if k > w.shape[-1]:  # a gate/up shape
        up = quantize(w[:, ::-1])
        ref = jax.nn.silu(refs["fp8"]) * f32_dot(xf, dequantize(up), gs)
        fused = functools.partial(fp8_gated_ragged_dot, interpret=interpret)
        pairs = ((wq.q, wq.scale_inv), (up.q, up.scale_inv))
        row("fp8 gate+up+SiLU fused, x quantised by the caller", fused, xq, xs.T, *pairs, gs, nbytes=2 * nbytes,
            int8=True, act="fp8", ref=ref, mult=2)  # fmt: skip
    refs.clear()


def _peers(spec: str, x, w, gs, done: list) -> None:
    """torch's grouped GEMMs on this case (pallas_kernels.bench.moe_peers), timed as the jax rows are."""
    from pallas_kernels.bench.moe_peers import peer_rows

    if any("(peer" in name for name in done):
        return
    _emit("BEGIN", spec, what="torch peers")
    kernels = None
    if os.environ.get("HCFJAX_BENCH_DEVICE_TIME") == "kernels":
        from hcfjax.bench.common import kernel_time

        kernels = lambda fn, wait: kernel_time(fn, wait=wait)  # noqa: E731
    for r in peer_rows(x, w, gs, lambda fn, wait: _timed(fn, wait=wait), kernels):
        _emit("ROW", spec, row=r)


def _device_timer(fn, args):
    """The row's timer on the device: hcfjax.bench.common.device_timer with --device-time, the summed kernel records
    of a profiler trace (kernel_times) with --kernel-time, else None."""
    mode = os.environ.get("HCFJAX_BENCH_DEVICE_TIME")
    if not mode:
        return None
    from hcfjax.bench.common import device_timer, kernel_time

    if mode == "kernels":  # the log shows where a row's time goes (the kernel, the wrapper's XLA passes)
        return lambda: kernel_time(fn, *args, show=lambda line: print(f"kernels: {line}", flush=True))
    return device_timer(fn, *args)


def _time_row(r: dict, f, timer, args) -> None:
    """Times one row back to back (f) and, with --device-time, on the device alone (timer) into r, keeping the best
    of the rounds so far ("t", "td") and every round's device time ("td_all")."""
    t = _timed(f, *args)
    r["t"], r["rounds"] = min(r.get("t", t), t), r.get("rounds", 0) + 1
    if timer is not None:
        r["td_all"] = r.get("td_all", []) + [timer()]
        r["td"] = min(r["td_all"])


def _device_lost(msg: str) -> bool:
    """A CUDA error (a kernel's misaligned address, an illegal access): the process's CUDA context is then poisoned,
    and every later call in it fails (the first H200 run lost all cases after one)."""
    return "CUDA_ERROR" in msg or "CUDA error" in msg


def _lost(spec: str, what: str, skip_key: str | None) -> None:
    """Tells the driver this worker's device is lost, then exits; a fresh worker continues with the next case."""
    _emit("LOST", spec, what=what, skip=skip_key)
    sys.stdout.flush()
    os._exit(3)


def worker(specs: list[str], sweep: str, interpret: bool, skip: dict, jnp_refs: bool) -> None:
    done = skip.pop("__done__", {})  # rows of a case that a lost worker already reported
    for spec in specs:
        _emit("BEGIN", spec, what="case")
        try:
            if spec == "ceilings":
                _emit("CEIL", spec, ceilings=_ceilings())
            else:
                _case(spec, sweep == "all" or spec in sweep.split(","), interpret, skip, jnp_refs, done.get(spec, []))
            _emit("DONE", spec)
        except Exception as ex:  # noqa: BLE001
            msg = f"{type(ex).__name__}: {str(ex)[:2000]}"
            if _device_lost(msg):
                _lost(spec, f"case ({msg[:300]})", None)
            _emit("DONE", spec, error=msg)
