"""generate(): ragged batches, stop tokens, sampling filters, bad input, and the CLI."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hcfjax
from hcfjax import cli
from hcfjax.frontdoor import InvalidRequest
from hcfjax.random_model import preset_config, random_model
from hcfjax.sampling import SamplingBatch, SamplingParams, filtered_logprobs, sample
from tests.engine_helpers import stop_across_tokens


def test_ragged_batch_equals_each_prompt_alone(v3_model):
    prompts = [[5, 9, 2, 33, 7], [8] * 13, [100, 3]]
    together = hcfjax.generate(v3_model, prompts, max_new_tokens=6, stop_token_ids=[])
    assert together.stats["rows"] == 8  # padded with mock rows (generate.padded_rows), which change nothing
    for p, toks in zip(prompts, together.tokens, strict=False):
        alone = hcfjax.generate(v3_model, [p], max_new_tokens=6, stop_token_ids=[])
        assert alone.tokens[0] == toks
    # prefill in groups of one row (16 padded tokens each) changes nothing
    assert (
        hcfjax.generate(v3_model, prompts, max_new_tokens=6, stop_token_ids=[], max_prefill_tokens=16).tokens
        == together.tokens
    )
    ref = np.asarray(hcfjax.forward(v3_model, [prompts[1] + together.tokens[1][:-1]]))
    assert list(np.argmax(ref[0, len(prompts[1]) - 1 :], -1)) == together.tokens[1]


def test_limits_and_lengths_within_their_buckets_share_the_compiled_steps(v3_model):
    """The decode program depends on max_new_tokens and the prompts' lengths only through their buckets (and the
    cache's size in pages): after one run, other limits and lengths in the same buckets compile nothing, and each
    stops where its own limit says (a longer limit's tokens start with the shorter's)."""
    from tests.engine_helpers import xla_compiles

    long = hcfjax.generate(v3_model, [[5, 9, 2]], max_new_tokens=14, stop_token_ids=[])
    with xla_compiles() as compiles:
        short = hcfjax.generate(v3_model, [[5, 9, 2]], max_new_tokens=6, stop_token_ids=[])
        other = hcfjax.generate(v3_model, [[8] * 13], max_new_tokens=9, stop_token_ids=[])
    assert compiles == []
    assert len(short.tokens[0]) == 6 and short.tokens[0] == long.tokens[0][:6]
    assert len(other.tokens[0]) == 9


def test_stop_tokens_end_a_row(v3_model):
    # 6 tokens: the shapes of test_ragged_batch_equals_each_prompt_alone's single prompts (compiled there)
    free = hcfjax.generate(v3_model, [[5, 9, 2]], max_new_tokens=6, stop_token_ids=[])
    stop = free.tokens[0][3]
    out = hcfjax.generate(v3_model, [[5, 9, 2]], max_new_tokens=6, stop_token_ids=[stop])
    first = free.tokens[0].index(stop)
    assert out.tokens[0] == free.tokens[0][: first + 1]
    assert out.stats["new_tokens"] == first + 1
    # a row that stops while another decodes on: each row as it decodes alone
    other = [8] * 13
    alone = hcfjax.generate(v3_model, [other], max_new_tokens=6, stop_token_ids=[stop]).tokens[0]
    both = hcfjax.generate(v3_model, [[5, 9, 2], other], max_new_tokens=6, stop_token_ids=[stop])
    assert both.tokens == [out.tokens[0], alone] and len(alone) > first + 1, (both.tokens, alone)


@pytest.mark.parametrize(
    "bad,match",
    [
        ([[]], "prompt 0: the prompt is empty"),
        ([[1, 2], [1, 2, 10_000]], "prompt 1: token id 10000 is outside"),
        ([[-1]], "token id -1 is outside"),
        ([[1] * 600], "prompt 0: the prompt has 600 tokens; the context is 512"),
        ([[1] * 500], r"prompt 0: the prompt \(500 tokens\) \+ max_new_tokens \(20\) exceed the context of 512"),
        ([[True, False]], "integers"),
        ("text", "no tokenizer"),
        ([], "non-empty"),
    ],
)
def test_bad_prompts_raise_clear_errors(v3_model, bad, match):
    with pytest.raises(InvalidRequest, match=match):
        hcfjax.generate(v3_model, bad, max_new_tokens=20)


def test_bad_generation_arguments(v3_model):
    for kwargs, param in [
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(sampling=[SamplingParams(), SamplingParams()]), "sampling"),
        (dict(sampling=SamplingParams(top_k=2**31 - 1)), "top_k"),  # beyond the vocabulary
        (dict(seed=2**32), "seed"),
        (dict(stop_token_ids=[v3_model.cfg.vocab_size]), "stop_token_ids"),
        (dict(stop=["x"]), "stop"),  # stop strings need a tokenizer
    ]:
        with pytest.raises(InvalidRequest) as e:
            hcfjax.generate(v3_model, [[1, 2]], **kwargs)
        assert e.value.param == param, (kwargs, str(e.value))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(temperature=-1.0), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_k=-2), "top_k"),
        (dict(top_k=1.5), "top_k"),
        (dict(top_k=2**31), "top_k"),  # beyond the batch's int32
        (dict(temperature=1e-9), "temperature"),  # logits / temperature would overflow float32
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(min_p=1.0), "min_p"),
    ],
)
def test_invalid_sampling_values(kwargs, match):
    with pytest.raises(ValueError, match=match) as e:
        SamplingParams(**kwargs)
    assert e.value.param == match


# The sampling functions as the steps run them: one compiled program per shape, not one per operation.
jitted_filtered_logprobs = jax.jit(filtered_logprobs, static_argnames="branch_free")
jitted_sample = jax.jit(sample, static_argnames="branch_free")


def test_sampling_filters_on_a_known_distribution():
    probs = np.array([[0.5, 0.2, 0.15, 0.1, 0.05]] * 4, np.float32)
    sp = SamplingBatch.of(
        [
            SamplingParams(1.0, top_k=2),
            SamplingParams(1.0, top_p=0.8),
            SamplingParams(1.0, min_p=0.25),
            SamplingParams(1.0),
        ]
    )
    kept = np.isfinite(np.asarray(jitted_filtered_logprobs(jnp.asarray(np.log(probs)), sp)))
    assert kept.tolist() == [[1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]


def test_filters_that_are_off_keep_every_token():
    """top_p = 1 is off: a top token at p = 1 - 1e-8 (1.0 in f32) made the running sum reach 1 before the tail, and
    'mass below top_p' dropped the tail's tokens. With no filter on in the batch the sort is skipped (lax.cond), and
    a row with none on keeps every token beside a row that filters."""
    logits = jnp.array([[20.0] + [0.0] * 9, [20.0] + [0.0] * 9])
    temp_only = SamplingBatch.of([SamplingParams(1.0), SamplingParams(1.0, top_p=1.0)])
    lp = np.asarray(jitted_filtered_logprobs(logits, temp_only))
    np.testing.assert_array_equal(lp, np.asarray(jax.nn.log_softmax(logits, axis=-1)))
    mixed = SamplingBatch.of([SamplingParams(1.0, top_k=1), SamplingParams(1.0)])
    kept = np.isfinite(np.asarray(jitted_filtered_logprobs(logits, mixed)))
    assert kept.sum(1).tolist() == [1, 10]


def test_sampling_frequencies_follow_the_filtered_distribution():
    logits = jnp.asarray(np.log(np.array([[0.5, 0.3, 0.2]], np.float32)))
    sp = SamplingBatch.of([SamplingParams(temperature=1.0, top_k=2)])
    draw = jax.jit(jax.vmap(lambda k: sample(logits, sp, k)))
    draws = np.asarray(draw(jax.random.split(jax.random.key(0), 4000)))[:, 0]
    freq = np.bincount(draws, minlength=3) / 4000
    assert freq[2] == 0 and abs(freq[0] - 0.625) < 0.03  # renormalised 0.5 / 0.8
    greedy = SamplingBatch.of([SamplingParams()])
    assert int(jitted_sample(logits, greedy, jax.random.key(1))[0]) == 0


def test_seeded_sampling_is_reproducible(v3_model):
    sp = SamplingParams(temperature=1.0, top_p=0.9)
    a = hcfjax.generate(v3_model, [[3, 4, 5]], max_new_tokens=6, sampling=sp, seed=7, stop_token_ids=[])
    b = hcfjax.generate(v3_model, [[3, 4, 5]], max_new_tokens=6, sampling=sp, seed=7, stop_token_ids=[])
    assert a.tokens == b.tokens
    # and the seed is what decides them: another one draws other tokens (six draws at temperature 1)
    c = hcfjax.generate(v3_model, [[3, 4, 5]], max_new_tokens=6, sampling=sp, seed=8, stop_token_ids=[])
    assert c.tokens != a.tokens


@pytest.fixture(scope="module")
def random_ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / "tiny"
    hcfjax.save(random_model(preset_config("tiny-v3", num_hidden_layers=2), seed=3), path)
    return path


def test_cli_generates_text(random_ckpt, capsys):
    assert (
        cli.main(
            [
                "generate",
                "--model",
                str(random_ckpt),
                "--prompt",
                "def f(x):",
                "--max-new-tokens",
                "5",
                "--dtype",
                "float32",
            ]
        )
        == 0
    )
    assert capsys.readouterr().out.startswith("def f(x):")


def test_string_prompts_use_the_tokenizer(random_ckpt):
    m = hcfjax.load(random_ckpt, dtype=jnp.float32)
    # 5 tokens, as test_cli_generates_text: the one-prompt call runs the programs that test compiled
    out = hcfjax.generate(m, ["hello", "import os"], max_new_tokens=5, stop_token_ids=[])
    ids = m.tokenizer.encode("hello").ids
    assert out.text[0] == m.tokenizer.decode(out.tokens[0])
    assert (
        out.tokens[0] == hcfjax.generate(m, [[m.cfg.bos_token_id] + ids], max_new_tokens=5, stop_token_ids=[]).tokens[0]
    )


def test_stop_strings_cut_each_row():
    """Each row's tokens end with the one that completed its first stop string (across a token boundary), its
    text just before the string; a row without one is whole. The cut is the engine's (the same text stream)."""
    m = hcfjax.load(dtype=jnp.float32)  # the embedded model: real text, multi-character tokens
    prompts = ["def fibonacci(n):", "import os"]
    free = hcfjax.generate(m, prompts, max_new_tokens=12, stop_token_ids=[])
    stop, n, expected = stop_across_tokens(m.tokenizer, free.tokens[0])
    out = hcfjax.generate(m, prompts, max_new_tokens=12, stop_token_ids=[], stop=[stop, "@@never@@"])
    assert (out.tokens[0], out.text[0]) == (free.tokens[0][:n], expected)
    if stop not in free.text[1]:
        assert (out.tokens[1], out.text[1]) == (free.tokens[1], free.text[1])
    assert out.stats["new_tokens"] == free.stats["new_tokens"]  # what the device generated


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--model", "/no/such/dir", "--prompt", "x"], "does not exist"),
        (["--model", "{tmp}", "--prompt", "x"], "not a checkpoint directory"),
        (["--model", "{tmp}/bad", "--prompt", "x"], "not valid JSON"),  # a clean error, not a traceback
        (["--prompt", "x", "--temperature", "-1", "--model", "{ckpt}"], "temperature"),
        (["--prompt", "", "--model", "{ckpt}"], "empty"),
        (["--prompt", "x", "--bogus"], "hcfjax generate: error: unrecognized arguments: --bogus"),  # its own usage
    ],
)
def test_cli_bad_arguments(random_ckpt, tmp_path, capsys, argv, message):
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text("{")
    argv = [a.replace("{ckpt}", str(random_ckpt)).replace("{tmp}", str(tmp_path)) for a in argv]
    try:
        code = cli.main(["generate", *argv])
    except SystemExit as e:  # argparse's error: an option's value out of its range
        code = e.code
    assert code == 2
    assert message in capsys.readouterr().err


