"""Batch-1 projections on the GPU: XLA's vector x matrix dot against the same dot over two copies of the row.

    python -m hcfjax.bench.gemv [--shapes 2048x2816,2816x2048,...] [--reps 50]

XLA's GPU compiler rewrites a dot whose left side is a vector (batch 1: one token) into a multiply and a reduction
when its operands hold under 10M elements together (the dot-strength-reduction pass), and that reduction reads the
weights well below copy speed. Two rows keep a GEMM. Each row times, on the kernel clock (`kernel_time`: all the GPU
kernels of one call), x [1, D] @ W [D, F] as written and as ([x; x] @ W)[:1]; the weight bandwidth is W's bytes over
that time, against the copy ceiling measured in the same run.

The model does not use the two-row form: tried in every projection (results in
docs/results.md), it cut V2-Lite's batch-1 decode kernels by 1.1 ms per step and still made the
step slower (4.94 against 4.57-4.61 ms, A/B twice in one session): that step is bound by kernel launches, and the
copy added one per projection.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from hcfjax.bench.common import header, kernel_time, torch_copy_bandwidth

# DeepSeek-V2-Lite's batch-1 decode projections (hidden 2048): shared experts' gate / up and down, o_proj,
# q, kv_a, the router; then V3's shared expert and o_proj (hidden 7168).
SHAPES = "2048x2816,2816x2048,2048x2048,2048x3072,2048x576,2048x64,7168x2048,2048x7168,16384x7168"


def two_rows(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [1, D] @ w computed over two copies of x (a GEMM for XLA), the first row kept."""
    return (jnp.concatenate([x, x]) @ w)[:1]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m hcfjax.bench.gemv", description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default=SHAPES, help="DxF,... (weights [D, F], bf16)")
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args(argv)
    copy = torch_copy_bandwidth()
    rows = []
    for shape in args.shapes.split(","):
        d, f = map(int, shape.split("x"))
        kx, kw = jax.random.split(jax.random.key(0))
        x = jax.random.normal(kx, (1, d), jnp.bfloat16)
        w = (jax.random.normal(kw, (d, f), jnp.float32) / d**0.5).astype(jnp.bfloat16)
        plain, padded = jax.jit(lambda x, w: x @ w), jax.jit(two_rows)
        err = float(jnp.max(jnp.abs(plain(x, w).astype(jnp.float32) - padded(x, w).astype(jnp.float32))))
        t = [kernel_time(fn, x, w, reps=args.reps) for fn in (plain, padded)]
        bw = [w.nbytes / s / 1e12 for s in t]
        pct = [f"{b * 1e12 / copy:.0%}" if copy else "" for b in bw]
        rows.append(
            f"| {d} x {f} | {w.nbytes / 1e6:.1f} | {t[0] * 1e6:.1f} | {bw[0]:.2f} | {pct[0]} | {t[1] * 1e6:.1f} | "
            f"{bw[1]:.2f} | {pct[1]} | {t[0] / t[1]:.2f}x | {err:.1e} |"
        )
    print(f"{header()}; copy {copy / 1e12:.2f} TB/s (torch copy_)" if copy else header())
    print()
    print("| W (D x F) | MB | 1 row us | TB/s | % copy | 2 rows us | TB/s | % copy | speed-up | max diff |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
