"""Quantised serving of a random model (`hcfjax serve --preset NAME --scheme S`) and the serving benchmark's load
runs (`python -m hcfjax.bench.serve --sweep ... --search`), on tiny-v3 with w4a8c8 weights. Both use one engine shape
(slots, pages, token budget, chunk bucket, context), so the second test reuses the first one's compiled steps."""

import dataclasses
import io
import json
import math
import os
import re
import signal
import sys
import threading
import urllib.request

import jax
import jax.numpy as jnp
import pytest

import hcfjax.engine
from hcfjax import cli
from hcfjax.config import QuantConfig
from hcfjax.quant import QWeight

SHAPE = ["--page-size", "16", "--token-budget", "16", "--max-model-len", "128"]  # one chunk bucket: 16
SERVE = ["serve", "--preset", "tiny-v3", "--scheme", "w4a8c8", "--max-slots", "2", "--max-prefill-rows", "1", *SHAPE]


def http_json(url: str, body: dict | None = None) -> dict:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


class Lines(io.StringIO):
    """stdout for a server run in this process (pytest's capsys closes its stream at the test's end, while logging
    handlers that the HTTP server set up still hold it)."""

    def lines(self) -> list[str]:
        return self.getvalue().splitlines()


def test_serve_preset_runs_quantised_and_says_random(monkeypatch):
    """The command itself, in this process: it announces the random model, answers a completion over HTTP, lists a
    random model, and its engine holds int4 experts, int8 dense linears and an int8 latent cache; SIGINT ends it."""
    out = Lines()
    monkeypatch.setattr(sys, "stdout", out)
    made, weights = [], []

    class Recorded(hcfjax.engine.Engine):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)
            weights.append(kwargs.get("weights"))

    monkeypatch.setattr(hcfjax.engine, "Engine", Recorded)
    answers, failure, returned = {}, [], threading.Event()

    def client():
        while not any("HTTP on" in line for line in out.lines()):
            if returned.wait(0.05):
                return  # the command ended without listening: its return code tells
        try:  # listening: the command's SIGINT handler is in place
            url = re.search(r"(http://\S+/v1)", next(line for line in out.lines() if "HTTP on" in line)).group(1)
            answers["models"] = http_json(f"{url}/models")
            body = {"prompt": "def f(x):", "max_tokens": 3, "ignore_eos": True}
            answers["usage"] = http_json(f"{url}/completions", body)["usage"]
        except Exception as e:  # noqa: BLE001 - reported by the test's thread
            failure.append(e)
        finally:
            os.kill(os.getpid(), signal.SIGINT)  # the server's handler ends it

    thread = threading.Thread(target=client, daemon=True)
    thread.start()
    try:
        code = cli.main([*SERVE, "--http-port", "0", "--no-warmup", "--grace", "0.5"])
    finally:
        returned.set()
        thread.join()
    assert code == 0
    assert not failure, failure
    said = [line for line in out.lines() if line.startswith("hcfjax serve")]
    assert said and all(line.startswith("hcfjax serve [random tiny-v3 weights, w4a8c8]:") for line in said)
    assert any("w4a8c8 weights, int8 KV cache" in line for line in said)
    assert [m["id"] for m in answers["models"]["data"]] == ["random-tiny-v3-w4a8c8"]
    assert answers["usage"]["completion_tokens"] == 3

    (engine,) = made
    # the random weights were made while the engine was built over their shapes, and are in place
    assert weights[0] is not None and weights[0].done()
    assert all(isinstance(x, jax.Array) for x in jax.tree.leaves((engine.model.params, engine.runner.params)))
    cache = engine.runner.state.cache
    assert cache.kv.dtype == jnp.int8 and cache.scale is not None
    segments = engine.runner.params["segments"]
    experts = [seg["mlp"]["experts"] for seg in segments if "experts" in seg["mlp"]]
    assert experts and all(
        isinstance(w, QWeight) and (w.bits, w.act) == (4, "int8") for e in experts for w in e.values()
    )
    dense = [seg["mlp"]["gate"] for seg in segments if "gate" in seg["mlp"]]
    assert dense and all(isinstance(w, QWeight) and (w.bits, w.act) == (8, "int8") for w in dense)


