"""`hcfjax serve`'s options as typed configs: the one place its parsed arguments become the served model, an
EngineConfig or a PrefillConfig, and the way back, the flags that make a worker process build a given config (the PD
benchmarks start their workers from configs they built). The precision flags (--dtype, --fp8, --kv-cache) are
defined here beside the tables they read, for `hcfjax serve` and `hcfjax generate` alike.

The jax-heavy config classes are imported inside the functions, so that `hcfjax --help` stays quick.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import os
from typing import TYPE_CHECKING

from hcfjax.config import QUANT_SCHEMES

if TYPE_CHECKING:
    from hcfjax.engine import EngineConfig
    from hcfjax.model import Model
    from hcfjax.options import Options
    from hcfjax.pd.prefill import PrefillConfig
    from hcfjax.speculative import SpeculativeConfig

DTYPES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float32": "float32", "fp32": "float32"}
SCHEMES = tuple(QUANT_SCHEMES)  # --scheme: quantise the served model in memory, as `hcfjax quantize` would
# --kv-cache -> the configs' cache_dtype (hcfjax.quantize.cache_dtype_for): auto follows the checkpoint's scheme
KV_CACHE = {"auto": "auto", "bf16": "float", "int8": "int8"}


def add_precision_flags(parser: argparse.ArgumentParser) -> None:
    """--dtype, --fp8 and --kv-cache, alike for `generate` and `serve`."""
    parser.add_argument(
        "--dtype", default="bfloat16", choices=[*sorted(DTYPES), "auto"], help="model dtype (auto: the checkpoint's)"
    )
    parser.add_argument(
        "--fp8",
        default="native",
        choices=["native", "dequantize"],
        help="DeepSeek fp8 checkpoints: run the weights as fp8 (native) or dequantise them to --dtype on load",
    )
    parser.add_argument(
        "--kv-cache",
        default="auto",
        choices=sorted(KV_CACHE),
        help="latent KV cache precision (auto: the checkpoint's scheme's, int8 for w4a8c8; bf16: the model's dtype)",
    )


def load_model(
    path: str | None,
    preset: str | None = None,
    scheme: str | None = None,
    dtype: str = "bfloat16",
    fp8: str = "native",
    shapes_only: bool = False,
) -> Model:
    """The model `hcfjax serve` serves: the checkpoint at `path` (None: the embedded model), or a random model of
    `preset`'s shape (hcfjax.random_model.PRESETS; seed 0, so every worker of a PD deployment builds the same
    weights), quantised to `scheme` as it is made or read when given (as `hcfjax quantize` does: an fp8 checkpoint
    is read dequantised for the other schemes, as it is for "fp8"); `fp8` as hcfjax.load's otherwise. ValueError for a
    path that is not a checkpoint, an unknown preset or scheme, or a scheme on a checkpoint that is quantised to
    another already. shapes_only: the same Model with its params as jax.ShapeDtypeStructs, without reading or
    making a weight (a checkpoint's from its headers, hcfjax.api.load_shapes; a random model's by jax.eval_shape)."""
    import jax.numpy as jnp

    import hcfjax
    from hcfjax.api import load_shapes

    check_model_args(path, preset, scheme)
    if preset:
        from hcfjax.random_model import preset_config, random_model

        cfg, floats = preset_config(preset), getattr(jnp, DTYPES.get(dtype, "bfloat16"))
        # quantised as it is made: the float model never whole on the device beside the KV cache
        make = lambda: random_model(cfg, seed=0, dtype=floats, scheme=scheme)  # noqa: E731
        return _shapes_of(make) if shapes_only else make()
    # quantised as it is read: the float model never whole on the device beside the KV cache
    read = load_shapes if shapes_only else hcfjax.load
    fp8 = fp8 if scheme in (None, "fp8") else "dequantize"
    return read(checkpoint_dir(path), dtype=load_dtype(dtype), fp8=fp8, scheme=scheme)


def _shapes_of(make) -> Model:
    """make()'s Model with its params as jax.ShapeDtypeStructs (jax.eval_shape: nothing is computed)."""
    import jax

    made = []
    shapes = jax.eval_shape(lambda: made.append(make()) or made[0].params)
    return dataclasses.replace(made[0], params=shapes)


def check_model_args(path: str | None, preset: str | None, scheme: str | None) -> None:
    if path and preset:
        raise ValueError("give --model or --preset, not both")
    if scheme is not None and scheme not in SCHEMES:
        raise ValueError(f"unknown quantisation scheme {scheme!r} (choose from {list(SCHEMES)})")


