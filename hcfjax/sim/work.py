"""What the device computes for a scheduler's StepPlan, as one Work per DP rank (cost.py prices it).

Two views of the same plan:
- `actual_works`: a production stack (CUDA graphs over exact batch sizes, FlashMLA-style kernels) computes the rows
  the plan holds, each attending over its own cached length; under attention DP an idle rank runs one mock row.
- `EngineShapes.works`: hcfjax's runner (hcfjax/engine/runner.py) computes fixed shapes: N decode rows on every
  rank in every decode step (N the runner's `decode_bucket` of the rank's decoding requests), each row
  attending over the whole page table (max_pages x page_size positions, the XLA reference gathers them all), and
  prefill rows and chunk lengths bucketed to powers of two.
- `PrefillShapes.works`: hcfjax's PD prefill worker (hcfjax/pd/prefill.py) computes whole prompts layer by layer
  in fixed batch shapes: rows and lengths bucketed to powers of two, each chunk of a layer attending over the
  batch's whole page table (its width bucketed too).
"""

from __future__ import annotations

import dataclasses

from hcfjax.engine.scheduler import StepPlan
from hcfjax.engine.shapes import StepShapes, decode_bucket
from hcfjax.generate import bucket
from hcfjax.sim.cost import Work


def _chunk_work(start: int, n: int, final: bool, spec_k: int) -> Work:
    pairs = n * start + n * (n + 1) // 2  # causal: query i sees start + i + 1 keys
    w = Work(tokens=n, pre_tokens=n, logits=int(final), pre_pairs=pairs, pre_kv=start, pre_expand=start + n)
    if spec_k:  # the MTP modules run over the whole prompt (their caches need every anchor)
        w.mtp_tokens, w.mtp_pairs, w.mtp_kv = n, pairs, start
    return w


def actual_works(plan: StepPlan, dp: int, spec_k: int = 0, chunks: bool = True) -> list[Work]:
    """Per-rank work of `plan` as a production stack computes it; chunks=False leaves the prefill chunks out (a PD
    decode instance, whose admissions are prefilled elsewhere)."""
    q = spec_k + 1
    rows, keys = [0] * dp, [0] * dp  # per rank: decode rows, and the positions they read
    for req in plan.decode:
        rows[req.rank] += 1
        keys[req.rank] += req.cached_bound  # positions written once this step's tokens are in
    works = [Work(tokens=q * n, logits=q * n, dec_pairs=q * k, dec_kv=k) for n, k in zip(rows, keys, strict=True)]
    if spec_k:  # each draft pass: one token per row over its cache
        for w, n, k in zip(works, rows, keys, strict=True):
            w.mtp_tokens, w.mtp_pairs, w.mtp_kv = n, k, k
    if chunks:
        for c in plan.chunks:
            works[max(c.req.rank, 0)] += _chunk_work(c.start, c.n, c.final, spec_k)
    if dp > 1 and any(w.tokens for w in works):
        for w in works:
            if not w.tokens:  # attention DP: an idle rank runs a mock decode row so the MoE collectives line up
                w += Work(tokens=1, logits=1, dec_pairs=1, dec_kv=1)
    return works


@dataclasses.dataclass(frozen=True)
class EngineShapes:
    """The fixed shapes hcfjax's ModelRunner compiles: `ranks` device ranks (1 without a decode plan: every DP rank
    on one device), `slots` decode slots in all, of which a step decodes N rows per rank (the runner's
    `decode_bucket` from min_decode_rows, up to the slots per rank), `keys` positions each row gathers (max_pages x
    page_size)."""

    ranks: int
    slots: int
    keys: int
    max_rows: int
    token_budget: int
    min_bucket: int
    spec_k: int = 0
    min_decode_rows: int = 8

    @property
    def step_shapes(self) -> StepShapes:
        """The prefill shapes the runner pads to (and the engine's scheduler plans within)."""
        return StepShapes(self.token_budget, self.max_rows, self.min_bucket, bool(self.spec_k), self.keys)

    def works(self, plan: StepPlan) -> list[Work]:
        b = t = 0
        if plan.chunks:
            per_rank = [0] * self.ranks
            for c in plan.chunks:
                per_rank[c.req.rank if self.ranks > 1 else 0] += 1
            b = self.step_shapes.rows(max(per_rank))
            t = self.step_shapes.tokens(max(c.n for c in plan.chunks))
        return self.shape_works(b, t, self.decode_rows(plan))

    def decode_rows(self, plan: StepPlan) -> int:
        """Decode rows per rank of the plan's step (0: none): the runner's N for the most requests a rank decodes."""
        if not plan.decode:
            return 0
        per_rank = [0] * self.ranks
        for r in plan.decode:
            per_rank[r.rank if self.ranks > 1 else 0] += 1
        return min(decode_bucket(max(per_rank), self.min_decode_rows), self.slots // self.ranks)

    def shape_works(self, b: int, t: int, decode_rows: int) -> list[Work]:
        """The work of one compiled step shape: b prefill rows per rank of t tokens, and decode_rows decode rows per
        rank (0: no decode part)."""
        works = [Work() for _ in range(self.ranks)]
        k, s = self.spec_k, decode_rows
        for w in works:
            if s:
                q = k + 1
                w += Work(tokens=s * q, logits=s * q, dec_pairs=s * q * self.keys, dec_kv=s * self.keys)
                if k:  # MTP extend over 2k + 1 anchors per depth, then k - 1 one-token chain steps, spread over k
                    per_pass = s * (k * (2 * k + 1) + k - 1) // k
                    w += Work(mtp_tokens=per_pass, mtp_pairs=per_pass * self.keys, mtp_kv=s * self.keys)
            if b:
                w += Work(
                    tokens=b * t,
                    pre_tokens=b * t,
                    logits=b,
                    pre_pairs=b * t * self.keys,
                    pre_kv=b * self.keys,
                    pre_expand=b * self.keys,
                )
                if k:
                    w += Work(mtp_tokens=b * t, mtp_pairs=b * t * self.keys, mtp_kv=b * self.keys)
        return works


@dataclasses.dataclass(frozen=True)
class PrefillShapes:
    """The batch shapes hcfjax's PD prefill worker compiles (PrefillWorker._shape): `page_size` of its scratch
    cache, prompts run in chunks of at most `chunk` tokens, chunk lengths padded to powers of two from
    `min_bucket`."""

    page_size: int
    chunk: int
    min_bucket: int
    spec_k: int = 0

    def shape(self, rows: int, longest: int) -> tuple[int, int, int, int]:
        """(rows, chunk, padded length, page-table width) of a batch of `rows` prompts, the longest `longest`."""
        tc = min(bucket(longest, self.min_bucket), self.chunk)
        t = -(-longest // tc) * tc
        return bucket(rows, 1), tc, t, bucket(-(-t // self.page_size), 1)

    def works(self, plan: StepPlan) -> list[Work]:
        return self.shape_works(*self.shape(len(plan.chunks), max(c.n for c in plan.chunks)))

    def shape_works(self, b: int, tc: int, t: int, m: int) -> list[Work]:
        keys = m * self.page_size
        reads = b * keys * (t // tc)  # every chunk of every layer gathers and expands the whole page table
        w = Work(tokens=b * t, pre_tokens=b * t, logits=b, pre_pairs=b * t * keys, pre_kv=reads, pre_expand=reads)
        if self.spec_k:  # the MTP modules over the whole prompt, in one pass each
            w += Work(mtp_tokens=b * t, mtp_pairs=b * t * keys, mtp_kv=b * keys)
        return [w]
