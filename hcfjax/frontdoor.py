"""The request front door: every check a request passes before any work is done for it, in one place for
hcfjax.generate, the engine (and through it the gRPC and HTTP servers) and the PD router.

    door = FrontDoor(model.cfg, model.tokenizer, max_model_len=4096)
    checked = door.check("def fib(n):", max_new_tokens=64, stop=["\\n\\n"], seed=1)   # or raises InvalidRequest

The checks, cheapest first: types and ranges of the sampling parameters (within what the batched step's int32 and
float32 arrays hold), the seed, stop token ids and stop strings (a bounded count and length), then the prompt: a
text must be valid UTF-8 (no lone surrogates) and short enough that it could fit the context, measured in
characters before it is tokenized (each token covers at most `longest token` characters, so a text longer than
(max_model_len - 1) x that cannot fit); then the token ids against the vocabulary and the context.

An InvalidRequest names the offending parameter (in the engine's spelling: prompt, max_new_tokens, stop,
stop_token_ids, seed, temperature, top_k, top_p, min_p, request_id) and, for a prompt or output beyond the context,
the code context_length_exceeded; the servers map them to an HTTP 400 error object or INVALID_ARGUMENT.
"""

from __future__ import annotations

import dataclasses
import functools
import uuid
from collections.abc import Sequence

from hcfjax.config import ModelConfig
from hcfjax.sampling import SamplingParams

MAX_STOP_STRINGS = 16  # OpenAI allows 4 (16 for newer models)
MAX_STOP_CHARS = 256  # per stop string
MAX_STOP_TOKEN_IDS = 256
MAX_REQUEST_ID_CHARS = 256
SEEDS = 2**32  # seeds are uint32
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"


class InvalidRequest(ValueError):
    """A request refused for what it asks: `param` names the offending parameter, `code` says why when a client
    can act on it (context_length_exceeded)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code


def new_request_id(prefix: str = "req") -> str:
    """A server-made request id: random (a uuid), so it never collides with an id a client chose."""
    return f"{prefix}-{uuid.uuid4().hex}"


def check_request_id(request_id) -> str:
    if not isinstance(request_id, str) or not request_id:
        raise InvalidRequest(f"request_id must be a non-empty string, got {request_id!r:.40}", "request_id")
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        raise InvalidRequest(
            f"request_id has {len(request_id)} characters; at most {MAX_REQUEST_ID_CHARS} are allowed", "request_id"
        )
    check_text(request_id, "request_id")
    return request_id


def check_text(text: str, param: str) -> None:
    """Refuses a str that is not valid Unicode text (a lone surrogate such as "\\ud800", which JSON can carry)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidRequest(f"{param} is not valid UTF-8 text ({e.reason} at character {e.start})", param) from None


def check_stop(stop) -> tuple[str, ...]:
    """Stop strings: None, a string or a list of them -> a tuple of at most MAX_STOP_STRINGS non-empty strings of at
    most MAX_STOP_CHARS characters each."""
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, Sequence):
        raise InvalidRequest("stop must be a string or a list of strings", "stop")
    if len(stops) > MAX_STOP_STRINGS:
        raise InvalidRequest(f"{len(stops)} stop strings; at most {MAX_STOP_STRINGS} are allowed", "stop")
    for s in stops:
        if not isinstance(s, str):
            raise InvalidRequest("stop must be a string or a list of strings", "stop")
        if not s:
            raise InvalidRequest("stop strings must not be empty", "stop")
        if len(s) > MAX_STOP_CHARS:
            raise InvalidRequest(f"a stop string has {len(s)} characters; at most {MAX_STOP_CHARS}", "stop")
        check_text(s, "stop")
    return tuple(stops)


def check_seed(seed) -> int:
    if not (_is_int(seed) and 0 <= seed < SEEDS):
        raise InvalidRequest(f"seed must be an integer in [0, 2^32), got {seed!r:.40}", "seed")
    return int(seed)


def check_max_new_tokens(n) -> None:
    """An integer >= 1, or None (up to the end of the context; FrontDoor.fit bounds it by the context)."""
    if n is not None and not (_is_int(n) and n >= 1):
        raise InvalidRequest(f"max_new_tokens must be an integer >= 1, got {n!r:.40}", "max_new_tokens")


