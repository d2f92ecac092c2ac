"""The request front door (hcfjax.frontdoor) and the text stream with stop strings (hcfjax.detokenize), on the
embedded model's config and tokenizer (no weights)."""

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

import hcfjax
from hcfjax.config import ModelConfig
from hcfjax.detokenize import StopStrings, TextStream, cut_at_stop
from hcfjax.frontdoor import (
    MAX_REQUEST_ID_CHARS,
    MAX_STOP_STRINGS,
    FrontDoor,
    InvalidRequest,
    check_request_id,
    new_request_id,
    sampling_params,
)
from hcfjax.sampling import SamplingParams
from tests.engine_helpers import CountingTokenizer

MAX_LEN = 128


@pytest.fixture(scope="module")
def parts():
    path = Path(hcfjax.DEFAULT_MODEL)
    return ModelConfig.from_json(path), Tokenizer.from_file(str(path / "tokenizer.json"))


@pytest.fixture
def door(parts):
    cfg, tok = parts
    return FrontDoor(cfg, CountingTokenizer(tok), MAX_LEN)


def refused(fn, param, code=None) -> str:
    with pytest.raises(InvalidRequest) as e:
        fn()
    assert (e.value.param, e.value.code) == (param, code), (str(e.value), e.value.param, e.value.code)
    return str(e.value)


def test_a_good_request(door, parts):
    cfg, tok = parts
    c = door.check("def f(x):", max_new_tokens=None, stop="\n\n", seed=3)
    assert c.prompt == [cfg.bos_token_id] + tok.encode("def f(x):").ids
    assert c.max_new_tokens == MAX_LEN - len(c.prompt)  # None: up to the end of the context
    assert (c.stop, c.stop_ids, c.seed) == (("\n\n",), frozenset(cfg.eos_token_ids), 3)
    assert door.check([5, 6], stop_token_ids=[]).stop_ids == frozenset()


def test_context_limits(door):
    assert "the context is 128" in refused(lambda: door.check([5] * MAX_LEN), "prompt", "context_length_exceeded")
    refused(lambda: door.check([5] * 10, max_new_tokens=MAX_LEN - 9), "max_new_tokens", "context_length_exceeded")
    assert len(door.check([5] * 10, max_new_tokens=MAX_LEN - 10).prompt) == 10
    refused(lambda: door.check("x", max_new_tokens=0), "max_new_tokens")
    refused(lambda: door.check("x", max_new_tokens=True), "max_new_tokens")
    refused(lambda: door.check(""), "prompt")
    refused(lambda: door.check([]), "prompt")
    refused(lambda: door.check([1, door.vocab_size]), "prompt")
    refused(lambda: door.check([True, False]), "prompt")


def test_a_text_that_cannot_fit_is_refused_before_tokenizing(door):
    limit = door.max_prompt_chars
    assert limit == (MAX_LEN - 1) * max(len(s) for s in door.tokenizer.get_vocab(with_added_tokens=True))
    message = refused(lambda: door.check("x" * (limit + 1)), "prompt", "context_length_exceeded")
    assert "characters" in message and door.tokenizer.encoded == 0
    # at the bound it is tokenized, and then refused on its tokens
    assert "tokens" in refused(lambda: door.check("x" * limit), "prompt", "context_length_exceeded")
    assert door.tokenizer.encoded == 1


def test_text_must_be_valid_unicode(door):
    assert "UTF-8" in refused(lambda: door.check("\ud800abc"), "prompt")
    refused(lambda: door.check("x", stop=["a\udfff"]), "stop")
    refused(lambda: check_request_id("id-\ud800"), "request_id")
    assert door.tokenizer.encoded == 0


def test_stop_strings_are_bounded(door):
    refused(lambda: door.check("x", stop=[""]), "stop")
    refused(lambda: door.check("x", stop=["s"] * (MAX_STOP_STRINGS + 1)), "stop")
    refused(lambda: door.check("x", stop=["s" * 257]), "stop")
    refused(lambda: door.check("x", stop=[3]), "stop")
    assert door.check("x", stop=["s"] * MAX_STOP_STRINGS).stop == ("s",) * MAX_STOP_STRINGS
    refused(lambda: door.check("x", stop_token_ids=[-3]), "stop_token_ids")
    refused(lambda: door.check("x", stop_token_ids=[1] * 257), "stop_token_ids")