def test_cli_stats_time_a_compiled_run(random_ckpt, capsys, monkeypatch):
    """--stats reports the second of two identical generate calls (the first compiles) and the first's time apart:
    compile time is not counted as prefill or decode time."""
    calls = []
    real = hcfjax.generate

    def spy(*args, **kwargs):
        calls.append(real(*args, **kwargs))
        return calls[-1]

    monkeypatch.setattr(hcfjax, "generate", spy)
    argv = ["generate", "--model", str(random_ckpt), "--prompt", "def f(x):", "--max-new-tokens", "3", "--stats"]
    assert cli.main([*argv, "--dtype", "float32"]) == 0
    err = capsys.readouterr().err
    stats = json.loads(err[err.index("{") :])
    assert len(calls) == 2 and calls[0].tokens == calls[1].tokens
    assert stats == {**calls[1].stats, "warmup_s": stats["warmup_s"]} and stats["warmup_s"] > 0


def test_a_new_batch_shape_compiles_its_steps_and_cache_only(v3_model):
    """A batch of a new shape compiles its prefill and decode programs and its cache's zeros; its inputs go to the
    device as they are (jnp.asarray of a host array, or an eager slice of a device one, would compile a program
    for each new shape: on a GPU tens of milliseconds each)."""
    from tests.engine_helpers import xla_compiles

    jax.clear_caches()  # (the file's other tests ran these shapes; last in the file, so none recompiles)
    hcfjax.generate(v3_model, [[5, 9, 2]], max_new_tokens=4)
    with xla_compiles() as compiles:
        hcfjax.generate(v3_model, [[5, 9, 2, 7] * 5, [3], [4, 4]], max_new_tokens=20)
    assert sorted(set(compiles)) == ["jit(broadcast_in_dim)", "jit(decode_steps)", "jit(step)"], compiles
    assert compiles.count("jit(step)") == compiles.count("jit(decode_steps)") == 1, compiles
