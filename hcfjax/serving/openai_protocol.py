"""The OpenAI API's request bodies and the checks that belong to the API, the error object, usage and server-sent
events, for hcfjax/serving/http.py. The checks of what a request asks of the model (prompt, context, sampling ranges,
seed, stop strings) are the front door's (hcfjax.frontdoor), run by the engine.

Only what the engine can do is accepted: n = 1, no logprobs, no penalties or logit bias, no tools; those are
refused rather than ignored. Parameters the OpenAI API does not have are ignored (clients send many).
"""

from __future__ import annotations

import json
import math
from typing import Any

from pydantic import BaseModel, ConfigDict


class APIError(Exception):
    """An error answer in OpenAI's shape: {"error": {"message", "type", "param", "code"}} with an HTTP status."""

    def __init__(self, status: int, message: str, type: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True)

    include_usage: bool = False


class _Common(BaseModel):
    """Parameters of both endpoints. The last group are extensions (as vLLM names them)."""

    model_config = ConfigDict(extra="allow", strict=True)  # no coercion: max_tokens "5" or true is refused

    model: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    # not supported: accepted only at their neutral values
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    logprobs: Any = None
    # extensions
    top_k: int = 0
    min_p: float = 0.0
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False

    def check_params(self) -> None:
        """The API's own checks (the front door checks the rest); raises APIError (400) naming the parameter."""
        if self.n != 1:
            raise bad_request(f"n must be 1 (one choice per request), got {self.n}", "n")
        if unsupported := self.unsupported():
            raise bad_request(f"{unsupported[0]} is not supported by this server", unsupported[0])
        if not (math.isfinite(self.temperature) and 0 <= self.temperature <= 2):
            raise bad_request(f"temperature must be in [0, 2], got {self.temperature}", "temperature")

    def unsupported(self) -> list[str]:
        """Names of parameters set to something the engine cannot do."""
        bad = [name for name in ("frequency_penalty", "presence_penalty") if getattr(self, name)]
        bad += [name for name in ("logit_bias", "logprobs") if getattr(self, name) not in (None, False, {}, 0)]
        return bad


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # the OpenAI default for completions
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def unsupported(self) -> list[str]:
        bad = super().unsupported()
        return bad + [
            n for n, v in (("echo", self.echo), ("best_of", (self.best_of or 1) > 1), ("suffix", self.suffix)) if v
        ]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    role: str
    content: str | list[dict] | None = None


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None  # the newer name of max_tokens
    tools: list[dict] | None = None
    response_format: dict | None = None
    top_logprobs: int | None = None

    def unsupported(self) -> list[str]:
        bad = super().unsupported()
        if self.tools:
            bad.append("tools")
        if self.response_format and self.response_format.get("type", "text") != "text":
            bad.append("response_format")
        return bad + (["top_logprobs"] if self.top_logprobs else [])


def message_text(m: ChatMessage, i: int) -> str:
    """A message's content as text: a string, or the concatenated text of its {"type": "text"} parts."""
    if m.content is None:
        return ""
    if isinstance(m.content, str):
        return m.content
    parts = []
    for part in m.content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise bad_request(f"messages[{i}]: only text content parts are supported", "messages")
        parts.append(part["text"])
    return "".join(parts)


def usage_json(u) -> dict:
    """OpenAI's usage from the engine's Usage, plus `speculative`: the request's verified and accepted MTP draft
    tokens (0 without speculative decoding)."""
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.output_tokens,
        "total_tokens": u.prompt_tokens + u.output_tokens,
        "speculative": {"draft_tokens": u.draft_tokens, "accepted_draft_tokens": u.accepted_draft_tokens},
    }


def sse(obj) -> str:
    """One server-sent event."""
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