def sampling_params(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, vocab_size: int | None = None) -> SamplingParams:
    """SamplingParams from loose values (a request body's), refusing bad ones with InvalidRequest naming the field;
    with vocab_size, top_k may be at most the vocabulary."""
    try:
        sp = SamplingParams(temperature, top_k, top_p, min_p)
    except ValueError as e:
        raise InvalidRequest(str(e), getattr(e, "param", None)) from None
    return check_sampling(sp, vocab_size)


def check_sampling(sp, vocab_size: int | None = None) -> SamplingParams:
    if not isinstance(sp, SamplingParams):
        raise InvalidRequest(f"sampling must be a SamplingParams, got {type(sp).__name__}", "sampling")
    if vocab_size is not None and sp.top_k > vocab_size:
        raise InvalidRequest(f"top_k must be in [0, {vocab_size}] (0 = off), got {sp.top_k}", "top_k")
    return sp


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def longest_token_chars(tokenizer) -> int:
    """The most characters of text one token can stand for: its vocabulary string's length (a byte-level BPE
    spells each byte as one character, and a character of text is at least one byte)."""
    return max(len(s) for s in tokenizer.get_vocab(with_added_tokens=True))


@dataclasses.dataclass(frozen=True)
class Checked:
    """A request that passed the door, ready to run."""

    prompt: list[int]
    sampling: SamplingParams
    max_new_tokens: int
    stop_ids: frozenset[int]  # tokens that end it (the eos tokens unless the caller gave its own)
    stop: tuple[str, ...]  # stop strings
    seed: int


class FrontDoor:
    """One model's request checks and prompt encoding; max_model_len: the context (prompt + output) a request must
    fit in."""

    def __init__(self, cfg: ModelConfig, tokenizer, max_model_len: int):
        self.cfg, self.tokenizer, self.max_model_len = cfg, tokenizer, max_model_len
        self.vocab_size = cfg.vocab_size

    @functools.cached_property
    def max_prompt_chars(self) -> int:
        """A text longer than this cannot fit the context: it is refused without being tokenized."""
        return (self.max_model_len - 1) * longest_token_chars(self.tokenizer)

    def encode(self, text: str, param: str = "prompt") -> list[int]:
        """A text prompt's token ids, with the checkpoint's bos token in front (unless the tokenizer put it there);
        a text that cannot fit the context is refused before it is tokenized."""
        if self.tokenizer is None:
            raise InvalidRequest("this model has no tokenizer: send token ids", param)
        if not isinstance(text, str):
            raise InvalidRequest(f"{param} must be a string, got {type(text).__name__}", param)
        if len(text) > self.max_prompt_chars:
            raise InvalidRequest(
                f"the {param} has {len(text)} characters, more than the context of {self.max_model_len} tokens can "
                f"hold (at most {self.max_prompt_chars} characters)",
                param,
                CONTEXT_LENGTH_EXCEEDED,
            )
        check_text(text, param)
        ids = encode_text(self.tokenizer, text)
        bos = self.cfg.bos_token_id
        return ids if bos is None or (ids and ids[0] == bos) else [bos] + ids

    def prompt_ids(self, prompt, param: str = "prompt") -> list[int]:
        """A text or token-id prompt -> its token ids, checked against the vocabulary and the context."""
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequest(f"the {param} is empty", param)
            ids = self.encode(prompt, param)
        else:
            if hasattr(prompt, "__len__") and len(prompt) > self.max_model_len - 1:  # before looking at each id
                self._too_long(len(prompt), param)
            ids = self.token_ids(prompt, param, "token id")
            if not ids:
                raise InvalidRequest(f"the {param} is empty", param)
        if len(ids) > self.max_model_len - 1:
            self._too_long(len(ids), param)
        return ids

    def _too_long(self, n: int, param: str):
        raise InvalidRequest(f"the {param} has {n} tokens; the context is {self.max_model_len}", param,
                             CONTEXT_LENGTH_EXCEEDED)  # fmt: skip

    def token_ids(self, ids, param: str, what: str, limit: int | None = None) -> list[int]:
        """A sequence of integers (numpy ones too), each in the vocabulary."""
        if isinstance(ids, str | bytes) or not hasattr(ids, "__len__"):
            raise InvalidRequest(f"{param} must be a list of token ids", param)
        if limit is not None and len(ids) > limit:
            raise InvalidRequest(f"{param} has {len(ids)} entries; at most {limit} are allowed", param)
        out = []
        for t in ids:
            if isinstance(t, bool) or not hasattr(t, "__index__"):
                raise InvalidRequest(f"{param} must hold integers, got {t!r:.40}", param)
            t = int(t)
            if not 0 <= t < self.vocab_size:
                raise InvalidRequest(f"{what} {t} is outside the vocabulary [0, {self.vocab_size})", param)
            out.append(t)
        return out

    def stop_ids(self, stop_token_ids: Sequence[int] | None) -> frozenset[int]:
        """The tokens that end a request: None: the checkpoint's eos tokens; []: none."""
        if stop_token_ids is None:
            return frozenset(self.cfg.eos_token_ids)
        return frozenset(self.token_ids(stop_token_ids, "stop_token_ids", "stop token id", MAX_STOP_TOKEN_IDS))

    def stop_strings(self, stop) -> tuple[str, ...]:
        stops = check_stop(stop)
        if stops and self.tokenizer is None:
            raise InvalidRequest("stop strings need a tokenizer, and this model has none", "stop")
        return stops

    def fit(self, ids: list[int], max_new_tokens: int | None) -> int:
        """max_new_tokens for a prompt of these ids, checked against the context (None: up to its end)."""
        room = self.max_model_len - len(ids)
        if max_new_tokens is None:
            return room
        if max_new_tokens > room:
            raise InvalidRequest(
                f"the prompt ({len(ids)} tokens) + max_new_tokens ({max_new_tokens}) exceed the context of "
                f"{self.max_model_len}",
                "max_new_tokens",
                CONTEXT_LENGTH_EXCEEDED,
            )
        return max_new_tokens

    def check(
        self,
        prompt,
        *,
        sampling: SamplingParams | None = None,
        max_new_tokens: int | None = 64,
        stop_token_ids: Sequence[int] | None = None,
        stop: str | Sequence[str] | None = None,
        seed: int = 0,
    ) -> Checked:
        """Every check of one request; max_new_tokens None: up to the end of the context; stop_token_ids None: the
        checkpoint's eos tokens ([]: none)."""
        sp = check_sampling(SamplingParams() if sampling is None else sampling, self.vocab_size)
        seed = check_seed(seed)
        stop_ids, stops = self.stop_ids(stop_token_ids), self.stop_strings(stop)
        check_max_new_tokens(max_new_tokens)
        ids = self.prompt_ids(prompt)
        return Checked(ids, sp, self.fit(ids, max_new_tokens), stop_ids, stops, seed)


