"""Property-based fuzzing (hypothesis) of what hcfjax reads before it runs anything: a checkpoint's config.json
(fields of other types or values, fields missing, files that are not a JSON object) and its
model.safetensors.index.json (not JSON, wrong types, a weight_map naming files that are missing or not beside it,
tensors mapped to a file that lacks them, tensors held by two files), each loaded with hcfjax.load from a copy of
the tiny_v3 fixture; and the numeric options of the `hcfjax` commands, parsed only (nothing is loaded or started).
A bad file gives ConfigError or CheckpointError (ValueErrors) whose message names the field or the file, a bad
option argparse's message and exit code 2; never another exception. A config that loads has fields of its types."""

import argparse
import dataclasses
import json
import math
import re
import shutil
import warnings
from pathlib import Path

import jax.numpy as jnp
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hcfjax
from hcfjax import cli
from hcfjax.checkpoint import CheckpointError
from hcfjax.config import ConfigError, ModelConfig

FUZZ = settings(
    max_examples=120, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck), database=None
)
TINY = Path(__file__).parent / "fixtures" / "tiny_v3"
CONFIG = json.loads((TINY / "config.json").read_text())
INDEX = json.loads((TINY / "model.safetensors.index.json").read_text())
SHARDS = sorted({*INDEX["weight_map"].values()})

