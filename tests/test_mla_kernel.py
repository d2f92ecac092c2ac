"""MLA decode kernel (pallas_kernels.mla_decode) against its jnp reference, run by Mosaic GPU's interpreter on the CPU.

The interpreter starts every buffer as NaN (uninitialized_memory="nan"), so an output element the kernel never writes
shows up as NaN. Shapes are small (C=128, R=64, page 64, heads padded to 64) to keep the file fast; the reference
itself is checked against a float64 softmax written out here. The interpreter runs each warpgroup as an XLA:CPU
computation on the CPU client's thread pool; with fewer than three workers (one CPU device on a two-core machine) two
waiting warpgroups starve the third and the run hangs. conftest's eight CPU devices give the pool enough threads.

The interpreter's wgmma is synchronous, so it cannot catch a slot released while an MMA still reads it; the kernel
keeps every MMA synchronous before a release (mla_kernel.py), and tests/test_mla_kernel_lowering.py checks the sm_90
lowering.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hcfjax.cache import quantize_int8
from pallas_kernels import mla_decode as M
from pallas_kernels import mla_kernel
from pallas_kernels.mla_merge import combine_dense
from pallas_kernels.mla_schedule import DIRECT, PADDING

C, R, PAGE = 128, 64, 64


pytestmark = pytest.mark.usefixtures("reset_interpreter")


def make(seed, lengths, t, h, max_pages, quant=False, zero_latent=False):
    """Random queries and a cache in shuffled pages; spare pages hold garbage that must never be read. zero_latent
    (int8): every 7th token's latent is zero with a zero scale, as in a zero-initialised cache. Drawn with numpy (no
    program to compile per shape; bf16 by ml_dtypes' round-to-nearest-even, as XLA's convert)."""
    rng = np.random.default_rng(seed)
    b = len(lengths)
    n_pages = b * max_pages + 2
    qn = rng.standard_normal((b, t, h, C), np.float32).astype(jnp.bfloat16)
    qp = rng.standard_normal((b, t, h, R), np.float32).astype(jnp.bfloat16)
    kv = rng.standard_normal((n_pages, PAGE, C + R), np.float32)
    pt = rng.permutation(n_pages)[: b * max_pages].reshape(b, max_pages).astype(np.int32)
    qn, qp, pt, lengths = jnp.asarray(qn), jnp.asarray(qp), jnp.asarray(pt), jnp.asarray(lengths, jnp.int32)
    if quant:
        kv, sc = _quantize_cache(kv, zero_latent)
        return qn, qp, kv, sc, pt, lengths
    return qn, qp, jnp.asarray(kv.astype(jnp.bfloat16)), None, pt, lengths


@functools.partial(jax.jit, static_argnums=1)  # one compiled program, not one per op (the same bits)
def _quantize_cache(kv, zero_latent):
    qc, sc = quantize_int8(kv[..., :C])
    qr, sr = quantize_int8(kv[..., C:])
    if zero_latent:
        zero = (jnp.arange(PAGE) % 7 == 3)[None, :]
        qc, sc = jnp.where(zero[..., None], 0, qc).astype(jnp.int8), jnp.where(zero, 0.0, sc)
    return jnp.concatenate([qc, qr], -1), jnp.stack([sc, sr], -1)


def float64_attention(qn, qp, kv, scales, pt, lengths, scale):
    """Softmax attention in float64 numpy, token by token from the page table: (out, natural-log lse)."""
    qn, qp = np.asarray(qn, np.float64), np.asarray(qp, np.float64)
    kv = np.asarray(kv, np.float64)
    if scales is not None:
        sc = np.asarray(scales, np.float64)
        kv = np.concatenate([kv[..., :C] * sc[..., :1], kv[..., C:] * sc[..., 1:]], -1)
    b, t, h, _ = qn.shape
    out, lse = np.zeros((b, t, h, C)), np.full((b, t, h), -np.inf)
    for i in range(b):
        keys = np.concatenate([kv[p] for p in np.asarray(pt[i])])  # [S, C+R]
        for j in range(t):
            n = int(lengths[i]) - t + j + 1
            if n <= 0:
                continue
            s = (qn[i, j] @ keys[:n, :C].T + qp[i, j] @ keys[:n, C:].T) * scale  # [H, n]
            p = np.exp(s - s.max(-1, keepdims=True))
            out[i, j] = (p / p.sum(-1, keepdims=True)) @ keys[:n, :C]
            lse[i, j] = s.max(-1) + np.log(p.sum(-1))
    return out, lse


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / np.linalg.norm(b)


# The kernel (interpreted), the reference and the qk8 queries, each jitted as the model runs them: one compiled
# program, not one per op (the same numbers either way), shared by the calls of one shape and settings.
STATIC = ("kv_lora_rank", "blocks_per_split", "return_lse", "interpret", "num_sms", "min_blocks_per_split", "pair")
STATIC += ("registers", "qk8", "profile", "f16", "transposed", "converters", "heads_first")
kernel = jax.jit(M.mla_decode, static_argnums=5, static_argnames=STATIC)
reference = jax.jit(M.mla_decode_reference, static_argnums=5, static_argnames="return_lse")
_quantized_queries = jax.jit(lambda qn, qp: M.dequantize_queries(*M.quantize_queries(qn, qp)))


def check_kernel(seed, lengths, t, h, max_pages, mode=None, quant=False, zero_latent=False, **kw):
    qn, qp, kv, sc, pt, lengths = make(seed, lengths, t, h, max_pages=max_pages, quant=quant, zero_latent=zero_latent)
    scale = C**-0.5 * 3  # sharp enough that a wrong mask or rescale shows
    if mode is not None:  # the merge path the case is meant to cover
        plan_kw = {k: kw[k] for k in ("num_sms", "min_blocks_per_split", "blocks_per_split") if k in kw}
        plan = jax.eval_shape(lambda lengths: M.mla_plan(lengths, max_pages, PAGE, h, t, **plan_kw), lengths)
        assert plan.mode == mode  # (static: tracing the plan decides it)
    out, lse = kernel(qn, qp, kv, pt, lengths, scale, scales=sc, return_lse=True, interpret=True, **kw)
    assert out.shape == (len(lengths), t, h, C) and out.dtype == jnp.bfloat16
    assert not np.isnan(np.asarray(out, np.float32)).any(), "unwritten (NaN-poisoned) output"
    # qk8: the kernel's function is attention with the queries quantised per head (and part), as the cache is per
    # token; the truth is computed from those queries.
    q_truth = _quantized_queries(qn, qp) if kw.get("qk8") else (qn, qp)
    want, want_lse = float64_attention(*q_truth, kv, sc, pt, lengths, scale)
    assert rel(np.asarray(out, np.float32), want) < 1e-2
    ref, ref_lse = reference(*q_truth, kv, pt, lengths, scale, scales=sc, return_lse=True)
    assert rel(np.asarray(ref, np.float32), want) < 1e-2
    # Against the truth, not the reference: the int8 kernel scales S instead of dequantising the cache to bf16.
    finite = np.isfinite(want_lse)
    ref_err = np.abs(np.asarray(ref_lse)[finite] - want_lse[finite]).max(initial=0.0)
    assert ref_err < 3e-2  # (bf16 caches ~1e-6; int8 ~1e-2, the reference rounding its dequantised cache to bf16)
    np.testing.assert_allclose(np.asarray(lse), want_lse, rtol=1e-3, atol=max(1e-2, 1.5 * ref_err))


@pytest.mark.parametrize(
    "lengths,t,h,kw",
    [
        # length 1, mid-page, exactly 3 pages; 8 SMs: bps 1, row 2 in 3 units, merged in XLA
        ([1, 150, 192], 1, 16, dict(num_sms=8, min_blocks_per_split=1, mode="dense")),
        # 80 heads: two head tiles, the second padded; default schedule: one unit per row, written directly
        ([97, 200], 1, 80, dict(mode="direct")),
        # T=3, causal within the new tokens; fixed 3-block splits: a unit's third block reuses its first's slot
        ([3, 250], 3, 32, dict(blocks_per_split=3, mode="dense")),
    ],
)
def test_kernel_matches_reference(lengths, t, h, kw):
    check_kernel(len(lengths) * 10 + t, lengths, t, h, max_pages=4, **kw)


def test_batch_1_long_context_splits_over_the_chip():
    # 400 tokens (7 blocks, the last ending mid-block) over 7 SMs: 7 one-block units merged by log-sum-exp.
    check_kernel(23, [400], 1, 16, max_pages=7, num_sms=7, min_blocks_per_split=1, mode="dense")


# Ragged rows in a 3-page table: lengths 0, 1, a block's end and either side of it, mid-page, a full table. 3 SMs
# (one unit each, with the rows: 10 CTAs, 3 of them padding) give B * max_units > 2 * units, the sparse merge (as 128
# rows on 132 SMs would be): single-unit rows are written by the kernel and the combine kernel passes over them.
RAGGED = [0, 1, 192, 63, 64, 65, 123]


def test_ragged_batch_of_mixed_lengths():
    check_kernel(37, RAGGED, 1, 16, max_pages=3, num_sms=3, min_blocks_per_split=1, mode="sparse")


def test_sparse_merge_of_a_split_row():
    # The sparse merge with a row to merge: over 3 SMs row 0's 190 tokens (its last block ending mid-block) run as two
    # units, which the combine kernel merges; the other rows (empty ones included) are single units the attention
    # kernel writes itself.
    lengths = [190, 0, 64, 1, 0, 0, 33]
    plan = M.mla_plan(jnp.asarray(lengths, jnp.int32), 3, PAGE, 16, 1, num_sms=3, min_blocks_per_split=1)
    assert np.asarray(plan.count).tolist() == [2, 1, 1, 1, 1, 1, 1]
    check_kernel(53, lengths, 1, 16, max_pages=3, num_sms=3, min_blocks_per_split=1, mode="sparse")


@pytest.mark.parametrize(
    "f16,transposed,converters",
    [(True, None, False), (False, None, False), (True, False, False), (True, True, True)],
)
def test_int8_kernel_matches_reference(f16, transposed, converters):
    # The loader and WG1 convert each part in place (the int8 twin overlays the 16-bit part), into fp16 (the
    # default) or bf16; the latent is left unscaled and S and P are scaled per token, where a zero latent scale must
    # not zero the rope's share of S. 16 heads run transposed by default (S^T = K Q^T: the scales go on S^T's rows),
    # or as 16 rows of a 64-row tile.
    kw = dict(f16=f16, transposed=transposed, converters=converters)
    kw.update(blocks_per_split=3, zero_latent=True)
    check_kernel(13, [1, 150, 255], 1, 16, max_pages=4, quant=True, **kw)


@pytest.mark.parametrize(
    "t,quant,kw",
    [
        (4, False, dict(mode="direct")),
        (2, True, dict(blocks_per_split=3, mode="dense")),  # transposed by default
        (3, True, dict(blocks_per_split=3, mode="dense")),  # 48 rows: padded by default
    ],
)
def test_stacked_tokens_match_reference(t, quant, kw):
    # T tokens of 16 heads share one 64-row tile (KernelSpec.stack): each token's rows masked at its own visible keys
    # (the row's last T positions, causal), written to the output directly or through the merged partials. Run
    # transposed, the tokens are S^T's column groups, masked by column.
    check_kernel(61 + t, [70, 190, 1][: 2 + quant], t, 16, max_pages=4, quant=quant, **kw)


def test_stacked_tokens_through_the_combine_kernel():
    # T=3 x 16 heads stacked, the ragged rows over 3 SMs: the combine kernel takes all of a row's tokens at once.
    check_kernel(47, RAGGED, 3, 16, max_pages=3, num_sms=3, min_blocks_per_split=1, mode="sparse")


@pytest.mark.parametrize(
    "t,h,kw",
    [
        (1, 16, dict(quant=True, converters=True, blocks_per_split=3)),  # V2-Lite's decode: 16 heads, converters
        (2, 16, dict(quant=False)),  # two stacked tokens, each token's rows at its own place in [H, B, T, C]
        (1, 128, dict(quant=False)),  # two head tiles: the second's rows start at head 64
    ],
)
def test_heads_first_queries_give_the_same_attention(t, h, kw):
    # q_nope [H, B, T, C], as the absorbed product makes it: the kernel's TMA reads each tile's rows at their stride
    # (or the wrapper moves them where it pads), so the output is the [B, T, H, C] layout's, bit for bit.
    quant = kw.pop("quant")
    qn, qp, kv, sc, pt, lengths = make(71 + t + h, [1, 150, 255][: 3 - t], t, h, max_pages=4, quant=quant)
    want = kernel(qn, qp, kv, pt, lengths, 0.1, scales=sc, return_lse=True, interpret=True, **kw)
    got = kernel(
        jnp.moveaxis(qn, 2, 0),
        qp,
        kv,
        pt,
        lengths,
        0.1,
        scales=sc,
        return_lse=True,
        interpret=True,
        heads_first=True,
        **kw,
    )
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))


def test_head_tiles_stack_tokens_that_fit_one_tile():
    assert M.head_tiles(16, 1) == (64, 16, 1)
    assert M.head_tiles(16, 4) == (64, 16, 4)  # 64 rows
    assert M.head_tiles(16, 5) == (64, 16, 1)  # 80 rows: a tile per token
    assert M.head_tiles(16, 3, qk8=True) == (64, 16, 1)
    assert M.head_tiles(32, 2) == (64, 32, 2)
    assert M.head_tiles(12, 2) == (64, 0, 1)  # not a multiple of 8: padded
    assert M.head_tiles(128, 2) == (128, 0, 1)


@pytest.mark.parametrize("lat,rope", [(1e-4, 1e-4), (1e-3, 1.0)])
def test_int8_kernel_in_fp16_keeps_the_scales_range(lat, rope):
    # Version 3 converts the int8 cache into fp16 (f16). Small scales: P times the latent scales would go subnormal
    # without P_SCALE (rel 1.5e-2 at 1e-4 with P_SCALE = 1, against 1.9e-3). A rope scale 1000x the latent's: the rope
    # part's values relative to the latent scale (127 x 1000) would overflow fp16 without ROPE_SHIFT (NaN). The
    # softmax scale keeps the usual logits (the rope's, in the second case).
    qn, qp, kv, sc, pt, lengths = make(5, [1, 150, 255], 1, 16, max_pages=4, quant=True)
    sc, scale = sc * jnp.asarray([lat, rope]), C**-0.5 * 3 / rope
    out, lse = kernel(qn, qp, kv, pt, lengths, scale, scales=sc, return_lse=True, interpret=True)
    want, want_lse = float64_attention(qn, qp, kv, sc, pt, lengths, scale)
    assert rel(np.asarray(out, np.float32), want) < 5e-3
    np.testing.assert_allclose(np.asarray(lse), want_lse, rtol=1e-3, atol=1e-2)


def test_int8_qk_kernel_matches_reference():
    # qk8: Q.K from the landed int8 blocks and int8 queries (an int32 sum per part, both scales on S), the latent
    # converted after it while the next block loads; one unit of three blocks reuses a slot, an empty row has a
    # unit of none. Checked against the attention of the per-head quantised queries.
    kw = dict(quant=True, blocks_per_split=3, zero_latent=True, qk8=True)
    check_kernel(17, [1, 150, 0], 1, 16, max_pages=3, **kw)


def test_plan_is_reusable_across_calls():
    qn, qp, kv, _, pt, lengths = make(41, [70, 190], 1, 16, max_pages=3)
    # each call one compiled program, not one per op
    plan = jax.jit(lambda lengths: M.mla_plan(lengths, 3, PAGE, 16, num_sms=8, min_blocks_per_split=1))(lengths)
    given = jax.jit(lambda *a, plan: M.mla_decode(*a, 0.1, plan=plan, interpret=True))
    got = given(qn, qp, kv, pt, lengths, plan=plan)
    built = jax.jit(lambda *a: M.mla_decode(*a, 0.1, num_sms=8, min_blocks_per_split=1, interpret=True))
    want = built(qn, qp, kv, pt, lengths)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    with pytest.raises(ValueError, match="plan is for"):
        M.mla_decode(qn[:1], qp[:1], kv, pt[:1], lengths[:1], 0.1, plan=plan, interpret=True)


def test_dense_merge_is_the_softmax_over_all_units():
    # combine_dense against the plain merge: row b's units wrote normalized partials with their lse to slots
    # b * 3 + k, k < count[b]; the other slots hold garbage (NaN) that must not leak in.
    rng = np.random.default_rng(3)
    count = np.array([1, 3, 2], np.int32)
    o = rng.normal(size=(9, 1, 4, 8)).astype(np.float32)
    lse = rng.normal(size=(9, 1, 4)).astype(np.float32) * 3
    lse[4, 0, 1] = -np.inf  # a unit that saw nothing for one head
    for b, n in enumerate(count):
        o[b * 3 + n : b * 3 + 3], lse[b * 3 + n : b * 3 + 3] = np.nan, np.nan
    merge = jax.jit(combine_dense, static_argnums=3)
    out, lse_out = merge(jnp.asarray(o, jnp.bfloat16), jnp.asarray(lse), jnp.asarray(count), 3)
    for b in range(3):
        s = slice(b * 3, b * 3 + count[b])
        w = np.exp(lse[s] - lse[s].max(0))
        o_b = np.asarray(jnp.asarray(o[s], jnp.bfloat16), np.float32)
        np.testing.assert_allclose(np.asarray(out[b]), (w[..., None] * o_b).sum(0) / w.sum(0)[..., None], rtol=1e-5)
        np.testing.assert_allclose(np.asarray(lse_out[b]), lse[s].max(0) + np.log(w.sum(0)), rtol=1e-5)


@pytest.mark.parametrize("num_sms,min_blocks,bps", [(132, 4, None), (16, 1, None), (8, 2, None), (132, 1, 3)])
def test_split_schedule_covers_each_rows_blocks_once(num_sms, min_blocks, bps):
    rng = np.random.default_rng(num_sms + min_blocks)
    max_blocks, q_tiles = 40, 2
    vis = np.concatenate([[[0], [1], [64 * max_blocks]], rng.integers(0, 64 * max_blocks + 1, (13, 1))])
    vis = np.concatenate([vis, vis - 1], axis=1).clip(0)  # T=2; the row reads max_t vis
    work, first, count, max_units = jax.jit(M.split_schedule, static_argnums=(1, 2, 3, 4, 5))(
        jnp.asarray(vis, jnp.int32), max_blocks, q_tiles, num_sms, min_blocks, bps
    )
    row, blk0, n_blk, slot = np.asarray(work)
    first, count = np.asarray(first), np.asarray(count)
    nb = -(-vis.max(1) // 64)
    target = num_sms // q_tiles
    real = slot >= 0
    assert sorted(slot[real]) == list(range(count.sum())) and (n_blk[~real] == 0).all()  # every slot once
    assert (count >= 1).all() and (count <= max_units).all() and (n_blk >= 0).all()
    if bps is None:
        assert work.shape[1] <= target + len(vis)
        bps = max(min(min_blocks, max_blocks), -(-nb.sum() // target))
    assert n_blk.max() == min(bps, nb.max())
    for b in range(len(vis)):
        mine = (row == b) & real
        assert mine.sum() == count[b]
        assert sorted(slot[mine]) == list(range(first[b], first[b] + count[b]))  # row-major slots
        covered = sorted(k for s, n in zip(blk0[mine], n_blk[mine], strict=True) for k in range(s, s + n))
        assert covered == list(range(nb[b]))
    # Grid order: the full units, then the shorter tails (and empty rows' units), then padding.
    kind = np.where(~real, 2, np.where(n_blk == bps, 0, 1))
    assert (np.diff(kind) >= 0).all()


@pytest.mark.parametrize(
    "b,ctx,min_blocks,mode",
    [(1, 256, 4, "direct"), (1, 16384, 4, "dense"), (4, 4096, 4, "dense"), (4, 16384, 4, "sparse")]
    + [(128, 4096, 4, "sparse"), (128, 256, 4, "direct")],
)
def test_plan_picks_the_merge_by_the_static_shapes(b, ctx, min_blocks, mode):
    plan_of = jax.jit(M.mla_plan, static_argnums=(1, 2, 3), static_argnames=("num_sms", "min_blocks_per_split"))
    plan = plan_of(jnp.full((b,), ctx, jnp.int32), ctx // 64, 64, 128, num_sms=132, min_blocks_per_split=min_blocks)
    assert plan.mode == mode
    dest = np.asarray(plan.work[3])
    n_real = int(np.asarray(plan.count).sum())
    assert (dest[n_real:] == PADDING).all()
    if mode == "direct":
        assert (dest[:n_real] == DIRECT).all()
    elif mode == "dense":  # row-major [B, max_units]: full rows fill it
        assert sorted(dest[:n_real]) == list(range(n_real)) and n_real == b * plan.max_units
    else:  # full rows of 4096 on 132 SMs are one unit each; of 16384 at batch 4, 16 each
        assert ((dest[:n_real] == DIRECT) == (np.asarray(plan.count)[0] == 1)).all()


def test_queries_with_no_visible_key_give_zeros():
    # T=3 with a single cached token: the first two queries sit at negative positions (mock/padding rows).
    qn, qp, kv, _, pt, lengths = make(3, [1], 3, 16, max_pages=1)
    out, lse = kernel(qn, qp, kv, pt, lengths, 0.1, return_lse=True, interpret=True)
    out = np.asarray(out, np.float32)
    assert not np.isnan(out).any()
    assert (out[0, :2] == 0).all() and np.isneginf(np.asarray(lse)[0, :2]).all()
    ref, ref_lse = reference(qn, qp, kv, pt, lengths, 0.1, return_lse=True)
    assert rel(out, np.asarray(ref, np.float32)) < 1e-2


def test_positions_match_a_ragged_chunk():
    # Row 1 has 2 real tokens at positions 40, 41 of a T=3 chunk; its third query is padding at position 0.
    qn, qp, kv, _, pt, _ = make(5, [1, 1], 3, 16, max_pages=2)
    lengths = jnp.array([100, 42], jnp.int32)
    positions = jnp.array([[97, 98, 99], [40, 41, 0]], jnp.int32)
    out = kernel(qn, qp, kv, pt, lengths, 0.2, positions=positions, interpret=True)
    ref = reference(qn, qp, kv, pt, lengths, 0.2, positions=positions)
    assert rel(np.asarray(out, np.float32), np.asarray(ref, np.float32)) < 1e-2
    # the padded query sees exactly key 0
    np.testing.assert_allclose(np.asarray(ref[1, 2], np.float32), np.broadcast_to(kv[pt[1, 0], 0, :C], (16, C)))


def test_reference_int8_dequantizes_per_token():
    qn, qp, kv, sc, pt, lengths = make(11, [70, 5], 2, 16, max_pages=2, quant=True)
    ref = reference(qn.astype(jnp.float32), qp.astype(jnp.float32), kv, pt, lengths, 0.1, scales=sc)
    assert rel(np.asarray(ref), float64_attention(qn, qp, kv, sc, pt, lengths, 0.1)[0]) < 1e-5
    minor = reference(qn, qp, kv, pt, lengths, 0.1, scales=jnp.swapaxes(sc, 1, 2))  # token-minor
    np.testing.assert_array_equal(np.asarray(minor), np.asarray(reference(qn, qp, kv, pt, lengths, 0.1, scales=sc)))


@pytest.mark.parametrize("layer", [None, 1])
def test_kernel_scales_index_the_same_token_in_both_layouts(layer):
    _, _, _, sc, pt, _ = make(31, [100, 7], 1, 16, max_pages=2, quant=True)
    if layer is not None:
        sc = jnp.stack([sc * 0 - 1, sc])  # [L=2, P, page, 2]; layer 0 is a decoy
    want = (sc if layer is None else sc[layer])[pt]  # [B, n, page, 2]
    got, rows = M.kernel_scales(sc, pt, layer)  # gathered in the table's order: row b's block j at b * n + j
    assert rows and got.shape == (pt.size, 2, PAGE)
    np.testing.assert_array_equal(np.asarray(jnp.swapaxes(got, -1, -2)).reshape(want.shape), np.asarray(want))
    got, rows = M.kernel_scales(jnp.swapaxes(sc, -1, -2), pt, layer)  # token-minor: the cache itself, no copy
    assert not rows and got.shape[0] == sc.size // (2 * PAGE)
    at = pt if layer is None else pt + layer * sc.shape[1]  # the kernel reads them at the cache's page
    np.testing.assert_array_equal(np.asarray(jnp.swapaxes(got[at], -1, -2)), np.asarray(want))


def test_model_layer_index_reads_that_layer():
    qn, qp, kv, _, pt, lengths = make(17, [50, 100, 7], 1, 16, max_pages=2)  # the second row in two units
    decoy = jax.random.normal(jax.random.key(5), kv.shape, jnp.float32).astype(kv.dtype)
    stacked = jnp.stack([decoy, kv, decoy])  # [L=3, P, page, C+R]: any other offset reads a decoy
    out = kernel(qn, qp, stacked, pt, lengths, 0.1, layer=jnp.int32(1), interpret=True, blocks_per_split=1)
    want = reference(qn, qp, kv, pt, lengths, 0.1)
    assert rel(np.asarray(out, np.float32), np.asarray(want, np.float32)) < 1e-2


@pytest.mark.parametrize("minor,qk8", [(False, False), (True, False), (False, True)])
def test_int8_kernel_reads_its_layer_of_a_stacked_cache(minor, qk8):
    # The kernel adds the layer's offset to the page table itself, for the cache and for token-minor scales; scales
    # gathered in the table's order are found by row and column (also with Q.K on int8, qk8). Layer 0 is a decoy
    # the kernel must not read.
    qn, qp, kv, sc, pt, lengths = make(19, [100, 7, 64], 1, 16, max_pages=2, quant=True)  # the first in two units
    decoy = jnp.zeros_like(sc).at[..., 0].set(1e3)
    scales = jnp.stack([decoy, sc])
    if minor:
        scales = jnp.swapaxes(scales, -1, -2)
    out = kernel(
        qn,
        qp,
        jnp.stack([kv[::-1], kv]),
        pt,
        lengths,
        0.1,
        scales=scales,
        layer=jnp.int32(1),
        interpret=True,
        blocks_per_split=1,
        qk8=qk8,
    )
    want = float64_attention(qn, qp, kv, sc, pt, lengths, 0.1)[0]
    assert rel(np.asarray(out, np.float32), want) < 1e-2


def test_timeline_summary_of_a_profiler_trace():
    # bench.timeline's reading of Mosaic GPU's trace: trace id 1 + warpgroup + 3 x CTA, ts in cycles / 1000; per
    # region its mean cycles, occurrences per CTA and share of the warpgroup's window (first start to last end).
    from pallas_kernels.bench.timeline import kernel_warpgroups, summarise

    def region(tid, name, t0, t1):
        return [dict(name=name, ph="B", ts=t0 / 1e3, tid=tid), dict(name=name, ph="E", ts=t1 / 1e3, tid=tid)]

    events = region(1, "qk", 0, 100) + region(1, "pv", 100, 150) + region(1, "qk", 200, 300)  # CTA 0, leader
    events.insert(1, region(1, "mma", 10, 60)[0])  # a region inside the first qk: its path, not in "(between)"
    events.insert(2, region(1, "mma", 10, 60)[1])
    events += region(4, "qk", 0, 300) + region(4, "pv", 300, 400)  # CTA 1, leader
    events += region(5, "wait_p", 0, 50) + [dict(name="pv", ph="B", ts=0.06, tid=5)]  # CTA 1, WG1: truncated
    got = summarise({"traceEvents": events})
    lead = got["WG0 (leader)"]
    np.testing.assert_allclose(lead["qk"], (500 / 3, 1.5, 500 / 700))
    np.testing.assert_allclose(lead["pv"], (75, 1.0, 150 / 700))
    np.testing.assert_allclose(lead["(between)"][2], 50 / 700)
    np.testing.assert_allclose(lead["qk > mma"], (50, 0.5, 50 / 700))
    assert set(got["WG1"]) == {"wait_p", "(between)"} and "loader" not in got
    # four warpgroups (converters): trace id 1 + warpgroup + 4 x CTA
    got = summarise({"traceEvents": region(4, "convert", 0, 80) + region(5, "qk", 0, 10)}, warpgroups=4)
    assert set(got) == {"WG3", "WG0 (leader)"} and got["WG3"]["convert"][0] == 80
    assert [kernel_warpgroups(v) for v in ("3tc", "3t", None)] == [4, 3, 3]


def test_profile_params():
    assert mla_kernel.profile_params("") == {}
    got = mla_kernel.profile_params("/tmp/traces:64")
    assert (got["profile_dir"], got["profile_space"], got["profile_bounds_check"]) == ("/tmp/traces", 64, True)
    with pytest.raises(ValueError, match="DIR or DIR:RANGES"):
        mla_kernel.profile_params("/tmp/traces:lots")
