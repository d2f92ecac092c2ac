"""Per-token int8 quantisation of a decode step's rows in one kernel (Pallas, Triton lowering).

`quantize_int8`'s arithmetic in IEEE f32, bit for bit: XLA runs it as three kernels a call (the rows' absolute
maximum, the scales on their own, then the integers), and a decode layer quantises its tokens three times (MLA's kv_a
input, the experts' input, the shared experts' hidden). One program per row reads the row twice (the second pass
from cache): its maximum, then the integers.

On the GPU the scale's reciprocal is IEEE-rounded (`div.rn.f32`, as XLA divides; Triton's own f32 division is
approximate) and the rounding to the nearest integer, ties to even, is `cvt.rni` (Pallas's Triton lowering has no
`round`): both inline PTX, which the interpreter replaces by jnp's division and `jnp.round`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.int8_quant import INV_127

BLOCK = 4096  # columns a program loads at once
MAX_ROWS = 1024  # rows up to which callers use the kernel, as the dense int8 kernel (decode steps); prefill is XLA's


def _ptx(asm: str, *args):
    """One f32 PTX instruction applied elementwise to f32 arrays of one shape."""
    import jax.experimental.pallas.triton as plt

    (out,) = plt.elementwise_inline_asm(
        asm,
        args=list(args),
        constraints=",".join(["=r"] + ["r"] * len(args)),
        pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(args[0].shape, jnp.float32)],
    )
    return out


def _div(x, y, exact: bool):
    """x / y, IEEE-rounded on the GPU (`exact`); jnp's division in the interpreter."""
    return _ptx("div.rn.f32 $0, $1, $2;", x, y) if exact else x / y


def _round(x, exact: bool):
    """x rounded to the nearest integer, ties to even (`jnp.round`)."""
    return _ptx("cvt.rni.f32.f32 $0, $1;", x) if exact else jnp.round(x)


def _row_kernel(x_ref, q_ref, s_ref, *, k: int, block: int, exact: bool):
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.triton as plt

    steps = pl.cdiv(k, block)

    def columns(i):
        c = i * block + jnp.arange(block)
        return c, c < k

    def amax_step(i, acc):
        c, m = columns(i)
        x = plt.load(x_ref.at[c], mask=m, other=0.0, eviction_policy="evict_last").astype(jnp.float32)
        return jnp.maximum(acc, jnp.abs(x))

    amax = lax.fori_loop(0, steps, amax_step, jnp.zeros((block,), jnp.float32)).max()
    scale = jnp.maximum(amax, 1e-8) * INV_127
    s_ref[...] = scale
    inv = _div(jnp.full((block,), 1.0, jnp.float32), jnp.full((block,), scale, jnp.float32), exact)

    @pl.loop(0, steps)
    def _(i):
        c, m = columns(i)
        x = plt.load(x_ref.at[c], mask=m, other=0.0, eviction_policy="evict_first").astype(jnp.float32)
        v = _round(x * inv, exact)
        plt.store(q_ref.at[c], jnp.clip(v, -127.0, 127.0).astype(jnp.int8), mask=m)


@functools.partial(jax.jit, static_argnames=("interpret",))
def quantize_rows(x: jax.Array, interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """x [M, K] (bf16 or f32) -> (q [M, K] int8, scale [M] f32), as `int8_quant.quantize_int8(x)` gives them; one
    program per row (`interpret`: Pallas's interpreter, any backend)."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.triton as plt

    m, k = x.shape
    block = min(BLOCK, pl.next_power_of_2(k))
    call = pl.pallas_call(
        functools.partial(_row_kernel, k=k, block=block, exact=not interpret),
        out_shape=(jax.ShapeDtypeStruct((k,), jnp.int8), jax.ShapeDtypeStruct((), jnp.float32)),
        grid=(),
        compiler_params=plt.CompilerParams(num_warps=min(max(block // 256, 1), 8), num_stages=1),
        interpret=interpret,
        name="quantize_int8_rows",
    )
    return jax.vmap(call)(x)