def checkpoint_dir(path: str | None):
    """--model's directory (None: the embedded model), checked to exist and to hold a config.json."""
    from pathlib import Path

    import hcfjax

    where = Path(path or hcfjax.DEFAULT_MODEL)
    if not where.exists():
        raise ValueError(f"{str(where)!r} does not exist")
    if not (where / "config.json").is_file():
        raise ValueError(f"{str(where)!r} is not a checkpoint directory (no config.json)")
    return where


def load_dtype(name: str):
    """--dtype NAME -> hcfjax.load's dtype: "auto" (the checkpoint's) or a jnp dtype."""
    import jax.numpy as jnp

    return "auto" if name == "auto" else getattr(jnp, DTYPES[name])


def served_model(args: argparse.Namespace) -> Model:
    """--model PATH | --preset NAME, --scheme S, --dtype D, --fp8 M: the model of `hcfjax serve` (every role)."""
    return load_model(args.model, args.preset, args.scheme, args.dtype, args.fp8)


def served_model_and_weights(args: argparse.Namespace) -> tuple[Model, concurrent.futures.Future]:
    """served_model(args) being loaded in a thread, and the Model it will be with only its params' shapes
    (jax.ShapeDtypeStruct, on the first device), so that the server's steps compile while the weights are read (or
    made, for a random model) and quantised (hcfjax.engine.Engine's `weights`). A bad path, preset or scheme fails
    here, before anything compiles."""
    import jax

    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="hcfjax-weights")
    weights = pool.submit(lambda: served_model(args).params)
    pool.shutdown(wait=False)
    model = load_model(args.model, args.preset, args.scheme, args.dtype, args.fp8, shapes_only=True)
    on = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=on), model.params)
    return dataclasses.replace(model, params=shapes), weights


def random_label(preset: str | None, scheme: str | None) -> str | None:
    """What a server of a random model says wherever it names its model (None for a checkpoint): random weights
    answer with noise, and a benchmark's reader must not mistake them for a trained model."""
    if not preset:
        return None
    return f"random {preset} weights" + (f", {scheme}" if scheme else "")


def served_model_name(args: argparse.Namespace) -> str | None:
    """The HTTP API's model name: --served-model-name, else random-PRESET[-SCHEME] for a random model, else None
    (the checkpoint directory's name)."""
    if args.served_model_name or not args.preset:
        return args.served_model_name
    return f"random-{args.preset}" + (f"-{args.scheme}" if args.scheme else "")


def run_options() -> Options:
    """How the model runs, from the HCFJAX_* environment variables (hcfjax.options.Options.from_env): the only
    place the library's commands read them. Worker processes inherit the environment, so they build the same."""
    from hcfjax.options import Options

    return Options.from_env(os.environ)


