"""MLA decode kernel benchmark: one table of kernel vs XLA reference over batch x context, bf16 and int8 caches.

    python -m pallas_kernels.bench.mla [--check] [--shapes 1x4096,32x4096,...] [--reps 20]

H=128, C=512, R=64, page size 64, every sequence full (lengths = context), shuffled page tables. Bandwidth is cache
bytes read (c_kv + k_pe, plus the 8 bytes of scales per int8 token) over the median time. The ceilings are measured in
the same run: torch's device-to-device copy (read + write) and XLA's int8 and bf16 matmul rates. The kernel is checked
against the reference on the device before it is timed (rel = ||out - ref|| / ||ref||). --check only compiles and
checks small and full shapes.
"""

from __future__ import annotations

import argparse
import functools
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from hcfjax.bench.common import header, matmul_flops, timed, torch_copy_bandwidth
from hcfjax.cache import quantize_int8
from pallas_kernels.mla_decode import mla_decode, mla_decode_reference

SHAPES = ((1, 4096), (1, 16384), (32, 4096), (32, 16384), (64, 16384), (128, 4096))


def int8_matmul_ops(n: int = 8192) -> float:
    a = jax.random.randint(jax.random.key(1), (n, n), -127, 127, jnp.int8)
    b = jax.random.randint(jax.random.key(2), (n, n), -127, 127, jnp.int8)
    f = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.int32))
    return 2 * n**3 / timed(f, a, b)


def make_inputs(key, batch, context, heads=128, c=512, r=64, page=64, dtype="bf16", t=1):
    """Random queries and a full cache of `context` tokens per row in shuffled pages."""
    ks = jax.random.split(key, 5)
    n = context // page
    qn = jax.random.normal(ks[0], (batch, t, heads, c), jnp.bfloat16)
    qp = jax.random.normal(ks[1], (batch, t, heads, r), jnp.bfloat16)
    kv = jax.random.normal(ks[2], (batch * n, page, c + r), jnp.bfloat16)
    pt = jax.random.permutation(ks[3], batch * n).reshape(batch, n).astype(jnp.int32)
    lengths = jnp.full((batch,), context, jnp.int32)
    scales = None
    if dtype == "int8":
        qc, sc = quantize_int8(kv[..., :c])
        qr, sr = quantize_int8(kv[..., c:])
        kv, scales = jnp.concatenate([qc, qr], -1), jnp.stack([sc, sr], -1)
    return qn, qp, kv, pt, lengths, scales


def cache_bytes(batch, context, c=512, r=64, dtype="bf16") -> int:
    per_token = (c + r) * 2 if dtype == "bf16" else (c + r) + 8
    return batch * context * per_token


def rel_err(out, ref) -> float:
    o, r = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    if np.isnan(o).any():
        return float("nan")
    return float(np.linalg.norm(o - r) / np.linalg.norm(r))


def fns(scale, num_splits=None):
    kern = jax.jit(functools.partial(mla_decode, sm_scale=scale, num_splits=num_splits))
    ref = jax.jit(functools.partial(mla_decode_reference, sm_scale=scale))
    return kern, ref


def check(batch, context, dtype, heads=128, c=512, r=64, t=1, ragged=False):
    qn, qp, kv, pt, lengths, sc = make_inputs(
        jax.random.key(batch * 7 + context), batch, context, heads, c, r, dtype=dtype, t=t
    )
    if ragged:
        lengths = jax.random.randint(jax.random.key(3), (batch,), t, context + 1).astype(jnp.int32)
    kern, ref = fns(c**-0.5)
    out = kern(qn, qp, kv, pt, lengths, scales=sc)
    want = ref(qn.astype(jnp.float32), qp.astype(jnp.float32), kv, pt, lengths, scales=sc)
    return rel_err(out, want)


def run_checks():
    cases = [
        dict(batch=2, context=256, dtype="bf16", heads=16, c=128, r=64),
        dict(batch=2, context=256, dtype="int8", heads=16, c=128, r=64),
        dict(batch=3, context=512, dtype="bf16", heads=128, t=3, ragged=True),
        dict(batch=3, context=512, dtype="int8", heads=128, t=3, ragged=True),
        dict(batch=4, context=4096, dtype="bf16"),
        dict(batch=4, context=4096, dtype="int8"),
        dict(batch=1, context=16384, dtype="bf16"),
    ]
    for case in cases:
        try:
            print(f"check {case}: rel {check(**case):.2e}", flush=True)
        except Exception as e:  # noqa: BLE001 (report every case)
            print(f"check {case}: FAILED {type(e).__name__}: {str(e)[:3000]}", flush=True)
            traceback.print_exc(limit=3)


def bench(shapes, reps):
    copy_bw = torch_copy_bandwidth(4.0)
    i8 = int8_matmul_ops()
    bf = matmul_flops()
    print(header())
    print(
        f"ceilings: copy {copy_bw / 1e12 if copy_bw else float('nan'):.2f} TB/s (torch copy_, read+write), "
        f"int8 matmul {i8 / 1e12:.0f} TOP/s, bf16 matmul {bf / 1e12:.0f} TFLOP/s (XLA, 8192^3)"
    )
    try:
        import flashinfer  # noqa: F401

        print("flashinfer is importable but not wired into this table")
    except ImportError:
        print("flashinfer: not installed (column omitted)")
    rows = []
    for batch, context in shapes:
        for dtype in ("bf16", "int8"):
            qn, qp, kv, pt, lengths, sc = make_inputs(jax.random.key(batch + context), batch, context, dtype=dtype)
            kern, ref = fns(512**-0.5)
            err = rel_err(kern(qn, qp, kv, pt, lengths, scales=sc), ref(qn, qp, kv, pt, lengths, scales=sc))
            tk = timed(functools.partial(kern, scales=sc), qn, qp, kv, pt, lengths, reps=reps)
            tr = timed(functools.partial(ref, scales=sc), qn, qp, kv, pt, lengths, reps=reps)
            nb = cache_bytes(batch, context, dtype=dtype)
            flops = batch * context * 128 * (576 + 512) * 2
            rows.append((dtype, batch, context, tk, nb / tk, tr, nb / tr, tr / tk, flops / tk, err))
            print(rows[-1], flush=True)
            del qn, qp, kv, pt, sc
    lines = [
        "| cache | B | ctx | kernel us | kernel GB/s | % copy | TFLOP/s | XLA ref us | ref GB/s | speedup | rel err |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for dtype, b, ctx, tk, bwk, tr, bwr, sp, fl, err in rows:
        pct = f"{100 * bwk / copy_bw:.0f}" if copy_bw else "-"
        lines.append(
            f"| {dtype} | {b} | {ctx} | {tk * 1e6:.1f} | {bwk / 1e9:.0f} | {pct} | {fl / 1e12:.0f} | "
            f"{tr * 1e6:.1f} | {bwr / 1e9:.0f} | {sp:.1f}x | {err:.1e} |"
        )
    by = {(d, b, c): tk for d, b, c, tk, *_ in rows}
    lines.append("")
    lines.append(
        "int8 speedup over bf16: "
        + ", ".join(f"{b}x{c} {by[('bf16', b, c)] / by[('int8', b, c)]:.2f}x" for b, c in shapes)
    )
    print("\n".join(lines))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--shapes", default=",".join(f"{b}x{c}" for b, c in SHAPES))
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    if args.check:
        run_checks()
        return
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    bench(shapes, args.reps)


if __name__ == "__main__":
    main()
