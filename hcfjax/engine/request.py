"""A request's lifecycle and the events it streams back to its caller."""

from __future__ import annotations

import dataclasses
import enum
import queue
from collections.abc import Iterator

from hcfjax.detokenize import TextStream
from hcfjax.sampling import SamplingParams


class Status(enum.Enum):
    QUEUED = "queued"
    PREFILLING = "prefilling"
    TRANSFERRING = "transferring"  # admitted on a PD decode worker, its cache being prefilled and sent elsewhere
    DECODING = "decoding"
    FINISHED = "finished"
    ABORTED = "aborted"


class FinishReason(enum.Enum):
    STOP = "stop"  # a stop token or stop string was generated (the token that completed it is the last output)
    LENGTH = "length"  # max_new_tokens reached
    ABORT = "abort"  # cancelled by the caller, deadline passed, or the engine shut down
    ERROR = "error"  # the engine failed while running the request


@dataclasses.dataclass
class Usage:
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft_s: float | None = None  # arrival -> first token
    draft_tokens: int = 0  # speculative drafts verified
    accepted_draft_tokens: int = 0  # of which accepted


@dataclasses.dataclass
class Output:
    """One streamed event: new tokens (and their text) since the last event; `finish` is set on the last one."""

    request_id: str
    token_ids: list[int]
    text: str
    finish: FinishReason | None
    usage: Usage
    error: str | None = None


def next_output(events, timeout: float | None = None) -> Output:
    """The next Output on a request's event queue, merged with every one already queued behind it (its last
    included): a reader that falls behind the engine sends one message for the tokens it missed instead of one a
    token, so a front end streaming hundreds of requests keeps up with the steps (vLLM merges outputs not yet
    delivered the same way). Raises queue.Empty when nothing came within `timeout`."""
    out = events.get(timeout=timeout)
    while out.finish is None:
        try:
            nxt = events.get_nowait()
        except queue.Empty:
            break
        out = Output(
            out.request_id, out.token_ids + nxt.token_ids, out.text + nxt.text, nxt.finish, nxt.usage, nxt.error
        )
    return out


def stream_events(events, timeout: float | None = None) -> Iterator[Output]:
    """A request's Output events (`next_output`'s merges) until the one with `finish` set."""
    while True:
        out = next_output(events, timeout)
        yield out
        if out.finish is not None:
            return


@dataclasses.dataclass(eq=False)
class Request:
    id: str
    prompt: list[int]
    sampling: SamplingParams
    max_new_tokens: int
    stop_ids: frozenset[int]
    seed: int
    arrival: float
    status: Status = Status.QUEUED
    output: list[int] = dataclasses.field(default_factory=list)
    # Tokens to prefill: the prompt, or prompt + output after a preemption (recompute).
    fill: list[int] = dataclasses.field(default_factory=list)
    computed: int = 0  # tokens of `fill` already in the cache
    rank: int = -1  # decode (DP) rank
    slot: int = -1  # decode slot (global index over ranks)
    pages: list[int] = dataclasses.field(default_factory=list)
    epoch: int = 0  # bumped by each preemption: outputs of steps dispatched before it are dropped
    cached_bound: int = 0  # upper bound of positions the dispatched steps will have written
    first_token_time: float | None = None
    last_token_time: float | None = None
    finish: FinishReason | None = None
    drafts: int = 0
    accepted: int = 0
    text: TextStream | None = None  # the output's text and stop strings (None: no tokenizer, no text)
    # (SimpleQueue: no task accounting, a fraction of Queue's lock-and-condition cost per put, once a step a request)
    events: queue.SimpleQueue = dataclasses.field(default_factory=queue.SimpleQueue)

    def __post_init__(self):
        if not self.fill:
            self.fill = list(self.prompt)

    @property
    def done(self) -> bool:
        return self.status in (Status.FINISHED, Status.ABORTED)

    @property
    def length(self) -> int:
        """Tokens in the sequence so far (prompt + output)."""
        return len(self.prompt) + len(self.output)

    def usage(self) -> Usage:
        ttft = None if self.first_token_time is None else self.first_token_time - self.arrival
        return Usage(len(self.prompt), len(self.output), ttft, self.drafts, self.accepted)