def speculative_config(args: argparse.Namespace) -> SpeculativeConfig | None:
    """--speculative K --spec-method M: MTP drafting, or None when K is 0."""
    from hcfjax.speculative import SpeculativeConfig

    if not args.speculative:
        return None
    return SpeculativeConfig(num_draft_tokens=args.speculative, method=args.spec_method)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The engine of `hcfjax serve` (colocated, or the decode role's)."""
    from hcfjax.engine import EngineConfig

    return EngineConfig(
        max_slots=args.max_slots,
        dp=args.dp,
        num_pages=args.num_pages,
        page_size=args.page_size,
        max_model_len=args.max_model_len,
        token_budget=args.token_budget,
        mixed_token_budget=args.mixed_token_budget,
        max_prefill_rows=args.max_prefill_rows,
        max_queue=args.max_queue,
        balance=args.balance,
        speculative=speculative_config(args),
        cache_dtype=KV_CACHE[args.kv_cache],
        min_prefill_bucket=args.min_prefill_bucket,
        options=run_options(),
        executable_cache=step_cache(args),
    )


def step_cache(args: argparse.Namespace) -> str | None:
    """Where compiled engine steps (and a prefill worker's programs) are kept: beside jax's cache under
    --compile-cache (None: off)."""
    cache = getattr(args, "compile_cache", "off")
    return None if cache in (None, "off") else os.path.join(os.path.expanduser(cache), "steps")


def prefill_config(args: argparse.Namespace) -> PrefillConfig:
    """The prefill worker of `hcfjax serve --role prefill`."""
    from hcfjax.pd.prefill import PrefillConfig

    return PrefillConfig(
        num_pages=args.prefill_pages,
        page_size=args.page_size,
        max_rows=args.max_prefill_rows,
        token_budget=max(args.token_budget, 1),
        chunk=args.prefill_chunk,
        min_bucket=args.min_prefill_bucket,
        layerwise_threshold=args.layerwise_threshold,
        layer_group=args.layer_group,
        transfer_timeout_s=args.transfer_timeout,
        cache_dtype=KV_CACHE[args.kv_cache],
        speculative=speculative_config(args),
        options=run_options(),
        executable_cache=step_cache(args),
    )


def _flags(values: dict) -> list[str]:
    out = []
    for name, value in values.items():
        if value is not None:
            out += [f"--{name}", str(value)]
    return out


def _speculative_flags(spec: SpeculativeConfig | None) -> dict:
    from hcfjax.speculative import SpeculativeConfig

    if spec is None:
        return {}
    if spec != SpeculativeConfig(num_draft_tokens=spec.num_draft_tokens, method=spec.method):
        raise ValueError(f"hcfjax serve sets only the draft count and method of speculative decoding: {spec}")
    return {"speculative": spec.num_draft_tokens, "spec-method": spec.method}


def _kv_cache_flag(cache_dtype: str) -> str:
    flag = {v: k for k, v in KV_CACHE.items()}.get(cache_dtype)
    if flag is None:
        raise ValueError(f"hcfjax serve has no --kv-cache for cache_dtype {cache_dtype!r}")
    return flag


def engine_flags(config: EngineConfig) -> list[str]:
    """The `hcfjax serve` flags from which engine_config() builds `config`. ValueError if a field the command does
    not set differs from its default (the worker would not get it)."""
    from hcfjax.engine import EngineConfig

    flags = dict(
        max_slots=config.max_slots,
        dp=config.dp,
        num_pages=config.num_pages,
        page_size=config.page_size,
        max_model_len=config.max_model_len,
        token_budget=config.token_budget,
        mixed_token_budget=config.mixed_token_budget,
        max_prefill_rows=config.max_prefill_rows,
        max_queue=config.max_queue,
        balance=config.balance,
        min_prefill_bucket=config.min_prefill_bucket,
    )
    unset = EngineConfig(
        **flags,
        speculative=config.speculative,
        cache_dtype=config.cache_dtype,
        options=config.options,
        executable_cache=config.executable_cache,
    )  # options travel in the workers' environment; a worker keeps its steps under its own --compile-cache
    if unset != config:
        raise ValueError(f"hcfjax serve cannot set every field of {config} (it would build {unset})")
    named = {k.replace("_", "-"): v for k, v in flags.items()}
    return _flags(named | {"kv-cache": _kv_cache_flag(config.cache_dtype)} | _speculative_flags(config.speculative))


def prefill_flags(config: PrefillConfig) -> list[str]:
    """The `hcfjax serve --role prefill` flags from which prefill_config() builds `config`."""
    if config.token_budget < 1:
        raise ValueError(f"a prefill worker's token budget is at least 1, got {config.token_budget}")
    named = {
        "prefill-pages": config.num_pages,
        "page-size": config.page_size,
        "max-prefill-rows": config.max_rows,
        "token-budget": config.token_budget,
        "prefill-chunk": config.chunk,
        "min-prefill-bucket": config.min_bucket,
        "layerwise-threshold": config.layerwise_threshold,
        "layer-group": config.layer_group,
        "transfer-timeout": config.transfer_timeout_s,
        "kv-cache": _kv_cache_flag(config.cache_dtype),
    }
    return _flags(named | _speculative_flags(config.speculative))


def parse_meshes(specs: list[str], need_decode: bool = True) -> dict[str, dict[str, int]]:
    """["prefill:tp=4,ep=2", "decode:dp=4,ep=4"] -> {"prefill": {"tp": 4, "ep": 2}, "decode": {...}}."""
    plans: dict[str, dict[str, int]] = {}
    for spec in specs:
        name, _, sizes = spec.partition(":")
        if name not in ("prefill", "decode") or not sizes:
            raise ValueError(f"bad --mesh {spec!r}: expected prefill:tp=N,ep=M or decode:dp=N,ep=N")
        try:
            plans[name] = {k: int(v) for k, v in (kv.split("=") for kv in sizes.split(","))}
        except ValueError:
            raise ValueError(f"bad --mesh {spec!r}: sizes are name=integer pairs") from None
        allowed = {"prefill": {"tp", "ep"}, "decode": {"dp", "ep"}}[name]
        if set(plans[name]) - allowed:
            raise ValueError(f"bad --mesh {spec!r}: {name} takes {sorted(allowed)}")
    if need_decode and plans and "decode" not in plans:
        raise ValueError("--mesh needs a decode plan (decode:dp=N,ep=N)")
    return plans


def generate_plans(meshes: dict[str, dict[str, int]]) -> dict:
    """parse_meshes' result -> hcfjax.generate's decode_plan= / prefill_plan= (none without --mesh)."""
    if not meshes:
        return {}
    from sharding.plans import decode_plan, prefill_plan

    pre = prefill_plan(**meshes["prefill"]) if "prefill" in meshes else None
    return {"decode_plan": decode_plan(**meshes["decode"]), "prefill_plan": pre}
