"""The padded shapes of an engine step's prefill part, shared by the scheduler (which only plans chunks that fit
one) and the runner (which pads to them and compiles each before serving).

A step's prefill part is `rows` chunks per rank of `tokens` tokens each: rows a power of two up to max_rows,
tokens a power of two from min_bucket (the token budget itself when that is not a power of two). The scheduler
keeps rows x tokens within the token budget, so the padded work of a step is bounded like its real work and the
set of shapes that can occur is small. With speculation prompts are prefilled whole: a prompt longer than the
budget runs alone, as one row of up to the context length.
"""

from __future__ import annotations

import dataclasses

from hcfjax.generate import bucket


def decode_bucket(n: int, minimum: int = 8) -> int:
    """Rows of the decode step that holds n requests (per rank): the smallest power of two or three times a power of
    two that holds them and is a multiple of `minimum` (at least it). Half-octave steps pad less than powers of two
    alone (23 requests run 24 rows, not 32) for one or two more compiled decode steps per octave."""
    two = bucket(n, minimum)
    three = 3 * two // 4
    return three if three >= max(n, minimum) and three % minimum == 0 else two


@dataclasses.dataclass(frozen=True)
class StepShapes:
    token_budget: int
    max_rows: int
    min_bucket: int = 16
    whole_prompts: bool = False  # speculation: a prompt longer than the budget runs whole, alone
    max_len: int = 0  # the longest prompt (with whole_prompts)

    @property
    def cap(self) -> int:
        """Padded prefill tokens per rank in one step."""
        return max(self.token_budget, self.min_bucket)

    def rows(self, n: int) -> int:
        """Rows per rank for n chunks."""
        return min(bucket(n, 1), self.max_rows)

    def tokens(self, n: int) -> int:
        """Tokens per row for a longest chunk of n tokens."""
        t = bucket(n, self.min_bucket)
        return t if t <= self.cap or self.whole_prompts else self.cap

    def room(self, chunks: int, longest: int) -> int:
        """The longest chunk that may join a step that already has `chunks` chunks whose longest has `longest`
        tokens (0: none may join)."""
        r = self.rows(chunks + 1)
        if r * self.tokens(max(longest, 1)) > self.cap:
            return 0
        widths = [t for t in self._widths() if r * t <= self.cap]
        return max(widths) if widths else 0

    def _widths(self) -> list[int]:
        top = self.cap
        return [t for t in (self.min_bucket << i for i in range(top.bit_length())) if t < top] + [top]

    def all(self) -> list[tuple[int, int]]:
        """Every (rows, tokens) a step can pad to."""
        out = {(r, t) for r in self._row_counts() for t in self._widths() if r * t <= self.cap}
        if self.whole_prompts:
            longest = bucket(max(self.max_len, 1), self.min_bucket)
            out |= {(1, t) for t in (self.min_bucket << i for i in range(longest.bit_length())) if t <= longest}
        return sorted(out)

    def maximal(self) -> list[tuple[int, int]]:
        """The shapes of `all` that no other one holds (as many rows or more and as many tokens or more): every
        prefill part fits one of them, padded."""
        shapes = self.all()
        return [s for s in shapes if not any(o != s and o[0] >= s[0] and o[1] >= s[1] for o in shapes)]

    def _row_counts(self) -> list[int]:
        return sorted({self.rows(n) for n in range(1, self.max_rows + 1)})
