"""`hcfjax serve`'s options as typed configs: the one place its parsed arguments become an EngineConfig or a
PrefillConfig.

The jax-heavy config classes are imported inside the functions, so that `hcfjax --help` stays quick.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hcfjax.engine import EngineConfig
    from hcfjax.pd.prefill import PrefillConfig
    from hcfjax.speculative import SpeculativeConfig

DTYPES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float32": "float32", "fp32": "float32"}


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
    )
