"""Generation under the two plans: hcfjax.generate with the batch spread over a decode plan's ranks (attention data
parallel over each rank's own requests, experts over EP with explicit dispatch, sharding/ep.py) and, optionally,
prefill under a prefill plan."""

from __future__ import annotations

from hcfjax.generate import GenerationResult, generate
from hcfjax.model import Model
from hcfjax.options import DEFAULT, Options
from hcfjax.sampling import SamplingParams
from sharding.plans import Plan


def generate_planned(
    model: Model,
    prompts,
    decode_plan: Plan,
    prefill_plan: Plan | None = None,
    max_new_tokens: int = 64,
    sampling: SamplingParams | None = None,
    seed: int = 0,
    stop_token_ids=None,
    page_size: int = 64,
    exchange: str | None = None,
    options: Options = DEFAULT,
) -> GenerationResult:
    """hcfjax.generate under the plans. Requests are dealt to ranks in contiguous blocks; ranks short of requests
    get mock rows, which run every step (the MoE exchange needs every rank) but never write or read another row's
    pages. exchange: how the MoE moves routed tokens between the ranks (dense or ragged; default options')."""
    if exchange is not None:
        options = options.replace(ep_exchange=exchange)
    return generate(
        model,
        prompts,
        max_new_tokens,
        sampling,
        seed,
        stop_token_ids,
        page_size,
        options=options,
        decode_plan=decode_plan,
        prefill_plan=prefill_plan,
    )
