"""The flash-decoding work list of the MLA decode kernel (pure jnp; mla_decode.py builds it, mla_kernel.py runs it,
mla_merge.py merges the rows it splits).

A plan is what the kernel needs besides the tensors: the visible keys per query and a list of work units (row, block
range, where the output goes), built on the device from the lengths in three small reductions (no cumsum scan, no
sort: each of those is its own kernel launch, and at batch 1 the launches were most of the call). It depends only on
the lengths, positions and static shapes, so a model can build it once per decode step and pass it to every layer
(`mla_decode(..., plan=...)`), as FlashInfer's plan()/run() split does.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

BLOCK = 64  # query heads per CTA (the wgmma M dimension)
BLOCK_KV = 64  # cache tokens per pipeline step

# Where a unit's output goes (work row 3): a slot >= 0 of the partial buffer, or one of these.
DIRECT = -1  # the row's only unit: straight to the output
PADDING = -2  # not a unit: the CTA does nothing


def visible_keys(lengths: jax.Array, t: int, positions: jax.Array | None = None) -> jax.Array:
    """[B, T] number of cache positions each query sees: query t of row b sits at lengths[b]-T+t (or at
    positions[b, t] when given, for ragged chunks) and sees keys at positions <= its own and < lengths[b]."""
    own = lengths[:, None] - t + jnp.arange(t)[None, :] if positions is None else positions
    return jnp.minimum(own + 1, lengths[:, None]).astype(jnp.int32)


def split_schedule(vis, max_blocks: int, q_tiles: int, num_sms: int = 132, min_blocks: int = 4, blocks_per_split=None):
    """The flash-decoding work list from the actual lengths.

    vis [B, T] visible keys per query. Row b reads nb = ceil(max_t vis / 64) blocks, cut into units of bps blocks:
    nb // bps full units and, when bps does not divide nb, one shorter tail (a row with nothing to read gets one empty
    unit, which writes zeros). bps = max(min_blocks, ceil(sum(nb) / target)) with target = num_sms // q_tiles units, so
    the CTAs (q_tiles per unit) come to about one wave of the chip whatever the spread of lengths. Since
    sum(count) <= sum(nb) / bps + B <= target + B, that is the grid's static size (or B * ceil(max_blocks / bps) when
    smaller, or when `blocks_per_split` fixes bps).

    -> (work [4, U] int32 in grid order: row, first block, blocks, slot (-1 for padding units);
        first [B] slot of each row's first unit, count [B] units per row, max_units: a static bound on count).
    Slots are row-major (row b owns slots first[b] .. first[b] + count[b] - 1). Grid order: every full unit, then the
    tails, then padding, so the short units fill the chip's last gaps (the longest-first order of list scheduling,
    without a sort: the tails are not ordered among themselves).

    Three reductions, each one fusion: sum(nb); the [B, B] prefix sums; a [U, B] selection of each unit's row.
    """
    (row, k, n_blk, slot, _), first, count, max_units, bps = _units(
        vis, max_blocks, q_tiles, num_sms, min_blocks, blocks_per_split
    )
    return jnp.stack([row, k * bps, n_blk, slot]), first, count, max_units


def _units(vis, max_blocks, q_tiles, num_sms, min_blocks, blocks_per_split):
    """split_schedule's unit columns (row, index within the row, blocks, slot, whether it is the row's only unit) and
    bps."""
    b = vis.shape[0]
    nb = jnp.clip(lax.div(jnp.max(vis, axis=1) + (BLOCK_KV - 1), BLOCK_KV), 0, max_blocks).astype(jnp.int32)
    target = max(1, num_sms // q_tiles)
    if blocks_per_split is None:
        min_blocks = max(1, min(min_blocks, max_blocks))
        bps = jnp.maximum(min_blocks, lax.div(jnp.sum(nb) + (target - 1), target))
        max_units = max(1, min(target, -(-max_blocks // min_blocks)))
        units = min(target + b, b * max_units)
    else:
        bps = jnp.int32(max(1, blocks_per_split))
        max_units = max(1, -(-max_blocks // max(1, blocks_per_split)))
        units = b * max_units
    full = lax.div(nb, bps)  # [B] full units
    tail = nb - full * bps  # [B] blocks of the shorter last unit
    has_tail = ((tail > 0) | (nb == 0)).astype(jnp.int32)
    count = full + has_tail
    rows = jnp.arange(b, dtype=jnp.int32)
    # Inclusive prefix sums over rows as one masked [B, B] reduction.
    upto = (rows[None, :] <= rows[:, None]).astype(jnp.int32)  # [B(b), B(c)]: c <= b
    inc = jnp.sum(upto[:, :, None] * jnp.stack([full, has_tail, count], -1)[None], axis=1)  # [B, 3]
    inc_full, inc_tail, inc_count = inc[:, 0], inc[:, 1], inc[:, 2]
    first = inc_count - count
    n_full = inc_full[-1]
    # Unit u is full unit u - (inc_full[c] - full[c]) of the row c with inc_full[c] - full[c] <= u < inc_full[c], or
    # the tail of the row c whose tail is the (u - n_full)-th in row order; one [U, B] selection covers both.
    u = jnp.arange(units, dtype=jnp.int32)[:, None]
    sel_full = ((inc_full - full)[None, :] <= u) & (u < inc_full[None, :])  # [U, B]
    sel_tail = (has_tail[None, :] == 1) & (inc_tail[None, :] == u - n_full + 1)
    one, zero, single = jnp.ones_like(rows), jnp.zeros_like(rows), (count == 1).astype(jnp.int32)
    on_full = jnp.stack([one, rows, first, inc_full - full, zero, single], -1)
    on_tail = jnp.stack([one, rows, first, -full, tail, single], -1)
    g = jnp.sum(sel_full[..., None] * on_full[None] + sel_tail[..., None] * on_tail[None], axis=1)  # [U, 6]
    active, row, row_first, base, tail_blocks, alone = (g[:, i] for i in range(6))
    is_full = jnp.sum(sel_full, axis=1)
    k = is_full * (u[:, 0] - base) - (1 - is_full) * base  # the unit's index within its row
    n_blk = is_full * bps + tail_blocks
    slot = jnp.where(active > 0, row_first + k, -1)
    i32 = jnp.int32
    cols = (row.astype(i32), k.astype(i32), n_blk.astype(i32), slot.astype(i32), alone > 0)
    return cols, first.astype(i32), count.astype(i32), max_units, bps


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MlaPlan:
    """What the kernel needs besides the tensors (build with `mla_decode.mla_plan`).

    vis [B, T] visible keys per query; work [4, U] the units in grid order (row, first block, blocks, destination:
    a partial slot, DIRECT or PADDING); first, count [B] each row's partial slots (dense mode: slots
    b * max_units + k instead, k < count[b]).
    mode: 'direct' (no row can have two units: every unit writes the output), 'dense' (every unit writes a partial
    slot; mla_merge.combine_dense merges them in XLA: few rows), 'sparse' (single-unit rows write the output, the
    others partial slots, merged by mla_merge.combine, which skips the single-unit rows).
    """

    vis: jax.Array
    work: jax.Array
    first: jax.Array
    count: jax.Array
    max_units: int = dataclasses.field(metadata=dict(static=True))
    mode: str = dataclasses.field(metadata=dict(static=True))

    @property
    def units(self) -> int:
        return self.work.shape[1]

    @property
    def slots(self) -> int:
        """Rows of the partial output."""
        return {"direct": 0, "dense": self.vis.shape[0] * self.max_units, "sparse": self.units}[self.mode]


def make_plan(vis, max_blocks: int, q_tiles: int, num_sms: int, min_blocks: int, blocks_per_split=None) -> MlaPlan:
    (row, k, n_blk, slot, single), first, count, max_units, bps = _units(
        vis, max_blocks, q_tiles, num_sms, min_blocks, blocks_per_split
    )
    b, units = vis.shape[0], row.shape[0]
    if max_units == 1:
        mode = "direct"
    elif b * max_units <= 2 * units:
        mode = "dense"  # the dense merge reads B x max_units slots, about the real number
    else:
        mode = "sparse"
    if mode == "direct":
        dest = jnp.where(slot >= 0, DIRECT, PADDING)
    elif mode == "dense":
        dest = jnp.where(slot >= 0, row * max_units + k, PADDING)  # slots [B, max_units]: the merge reads them as is
    else:
        dest = jnp.where(slot >= 0, jnp.where(single, DIRECT, slot), PADDING)
    work = jnp.stack([row, k * bps, n_blk, dest.astype(jnp.int32)])
    return MlaPlan(vis=vis, work=work, first=first, count=count, max_units=max_units, mode=mode)
