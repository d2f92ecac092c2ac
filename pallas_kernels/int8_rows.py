"""Per-token int8 quantisation of a decode step's rows in one kernel (Pallas, Triton lowering), alone
(`quantize_rows`) or after the RMSNorm that precedes a layer's int8 products (`norm_quantize_rows`).

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


def ieee_div(x, y, exact: bool):
    """x / y for f32 arrays of one shape, IEEE-rounded on the GPU (`exact`); jnp's division in the interpreter."""
    return _ptx("div.rn.f32 $0, $1, $2;", x, y) if exact else x / y


def _round(x, exact: bool):
    """x rounded to the nearest integer, ties to even (`jnp.round`)."""
    return _ptx("cvt.rni.f32.f32 $0, $1;", x) if exact else jnp.round(x)


def to_int8(v, inv, exact: bool):
    """f32 values v times their scale's reciprocal `inv`, rounded to even and clipped to [-127, 127], as int8."""
    return jnp.clip(_round(v * inv, exact), -127.0, 127.0).astype(jnp.int8)


def _columns(i, block: int, k: int):
    c = i * block + jnp.arange(block)
    return c, c < k


def _load_f32(ref, i, block: int, k: int, policy: str, base=0):
    """Columns i * block.. of a row (of ref, from `base` on) in f32, zero past k."""
    import jax.experimental.pallas.triton as plt

    c, m = _columns(i, block, k)
    return plt.load(ref.at[base + c], mask=m, other=0.0, eviction_policy=policy).astype(jnp.float32)


def _quantize_pass(row, q_ref, s_ref, *, k: int, block: int, exact: bool):
    """The row's integers and scale from `row(i, policy)`, its i-th block of columns in f32 (zero past k): its
    maximum first, then the integers (the second pass reads the row again, from cache)."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.triton as plt

    steps = pl.cdiv(k, block)
    amax = lax.fori_loop(
        0, steps, lambda i, acc: jnp.maximum(acc, jnp.abs(row(i, "evict_last"))), jnp.zeros((block,), jnp.float32)
    ).max()
    scale = jnp.maximum(amax, 1e-8) * INV_127
    s_ref[...] = scale
    inv = ieee_div(jnp.full((block,), 1.0, jnp.float32), jnp.full((block,), scale, jnp.float32), exact)

    @pl.loop(0, steps)
    def _(i):
        c, m = _columns(i, block, k)
        plt.store(q_ref.at[c], to_int8(row(i, "evict_first"), inv, exact), mask=m)


def _row_kernel(x_ref, q_ref, s_ref, *, k: int, block: int, exact: bool):
    _quantize_pass(lambda i, policy: _load_f32(x_ref, i, block, k, policy), q_ref, s_ref, k=k, block=block, exact=exact)


def _norm_row_kernel(x_ref, w_ref, layer_ref, h_ref, q_ref, s_ref, *, k: int, block: int, eps: float, exact: bool):
    """`rms_norm(x, w[layer])` of one row, written in x's dtype, then that row quantised as `_row_kernel` does."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.triton as plt

    steps = pl.cdiv(k, block)
    base = layer_ref[0] * k  # the layer's weight in the flattened stack

    def x_at(i, policy):
        return _load_f32(x_ref, i, block, k, policy)

    squares = lax.fori_loop(0, steps, lambda i, acc: acc + jnp.square(x_at(i, "evict_last")), jnp.zeros((block,)))
    r = lax.rsqrt(squares.sum() / k + eps)

    def normed(i, policy):
        w = _load_f32(w_ref, i, block, k, "evict_last", base)
        # Scaled in the input dtype, as rms_norm: the product of two bf16 values is exact in f32, then rounded.
        return (w * (x_at(i, policy) * r).astype(h_ref.dtype).astype(jnp.float32)).astype(h_ref.dtype)

    @pl.loop(0, steps)
    def _(i):
        c, m = _columns(i, block, k)
        plt.store(h_ref.at[c], normed(i, "evict_last"), mask=m)

    _quantize_pass(lambda i, policy: normed(i, policy).astype(jnp.float32), q_ref, s_ref, k=k, block=block, exact=exact)


def _params(k: int):
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.triton as plt

    block = min(BLOCK, pl.next_power_of_2(k))
    return block, plt.CompilerParams(num_warps=min(max(block // 256, 1), 8), num_stages=1)


@functools.partial(jax.jit, static_argnames=("interpret",))
def quantize_rows(x: jax.Array, interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """x [M, K] (bf16 or f32) -> (q [M, K] int8, scale [M] f32), as `int8_quant.quantize_int8(x)` gives them; one
    program per row (`interpret`: Pallas's interpreter, any backend)."""
    import jax.experimental.pallas as pl

    m, k = x.shape
    block, params = _params(k)
    call = pl.pallas_call(
        functools.partial(_row_kernel, k=k, block=block, exact=not interpret),
        out_shape=(jax.ShapeDtypeStruct((k,), jnp.int8), jax.ShapeDtypeStruct((), jnp.float32)),
        grid=(),
        compiler_params=params,
        interpret=interpret,
        name="quantize_int8_rows",
    )
    return jax.vmap(call)(x)


@functools.partial(jax.jit, static_argnames=("eps", "interpret"))
def norm_quantize_rows(
    x: jax.Array, weight: jax.Array, eps: float, layer: jax.Array | int = 0, interpret: bool = False
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """x [M, K] bf16 -> (h = `layers.rms_norm(x, w, eps)` [M, K] bf16, and h quantised as `quantize_rows(h)` gives
    it), one program per row: the RMSNorm before a layer's int8 products and its quantisation in one kernel. w is
    weight [K], or row `layer` of a stacked weight [L, K], read in place (a slice of the stack would be a copy)."""
    import jax.experimental.pallas as pl

    m, k = x.shape
    stack = weight.reshape(-1)  # [L*K]: the kernel reads the layer's row at layer * K
    block, params = _params(k)
    call = pl.pallas_call(
        functools.partial(_norm_row_kernel, k=k, block=block, eps=eps, exact=not interpret),
        out_shape=(
            jax.ShapeDtypeStruct((k,), x.dtype),
            jax.ShapeDtypeStruct((k,), jnp.int8),
            jax.ShapeDtypeStruct((), jnp.float32),
        ),
        grid=(),
        compiler_params=params,
        interpret=interpret,
        name="rms_norm_int8_rows",
    )
    layer = jnp.asarray(layer, jnp.int32).reshape(1)
    return jax.vmap(call, in_axes=(0, None, None))(x, stack, layer)