def encode_text(tokenizer, text: str) -> list[int]:
    """The token ids of one text through tokenizers' batch call, which lets go of the GIL while it runs: its
    one-text `encode` holds it, and a long prompt stopped every other thread of a server (its streams, its health
    answers) for as long as it took. The fast variant skips the character offsets, which nothing reads."""
    batch = getattr(tokenizer, "encode_batch_fast", None) or tokenizer.encode_batch
    return batch([text])[0].ids


class Submitting:
    """submit() for every engine surface: the Engine, and the stand-ins for one that front ends hold (over a pipe to
    the engine's process, over gRPC to a router). It runs the front door's checks (self.door) and hands the checked
    request to self.add(request_id, checked), which queues it and returns the request."""

    def submit(
        self,
        prompt: str | list[int],
        *,
        sampling: SamplingParams | None = None,
        max_new_tokens: int | None = 64,
        stop_token_ids: list[int] | None = None,
        stop: str | list[str] | None = None,
        seed: int = 0,
        request_id: str | None = None,
    ):
        """Queues a request (never waits for its tokens). max_new_tokens None: up to the end of the context;
        stop_token_ids None: the checkpoint's eos tokens; stop: strings that end the request (its text cut just
        before the first). Raises InvalidRequest (the checks), QueueFull or EngineStopped."""
        rid = new_request_id() if request_id is None else check_request_id(request_id)
        checked = self.door.check(prompt, sampling=sampling, max_new_tokens=max_new_tokens,
                                  stop_token_ids=stop_token_ids, stop=stop, seed=seed)  # fmt: skip
        return self.add(rid, checked)
