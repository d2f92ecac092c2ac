"""Merging a split row's partial outputs (flash-decoding's second step), for the MLA decode wrapper (mla_decode.py).

Each unit of a split row wrote its normalized bf16 rows and natural-log lse to a partial slot (mla_schedule); row b's
slots are first[b] .. first[b] + count[b] - 1, or b * max_units + k in the dense mode. `combine_dense` merges the
dense layout in XLA (small batches, where B x max_units is about the real number of slots);
`combine` is a Mosaic GPU kernel that merges only the rows with two or more units, in place into the output the
attention kernel wrote for the others.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax

from pallas_kernels.mla_schedule import BLOCK


def combine_dense(o, lse, count, max_units: int):
    """Merges each row's partials in XLA. o [B * max_units, T, H, C] bf16, lse [B * max_units, T, H] f32 (natural
    log); row b's units wrote slots b * max_units + k for k < count[b] (the rest is never written).
    -> out [B, T, H, C] f32, lse [B, T, H]; rows with no visible key: zeros and -inf.

    The weights exp(lse - max lse) are computed once per (slot, head) on [B, max_units, T, H], then one fused
    multiply-and-sum reads the partials: one pass over o and no exp per element."""
    b = count.shape[0]
    ok = jnp.arange(max_units)[None, :] < count[:, None]  # [B, S]
    o = o.reshape(b, max_units, *o.shape[1:])
    lse = jnp.where(ok[..., None, None], lse.reshape(b, max_units, *lse.shape[1:]), -jnp.inf)  # [B, S, T, H]
    m = lse.max(axis=1)
    w = jnp.exp(lse - jnp.where(m == -jnp.inf, 0.0, m)[:, None])  # 0 for unwritten and empty slots
    den = w.sum(axis=1)
    # Unwritten slots hold whatever was in memory (NaN included): masked, not weighted by 0.
    o = jnp.where(ok[..., None, None, None], o.astype(jnp.float32), 0.0)
    out = (o * w[..., None]).sum(axis=1) / jnp.where(den > 0, den, 1.0)[..., None]
    return out, jnp.where(den > 0, m + jnp.log(jnp.maximum(den, 1e-37)), -jnp.inf)


COMBINE_STAGES = 4  # partial tiles in flight per merging CTA


def _combine_body(spec, max_units, cw, first_ref, count_ref, op_ref, lp_ref, out_ref, lse_ref, scratch, bars):
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    lse_smem, tiles, out_tile, lse_row = scratch
    lse_bar, tile_bar = bars
    ns = COMBINE_STAGES
    b, qt, cb = lax.axis_index("row"), lax.axis_index("qt"), lax.axis_index("col")
    n_ht, stack = spec.heads // BLOCK, spec.stack
    # The tile's query token (stacked: its first) and heads; with q_heads the tile's other rows are never stored.
    tok, h0 = lax.div(qt, n_ht), lax.rem(qt, n_ht) * BLOCK
    t, heads, cols = tok * stack, pl.ds(h0, spec.tile_rows), pl.ds(cb * cw, cw)
    n = count_ref[b]
    row = plgpu.Layout.WGMMA.reduce(1)

    @pl.when(n > 1)
    def _():
        s0 = first_ref[b]
        # All of the row's lse in one TMA (max_units rows; rows past the row's own are ignored, past the end zeros).
        plgpu.copy_gmem_to_smem(lp_ref.at[pl.ds(s0, max_units), tok, pl.ds(h0, BLOCK)], lse_smem, lse_bar.at[0])
        plgpu.barrier_wait(lse_bar.at[0])
        lse_k = lambda k: plgpu.load(lse_smem.at[k], layout=row)  # noqa: E731
        m = lax.fori_loop(0, n, lambda k, m: jnp.maximum(m, lse_k(k)), jnp.full((BLOCK,), -jnp.inf, jnp.float32))
        m = jnp.where(m == -jnp.inf, 0.0, m)  # nothing visible in any unit: every weight is 0
        tot = lax.fori_loop(0, n, lambda k, s: s + jnp.exp(lse_k(k) - m), jnp.zeros((BLOCK,), jnp.float32))

        def issue(k):
            slot = lax.rem(k, ns)
            for j in range(stack):
                dst = spec.token_rows(tiles.at[slot], j)
                plgpu.copy_gmem_to_smem(op_ref.at[s0 + k, t + j, heads, cols], dst, tile_bar.at[slot])

        for k in range(ns):
            pl.when(k < n)(functools.partial(issue, k))

        def step(k, acc):
            slot = lax.rem(k, ns)
            plgpu.barrier_wait(tile_bar.at[slot])
            x = plgpu.load(tiles.at[slot], layout=plgpu.Layout.WGMMA).astype(jnp.float32)
            plgpu.commit_smem()  # every thread has read the slot before it is refilled

            @pl.when(k + ns < n)
            def _():
                issue(k + ns)

            return acc + x * lax.broadcast_in_dim(jnp.exp(lse_k(k) - m), x.shape, [0])

        acc0 = plgpu.layout_cast(jnp.zeros((BLOCK, cw), jnp.float32), plgpu.Layout.WGMMA)
        acc = lax.fori_loop(0, n, step, acc0)
        inv = jnp.where(tot > 0, 1.0 / jnp.maximum(tot, 1e-30), 0.0)
        out_tile[...] = (acc * lax.broadcast_in_dim(inv, acc.shape, [0])).astype(out_tile.dtype)
        lse_row[...] = jnp.where(tot > 0, m + jnp.log(jnp.maximum(tot, 1e-30)), -jnp.inf)
        plgpu.commit_smem()
        for j in range(stack):
            plgpu.copy_smem_to_gmem(spec.token_rows(out_tile, j), out_ref.at[b, t + j, heads, cols])

        @pl.when(cb == 0)
        def _():
            plgpu.copy_smem_to_gmem(lse_row, lse_ref.at[b, tok, pl.ds(h0, BLOCK)])

        plgpu.wait_smem_to_gmem(0)


def combine(spec, out, lse, o_part, lse_part, first, count, max_units: int):
    """Merges rows with two or more units from their partial slots (o_part [U, T, H, C] bf16, lse_part [U, T', H'];
    row b's are first[b] .. first[b] + count[b] - 1) into out [B, T, H, C] and lse [B, T', H'] in place: the other
    rows keep what the attention kernel wrote. H = spec.io_heads, H' = spec.heads (the lse keeps whole tiles; with
    stacked tokens, spec.stack, one lse row holds every token's and T' = 1). One CTA per (row, query token x head
    tile, 128 columns), or per (row, 128 columns) for all of a row's stacked tokens."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    cw = min(128, spec.c)
    n_ht = spec.heads // BLOCK
    t128 = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    scratch = (
        plgpu.SMEM((max_units, BLOCK), jnp.float32),
        plgpu.SMEM((COMBINE_STAGES, BLOCK, cw), jnp.bfloat16, transforms=t128),
        plgpu.SMEM((BLOCK, cw), jnp.bfloat16, transforms=t128),
        plgpu.SMEM((BLOCK,), jnp.float32),
    )
    bars = (plgpu.Barrier(num_barriers=1), plgpu.Barrier(num_arrivals=spec.stack, num_barriers=COMBINE_STAGES))

    def body(first_ref, count_ref, op_ref, lp_ref, out_ref, lse_ref):
        pl.run_scoped(
            lambda scr, brs: _combine_body(
                spec, max_units, cw, first_ref, count_ref, op_ref, lp_ref, out_ref, lse_ref, scr, brs
            ),
            scratch,
            bars,
        )

    kern = pl.kernel(
        body,
        out_type=(),
        mesh=plgpu.Mesh(grid=(out.shape[0], spec.lse_tokens * n_ht, spec.c // cw), grid_names=("row", "qt", "col")),
        compiler_params=plgpu.CompilerParams(),
        interpret=plgpu.InterpretGPUParams(num_tma_threads_per_device=8) if spec.interpret else False,
        name="mla_combine",  # in profiles: "mla_combine_mosaic_gpu_kernel"
    )

    def run(refs):
        kern(first, count, o_part, lse_part, *refs)

    return pl.run_state(run)((out, lse))