def test_kv_cache_flag_overrides_the_scheme():
    from hcfjax.quantize import cache_dtype_for
    from hcfjax.serving.config import engine_config, engine_flags, load_model

    parse = lambda *extra: cli.build_parser().parse_args([*SERVE, "--port", "0", *extra])
    model = load_model(None, "tiny-v3", "w4a8c8")
    for flag, dtype in (("auto", jnp.int8), ("bf16", jnp.bfloat16), ("int8", jnp.int8)):
        config = engine_config(parse("--kv-cache", flag))
        assert cache_dtype_for(model, config.cache_dtype) == dtype
        assert engine_config(parse(*engine_flags(config))) == config  # the flags a PD worker gets
    mixed = engine_config(parse("--token-budget", "64", "--mixed-token-budget", "32"))
    assert mixed.mixed_token_budget == 32 and engine_config(parse(*engine_flags(mixed))) == mixed
    w4a8 = dataclasses.replace(model.cfg, quantization=QuantConfig.for_scheme("w4a8"))
    assert cache_dtype_for(dataclasses.replace(model, cfg=w4a8), "auto") == jnp.bfloat16  # no int8 cache in w4a8
    with pytest.raises(ValueError, match="not both"):
        load_model("some/dir", "tiny-v3")


def test_bench_serve_sweep_search_and_efficiency(tmp_path):
    from hcfjax.bench import serve as bench

    out, md = tmp_path / "serve.json", tmp_path / "serve.md"
    bench.main(
        ["--preset", "tiny-v3", "--scheme", "w4a8c8", "--max-slots", "2", "--prefill-rows", "1", "--min-bucket", "16"]
        + [*SHAPE, "--requests", "3", "--input-scale", "0.004", "--output-scale", "0.003"]
        + ["--sweep", "4,8", "--search", "--search-range", "4,8", "--search-iters", "1"]
        + ["--efficiency", "--profile", "0", "0.2", "--out", str(out), "--md", str(md)]
    )
    got = json.loads(out.read_text())
    runs = got["rates"]
    assert [r["rate"] for r in runs if r["kind"] == "sweep"] == [4.0, 8.0]
    searched = [r["rate"] for r in runs if r["kind"] == "search"]
    assert searched[0] == 8.0 and set(searched) <= {8.0, 4.0, math.sqrt(32)}  # the range's top first, then bisection
    assert got["search"]["found"]
    keys = {"qpm", "output_tok_s", "total_tok_s", "goodput_req_s", "preemptions", "lost", "decode_batch"}
    for r in runs:
        assert keys <= set(r) and set(r["ttft_s"]) == set(r["tpot_s"]) == {"p50", "p90", "p99"}
        assert r["requests"] == 3 and r["lost"] == 0 and r["finished"] + r["errors"] == 3
        assert r["output_tok_s"] > 0 and r["total_tok_s"] > r["output_tok_s"] and r["decode_batch"] >= 1
        # the engine's time by kind of step: every request prefilled and decoded, within the run's wall
        split = r["step_time"]
        assert split["decode"]["steps"] > 0 and split["decode"]["prefill_tokens_per_step"] == 0
        assert split["prefill"]["steps"] + split["mixed"]["steps"] > 0
        kinds = [split[k] for k in ("decode", "mixed", "prefill")]
        prefilled = sum(k["steps"] * (k["prefill_tokens_per_step"] or 0) for k in kinds)
        inputs = round((r["total_tok_s"] - r["output_tok_s"]) * r["wall_s"])
        assert prefilled >= inputs  # every prompt's tokens, at least once (a preemption prefills again)
        assert 0 < sum(k["seconds"] for k in kinds) <= r["wall_s"]
        assert r["decode_batch"] <= split["decode_rows_run"] <= 2  # the first N slots of the 2 that hold them
    sat, eff = got["saturation"], got["efficiency"]
    assert sat["output_tok_s"] == max(r["output_tok_s"] for r in runs)
    assert eff["batch"] == max(1, round(sat["decode_batch"])) and eff["offline_tok_s"] > 0
    assert eff["ratio"] == pytest.approx(sat["output_tok_s"] / eff["offline_tok_s"])
    text = md.read_text()
    for column in ("QPM", "total tok/s", "TTFT p50 / p90 / p99", "goodput", "preemptions", "lost", "mean context"):
        assert column in text
    assert "Engine time over the" in text and "decode-only steps took" in text
    assert "At 8 req/s: The profiled window (" in text and "holds no GPU kernels" in text  # the last rate's, on a CPU
    assert "random tiny-v3 weights, w4a8c8" in text and len(re.findall(r"^\| \d", text, re.M)) == len(runs)
