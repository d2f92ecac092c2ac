"""`hcfjax serve`'s options as typed configs: the one place its parsed arguments become an EngineConfig or a
PrefillConfig, and the way back, the flags that make a worker process build a given config (the PD benchmarks start
their workers from configs they built).

The jax-heavy config classes are imported inside the functions, so that `hcfjax --help` stays quick.
"""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hcfjax.engine import EngineConfig
    from hcfjax.options import Options
    from hcfjax.pd.prefill import PrefillConfig
    from hcfjax.speculative import SpeculativeConfig

DTYPES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float32": "float32", "fp32": "float32"}


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
        max_prefill_rows=args.max_prefill_rows,
        max_queue=args.max_queue,
        balance=args.balance,
        speculative=speculative_config(args),
        cache_dtype="int8" if args.kv_cache == "int8" else "auto",
        min_prefill_bucket=args.min_prefill_bucket,
        options=run_options(),
    )


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
        cache_dtype="int8" if args.kv_cache == "int8" else "auto",
        speculative=speculative_config(args),
        options=run_options(),
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
    if cache_dtype not in ("auto", "int8"):
        raise ValueError(f"hcfjax serve has no --kv-cache for cache_dtype {cache_dtype!r}")
    return "int8" if cache_dtype == "int8" else "bf16"


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
        max_prefill_rows=config.max_prefill_rows,
        max_queue=config.max_queue,
        balance=config.balance,
        min_prefill_bucket=config.min_prefill_bucket,
    )
    unset = EngineConfig(
        **flags, speculative=config.speculative, cache_dtype=config.cache_dtype, options=config.options
    )  # options travel in the workers' environment
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
