"""Int4 MoE grouped GEMM (pallas_kernels.moe_int4) on the GPU: correctness, then time against bf16 `ragged_dot` and
the int4 jnp reference, with the ceilings measured in the same run. One table at the end.

    python -m pallas_kernels.bench.moe [--cases default|all|ExMxKxN,...] [--time-limit 200] [--hard-limit SECONDS]
                                       [--stall 45] [--sweep [CASES]] [--sweep-only TEXT] [--rounds N] [--jnp-refs]
                                       [--no-ceilings] [--interpret] [--lower] [--out FILE]

Cases: DeepSeek-V3 expert shapes, gate/up (K = hidden 7168, N = expert width 2048) and down (K = 2048, N = 7168), for
E local experts in {16, 32} and M routed token copies in {128, 1024, 4096, 16384} (decode to prefill), spread
uniformly at random over the experts. "default": decode (E=16 M=128), prefill (E=32 M=4096), E=16 M=1024 and
E=32 M=16384 gate/up, in that order; "all": every combination, those four first.
Each case first checks every kernel row (w4a16, w4a8) against the exactly-quantised function computed in f32 (the
max error over the max of the reference, and the norm-wise relative error), then times every implementation. Kernel
rows: the default tiling (moe_int4_tiling.default_tiling) and with --sweep a few alternatives (`sweep_tilings`).
`--lower` lowers every one of them for sm_90 on any host (Mosaic's checks without a GPU): run it before a GPU run.

Gate/up shapes also time the fused gate + up + SiLU kernel (int4_gated_ragged_dot; its bytes and FLOPs count both
weights) against two kernel calls and XLA's SiLU-and-multiply.

Per row: time (pipelined: `reps` calls back to back, then one wait, so dispatch overlaps execution; the kernel rows
include the wrapper's XLA work: the per-block table from group_sizes and, for w4a8, the activation quantisation; the
"wrapper's XLA passes only" rows time that work alone), weight bandwidth
(bytes of the weights of the experts with rows as stored, int4 + f32 scales or bf16, over the time: every expert's
unless M is small) and TFLOP/s (2 M K N over the time; TOP/s
for w4a8). Ceilings: torch `copy_` over 2 GiB counting read + write (XLA's own copy if torch is missing), XLA bf16
and int8 8192^3 matmuls. --rounds N times every row of a case N times, interleaved (all rows, then all again), and
keeps each row's best: the H200's times of one configuration varied by up to 1.5x between runs, and a slow spell then
hits every row of a round alike instead of whichever row it fell on.

Robustness: the cases run in a worker process that prints one JSON line per row; a row that raises reports its error
and the next runs; a CUDA error (which poisons the process's CUDA context) ends the worker, and a kernel row that hangs
(a deadlocked kernel) is killed after --stall seconds without progress (the worker dumps its Python stack first);
either way a fresh worker resumes the case without that row (at most twice per case; rows already reported are not
rerun) and later cases skip that kernel (a CUDA error: at that token block), and the gate/up rows that share its code.
No case starts after --time-limit seconds and nothing runs past --hard-limit (defaults: 200 s, and 35 s more than
the time limit: the whole run within 4 minutes).
Everything printed also goes to moe_bench.log (and the table to moe_bench.md) under $OUT when it is set.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import select
import subprocess
import sys
import time

HEADLINE = [(16, 128, 7168, 2048), (32, 4096, 7168, 2048), (16, 1024, 7168, 2048), (32, 16384, 7168, 2048)]
SHAPES = [(7168, 2048), (2048, 7168)]
EXPERTS = (16, 32)
TOKENS = (128, 1024, 4096, 16384)
CHECK_TOL = 2e-2  # max |kernel - ref| / max |ref|: a few bf16 roundings of the output


def sweep_tilings(act: str, e: int, m: int, k: int, n: int, nw: int = 1) -> list:
    """Alternatives to the default tiling worth timing next to it (what the next tuning step would choose from):
    decode: one K group per step with 1, 2 or 4 K splits, two with 1 or 2, 64 or 256 weight rows per CTA (the fused
    kernel, nw = 2: 64 rows, also with stages for 2 CTAs per SM, and 128 rows with the deep pipeline of one CTA per
    SM); otherwise (nw = 1 only): 64 weight rows with larger token blocks (the other side of the registers' trade) or
    with the same ones (more CTAs per SM), 64- and 48-row token blocks (less padding per expert, more CTAs per SM).
    Then the default tiling with A through smem (nw = 1: what the registers path gains) and, for w4a8, with each
    tile unpacked just before its wgmmas (what unpacking a step's tiles first gains), in prefill with the other
    choice of Tiling.narrow (a group's last block at the narrowest width that holds its rows) and of Tiling.wgs (one
    compute warpgroup per CTA, or two sharing each token tile). (Persistent CTAs, Tiling.persistent until 2026-12-01,
    were slower in every regime timed and were removed: docs/kernels.md.)"""
    import dataclasses

    from pallas_kernels.moe_int4_tiling import default_tiling

    kg, d = k // 128, default_tiling(act, m, n, k // 128, e, nw)
    if d.bm <= 32:
        alts = [dict(gps=1, splits=s) for s in (1, 2, 4)] + [dict(gps=2, splits=s) for s in (1, 2)]
        alts += [dict(bn=64), dict(bn=256)] if nw == 1 else [dict(bn=64), dict(bn=64, ctas=2), dict(ctas=1)]
    else:  # bn=64 alone takes the larger token blocks its registers allow; with bm: more CTAs per SM
        alts = [dict(bn=64), dict(bn=64, bm=d.bm), dict(bm=64), dict(bm=48)] if nw == 1 else []
        if act == "int8":  # the other choice of compute warpgroups per CTA (one, or two sharing each token tile)
            alts += [dict(wgs=1)] if d.wgs > 1 else [dict(wgs=2, bn=d.bn)] if n % (2 * d.bn) == 0 else []
    out = [default_tiling(act, m, n, kg, e, nw, **a) for a in alts if n % a.get("bn", 64) == 0]
    out += [dataclasses.replace(d, a_regs=False)] if nw == 1 else []
    out += [dataclasses.replace(d, unpack_first=False)] if act == "int8" else []
    out += [dataclasses.replace(d, narrow=not d.narrow)] if d.bm > 32 else []
    out = [t for t in out if kg % (t.gps * t.splits) == 0]  # K = 1408 (V2-Lite's down projection): 11 groups
    return [t for i, t in enumerate(out) if t != d and t not in out[:i]]


def _swept(act: str, e: int, m: int, k: int, n: int, nw: int = 1) -> list:
    """sweep_tilings, less those whose row label has none of --sweep-only's texts (separated by "|"; the workers read
    it from the environment)."""
    only = os.environ.get("MOE_BENCH_SWEEP_ONLY", "")
    return [t for t in sweep_tilings(act, e, m, k, n, nw) if any(o in _short(t) for o in only.split("|"))]


def all_cases() -> list[tuple[int, int, int, int]]:
    rest = [(e, m, k, n) for k, n in SHAPES for e in EXPERTS for m in TOKENS]
    return HEADLINE + [c for c in rest if c not in HEADLINE]


# ---------------------------------------------------------------------------------------------------------------
# Worker (imports jax; one process runs many cases)


def _timed(fn, *args, min_time: float = 0.1, max_reps: int = 50) -> float:
    """Seconds per call: calls issued back to back and waited for once (best of 3 rounds)."""
    import jax

    jax.block_until_ready(fn(*args))
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    once = time.perf_counter() - t0
    reps = int(min(max_reps, max(3, min_time / max(once, 1e-6))))
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        out = None
        for _ in range(reps):
            out = fn(*args)
        jax.block_until_ready(out)
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


def _problem(e: int, m: int, k: int, n: int, seed: int = 0):
    import jax
    import jax.numpy as jnp

    kw, kx, kg = jax.random.split(jax.random.key(seed), 3)
    w = (jax.random.normal(kw, (e, k, n), jnp.float32) / k**0.5).astype(jnp.bfloat16)  # [E, K, N]
    x = jax.random.normal(kx, (m, k), jnp.float32).astype(jnp.bfloat16)  # [M, K]
    gs = jnp.bincount(jax.random.randint(kg, (m,), 0, e), length=e).astype(jnp.int32)  # [E]
    return w, x, gs


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


def _short(t) -> str:
    gps = f" gps={t.gps}" if t.gps > 1 else ""
    gps += f" split-K {t.splits}" if t.splits > 1 else ""
    via = ("" if t.a_regs else " A via smem") + ("" if t.inline else " int16")
    via += "" if t.unpack_first else " unpacked per tile"
    via += " narrow tails" if t.narrow else (" full-width tails" if t.bm > 32 else "")
    via += f" {t.wgs} compute warpgroups" if t.wgs > 1 else ""
    return f"bm={t.bm} bn={t.bn} st={t.stages}{gps}{via}"


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
    w, x, gs = _problem(e, m, k, n)
    q4 = quant.quantize(w, 4, "bf16")
    touched = int((gs > 0).sum()) / e  # the experts with rows: all of them unless M is small (64 experts x 6 rows)
    nb_bf16, nb_int4 = w.size * 2 * touched, (q4.q.nbytes + q4.scale.nbytes) * touched

    # The exactly-quantised function in f32 (dequantised weights; w4a8: dequantised int8 tokens too).
    wf = quant.dequantize(q4, jnp.bfloat16).astype(jnp.float32)
    f32_dot = jax.jit(lambda a, b, g: jax.lax.ragged_dot(a, b, g, precision="highest"))
    x_rows = quantize_int8(x)  # per row, as the model quantises the tokens before gathering their copies
    x_rows_f32 = x_rows[0].astype(jnp.float32) * x_rows[1][:, None]
    # x in 128-channel groups, as the gate/up kernel's quant_out writes it (scales padded as that kernel leaves them)
    xg, xgs = quantize_int8_groups(x)
    x_groups = (xg, jnp.pad(xgs, ((0, 0), (0, _hs_rows(m) - m))))
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
                smem = smem_bytes(act, tiling, nw=nw)
                c["repeats"] = repeats_exactly(checked, args, y)  # a race shows as outputs that change between runs
                ok = c["finite"] and c["max_rel"] < CHECK_TOL and c["repeats"]
                c.update(ok=ok, tiling=_short(tiling), smem=smem)
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
        alternatives = _swept(act, e, m, k, n) if sweep else []
        for t in alternatives:
            fn = functools.partial(int4_ragged_dot, act=act, interpret=interpret, tiling=t)
            label = f"{name} kernel, {_short(t)}"
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
            for ts in _swept(act, e, m, k, n, nw=2) if sweep else []:
                fn = functools.partial(int4_gated_ragged_dot, act=act, interpret=interpret, tiling=ts)
                if act == "int8":  # as the model calls it (the row to compare: "x quantised by the caller")
                    label = f"{name} gate+up+SiLU fused, x quantised by the caller, {_short(ts)}"
                    row(label, _given_x_q(fn), *weights, x_rows, act=act, tiling=ts, ref=ref, nw=2, **kw)
                else:
                    label = f"{name} gate+up+SiLU fused, {_short(ts)}"
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

    def passes(x, q, sc, gs):  # w4a8's quantised tokens and scales (w4a16's wrapper does no XLA work)
        return kernel_operands(x, ((q, sc),), gs, "int8", default_tiling("int8", m, n, kg, e).bm)[3:]

    row("w4a8 wrapper's XLA passes only", passes, x, q4.q, q4.scale, gs, mult=0)
    row("bf16 ragged_dot (XLA)", jax.lax.ragged_dot, x, w, gs, nbytes=nb_bf16)
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


def kernel_configs(e: int, m: int, k: int, n: int, sweep: bool):
    """(act, nw, tiling) of every kernel row a case times, in order."""
    from pallas_kernels.moe_int4_tiling import default_tiling

    out = [(act, 1, default_tiling(act, m, n, k // 128, e)) for act in ("bf16", "int8")]
    for act in ("bf16", "int8"):
        out += [(act, 1, t) for t in (_swept(act, e, m, k, n) if sweep else [])]
    for act in ("bf16", "int8") if k > n else ():
        out += [(act, 2, t) for t in [default_tiling(act, m, n, k // 128, e, nw=2)]]
        out += [(act, 2, t) for t in (_swept(act, e, m, k, n, nw=2) if sweep else [])]
    return out


def lower_all(cases, sweep: str) -> bool:
    """Lowers every kernel the bench would run for sm_90 on this host (no GPU: layout inference, the ops Mosaic
    supports, smem), one line each; the pre-flight check for a GPU run."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels.cross_lower import lower_for_hopper
    from pallas_kernels.moe_int4 import int4_gated_ragged_dot, int4_ragged_dot
    from pallas_kernels.moe_int4_tiling import smem_bytes

    s, ok = jax.ShapeDtypeStruct, True
    for e, m, k, n in cases:
        spec = f"{e}x{m}x{k}x{n}"
        x, gs = s((m, k), jnp.bfloat16), s((e,), jnp.int32)
        w = (s((e, n, k // 2), jnp.uint8), s((e, k // 128, n), jnp.float32))
        for act, nw, t in kernel_configs(e, m, k, n, sweep == "all" or spec in sweep.split(",")):
            if nw == 1:
                fn = lambda x, w, gs, act=act, t=t: int4_ragged_dot(x, *w, gs, act=act, tiling=t)  # noqa: E731
            else:
                fn = lambda x, w, gs, act=act, t=t: int4_gated_ragged_dot(x, w, w, gs, act=act, tiling=t)  # noqa: E731
            try:
                lower_for_hopper(fn, x, w, gs)
                r = "ok"
            except Exception as ex:  # noqa: BLE001 - reported, the others still lower
                r, ok = f"FAIL {type(ex).__name__}: {str(ex)[:300]}", False
            print(f"{spec} {act} nw={nw} {_short(t)} smem={smem_bytes(act, t, nw=nw)}: {r}", flush=True)
    return ok


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


# ---------------------------------------------------------------------------------------------------------------
# Driver (no jax: it only starts workers, enforces the time limits and prints the table)


class Log:
    def __init__(self):
        out = os.environ.get("OUT")
        self.dir = out if out and os.path.isdir(out) else None
        self.fh = open(os.path.join(self.dir, "moe_bench.log"), "a") if self.dir else None

    def __call__(self, *lines: str) -> None:
        for line in lines:
            print(line, flush=True)
            if self.fh:
                self.fh.write(line + "\n")
                self.fh.flush()


def _lines(fd: int, timeout: float, buf: bytearray) -> list[str] | None:
    """Complete lines from fd within timeout ([] if none yet), None at EOF. Reads the raw fd so that select() sees
    every byte (a buffered readline could hold a finished line back)."""
    ready, _, _ = select.select([fd], [], [], max(0.0, timeout))
    if ready:
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            return None
        buf.extend(chunk)
    *done, rest = bytes(buf).split(b"\n")
    buf[:] = rest
    return [d.decode(errors="replace") for d in done]


def run_workers(specs: list[str], args, log: Log) -> dict[str, dict]:
    """Runs the specs in order in worker processes: {spec: {rows, ceilings, error, note}}. A worker that exits early
    or stays silent for --stall seconds (a hung kernel) is killed, as is one whose CUDA context a kernel broke; the
    row it was on is reported, and a new worker resumes the case without it (once or twice per case: the rows already
    reported are not rerun) or goes on with the next case. A kernel that hung or broke the context is skipped in the
    later cases too (each hang costs the stall time)."""
    results: dict[str, dict] = {s: dict(rows=[]) for s in specs}
    t_start = time.time()
    hard_stop = t_start + (args.hard_limit or args.time_limit + 35)
    pending, skip, done, retries = list(specs), {}, {}, {}

    def resume(spec: str) -> bool:  # whether a fresh worker should take this case up again
        if spec == "ceilings" or retries.get(spec, 0) >= 2 or time.time() >= hard_stop:
            return False
        retries[spec] = retries.get(spec, 0) + 1
        return True

    env = dict(os.environ, MOE_BENCH_STALL=str(args.stall))
    while pending:
        if time.time() - t_start > args.time_limit:
            for s in pending:
                results[s]["error"] = f"skipped: the run's time limit ({args.time_limit:.0f} s) was reached"
            break
        cmd = [
            sys.executable,
            "-m",
            "pallas_kernels.bench.moe",
            "--worker",
            ",".join(pending),
            "--skip",
            json.dumps(dict(skip, __done__=done)),
        ]
        cmd += ["--sweep", args.sweep] * bool(args.sweep) + ["--interpret"] * args.interpret
        cmd += ["--jnp-refs"] * args.jnp_refs
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
        fd, buf, last, begun, why = proc.stdout.fileno(), bytearray(), time.time(), None, None
        log(f"[{time.time() - t_start:6.1f} s] worker {proc.pid} starts at {pending[0]}")
        while why is None:
            deadline = min(last + args.stall, hard_stop)
            lines = _lines(fd, min(1.0, deadline - time.time()), buf)
            if lines is None:
                why = "exit"
                break
            for line in lines:
                kind, _, payload = line.partition(" ")
                if kind not in ("BEGIN", "ROW", "CEIL", "DONE", "LOST"):
                    log("  | " + line)
                    continue
                ev, last = json.loads(payload), time.time()
                spec = ev["spec"]
                if kind == "BEGIN":
                    begun = (spec, ev["what"])
                elif kind == "ROW":  # a later round's report of a row replaces its earlier one
                    rows, row = results[spec]["rows"], ev["row"]
                    again = [i for i, r in enumerate(rows) if r["name"] == row["name"]]
                    if again:
                        rows[again[0]] = row
                    else:
                        rows.append(row)
                        done.setdefault(spec, []).append(row["name"])
                    log(f"  {spec}: {_row_summary(row)}" + (f" (round {row.get('rounds')})" if again else ""))
                elif kind == "CEIL":
                    results[spec]["ceilings"] = ev["ceilings"]
                elif kind == "LOST":  # a CUDA error: the worker exits
                    if ev.get("skip"):
                        skip[ev["skip"]] = f"a CUDA error in case {spec}"
                    if resume(spec):
                        note = f"CUDA error in {ev['what']}: worker exited, a fresh one resumes the case without it"
                    else:
                        pending.remove(spec)
                        note = f"CUDA error in {ev['what']}: worker exited, a fresh one runs the next case"
                        results[spec]["rows"].append(dict(name="(rest of the case)", error=f"not run: {note}"))
                    log(f"[{time.time() - t_start:6.1f} s] {spec}: {note}")
                    why = "lost"
                    break
                else:
                    if "error" in ev:
                        results[spec]["error"] = ev["error"]
                    pending.remove(spec)
                    err = f": {ev['error']}" if "error" in ev else ""
                    log(f"[{time.time() - t_start:6.1f} s] done {spec}{err}")
                    if not pending:
                        why = "done"
                    elif time.time() - t_start > args.time_limit:
                        why = "limit"  # start no new case
            if why is None and time.time() >= deadline:
                why = "stall"
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        if why in ("done", "limit", "lost") or not pending:
            continue
        # The worker died or hung inside pending[0]: report the item it was on; resume the case without a kernel row
        # that hung, else move past the case.
        spec = pending[0]
        what = begun[1] if begun and begun[0] == spec else "case"
        hard = time.time() >= hard_stop
        kernel_row = what.split()[0] in ("w4a16", "w4a8")
        if not (kernel_row and resume(spec)):
            pending.pop(0)
        msg = f"no progress for {time.time() - last:.0f} s"
        if why == "exit":  # it dumps its stack ('Timeout') and exits itself shortly before a stall would be seen here
            stalled = f"a 'Timeout' stack dump above means no progress for {args.stall - 3:.0f} s"
            msg = f"worker exited ({proc.returncode}; {stalled})"
        msg += " at the run's hard limit" if hard else ""
        log(f"  {spec}: {what}: {msg}; worker killed" if why == "stall" else f"  {spec}: {what}: {msg}")
        if what == "case":
            results[spec]["error"] = msg
        else:
            later = "the case resumes without it" if spec in pending else "the case's later rows are lost"
            results[spec]["rows"].append(dict(name=what, error=f"hung or crashed: {msg}; {later}"))
            done.setdefault(spec, []).append(what)
            if kernel_row and not hard:
                skip[what] = f"it hung or crashed in case {spec}"
        if hard:
            for s in pending:
                results[s]["error"] = "skipped: the run's hard limit was reached"
            break
    return results


def _row_summary(r: dict) -> str:
    parts = [r["name"]]
    if "check" in r:
        c = r["check"]
        parts.append(f"check {'ok' if c.get('ok') else 'FAIL'} max rel {c.get('max_rel', float('nan')):.2e}")
    if "t" in r:
        parts.append(f"{r['t'] * 1e6:.1f} us")
    if "error" in r:
        parts.append(r["error"][:300])
    return ", ".join(parts)


def table(results: dict[str, dict], cases, ceil: dict) -> list[str]:
    copy = ceil.get("torch_copy") or ceil.get("xla_copy")
    i8, bf = ceil.get("int8"), ceil.get("bf16")
    device = any("td" in r for res in results.values() for r in res.get("rows", []))
    lines = [
        "| E | M | K x N | implementation | time (us) |"
        + (" device (us) |" if device else "")
        + " weights TB/s | % copy | TFLOP/s | % MMA ceiling | vs bf16 | check (max rel) |",
        "|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if device else ""),
    ]
    when = lambda r: r.get("td") or r["t"]  # the rates: from the device time when measured
    for e, m, k, n in cases:
        res = results.get(f"{e}x{m}x{k}x{n}", {})
        head = f"| {e} | {m} | {k} x {n} |"
        rows = res.get("rows", [])
        t_bf16 = next((when(r) for r in rows if r["name"].startswith("bf16") and "t" in r), None)
        for r in rows:
            c = r.get("check", {})
            chk = f"{'ok' if c.get('ok') else 'FAIL'} {c.get('max_rel', float('nan')):.1e}" if c else ""
            if "t" not in r:
                lines.append(
                    f"{head} {r['name']} | error |{' |' if device else ''} | | | | | {chk} {r.get('error', '')[:160]} |"
                )
                continue
            t = when(r)
            times = f"{r['t'] * 1e6:.1f} |" + (f" {r['td'] * 1e6:.1f} |" if "td" in r else " |" if device else "")
            if not r.get("mult", 1):  # not a matmul: its time only
                lines.append(f"{head} {r['name']} | {times} | | | | | |")
                continue
            tbs, flops = r["nbytes"] / t / 1e12, r.get("mult", 1) * 2 * m * k * n / t / 1e12
            ceiling = i8 if r.get("int8") else bf
            pc = f"{100 * r['nbytes'] / t / copy:.0f}%" if copy else ""
            pm = f"{100 * flops * 1e12 / ceiling:.0f}%" if ceiling else ""
            vs = f"{r.get('mult', 1) * t_bf16 / t:.2f}x" if t_bf16 else ""  # fused rows: against two bf16 calls
            lines.append(f"{head} {r['name']} | {times} {tbs:.2f} | {pc} | {flops:.0f} | {pm} | {vs} | {chk} |")
        if "error" in res:
            lines.append(f"{head} (case) | error | | | | | | | {res['error'][:160]} |")
    return lines


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default="default", help="'default', 'all' or ExMxKxN,... (e.g. 16x1024x7168x2048)")
    ap.add_argument("--time-limit", type=float, default=200.0, help="start no new case after this many seconds")
    ap.add_argument(
        "--hard-limit", type=float, help="kill whatever still runs after this many seconds (default: time limit + 35)"
    )
    ap.add_argument("--stall", type=float, default=45.0, help="kill a worker silent this long (e.g. a hung kernel)")
    sweep = "also time other tilings (sweep_tilings): in all cases, or in these (ExMxKxN,...)"
    ap.add_argument("--sweep", nargs="?", const="all", default="", help=sweep)
    only = "sweep only the tilings whose row label has one of these texts (A|B)"
    ap.add_argument("--sweep-only", default="", help=only)
    ap.add_argument("--jnp-refs", action="store_true", help="also time the jnp references (slow: ~0.1-10 ms)")
    ap.add_argument("--out", help="append the table to this markdown file")
    ap.add_argument("--no-ceilings", action="store_true", help="skip the ceiling measurements")
    ap.add_argument(
        "--device-time",
        action="store_true",
        help="also time each row on the device alone (hcfjax.bench.common.device_time); the rates then use it",
    )
    ap.add_argument(
        "--kernel-time",
        action="store_true",
        help="as --device-time, but the device column is the GPU's kernel time from a profiler trace "
        "(hcfjax.bench.common.kernel_times: no launch gaps or timing loop)",
    )
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="time every row of a case this many times, interleaved (row 1..n, then again), and keep each row's best",
    )
    ap.add_argument("--interpret", action="store_true", help="Mosaic GPU's interpreter (a CPU smoke test)")
    ap.add_argument("--lower", action="store_true", help="only lower every kernel for sm_90 here (no GPU needed)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--skip", default="{}", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args.worker.split(","), args.sweep, args.interpret, json.loads(args.skip), args.jnp_refs)
        return
    if args.cases in ("default", "all"):
        cases = HEADLINE if args.cases == "default" else all_cases()
    else:
        cases = [tuple(map(int, c.split("x"))) for c in args.cases.split(",")]
    if args.lower:
        sys.exit(0 if lower_all(cases, args.sweep) else 1)
    if args.device_time or args.kernel_time:  # the workers (child processes) read it
        os.environ["HCFJAX_BENCH_DEVICE_TIME"] = "kernels" if args.kernel_time else "1"
    os.environ["MOE_BENCH_ROUNDS"] = str(args.rounds)
    os.environ["MOE_BENCH_SWEEP_ONLY"] = args.sweep_only
    log = Log()
    t0 = time.time()
    specs = ["ceilings"] * (not args.no_ceilings) + ["x".join(map(str, c)) for c in cases]
    results = run_workers(specs, args, log)
    ceil = results.get("ceilings", {}).get("ceilings", {})
    if ceil.get("torch_copy"):
        copy_s = (
            f"torch copy_ {ceil['torch_copy'] / 1e12:.2f} TB/s (read + write), XLA copy {ceil['xla_copy'] / 1e12:.2f}"
        )
    elif ceil.get("xla_copy"):
        copy_s = f"XLA copy {ceil['xla_copy'] / 1e12:.2f} TB/s (read + write; torch with CUDA not available)"
    else:
        copy_s = "not measured " + results.get("ceilings", {}).get("error", "(--no-ceilings)")
    mma_s = (
        f"XLA bf16 matmul {ceil['bf16'] / 1e12:.0f} TFLOP/s, XLA int8 matmul {ceil['int8'] / 1e12:.0f} TOP/s (8192^3)"
        if ceil.get("int8")
        else "matmul ceilings not measured"
    )
    checks = []
    for c in cases:
        for r in results["x".join(map(str, c))]["rows"]:
            if "check" in r:
                k = r["check"]
                cfg = f"{k['tiling']}, smem {k['smem']} B"
                checks.append(
                    f"- {c} {r['name']}: {'ok' if k['ok'] else 'FAIL'}, max rel {k['max_rel']:.2e}, "
                    f"norm rel {k['rel']:.2e}{'' if k.get('repeats', True) else ', outputs differ between runs'}"
                    f" ({cfg})"
                )
    text = [
        "",
        f"{ceil.get('header', 'device: see the log')}; whole run {time.time() - t0:.0f} s",
        f"Ceilings (this run): copy {copy_s}; {mma_s}.",
        "Kernel times include the wrapper's XLA work. % MMA ceiling: of the bf16 rate (bf16, w4a16 rows) or the int8",
        "rate (w4a8 rows)." + (f" Times: each row's best of {args.rounds} interleaved rounds." * (args.rounds > 1)),
        *(
            [
                "Device column: the GPU's kernel time (kernel records of a profiler trace summed per call: the",
                "wrapper's XLA kernels included, launch gaps and the timing loop not); the rates use it.",
            ]
            if args.kernel_time
            else []
        ),
        "",
        "Checks on this device (kernel vs the exactly-quantised function in f32; max |err| / max |ref| "
        f"< {CHECK_TOL}):",
        *checks,
        "",
        *table(results, cases, ceil),
        "",
    ]
    log(*text)
    if log.dir:
        with open(os.path.join(log.dir, "moe_bench.md"), "w") as fh:
            fh.write("\n".join(text))
    if args.out:
        with open(args.out, "a") as fh:
            fh.write("\n".join(text))


if __name__ == "__main__":
    main()
