"""Int4 MoE grouped GEMM against bf16 `ragged_dot` at DeepSeek-V3 expert shapes, with the ceilings of the same run.

    python -m pallas_kernels.bench.moe [--experts 16,32] [--tokens 128,1024,4096,16384] [--k 7168] [--n 2048]
                                       [--time-limit S] [--out RESULTS.md]

One grouped GEMM x [M, K] @ W [E, K, N] (an expert's gate or up projection: K = hidden 7168, N = expert width 2048)
over M routed token copies spread uniformly at random over E local experts. Per row: median time, weight bandwidth
(bytes of the weights as stored, int4 + scales or bf16, over the time), and TOPS (2 M K N over the time). Ceilings:
copy bandwidth (torch `copy_` over 2 GiB, read + write; XLA's own copy too) and the int8 x int8 -> int32 rate of an
8192^3 XLA matmul. A correctness check against the jnp reference runs first.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from hcfjax import quant
from hcfjax.bench.common import copy_bandwidth, header, timed, torch_copy_bandwidth
from pallas_kernels.moe_int4 import int4_ragged_dot


def int8_matmul_ops(n: int = 8192) -> float:
    a = jax.random.randint(jax.random.key(1), (n, n), -127, 127, jnp.int8)
    b = jax.random.randint(jax.random.key(2), (n, n), -127, 127, jnp.int8)
    f = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.int32))
    return 2 * n**3 / timed(f, a, b)


def problem(e: int, m: int, k: int, n: int, seed: int = 0):
    kw, kx, kg = jax.random.split(jax.random.key(seed), 3)
    w = (jax.random.normal(kw, (e, k, n), jnp.float32) / np.sqrt(k)).astype(jnp.bfloat16)
    x = jax.random.normal(kx, (m, k), jnp.float32).astype(jnp.bfloat16)
    gs = jnp.bincount(jax.random.randint(kg, (m,), 0, e), length=e).astype(jnp.int32)
    return w, x, gs


def check(k: int, n: int) -> str:
    w, x, gs = problem(16, 1024, k, n, seed=1)
    lines = []
    for act in ("bf16", "int8"):
        qw = quant.quantize(w, 4, act)
        ref = jax.jit(quant.ragged_dot_reference)(x, qw, gs).astype(jnp.float32)
        y = int4_ragged_dot(x, qw.q, qw.scale, gs, act=act).astype(jnp.float32)
        rel = float(jnp.linalg.norm(y - ref) / jnp.linalg.norm(ref))
        lines.append(f"w4a{'16' if act == 'bf16' else '8'} kernel vs reference (E=16, M=1024): rel. error {rel:.2e}")
        assert rel < 1e-2, lines[-1]
    return "; ".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--experts", default="16,32")
    ap.add_argument("--tokens", default="128,1024,4096,16384")
    ap.add_argument("--k", type=int, default=7168)
    ap.add_argument("--n", type=int, default=2048)
    ap.add_argument("--time-limit", type=float, default=0.0, help="stop adding rows after this many seconds")
    ap.add_argument("--out", help="append the table to this markdown file")
    args = ap.parse_args(argv)
    t0 = time.time()
    k, n = args.k, args.n
    ok = check(k, n)
    print(ok, flush=True)
    torch_bw = torch_copy_bandwidth()
    xla_bw = copy_bandwidth()
    i8 = int8_matmul_ops()
    copy = torch_bw or xla_bw
    ceil = (
        f"copy {copy / 1e12:.2f} TB/s ({'torch copy_' if torch_bw else 'XLA'}; XLA copy {xla_bw / 1e12:.2f}), "
        f"int8 matmul {i8 / 1e12:.0f} TOPS (XLA)"
    )
    print(ceil, flush=True)
    rows = [
        "| E | tokens | kernel | time (ms) | weight GB/s | TOPS | % copy | % int8 rate | vs bf16 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for e in map(int, args.experts.split(",")):
        for m in map(int, args.tokens.split(",")):
            if args.time_limit and time.time() - t0 > args.time_limit:
                break
            w, x, gs = problem(e, m, k, n)
            ops = 2 * m * k * n
            t_bf16 = timed(jax.jit(jax.lax.ragged_dot), x, w, gs)
            results = [("bf16 ragged_dot", t_bf16, w.nbytes)]
            for act in ("bf16", "int8"):
                qw = quant.quantize(w, 4, act)
                f = jax.jit(lambda x, q, s, g, act=act: int4_ragged_dot(x, q, s, g, act=act))
                name = "w4a16" if act == "bf16" else "w4a8"
                results.append((name, timed(f, x, qw.q, qw.scale, gs), quant.nbytes(qw)))
                del qw
            for name, t, nb in results:
                rows.append(
                    f"| {e} | {m} | {name} | {t * 1e3:.3f} | {nb / t / 1e9:.0f} | {ops / t / 1e12:.1f} | "
                    f"{100 * nb / t / copy:.0f}% | {100 * ops / t / i8:.0f}% | {t_bf16 / t:.2f}x |"
                )
                print(rows[-1], flush=True)
    text = f"{header()}; K={k}, N={n}; {ceil}\n{ok}\n\n" + "\n".join(rows) + "\n"
    print(text)
    if args.out:
        with open(args.out, "a") as fh:
            fh.write("\n" + text)


if __name__ == "__main__":
    main()
