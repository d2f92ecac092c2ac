"""Does a layer scan copy its layers' weights? A `lax.scan` over stacked dense weights (q-, o- and int8
shared-expert-shaped products at decode row counts, as a V2-Lite decode step's dense part), compiled with XLA's
GEMM library choices (`Options.xla_gemm`) and unrolled, timed on the device, with the copies its optimised HLO holds.

    python -m hcfjax.bench.layer_scan [--layers 27] [--rows 64]

A Triton GEMM fusion cannot read a dynamic slice of its operand in place, so XLA copies each layer's weights out
of the stack first (async `fusion-start` copies in the HLO); cuBLAS takes the slice where it lies (XLA's
dynamic-slice fusion).
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from hcfjax.bench.common import header, timed
from hcfjax.options import CUBLAS_GEMMS

VARIANTS = {  # name: (compiler options, scan unroll)
    "XLA default (Triton GEMM fusions)": ((), 1),
    "cuBLAS (xla_gpu_enable_triton_gemm=false)": (CUBLAS_GEMMS, 1),
    "layers unrolled": ((), True),
}


def layer_stack(x, wq, wo, wi, unroll):
    """x [B, D] through each layer's q-shaped, o-shaped and int8 products, the weights stacked on a leading axis."""
    b = x.shape[0]

    def layer(x, ws):
        wq, wo, wi = ws
        h = jnp.einsum("bd,dhk->bhk", x, wq).reshape(b, -1) @ wo
        hq = jnp.clip(h * 8, -127, 127).astype(jnp.int8)
        g = jax.lax.dot_general(hq, wi, (((1,), (1,)), ((), ())), preferred_element_type=jnp.int32)
        return x + h * 0.5 + g[:, : x.shape[1]].astype(x.dtype) * 1e-4, None

    return jax.lax.scan(layer, x, (wq, wo, wi), unroll=unroll)[0]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=27)
    ap.add_argument("--rows", type=int, default=64)
    args = ap.parse_args(argv)
    k = jax.random.split(jax.random.key(0), 4)
    n = args.layers
    x = jax.random.normal(k[0], (args.rows, 2048), jnp.bfloat16)
    wq = jax.random.normal(k[1], (n, 2048, 16, 192), jnp.bfloat16) * 0.02
    wo = jax.random.normal(k[2], (n, 3072, 2048), jnp.bfloat16) * 0.02
    wi = jax.random.randint(k[3], (n, 2816, 2048), -8, 8, jnp.int8)
    nbytes = wq.nbytes + wo.nbytes + wi.nbytes
    print(f"{header()}; {n} layers, {args.rows} rows, {nbytes / n / 1e6:.1f} MB of weights a layer\n")
    print("| program | compile | time | weights read | async copies in the HLO | dynamic-slice fusions | max diff |")
    print("|---|---|---|---|---|---|---|")
    ref = None
    for name, (options, unroll) in VARIANTS.items():
        t0 = time.perf_counter()
        lowered = jax.jit(layer_stack, static_argnums=4).lower(x, wq, wo, wi, unroll)
        compiled = lowered.compile(compiler_options=dict(options) or None)
        took = time.perf_counter() - t0
        hlo = compiled.as_text()
        out = np.asarray(compiled(x, wq, wo, wi), np.float32)
        ref = out if ref is None else ref
        t = timed(compiled, x, wq, wo, wi, reps=30)
        print(
            f"| {name} | {took:.1f} s | {t * 1e6:,.1f} us | {nbytes / t / 1e12:.2f} TB/s | {hlo.count('fusion-start')} "
            f"| {hlo.count('calls=%dynamic-slice-fusion')} | {np.max(np.abs(out - ref)):.3g} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
