"""Which decode (DP) rank a new request goes to.

round_robin: the next rank in turn that has room; fewest_requests: the rank running the fewest requests;
least_pages: the rank with the most free cache pages (KV-cache aware: long requests spread out).
"""

from __future__ import annotations

import dataclasses

POLICIES = ("round_robin", "fewest_requests", "least_pages")


@dataclasses.dataclass
class RankLoad:
    rank: int
    requests: int  # requests holding a slot (prefilling or decoding)
    free_slots: int
    free_pages: int  # free pages not already promised to running requests


class Balancer:
    def __init__(self, policy: str, num_ranks: int):
        if policy not in POLICIES:
            raise ValueError(f"balance policy must be one of {POLICIES}, got {policy!r}")
        self.policy, self.num_ranks = policy, num_ranks
        self._next = 0

    def choose(self, loads: list[RankLoad], pages_needed: int) -> int | None:
        """The rank for a request needing `pages_needed` pages, or None when no rank has a slot and the pages."""
        fits = [r for r in loads if r.free_slots > 0 and r.free_pages >= pages_needed]
        if not fits:
            return None
        if self.policy == "round_robin":
            order = {(self._next + i) % self.num_ranks: i for i in range(self.num_ranks)}
            best = min(fits, key=lambda r: order[r.rank])
            self._next = (best.rank + 1) % self.num_ranks
            return best.rank
        if self.policy == "fewest_requests":
            return min(fits, key=lambda r: (r.requests, -r.free_pages, r.rank)).rank
        return min(fits, key=lambda r: (-r.free_pages, r.requests, r.rank)).rank
