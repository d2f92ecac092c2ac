"""Absorbed-MLA decode attention over the paged latent cache: the wrapper of the Mosaic GPU kernel (mla_kernel.py),
its work list (mla_schedule.py) and a pure-jnp reference. The model picks between them (hcfjax.options).

Per query token the heads attend in the latent space: scores = q_lat . c_kv + q_pe . k_pe over the cached tokens,
out = softmax(scores * sm_scale) @ c_kv, with q_lat = q_nope @ W_UK already folded in by the caller.

A call is: the plan (`mla_plan`: visible keys and the flash-decoding work list, three small XLA reductions; pass
`plan=` to reuse one across layers), for int8 caches in hcfjax.cache's scale layout one gather of the table's scales,
the attention kernel, and, when some row was split over several CTAs, the merge (in XLA for few rows, else a second
kernel that touches only the split rows). Rows read in one piece are written by the attention kernel directly.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import mla_kernel
from pallas_kernels.int8_quant import quantize_int8
from pallas_kernels.mla_merge import combine, combine_dense
from pallas_kernels.mla_schedule import BLOCK, BLOCK_KV, MlaPlan, make_plan, split_schedule, visible_keys

__all__ = ["BLOCK", "BLOCK_KV", "MlaPlan", "split_schedule", "visible_keys"]  # and the functions below


# ---------------------------------------------------------------------------------------------------------------
# Reference


def mla_decode_reference(
    q_nope,
    q_pe,
    kv_pages,
    page_table,
    lengths,
    sm_scale,
    *,
    scales=None,
    kv_lora_rank=None,
    blocks_per_split=None,
    return_lse=False,
    positions=None,
    layer=None,
    interpret=False,
    num_sms=None,
    min_blocks_per_split=None,
    plan=None,
    pair=None,
):
    """The same function as `mla_decode`, in plain jnp over the gathered cache (the XLA baseline)."""
    del blocks_per_split, interpret, num_sms, min_blocks_per_split, plan, pair
    c = q_nope.shape[-1] if kv_lora_rank is None else kv_lora_rank
    b, t = q_nope.shape[:2]
    if layer is not None:
        kv_pages = kv_pages[layer]
        scales = None if scales is None else scales[layer]
    n, ps = page_table.shape[1], kv_pages.shape[1]
    entry = kv_pages[page_table].reshape(b, n * ps, -1)  # [B, S, C+R]
    dt = q_nope.dtype
    if scales is None:
        ckv, kpe = entry[..., :c].astype(dt), entry[..., c:].astype(dt)
    else:
        # token-minor [P, 2, page] (hcfjax.cache's; also what a 2-token page reads as) or [P, page, 2]
        sc = jnp.swapaxes(scales, -1, -2) if scales.shape[-2] == 2 else scales
        sc = sc[page_table].reshape(b, n * ps, 2)
        ef = entry.astype(jnp.float32)
        ckv, kpe = (ef[..., :c] * sc[..., :1]).astype(dt), (ef[..., c:] * sc[..., 1:]).astype(dt)
    s = jnp.einsum("BTHC,BSC->BTHS", q_nope, ckv, preferred_element_type=jnp.float32)
    s = (s + jnp.einsum("BTHR,BSR->BTHS", q_pe, kpe, preferred_element_type=jnp.float32)) * sm_scale
    vis = visible_keys(lengths, t, positions)  # [B, T]
    mask = jnp.arange(n * ps)[None, None, None, :] < vis[:, :, None, None]  # [B, T, 1, S]
    m = jnp.max(jnp.where(mask, s, -jnp.inf), axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)  # rows with no visible key: all-zero output, lse -inf
    p = jnp.where(mask, jnp.exp(s - m), 0.0)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    probs = (p / jnp.where(denom > 0, denom, 1.0)).astype(ckv.dtype)
    out = jnp.einsum("BTHS,BSC->BTHC", probs, ckv, preferred_element_type=jnp.float32).astype(dt)
    if not return_lse:
        return out
    lse = jnp.where(denom[..., 0] > 0, m[..., 0] + jnp.log(jnp.maximum(denom[..., 0], 1e-37)), -jnp.inf)
    return out, lse


def kernel_scales(scales, pt, layer=None):
    """The int8 scales as the kernel's TMA reads them, [N, 2, page] (a 64-token box needs the token axis innermost),
    and whether they are in the table's order (KernelSpec.scale_rows).

    Token-minor scales ([P, 2, page], or [L, P, 2, page] with `layer`: hcfjax.cache's) are used as they are, at the
    cache's pages: no per-call pass. Token-major ones, [.., P, page, 2], are gathered for the table's pages only
    and transposed, [B * max_pages, 2, page] (16 B per table token moved per call, against the 584 B the kernel
    reads per token): row b's block j at b * max_pages + j.
    """
    b, n = pt.shape
    if scales.shape[-2] == 2:  # token-minor
        return (scales if layer is None else scales.reshape(-1, *scales.shape[-2:])), False
    g = scales[pt] if layer is None else scales[layer, pt]  # [B, n, page, 2]
    return jnp.swapaxes(g, -1, -2).reshape(b * n, 2, -1), True


def check_supported(q_nope, q_pe, kv_pages, page_table, lengths, scales, kv_lora_rank, layer) -> None:
    """Raises ValueError naming the first shape, dtype or alignment the kernel cannot take."""
    if q_nope.ndim != 4 or q_pe.ndim != 4:
        raise ValueError(f"q_nope and q_pe must be [B, T, H, *], got {q_nope.shape} and {q_pe.shape}")
    b, t, h, c = q_nope.shape
    if q_pe.shape[:3] != (b, t, h):
        raise ValueError(f"q_pe {q_pe.shape} does not match q_nope {q_nope.shape} in [B, T, H]")
    if kv_lora_rank is not None and kv_lora_rank != c:
        raise ValueError(f"q_nope's last dim {c} must be kv_lora_rank {kv_lora_rank} (absorb W_UK first)")
    want_rank = 3 if layer is None else 4
    if kv_pages.ndim != want_rank:
        raise ValueError(
            f"kv_pages must have rank {want_rank} ({'[L, ' if layer is not None else '['}P, page, C+R]), "
            f"got {kv_pages.shape}"
        )
    r = q_pe.shape[-1]
    if kv_pages.shape[-1] != c + r:
        raise ValueError(f"kv_pages' last dim {kv_pages.shape[-1]} must be C+R = {c}+{r}")
    if r != BLOCK_KV:
        raise ValueError(f"qk_rope_head_dim {r} must be {BLOCK_KV} (P is staged in a block's dead k_pe columns)")
    if c % 128:
        raise ValueError(f"kv_lora_rank {c} must be a multiple of 128 (two 64-aligned output halves)")
    if (c + r) % 64:
        raise ValueError(f"C+R = {c + r} must be a multiple of 64 (128-byte swizzled tiles)")
    if kv_pages.shape[-2] % BLOCK_KV:
        raise ValueError(f"page size {kv_pages.shape[-2]} must be a multiple of {BLOCK_KV}")
    if kv_pages.dtype == jnp.int8:
        shapes = (kv_pages.shape[:-1] + (2,), kv_pages.shape[:-2] + (2, kv_pages.shape[-2]))
        if scales is None or scales.shape not in shapes or scales.dtype != jnp.float32:
            got = None if scales is None else (scales.shape, scales.dtype)
            raise ValueError(f"an int8 cache needs f32 scales of shape {shapes[0]} (or {shapes[1]}), got {got}")
    elif kv_pages.dtype != jnp.bfloat16:
        raise ValueError(f"kv_pages must be bfloat16 or int8, got {kv_pages.dtype}")
    elif scales is not None:
        raise ValueError("scales are only for an int8 cache")
    if page_table.ndim != 2 or page_table.shape[0] != b or not jnp.issubdtype(page_table.dtype, jnp.integer):
        raise ValueError(f"page_table must be integer [B={b}, max_pages], got {page_table.shape} {page_table.dtype}")
    if lengths.shape != (b,) or not jnp.issubdtype(lengths.dtype, jnp.integer):
        raise ValueError(f"lengths must be integer [B={b}], got {lengths.shape} {lengths.dtype}")


def _tokens_first(q_nope):
    """The shape and dtype of heads-first q_nope [H, B, T, C] as [B, T, H, C] (for the checks)."""
    if q_nope.ndim != 4:
        raise ValueError(f"heads-first q_nope must be [H, B, T, C], got {q_nope.shape}")
    h, b, t, c = q_nope.shape
    return jax.ShapeDtypeStruct((b, t, h, c), q_nope.dtype)


def _num_sms(num_sms):
    return num_sms if num_sms is not None else getattr(jax.devices()[0], "core_count", 132) or 132


def head_tiles(h: int, t: int, qk8: bool = False) -> tuple[int, int, int]:
    """How the kernel lays out h query heads of t tokens: (heads padded to whole 64-row tiles, q_heads, stack).
    Fewer heads than a tile (V2-Lite's 16, a multiple of 8) are loaded and stored as they are (KernelSpec.q_heads),
    and when the t tokens' heads fit one tile together they share it (KernelSpec.stack; not with qk8), so a row's
    cache is read once for all its tokens."""
    heads = -(-h // BLOCK) * BLOCK
    q_heads = h if h < BLOCK and h % 8 == 0 else 0
    stack = t if q_heads and t > 1 and t * q_heads <= BLOCK and not qk8 else 1
    return heads, q_heads, stack


def transposes(q_heads: int, stack: int, qk8: bool = False) -> bool:
    """Whether the kernel runs transposed by default (KernelSpec.transposed): for tiles of at most 32 query rows,
    where it measured as fast as the padded tile or faster; 48 rows measured slower (docs/kernels.md)."""
    return bool(q_heads) and not qk8 and q_heads * stack <= 32


def converters_apply(h: int, t: int, quant: bool, qk8: bool = False) -> bool:
    """Whether the converter warpgroups (`mla_decode(converters=True)`) suit h heads of t tokens: an int8 cache in
    transposed tiles (by default) of one query token. Stacked tokens (t > 1) measured twice as slow with them
    (docs/results.md)."""
    _, q_heads, stack = head_tiles(h, t, qk8)
    return quant and t == 1 and transposes(q_heads, stack, qk8)


def mla_plan(
    lengths,
    max_pages: int,
    page_size: int,
    heads: int,
    t: int = 1,
    *,
    positions=None,
    num_sms=None,
    min_blocks_per_split=4,
    blocks_per_split=None,
) -> MlaPlan:
    """The kernel's plan for rows of `lengths` [B] (and query `positions` [B, T]) over a page table max_pages wide:
    the same for every layer of a decode step, so a model can build it once and pass it to each `mla_decode`.

    Work units are cut by `split_schedule` (about one wave of `num_sms` SMs, at least `min_blocks_per_split` 64-token
    blocks per unit, or exactly `blocks_per_split`)."""
    heads, _, stack = head_tiles(heads, t)  # (qk8's unstacked tokens run more CTAs over the same work list)
    vis = visible_keys(jnp.asarray(lengths).astype(jnp.int32), t, positions)
    max_blocks = max_pages * page_size // BLOCK_KV
    q_tiles = t // stack * (heads // BLOCK)
    return make_plan(vis, max_blocks, q_tiles, _num_sms(num_sms), min_blocks_per_split, blocks_per_split)


def mla_decode(
    q_nope,
    q_pe,
    kv_pages,
    page_table,
    lengths,
    sm_scale,
    *,
    scales=None,
    kv_lora_rank=None,
    blocks_per_split=None,
    return_lse=False,
    positions=None,
    layer=None,
    interpret=False,
    num_sms=None,
    min_blocks_per_split=4,
    plan=None,
    pair=None,
    registers=None,
    qk8=False,
    profile="",
    f16=None,
    transposed=None,
    converters=False,
    heads_first=False,
):
    """Absorbed-MLA decode attention with the Mosaic GPU kernel.

    q_nope [B, T, H, C] (absorbed latent query), q_pe [B, T, H, R]; kv_pages [P, page, C+R] bf16 or int8 (with
    scales token-minor [P, 2, page] f32 as hcfjax.cache stores them, which the kernel reads with no per-call pass,
    or [P, page, 2]: `kernel_scales`), or the whole cache [L, P, page, C+R] (and [L, ...] scales) with `layer`;
    page_table [B, max_pages]; lengths [B] cache tokens including the T queries, which sit at the last T positions
    (or at `positions` [B, T]).
    -> out [B, T, H, C] in q's dtype (and lse [B, T, H] f32).  `interpret` runs Mosaic GPU's interpreter (CPU tests).

    `plan` (from `mla_plan` with the same lengths, positions and shapes) skips building the work list; otherwise it
    is built here from num_sms, min_blocks_per_split and blocks_per_split. `pair`: whether head tiles run in
    multicasting CTA pairs (None: where the padded head count is a multiple of 128, not in interpret mode; pairs
    multicast the cache to both head tiles of a token).
    `registers` overrides the warpgroups' register split (WG0, WG1, loader; default mla_kernel.REGISTERS), for
    benchmarks comparing splits. `qk8` (int8 caches): Q.K on the int8 tensor cores, with the queries quantised per
    head here (`quantize_queries`: a scale per head for each of the latent's halves and the rope, as the cache
    quantises each token). `f16` (int8 caches without qk8; default on there): the kernel converts the cache, and the
    queries, into fp16 rather than bf16 (mla_kernel.KernelSpec.f16). `profile`: "DIR[:RANGES]" builds the kernel
    with Mosaic GPU's in-kernel profiler (mla_kernel.profile_params; bench.timeline). `transposed` (None: wherever
    a tile holds at most 32 query rows, without qk8): the MMAs take the cache tokens as M, so a tile of 16 heads
    does 16 rows' work rather than 64's (mla_kernel.KernelSpec.transposed). `converters` (int8 cache, transposed
    tiles; the model asks for them where `converters_apply`): two warpgroups convert each block as it lands while the
    leader runs both P.V halves (mla_kernel.KernelSpec.converters).
    `heads_first`: q_nope is [H, B, T, C], as the absorbed query's batched product over the heads makes it; the
    kernel reads it as it lies (mla_kernel.KernelSpec.heads_first), or, where the queries are padded to whole tiles
    or quantised (qk8), it is moved to [B, T, H, C] first.
    """
    as_checked = _tokens_first(q_nope) if heads_first else q_nope
    check_supported(as_checked, q_pe, kv_pages, page_table, lengths, scales, kv_lora_rank, layer)
    b, t, h, c = q_pe.shape[:3] + q_nope.shape[-1:]
    r = q_pe.shape[-1]
    quant = kv_pages.dtype == jnp.int8
    ps = kv_pages.shape[-2]
    n_pages = kv_pages.shape[-3]
    pt = page_table.astype(jnp.int32)
    sc, scale_rows, layer_op = None, False, None
    if quant:
        sc, scale_rows = kernel_scales(scales, pt, layer)
    if layer is not None:
        # The kernel indexes the whole cache (page + layer * P) instead of a layer's copy sliced out, and adds the
        # layer's offset itself: the table goes in as it is, the same for every layer.
        layer_op = jnp.reshape(jnp.asarray(layer, jnp.int32), (1,))
        kv_pages = kv_pages.reshape(-1, ps, c + r)
    # Fewer heads than one tile (V2-Lite's 16) are not padded here nor sliced after; other counts are padded to
    # whole tiles (head_tiles).
    heads, q_heads, stack = head_tiles(h, t, qk8)
    if transposed and not (q_heads and not qk8):
        raise ValueError(f"transposed needs fewer than {BLOCK} heads (a multiple of 8) and no qk8, got {h} heads")
    if transposed is None:
        transposed = transposes(q_heads, stack, qk8)
    if f16 is None:
        f16 = quant and not qk8
    if heads_first and (qk8 or (heads != h and not q_heads)):
        q_nope, heads_first = jnp.moveaxis(q_nope, 0, 2), False
    qs = None
    if qk8:  # [B, T, H, *] int8 and [B, T, 3, H] f32 scales: per head and part (the latent's halves A, B; rope)
        qn, qp, qs = quantize_queries(q_nope, q_pe)
    else:  # (no-ops for bf16 queries; with f16 the kernel converts them)
        qn, qp = q_nope.astype(jnp.bfloat16), q_pe.astype(jnp.bfloat16)
    if heads != h and not q_heads:
        qn = jnp.pad(qn, ((0, 0), (0, 0), (0, heads - h), (0, 0)))
        qp = jnp.pad(qp, ((0, 0), (0, 0), (0, heads - h), (0, 0)))
    if heads != h:  # (the qk8 scales always: the kernel reads a tile's row vector)
        qs = None if qs is None else jnp.pad(qs, ((0, 0), (0, 0), (0, 0), (0, heads - h)))
    if plan is None:
        plan = mla_plan(
            lengths,
            page_table.shape[1],
            ps,
            heads,
            t,
            positions=positions,
            num_sms=num_sms,
            min_blocks_per_split=min_blocks_per_split,
            blocks_per_split=blocks_per_split,
        )
    elif plan.vis.shape != (b, t):
        raise ValueError(f"plan is for [B, T] = {plan.vis.shape}, the queries are {(b, t)}")
    can_pair = (heads // BLOCK) % 2 == 0 and not interpret
    if pair and not can_pair:
        raise ValueError(f"pair=True needs a multiple of {2 * BLOCK} heads (got {heads}) and a GPU (not interpret)")
    spec = mla_kernel.KernelSpec(
        c=c,
        r=r,
        t=t,
        heads=heads,
        page_size=ps,
        max_pages=page_table.shape[1],
        units=plan.units,
        batch=0 if plan.mode == "dense" else b,
        slots=plan.slots,
        quant=quant,
        sm_scale=float(sm_scale),
        interpret=interpret,
        pair=(True if pair is None else pair) and can_pair,
        registers=None if registers is None else mla_kernel.check_registers(registers, 4 if converters else 3),
        qk8=qk8,
        f16=f16,
        profile=profile,
        q_heads=q_heads,
        stack=stack,
        transposed=transposed,
        converters=converters,
        layer_pages=0 if layer is None else n_pages,
        scale_rows=scale_rows,
        heads_first=heads_first,
    )
    outs = mla_kernel.attention(spec, qn, qp, kv_pages, sc, pt, plan.vis, plan.work, qs, layer_op)

    def per_token(lse):  # [N, T', heads] -> [N, T, io_heads] (stacked tokens: one row of the kernel's lse holds all)
        if stack == 1:
            return lse[..., : spec.io_heads]
        return lse[:, 0, : t * q_heads].reshape(lse.shape[0], t, q_heads)

    if plan.mode == "direct":
        out, lse = outs[0], per_token(outs[1])
    elif plan.mode == "dense":
        out, lse = combine_dense(outs[0], per_token(outs[1]), plan.count, plan.max_units)
    else:
        out, lse = combine(spec, *outs, plan.first, plan.count, plan.max_units)
        lse = per_token(lse)
    out = out[:, :, :h].astype(q_nope.dtype)
    return (out, lse[:, :, :h]) if return_lse else out


def quantize_queries(q_nope, q_pe):
    """qk8's queries: int8 per head and slot part (the latent's two halves, the rope), as the kernel's int8 Q.K sums
    each part in its own accumulator. -> (q_nope int8, q_pe int8, scales [B, T, 3, H] f32)."""
    b, t, h, c = q_nope.shape
    qn, s_lat = quantize_int8(q_nope.reshape(b, t, h, 2, c // 2))
    qp, s_rope = quantize_int8(q_pe)
    scales = jnp.concatenate([jnp.moveaxis(s_lat, -1, 2), s_rope[:, :, None]], axis=2)
    return qn.reshape(b, t, h, c), qp, scales


def dequantize_queries(qn, qp, scales):
    """quantize_queries' inverse in f32: the queries the qk8 kernel's attention is exact for."""
    b, t, h, c = qn.shape
    lat = qn.reshape(b, t, h, 2, c // 2).astype(jnp.float32) * jnp.moveaxis(scales[:, :, :2], 2, -1)[..., None]
    return lat.reshape(b, t, h, c), qp.astype(jnp.float32) * scales[:, :, 2][..., None]


# ---------------------------------------------------------------------------------------------------------------
# Selection (hcfjax.options.Options.mode decides; this says whether the kernel takes the shapes)


def kernel_applies(q_nope, q_pe, kv_pages, page_table, lengths, scales=None, kv_lora_rank=None, layer=None) -> bool:
    try:
        check_supported(q_nope, q_pe, kv_pages, page_table, lengths, scales, kv_lora_rank, layer)
    except ValueError:
        return False
    return True
