"""Generated tokens -> text, token by token, with stop strings: the engine streams a request's text through a
TextStream, and hcfjax.generate cuts its finished rows with cut_at_stop, which runs the same stream.

Incremental detokenisation (tokenizers' DecodeStream, one Rust call a token) decodes only from where the streamed
text last ended on a whole character, and holds back a partial UTF-8 character. Stop strings: text that could be
the start of one is held back until the next token shows it is not; when one appears, the stream ends there, its
text cut just before it, and the token that completed it is the last one the request generated (so usage counts
exactly the tokens up to it).
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers.decoders import DecodeStream


class StopStrings:
    """Finds stop strings in streamed text. feed(delta) returns the text that may be sent now and whether a stop
    string was found (the text then ends just before it); text that could be the start of a stop string is held
    back until the next delta shows it is not, or until flush() at the end."""

    def __init__(self, stops: Sequence[str]):
        self.stops = tuple(stops)
        self.pending = ""

    def feed(self, delta: str) -> tuple[str, bool]:
        if not self.stops:
            return delta, False
        text = self.pending + delta
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.pending = ""
            return text[: min(hits)], True
        keep = 0  # the longest tail of text that is a proper prefix of a stop string
        for s in self.stops:
            for n in range(min(len(s) - 1, len(text)), keep, -1):
                if text.endswith(s[:n]):
                    keep = n
                    break
        self.pending = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep], False

    def flush(self) -> str:
        text, self.pending = self.pending, ""
        return text


class TextStream:
    """One request's output text. add(token) -> (the text it releases, whether it completed a stop string);
    finish() -> (the text held back until the end, whether that completed a stop string). Tokens in skip_ids (the
    stop tokens) have no text. tokenizer: a `tokenizers.Tokenizer`; special tokens have no text (its decode's
    default)."""

    def __init__(self, tokenizer, skip_ids=frozenset(), stops: Sequence[str] = ()):
        self.tokenizer, self.skip_ids = tokenizer, skip_ids
        self.ids: list[int] = []  # the output's tokens that have text
        self.decoder = DecodeStream(skip_special_tokens=True)
        self.prefix_offset = 0  # tokens before the window the streamed text is decoded from
        self.read_offset = 0  # tokens whose text has been released
        self.stops = StopStrings(stops)

    def add(self, token: int) -> tuple[str, bool]:
        if token in self.skip_ids:
            return "", False
        self.ids.append(token)
        text = self.decoder.step(self.tokenizer, token)
        if text is None:  # no new text yet, or a partial UTF-8 character: wait for the rest
            return self.stops.feed("")
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return self.stops.feed(text)

    def finish(self) -> tuple[str, bool]:
        """The text of the tokens not yet released (a partial character as U+FFFD), decoded in the window the
        stream would have used."""
        decode = self.tokenizer.decode
        sent = decode(self.ids[self.prefix_offset : self.read_offset])
        full = decode(self.ids[self.prefix_offset :])
        text, hit = self.stops.feed(full[len(sent) :] if len(self.ids) > self.read_offset else "")
        return (text, True) if hit else (text + self.stops.flush(), False)


def cut_at_stop(tokenizer, tokens: Sequence[int], skip_ids, stops: Sequence[str]) -> tuple[list[int], str, bool]:
    """A finished row's (tokens up to and including the one that completed the first stop string, its text cut just
    before that string, whether one was found); without one, all tokens and their whole text."""
    stream, pieces = TextStream(tokenizer, skip_ids, stops), []
    for i, t in enumerate(tokens):
        text, hit = stream.add(t)
        pieces.append(text)
        if hit:
            return list(tokens[: i + 1]), "".join(pieces), True
    text, hit = stream.finish()
    return list(tokens), "".join(pieces) + text, hit
