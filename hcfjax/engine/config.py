"""The engine's configuration (EngineConfig) and the errors its submit raises besides InvalidRequest."""

from __future__ import annotations

import dataclasses

from hcfjax.options import DEFAULT, Options
from hcfjax.quantize import CACHE_DTYPES
from hcfjax.speculative import SpeculativeConfig

DEFAULT_MAX_MODEL_LEN = 4096  # the context a request may ask for when none is given (at most the model's)


def context_length(model_context: int, requested: int | None) -> int:
    """The context of an engine's requests: `requested`, or DEFAULT_MAX_MODEL_LEN, at most the model's."""
    return min(model_context, requested or DEFAULT_MAX_MODEL_LEN)


def lookahead_tokens(k: int) -> int:
    """Cache positions past a request's context that a step may write, with k draft tokens (0: no speculation): k + 1
    target positions and the drafts' k past them, one step beyond the host's view."""
    return 2 * (2 * k + 1)


class QueueFull(RuntimeError):
    pass


class EngineStopped(RuntimeError):
    pass


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """max_slots: decode slots per DP rank; dp: decode ranks (each with its own slots and pages); num_pages: pages per
    rank (default: room for every slot at max_model_len / 2, or what the device's memory holds where that is less:
    `hcfjax.engine.memory`; an int8 cache array whose entries would take 2-4 GiB grows past 4 GiB where decode steps
    write their latents on the cache-write kernel and the memory holds it; an explicit one smaller than a request at
    max_model_len bounds the context a request may ask for, `Engine.max_model_len`); token_budget: tokens per step
    (decode rows plus prefill chunks); mixed_token_budget: tokens in a step that also decodes (at most token_budget,
    the default; a smaller one bounds the decoding requests' time per token, at some prefill throughput); max_queue:
    waiting requests beyond this are refused (QueueFull); spf_window_s / max_wait_s: the shortest-prompt-first
    window and the starvation bound; balance: round_robin | fewest_requests | least_pages; cache_dtype: auto (the
    checkpoint scheme's: int8 for w4a8c8, else the model's dtype), float (the model's dtype) or int8;
    min_prefill_bucket: the smallest prefill chunk shape (chunks are padded to powers of two from here: larger means
    fewer compiled shapes, more padding); min_decode_rows: the fewest rows a decode step runs per rank (a step packs
    its decoding requests into N rows, N a power of two or three times one from here that holds them
    (`shapes.decode_bucket`), or max_slots: one compiled decode step per N).

    Live EPLB (under a decode plan; without one the experts are not split over ranks and it is skipped):
    eplb_interval: re-place the experts every this many steps, for the expert loads routed in the last
    eplb_window steps (0: off, and no load counting); eplb_redundant: extra physical expert slots per MoE layer
    (E + eplb_redundant must divide over the dp ranks), given to the hottest experts as replicas; eplb_nodes: the
    nodes the dp ranks span (it must divide dp; node i holds ranks i * dp / nodes ..): when it also divides the
    model's n_group, the placement is hierarchical as in DeepSeek's EPLB (expert groups packed onto nodes, every
    replica of an expert on its group's node, so routed tokens cross nodes no more than without EPLB), else
    global. options: how the model runs (hcfjax.options.Options). executable_cache: a directory where compiled
    steps are kept, so a restart loads them (hcfjax.engine.executables; None: compile every start)."""

    max_slots: int = 8
    dp: int = 1
    num_pages: int | None = None
    page_size: int = 16
    max_model_len: int | None = None
    token_budget: int = 256
    mixed_token_budget: int | None = None
    max_prefill_rows: int = 4
    max_queue: int = 256
    spf_window_s: float = 0.05
    max_wait_s: float = 2.0
    balance: str = "round_robin"
    speculative: SpeculativeConfig | None = None
    cache_dtype: str = "auto"
    min_prefill_bucket: int = 16
    min_decode_rows: int = 8
    eplb_interval: int = 0
    eplb_redundant: int = 0
    eplb_window: int = 100
    eplb_nodes: int = 1
    options: Options = DEFAULT  # how the model runs: kernel or reference per op, the kernels' variants
    executable_cache: str | None = None

    def __post_init__(self):
        sizes = ("max_slots", "dp", "page_size", "token_budget", "max_prefill_rows", "max_queue", "min_prefill_bucket")
        sizes += ("min_decode_rows",)
        derived = ("num_pages", "max_model_len")  # None: from the slots, from the model's context
        for name in sizes + derived:
            value = getattr(self, name)
            if not (isinstance(value, int) and value >= 1) and not (value is None and name in derived):
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        for name in ("eplb_interval", "eplb_redundant"):
            if not (isinstance(getattr(self, name), int) and getattr(self, name) >= 0):
                raise ValueError(f"{name} must be an integer >= 0, got {getattr(self, name)!r}")
        if not (isinstance(self.eplb_window, int) and self.eplb_window >= 1):
            raise ValueError(f"eplb_window must be an integer >= 1, got {self.eplb_window!r}")
        if not (isinstance(self.eplb_nodes, int) and self.eplb_nodes >= 1 and self.dp % self.eplb_nodes == 0):
            raise ValueError(f"eplb_nodes must be an integer >= 1 dividing dp={self.dp}, got {self.eplb_nodes!r}")
        m = self.mixed_token_budget
        if m is not None and not (isinstance(m, int) and m >= 1):
            raise ValueError(f"mixed_token_budget must be an integer >= 1, got {m!r}")
        if self.cache_dtype not in CACHE_DTYPES:
            raise ValueError(f"cache_dtype must be one of {CACHE_DTYPES}, got {self.cache_dtype!r}")
        if self.speculative is not None and self.speculative.forced_acceptance is not None:
            raise ValueError("forced_acceptance is for benchmarks only; a serving engine verifies drafts for real")
