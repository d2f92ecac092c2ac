"""A decode step's new MLA latents written to an int8 paged cache in one kernel (Pallas, Triton lowering).

Per token the kv_a projection's output [C + R] becomes its cache entry: RMSNorm of the latent c_kv (C), the rotary
embedding of k_pe (R), each part quantised to int8 with its own scale, all stored at the token's page and slot. XLA
runs that as six kernels a layer (the norm, the rope with the parts' maxima, the scales, the integers, and a scatter
each for the entries and the scales); here one program per token does it all, reading the page table itself, and
the caches are updated in place (aliased).

The arithmetic is the model's jnp path's, which the tests compare it with (hcfjax.layers' rms_norm and apply_rope
in bf16, then hcfjax.cache.quantize_entry as XLA computes it), with the IEEE reciprocal and rounding to even on the
GPU as pallas_kernels.int8_rows has them; the norm's sum of squares is the kernel's own order, as in int8_rows.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.int8_quant import INV_127
from pallas_kernels.int8_rows import ieee_div, to_int8

# int8 cache bytes whose stores the kernel cannot reach: above the first, up to the second (`addressable`)
WRAPPING = (2**31, 2**32)
MAX_TOKENS = 1024  # tokens up to which callers use the kernel (decode steps); a prefill chunk writes through XLA


def _bf16(v, exact: bool):
    """f32 values v rounded to bf16 (to nearest, ties to even), kept in f32: the rounding of jnp's bf16 arithmetic
    after each op. In the interpreter a reduce_precision, which XLA keeps (it drops a round trip through bf16
    inside a fusion)."""
    return v.astype(jnp.bfloat16).astype(jnp.float32) if exact else lax.reduce_precision(v, 8, 7)


def _quantize(v, exact: bool):
    """(int8 values, scale [n]) of f32 values v [n] as XLA computes `quantize_int8` (cache.quantize_entry): scale
    max(|v|) times f32(1/127), the values times its reciprocal, rounded to even."""
    scale = jnp.full(v.shape, jnp.maximum(jnp.abs(v).max(), 1e-8) * INV_127)
    inv = ieee_div(jnp.full(v.shape, 1.0, jnp.float32), scale, exact)
    return to_int8(v, inv, exact), scale, inv


def _kernel(
    kv_ref, w_ref, layer_ref, row_ref, cos_ref, sin_ref, pos_ref, valid_ref, table_ref, _kv_in, _s_in, kv_out, s_out,
    *, c: int, r: int, t: int, pages: int, eps: float, interleave: bool, exact: bool,
):  # fmt: skip
    """One token: its entry from the projection's row, stored at (cache layer, page, slot) unless the token is not
    valid or its page lies outside the page table or the cache. kv_ref: the rows [N, C + R] bf16, or the split-K
    partial products [S, N', C + R] f32 that sum to them (N' >= N)."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.triton as plt

    n = pl.program_id(0)

    def projected(cols):
        """The projection's row at columns cols (a pl.ds or an index vector), in f32: a bf16 row's values, or the
        partials added in split order and rounded to bf16, as the product's own sum rounds them."""
        if len(kv_ref.shape) == 2:
            return plt.load(kv_ref.at[n, cols]).astype(jnp.float32)
        total = plt.load(kv_ref.at[jnp.int32(0), n, cols])
        for split in range(1, kv_ref.shape[0]):
            total = total + plt.load(kv_ref.at[jnp.int32(split), n, cols])
        return _bf16(total, exact)

    layer, w_row = layer_ref[0], row_ref[0]
    page_size, max_pages = kv_out.shape[2], table_ref.shape[1]
    pos = pos_ref[n]
    block = pos // page_size
    page = table_ref[n // t, jnp.clip(block, 0, max_pages - 1)]
    slot = pos - block * page_size
    write = valid_ref[n] & (block < max_pages) & (page >= 0) & (page < pages)

    # RMSNorm of the latent, scaled in bf16 (layers.rms_norm); C is a power of two, so the mean's product is exact.
    x = projected(pl.ds(0, c))
    norm = lax.rsqrt(jnp.square(x).sum() * (1.0 / c) + eps)
    w = w_ref[w_row, pl.ds(0, c)].astype(jnp.float32)
    latent = _bf16(w * _bf16(x * norm, exact), exact)  # a product of two bf16 values is exact in f32
    q_latent, s_latent, _ = _quantize(latent, exact)
    # The rotary embedding of k_pe (layers.apply_rope): pairs interleaved or in halves, the rotated first elements
    # first; bf16 arithmetic, each product and sum rounded.
    half = r // 2
    i = jnp.arange(half, dtype=jnp.int32)
    first, second = (c + 2 * i, c + 2 * i + 1) if interleave else (c + i, c + half + i)
    x1, x2 = projected(first), projected(second)
    cos, sin = (_bf16(ref[n, pl.ds(0, half)], exact) for ref in (cos_ref, sin_ref))
    rot1 = _bf16(_bf16(x1 * cos, exact) - _bf16(x2 * sin, exact), exact)
    rot2 = _bf16(_bf16(x2 * cos, exact) + _bf16(x1 * sin, exact), exact)
    # The rope's two halves share one scale: quantise them as one vector of their maxima's larger.
    _, s_rope, inv_rope = _quantize(jnp.maximum(jnp.abs(rot1), jnp.abs(rot2)), exact)

    @pl.when(write)
    def _():
        kv_out[layer, page, slot, pl.ds(0, c)] = q_latent
        kv_out[layer, page, slot, pl.ds(c, half)] = to_int8(rot1, inv_rope, exact)
        kv_out[layer, page, slot, pl.ds(c + half, half)] = to_int8(rot2, inv_rope, exact)
        s_out[layer, page, 0, slot] = s_latent.max()
        s_out[layer, page, 1, slot] = s_rope.max()


def _is_pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


def addressable(cache_bytes: int) -> bool:
    """Whether the kernel's stores reach every byte of an int8 cache of this size. Pallas's Triton lowering takes
    32-bit element offsets up to 2^32 bytes and 64-bit ones past that; a signed 32-bit offset wraps past 2^31, so an
    int8 cache between 2 and 4 GiB would have its last layers' entries stored outside it."""
    return cache_bytes <= WRAPPING[0] or cache_bytes > WRAPPING[1]


def applies(tokens: int, c: int, r: int, dtype, cache_bytes: int = 0) -> bool:
    """Whether the kernel writes `tokens` new entries of a C + R latent projected in `dtype` into an int8 cache of
    `cache_bytes`: a decode step's tokens, bf16, C and R/2 powers of two (the kernel's vectors), a cache whose
    every byte its offsets reach (`addressable`)."""
    shapes = _is_pow2(c) and r % 2 == 0 and _is_pow2(r // 2)
    return 0 < tokens <= MAX_TOKENS and dtype == jnp.bfloat16 and shapes and addressable(cache_bytes)


@functools.partial(jax.jit, static_argnames=("eps", "interleave", "interpret"))
def write_latents(
    kv_cache, scale_cache, layer, kv, weight, weight_row, rope_table, positions, valid, page_table,
    *, eps: float, interleave: bool, interpret: bool = False,
):  # fmt: skip
    """The cache (kv [L, P, page, C + R] int8, scales [L, P, 2, page] f32) with the entries of kv [B, T, C + R] bf16
    (the kv_a projection of B x T tokens at positions [B, T]) written in `layer`, where valid [B, T]: the latent
    RMSNormed by row `weight_row` of weight [L', C] and quantised, k_pe roped by rope_table ((cos, sin) [B, T, R/2]
    f32, layers.rope_table's) and quantised. One program per token (`interpret`: Pallas's interpreter).
    kv may also be the projection's split-K partial products [S, M, C + R] f32 over the B x T tokens' rows (M >= B T;
    rows past B T are ignored; `quant.linear_partials`), which the kernel adds itself: one pass over them fewer
    than summing them first."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.triton as plt

    (b, t), width = positions.shape, kv.shape[-1]
    c = weight.shape[-1]
    r = width - c
    partials = kv.dtype == jnp.float32  # the projection itself is bf16
    shaped = kv.ndim == 3 and kv.shape[1] >= b * t if partials else kv.shape == (b, t, width)
    projection = jnp.bfloat16 if partials else kv.dtype
    if not shaped or not applies(b * t, c, r, projection, kv_cache.size) or kv_cache.dtype != jnp.int8:
        raise ValueError(f"latent_write takes a bf16 projection (or its f32 split-K partials) of C, R/2 powers of two "
                         f"into an int8 cache of at most 2 or over 4 GiB, got {kv.dtype} {list(kv.shape)} into "
                         f"{kv_cache.dtype} {kv_cache.shape}")  # fmt: skip
    cos, sin = (a.reshape(b * t, r // 2).astype(jnp.float32) for a in rope_table)
    kernel = functools.partial(
        _kernel, c=c, r=r, t=t, pages=kv_cache.shape[1], eps=eps, interleave=interleave, exact=not interpret
    )
    return pl.pallas_call(
        kernel,
        out_shape=(
            jax.ShapeDtypeStruct(kv_cache.shape, kv_cache.dtype),
            jax.ShapeDtypeStruct(scale_cache.shape, jnp.float32),
        ),
        grid=(b * t,),
        input_output_aliases={9: 0, 10: 1},
        compiler_params=plt.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="latent_write",
    )(
        kv if partials else kv.reshape(b * t, width),
        weight.reshape(-1, c),
        # Each index on its own: in the layer loop a stack of the two would be a launch of its own.
        jnp.asarray(layer, jnp.int32).reshape(1),
        jnp.asarray(weight_row, jnp.int32).reshape(1),
        cos,
        sin,
        positions.reshape(-1).astype(jnp.int32),
        valid.reshape(-1),
        page_table.astype(jnp.int32),
        kv_cache,
        scale_cache,
    )
