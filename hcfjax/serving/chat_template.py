"""Chat templates: messages -> one prompt string, rendered with Jinja like transformers' apply_chat_template.

The template is the checkpoint's (tokenizer_config.json's `chat_template`), or a file given to `hcfjax serve
--chat-template`, or else DEFAULT_TEMPLATE, which renders

    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]

as "<|system|>\\nBe brief.\\n<|user|>\\nHi\\n<|assistant|>\\n" (the <|role|> markers are plain text, not special
tokens). The engine adds the BOS token when the rendered prompt does not start with it.
"""

from __future__ import annotations

import json
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

DEFAULT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


class TemplateError(ValueError):
    """The messages do not fit the template (raised by the template itself, or a rendering error)."""


def _raise(message):
    raise TemplateError(message)


def _token_text(tok) -> str:
    """tokenizer_config.json spells special tokens as a string or as {"content": ...}."""
    if isinstance(tok, dict):
        return tok.get("content", "")
    return tok or ""


class ChatTemplate:
    def __init__(self, source: str = DEFAULT_TEMPLATE, bos_token: str = "", eos_token: str = ""):
        # the environment transformers uses: sandboxed, trim_blocks / lstrip_blocks, a raise_exception helper
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
        env.globals["raise_exception"] = _raise
        self.source = source
        try:
            self.template = env.from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise TemplateError(f"the chat template does not parse: {e}") from None
        self.bos_token, self.eos_token = bos_token, eos_token

    @classmethod
    def for_checkpoint(cls, path: str | Path | None, override: str | Path | None = None) -> ChatTemplate:
        """The template of `override` (a Jinja file) if given, else the checkpoint's, else DEFAULT_TEMPLATE."""
        conf = {}
        if path is not None and (Path(path) / "tokenizer_config.json").is_file():
            conf = json.loads((Path(path) / "tokenizer_config.json").read_text())
        source = conf.get("chat_template")
        if isinstance(source, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
            named = {t.get("name"): t.get("template") for t in source}
            source = named.get("default") or next(iter(named.values()), None)
        if override is not None:
            source = Path(override).read_text()
        bos, eos = _token_text(conf.get("bos_token")), _token_text(conf.get("eos_token"))
        return cls(source or DEFAULT_TEMPLATE, bos, eos)

    @property
    def is_default(self) -> bool:
        return self.source == DEFAULT_TEMPLATE

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """messages: [{"role": ..., "content": str}, ...] -> the prompt. Raises TemplateError."""
        try:
            return self.template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except TemplateError:
            raise
        except jinja2.TemplateError as e:
            raise TemplateError(f"the chat template failed on these messages: {e}") from None