# JSON values of every type; numbers near the fixture's and far from them
json_scalar = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 600),
    st.sampled_from([2**31, 2**63, 10**30, -(2**63)]),
    st.floats(allow_nan=True, allow_infinity=True),  # json.dumps writes NaN / Infinity, json.loads reads them
    st.text(max_size=8),
)
json_value = st.one_of(
    json_scalar, st.lists(json_scalar, max_size=3), st.dictionaries(st.text(max_size=6), json_scalar, max_size=2)
)
# keys config.json may hold beyond the fixture's
OPTIONAL_KEYS = ["quantization_config", "rope_parameters", "num_mtp_layers", "dtype", "attention_bias", "mlp_bias"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A copy of tiny_v3 (its weights linked) whose config.json and index the tests rewrite."""
    where = tmp_path_factory.mktemp("ckpt")
    for f in TINY.iterdir():
        if f.suffix == ".safetensors":
            (where / f.name).symlink_to(f)
        elif f.suffix == ".json":
            shutil.copy(f, where / f.name)
    hcfjax.load(where, dtype=jnp.float32)  # as copied, it loads
    return where


def load(where):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a config that names MTP layers the checkpoint lacks warns and loads
        return hcfjax.load(where, dtype=jnp.float32)


def check_types(cfg: ModelConfig) -> None:
    """A loaded config's fields have the types its dataclass names (ints are not bools or floats; floats are
    finite), and its sizes are positive where the model needs them to be."""
    for obj in (cfg, cfg.rope, *([cfg.quantization] if cfg.quantization else [])):
        for f in dataclasses.fields(obj):
            v = getattr(obj, f.name)
            kind = str(f.type)
            if kind == "int":
                assert type(v) is int, (f.name, v)
            elif kind == "float":
                assert type(v) is float and math.isfinite(v), (f.name, v)
            elif kind == "bool":
                assert type(v) is bool, (f.name, v)
            elif kind == "str":
                assert type(v) is str, (f.name, v)
    for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "kv_lora_rank"):
        assert getattr(cfg, name) >= 1, name
    assert all(type(t) is int and 0 <= t < cfg.vocab_size for t in cfg.eos_token_ids), cfg.eos_token_ids
    assert cfg.rms_norm_eps > 0 and cfg.rope.theta > 0


@st.composite
def configs(draw):
    """(config.json text, the keys changed): 1-3 fields of the fixture's config (or optional ones) replaced by
    other JSON values or removed, a field of rope_scaling changed, a quantization_config added (hcfjax's or
    DeepSeek's fp8), or a file that is not a JSON object."""
    kind = draw(st.sampled_from(["fields", "fields", "fields", "rope", "quant", "file"]))
    if kind == "file":
        text = draw(st.sampled_from(["", "{", "[1, 2]", "null", "3", '"config"', "{}", "\x00\xff", '{"a": }']))
        return text, {"config.json"}
    d = json.loads(json.dumps(CONFIG))
    if kind == "rope":
        key = draw(st.sampled_from(sorted(d["rope_scaling"]) + ["rope_type"]))
        d["rope_scaling"][key] = draw(json_value)
        return json.dumps(d), {"rope", key}
    if kind == "quant" and draw(st.booleans()):  # DeepSeek's fp8 block, its fields drawn (float weights: named)
        q = {"quant_method": "fp8"}
        for key in draw(st.lists(st.sampled_from(["fmt", "activation_scheme", "weight_block_size", "scale_fmt"]))):
            q[key] = draw(st.one_of(json_value, st.sampled_from(["e4m3", "dynamic", "ue8m0", [128, 128], [64, 128]])))
        d["quantization_config"] = q
        return json.dumps(d), {"quantization_config", *q}
    if kind == "quant":  # an hcfjax quantization_config, its fields drawn (the fixture's weights are float)
        q = {"quant_method": "hcfjax", "scheme": draw(st.sampled_from(["w4a16", "w4a8", "w4a8c8", "w8a8", "w3"]))}
        q["group_size"] = draw(st.one_of(st.integers(1, 130), json_scalar))
        for key in draw(st.lists(st.sampled_from(["experts", "linear", "kv_cache_dtype"]), max_size=2)):
            q[key] = draw(st.one_of(json_scalar, st.sampled_from(["w4a16", "w8a8", "int8"])))
        d["quantization_config"] = q
        return json.dumps(d), {"quantization_config", *q}
    keys = draw(st.lists(st.sampled_from(sorted(CONFIG) + OPTIONAL_KEYS), min_size=1, max_size=3, unique=True))
    for key in keys:
        if draw(st.booleans()):
            d.pop(key, None)
        else:
            d[key] = draw(json_value)
    return json.dumps(d), set(keys)


def test_config_json(checkpoint):
    @FUZZ
    @given(configs())
    def run(case):
        text, changed = case
        (checkpoint / "config.json").write_text(text)
        try:
            model = load(checkpoint)
        except ConfigError as e:
            assert any(k in str(e) for k in changed), (text, str(e))
        except CheckpointError as e:  # a size or count the weights do not have: the key or a tensor named
            assert re.search(r"tensor|'model\.|'lm_head", str(e)) or any(k in str(e) for k in changed), (text, e)
        else:
            check_types(model.cfg)

    try:
        run()
    finally:
        shutil.copy(TINY / "config.json", checkpoint / "config.json")


SHARD_0 = sorted(n for n, f in INDEX["weight_map"].items() if f == SHARDS[0])


@st.composite
def indexes(draw):
    """(index text, what the error must name, or None where the index still describes the checkpoint): the
    fixture's index broken one way."""
    index = json.loads(json.dumps(INDEX))
    wm = index["weight_map"]
    name = draw(st.sampled_from(sorted(wm)))
    kind = draw(st.sampled_from(["text", "shape", "file", "file", "missing", "wrong", "extra", "duplicate", "drop"]))
    if kind == "text":
        text = draw(st.sampled_from(["", "{", "[]", "null", '{"weight_map": }', "\x00"]))
        return text, "model.safetensors.index.json"  # (the index's path)
    if kind == "shape":  # weight_map absent or of another type, or its values not file names
        index["weight_map"] = draw(st.one_of(json_scalar, st.lists(json_scalar, max_size=2), st.just({name: 1})))
        if draw(st.booleans()):
            del index["weight_map"]
        return json.dumps(index), "weight_map"
    if kind == "file":  # a file that is not there, not beside the index, or not safetensors
        wm[name] = draw(
            st.sampled_from(["", ".", "..", "../config.json", "/etc/hostname", "nope.safetensors", "config.json"])
        )
        return json.dumps(index), wm[name] if len(wm[name]) > 2 else "weight_map"
    if kind == "missing":  # a tensor no file holds
        wm[name + ".extra"] = wm[name]
        return json.dumps(index), name + ".extra"
    if kind == "wrong":  # a tensor mapped to the other shard
        wm[name] = next(s for s in SHARDS if s != wm[name])
        return json.dumps(index), name
    if kind == "extra":  # a tensor the name table does not have, in a file of its own
        wm["model.layers.0.mlp.bogus.weight"] = "extra.safetensors"
        return json.dumps(index), "bogus"
    if kind == "duplicate":  # a tensor of the first shard mapped to a copy of that shard: every tensor twice
        wm[draw(st.sampled_from(SHARD_0))] = "copy.safetensors"
        return json.dumps(index), "copy.safetensors"
    del wm[name]  # a tensor the index does not list, held by a shard it lists: loaded, as transformers does
    return json.dumps(index), None


def test_index_json(checkpoint):
    import numpy as np
    from safetensors.numpy import save_file

    save_file({"model.layers.0.mlp.bogus.weight": np.zeros(2, np.float32)}, str(checkpoint / "extra.safetensors"))
    (checkpoint / "copy.safetensors").symlink_to(TINY / SHARDS[0])

    @FUZZ
    @given(indexes())
    def run(case):
        text, named = case
        (checkpoint / "model.safetensors.index.json").write_text(text)
        try:
            load(checkpoint)
        except (ConfigError, CheckpointError) as e:
            assert named is not None and named in str(e), (text, e)
        else:
            assert named is None, f"loaded with a broken index: {text[:300]}"

    try:
        run()
    finally:
        shutil.copy(TINY / "model.safetensors.index.json", checkpoint / "model.safetensors.index.json")
        (checkpoint / "extra.safetensors").unlink()
        (checkpoint / "copy.safetensors").unlink()


# -- the commands' numeric options, parsed only ----------------------------------------------------------------------
REQUIRED = {  # what each command needs besides the option drawn (a later option of the same name wins)
    "generate": ["--prompt", "x"],
    "serve": [],
    "client": ["--port", "1", "--prompt", "x"],
    "quantize": ["--out", "o", "--scheme", "w4a16"],
    "sim": ["--config", "c.yaml"],
}


def numeric_options(command: str) -> dict[str, argparse.Action]:
    """The command's options that take a number: every one whose type is not a plain string."""
    (sub,) = [a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return {a.option_strings[0]: a for a in sub.choices[command]._actions if a.type is not None and a.option_strings}


def built(command: str, args: argparse.Namespace) -> None:
    """What the command makes of its numbers, from options that parsed: each must take them."""
    from hcfjax.frontdoor import check_max_new_tokens, check_seed
    from hcfjax.sampling import SamplingParams
    from hcfjax.serving import client
    from hcfjax.serving.config import engine_config, prefill_config

    positive = lambda v: v is None or (math.isfinite(v) and v > 0)  # noqa: E731
    if command == "generate":
        SamplingParams(args.temperature, args.top_k, args.top_p, args.min_p)
        check_seed(args.seed)
    if command in ("generate", "client"):
        check_max_new_tokens(args.max_new_tokens)
        client.make_request("x", max_new_tokens=args.max_new_tokens)
    if command == "client":  # (its sampling values and seed go to the server as they are: test_fuzz sends them)
        assert 1 <= args.port <= 65535 and positive(args.timeout)
    if command == "serve":
        engine_config(args)
        prefill_config(args)
        assert all(p is None or 0 <= p <= 65535 for p in (args.port, args.http_port, args.metrics_port))
        assert positive(args.request_timeout) and args.grace >= 0 and math.isfinite(args.grace)
        assert args.max_body_bytes >= 1
    if command in ("generate", "serve"):
        assert args.cpu_devices is None or args.cpu_devices >= 1
    if command == "quantize":
        assert args.group_size >= 1
    if command == "sim":
        assert (args.requests is None or args.requests >= 1) and positive(args.rate)
        assert args.attainment is None or 0 < args.attainment <= 1


option_values = st.one_of(
    st.integers(-3, 70000).map(str),
    st.sampled_from([2**31, 2**32, 2**63, -(2**63), 10**30]).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(str),
    st.sampled_from(["", "1e400", "1.5", "0.5", "1e-6", "0x10", "1_0", " 7", "五", "--"]),
)


def test_numeric_options(capsys):
    """Every numeric option of generate, serve, client, quantize and sim, with fuzzed values: the command line
    either parses to values the command's configs take, or ends in argparse's error naming the option (exit 2)."""
    options = {command: numeric_options(command) for command in REQUIRED}
    for command, actions in options.items():  # the defaults are in range
        args = cli.build_parser().parse_args([command, *REQUIRED[command]])
        built(command, args)
        assert actions, command

    @FUZZ
    @given(st.sampled_from(sorted(REQUIRED)).flatmap(
        lambda c: st.tuples(st.just(c), st.dictionaries(st.sampled_from(sorted(options[c])), option_values,
                                                        min_size=1, max_size=3))))  # fmt: skip
    def run(case):
        command, values = case
        argv = [command, *REQUIRED[command], *(f"{k}={v}" for k, v in values.items())]
        try:
            args = cli.build_parser().parse_args(argv)
        except SystemExit as e:
            err = capsys.readouterr().err
            assert e.code == 2 and "error: argument " in err, (argv, e.code, err)
            assert any(f"argument {k}" in err for k in values), (argv, err)
        else:
            built(command, args)

    run()