def test_sampling_and_seed_ranges(door):
    refused(lambda: sampling_params(top_k=2**31), "top_k")
    refused(lambda: sampling_params(top_k=-1), "top_k")
    refused(lambda: sampling_params(temperature=1e-9), "temperature")
    refused(lambda: sampling_params(temperature=float("inf")), "temperature")
    refused(lambda: sampling_params(top_p=0.0), "top_p")
    refused(lambda: sampling_params(min_p=1.0), "min_p")
    assert sampling_params(0.7, 40, 0.9, 0.05) == SamplingParams(0.7, 40, 0.9, 0.05)
    # within int32 but beyond the vocabulary: the model's door refuses it
    big = SamplingParams(top_k=2**31 - 1)
    assert "top_k" in refused(lambda: door.check("x", sampling=big), "top_k")
    assert door.check("x", sampling=SamplingParams(top_k=door.vocab_size)).sampling.top_k == door.vocab_size
    for seed in (-1, 2**32, 1.5, True):
        refused(lambda seed=seed: door.check("x", seed=seed), "seed")


def test_request_ids():
    assert check_request_id("r" * MAX_REQUEST_ID_CHARS)
    refused(lambda: check_request_id("r" * (MAX_REQUEST_ID_CHARS + 1)), "request_id")
    refused(lambda: check_request_id(""), "request_id")
    made = {new_request_id() for _ in range(1000)}
    assert len(made) == 1000 and not made & {f"req-{i}" for i in range(1000)}


def test_stop_strings_hold_back_partial_matches():
    s = StopStrings(["</end>", "xyz"])
    assert s.feed("abc</e") == ("abc", False)  # "</e" may start "</end>"
    assert s.feed("nx") == ("</en", False)  # "x" may start "xyz"
    assert s.feed("xy") == ("x", False)
    assert s.feed("z tail") == ("", True)
    s = StopStrings(["</end>"])
    assert s.feed("a</") == ("a", False) and s.flush() == "</"


def test_text_stream_finds_a_stop_string_across_tokens(parts):
    _, tok = parts
    ids = tok.encode("def walk(top):\n    for name in names:\n        yield name").ids
    full = tok.decode(ids)
    stop = "name in"  # spans several tokens
    expected = full[: full.find(stop)]
    # the first prefix of the tokens whose text holds the stop string: the last one completed it
    n = next(i for i in range(1, len(ids) + 1) if stop in tok.decode(ids[:i]))
    tokens, text, hit = cut_at_stop(tok, ids, frozenset(), [stop])
    assert (tokens, text, hit) == (ids[:n], expected, True)
    # streamed: nothing of the stop string is released before the stream ends
    stream, pieces = TextStream(tok, frozenset(), [stop]), []
    for t in ids[:n]:
        pieces.append(stream.add(t))
    assert [p[1] for p in pieces] == [False] * (n - 1) + [True]
    assert "".join(p[0] for p in pieces) == expected
    # without a stop string, all tokens and their whole text; skipped (stop) tokens have none
    assert cut_at_stop(tok, ids + [1], frozenset({1}), ["@@"]) == (ids + [1], full, False)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(data=st.data())
def test_streamed_text_is_the_whole_decode_for_any_tokens(parts, data):
    """Any token sequence (partial UTF-8 characters, special tokens, skipped stop tokens among them): the released
    pieces are always a prefix of the decode of the tokens so far (an unfinished character waits), and with
    finish() they are the tokenizer's decode of all of them."""
    _, tok = parts
    ids = data.draw(st.lists(st.integers(0, tok.get_vocab_size() - 1), min_size=1, max_size=24))
    skip = frozenset(data.draw(st.lists(st.sampled_from(ids), max_size=2)))
    kept, stream, text = [], TextStream(tok, skip), ""
    for t in ids:
        piece, hit = stream.add(t)
        kept += [] if t in skip else [t]
        text += piece
        assert not hit and tok.decode(kept).startswith(text)
    assert text + stream.finish()[0] == tok.decode(kept)


def test_text_stream_holds_back_a_partial_character(parts):
    _, tok = parts
    ids = tok.encode("é€x").ids
    stream = TextStream(tok)
    pieces = [stream.add(t)[0] for t in ids]
    assert "".join(pieces) == "é€x" and all("\ufffd" not in p for p in pieces)
    stream = TextStream(tok, stops=["€"])
    assert "".join(stream.add(t)[0] for t in ids[:-1]) == "é"


def test_a_random_models_tokenizer_gives_every_id_text():
    """random_model's byte-level tokenizer covers the model's whole vocabulary: ids past the 256 bytes are words, so
    a random model's sampled tokens stream text one by one as a real model's do (an unknown id has no text, and the
    stream then decodes a growing window); text still encodes to bytes, as with the bytes alone."""
    from hcfjax.random_model import byte_tokenizer

    tok, small = byte_tokenizer(1000), byte_tokenizer()
    assert tok.get_vocab_size() == 1000 and small.get_vocab_size() == 258
    assert tok.encode("def f(x): return x").ids == small.encode("def f(x): return x").ids
    assert tok.decode([258, 283, 284, 999]) == " a z aa abn"
    stream = TextStream(tok, frozenset([1]))
    ids = list(range(258, 1000, 37)) + [72, 999]
    pieces = [stream.add(t)[0] for t in ids]
    assert all(pieces) and "".join(pieces) == tok.decode(ids)
