"""A deployment to simulate, as data: the model, GPU, efficiency profile, quantisation, speculation, and pools of
identical instances (colocated, or PD prefill + decode), read from YAML (see hcfjax/sim/configs/).

Each pool's KV cache gets the HBM its weights leave (mem_fraction of the card, minus weights and an activation
reserve) unless num_pages is given. `engine_shapes: true` prices steps as hcfjax's runner computes them (padded
fixed shapes, pages sized as Engine does) and, in PD, prefill batches as hcfjax's PrefillWorker forms and computes
them, for predicting this project's engine; otherwise as a production stack. A pool may name its own efficiency
profile (a PD validation fits one per role).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from hcfjax.config import ModelConfig
from hcfjax.engine.config import context_length, lookahead_tokens
from hcfjax.engine.scheduler import SchedulerConfig
from hcfjax.sim.cost import CostModel
from hcfjax.sim.gpus import DEEPSEEK_KERNELS, HCFJAX_XLA_H200_MICRO, Efficiency, gpu
from hcfjax.sim.weights import holds_float_heads
from hcfjax.sim.work import EngineShapes, PrefillShapes

PROFILES = {"deepseek-kernels": DEEPSEEK_KERNELS, "hcfjax-xla-h200-micro": HCFJAX_XLA_H200_MICRO}


def model_config(name: str) -> ModelConfig:
    """'deepseek-v3', a hcfjax.random_model preset ('v2-lite', 'tiny-v3'), 'stdlib-v3' (the embedded model), or a
    path to a config.json or checkpoint directory."""
    if name == "deepseek-r1":  # the same architecture and shapes
        name = "deepseek-v3"
    if name == "stdlib-v3":
        import hcfjax

        return ModelConfig.from_json(hcfjax.DEFAULT_MODEL)
    from hcfjax.random_model import PRESETS, preset_config

    if name in PRESETS:
        return preset_config(name)
    if Path(name).exists():
        return ModelConfig.from_json(name)
    raise ValueError(f"unknown model {name!r}: deepseek-r1, stdlib-v3, one of {sorted(PRESETS)}, or a config path")


def efficiency(name: str, overrides: dict | None = None) -> Efficiency:
    """A named profile, or a JSON file of Efficiency fields (what validate.py writes), with overrides applied."""
    if name in PROFILES:
        eff = PROFILES[name]
    elif Path(name).is_file():
        eff = Efficiency(**json.loads(Path(name).read_text()))
    else:
        raise ValueError(f"unknown efficiency profile {name!r} (known: {sorted(PROFILES)}, or a JSON file)")
    return eff.replace(**(overrides or {}))


@dataclasses.dataclass(frozen=True)
class Pool:
    """`instances` identical instances of tp x dp GPUs, experts over ep of them; limits are per DP rank."""

    instances: int = 1
    tp: int = 1
    dp: int = 1
    ep: int = 1
    max_slots: int = 64
    token_budget: int = 8192
    mixed_token_budget: int | None = None  # colocated: the budget of a step that also decodes (None: token_budget)
    max_prefill_rows: int = 8
    page_size: int = 64
    num_pages: int | None = None
    balance: str = "fewest_requests"
    spf_window_s: float = 0.05
    max_wait_s: float = 2.0
    min_bucket: int = 16  # engine_shapes only: the smallest prefill chunk shape
    min_decode_rows: int = 8  # engine_shapes only: the smallest decode step (rows per rank)
    chunk: int = 2048  # engine_shapes, PD prefill: the worker's forward chunk (PrefillConfig.chunk)
    efficiency: str | None = None  # this pool's profile (default: the deployment's)

    @property
    def gpus(self) -> int:
        return self.instances * self.tp * self.dp


@dataclasses.dataclass(frozen=True)
class Deployment:
    model: str = "deepseek-v3"
    gpu: str = "H20"
    quant: str | None = "w4a8c8"
    efficiency: str = "deepseek-kernels"
    efficiency_overrides: dict = dataclasses.field(default_factory=dict)
    attn_int8: bool = False  # attention core at the int8/fp8 rate (an FP8 MLA kernel over the int8 cache)
    imbalance: float = 1.3  # EPLB: busiest rank's expert load over the mean (the reference: 1.2 to 1.5)
    acceptance: tuple[float, ...] = ()  # MTP acceptance per depth (conditional); empty: no speculation
    mode: str = "pd"  # pd | colocated
    colocated: Pool | None = None
    prefill: Pool | None = None
    decode: Pool | None = None
    layerwise_threshold: int = 8192  # prompts at least this long move their KV layerwise
    # A KV transfer into a decode instance completes only when the decode step running there ends, and lands one
    # engine iteration later. Measured for hcfjax's jax transport on the H200 (hcfjax.trace, bench.sim_validate:
    # 46 of 48 pulls ended within 1 ms of a decode step's end); False: it lands at the first iteration after its
    # bytes arrived (a transport writing into reserved pages without the decode stream, as Mooncake's RDMA does).
    transfer_waits_for_step: bool = False
    engine_shapes: bool = False
    max_model_len: int | None = None  # engine_shapes: the engine's context (default min(model's, 4096))
    mem_fraction: float = 0.9
    activation_reserve_gb: float = 4.0
    seed: int = 0

    def __post_init__(self):
        if self.mode not in ("pd", "colocated"):
            raise ValueError(f"mode must be 'pd' or 'colocated', got {self.mode!r}")
        if self.mode == "pd" and (self.prefill is None or self.decode is None):
            raise ValueError("a pd deployment needs prefill and decode pools")
        if self.mode == "colocated" and self.colocated is None:
            raise ValueError("a colocated deployment needs a colocated pool")

    @property
    def spec_k(self) -> int:
        return len(self.acceptance)

    @property
    def gpus(self) -> int:
        pools = [self.colocated] if self.mode == "colocated" else [self.prefill, self.decode]
        return sum(p.gpus for p in pools)

    def replace(self, **kw) -> Deployment:
        return dataclasses.replace(self, **kw)

    # -- building blocks -------------------------------------------------------------------------------------------
    def model_config(self) -> ModelConfig:
        return model_config(self.model)

    def cost_model(self, pool: Pool, cfg: ModelConfig | None = None) -> CostModel:
        cfg = cfg or self.model_config()
        return CostModel(
            cfg,
            gpu(self.gpu),
            efficiency(pool.efficiency or self.efficiency, self.efficiency_overrides),
            self.quant,
            tp=pool.tp,
            dp=pool.dp,
            ep=pool.ep,
            imbalance=self.imbalance,
            spec_k=self.spec_k,
            attn_int8=self.attn_int8,
            float_heads=holds_float_heads(cfg, self.quant),
        )

    def kv_budget(self, cost: CostModel) -> float:
        """Bytes of one GPU left for the KV cache: mem_fraction of its HBM, less the weights it holds and the
        activation reserve (negative when the weights do not fit)."""
        hbm = gpu(self.gpu).hbm_gb * 1e9
        return hbm * self.mem_fraction - cost.weight_bytes_per_gpu() - self.activation_reserve_gb * 1e9

    def pages_per_rank(self, pool: Pool, cost: CostModel) -> int:
        """KV pages one DP rank holds: what the card's HBM leaves after weights (the latent cache is replicated
        over TP ranks, so a rank holds as much as one of its GPUs)."""
        if pool.num_pages:
            return pool.num_pages
        pages = int(self.kv_budget(cost) // cost.kv_bytes(pool.page_size))
        if pages < 1:
            raise ValueError(
                f"{self.model} ({self.quant or 'bf16'}) does not fit: {cost.weight_bytes_per_gpu() / 1e9:.0f} GB of "
                f"weights per {self.gpu} GPU at tp={pool.tp}, dp={pool.dp}, ep={pool.ep}"
            )
        return pages

    def engine_limits(self, pool: Pool, cfg: ModelConfig) -> tuple[int, int, int]:
        """(max_model_len, max_pages, num_pages per rank) as hcfjax.engine.Engine derives them, but for the pages an
        int8 pool gains past the cache-write kernel's 2-4 GiB window on a GPU (engine.memory.past_write_window)."""
        k = self.spec_k
        max_len = context_length(cfg.max_position_embeddings, self.max_model_len)
        max_pages = math.ceil((max_len + lookahead_tokens(k)) / pool.page_size)
        return max_len, max_pages, pool.num_pages or max(max_pages, pool.max_slots * max_pages // 2)

    def scheduler_config(self, pool: Pool, role: str, num_pages: int, shapes=None) -> SchedulerConfig:
        """role: colocated | prefill | decode. shapes (hcfjax.engine.shapes.StepShapes, engine_shapes only): plan
        within the runner's padded prefill shapes, as the engine does."""
        k = self.spec_k
        common = dict(page_size=pool.page_size, spf_window_s=pool.spf_window_s, max_wait_s=pool.max_wait_s)
        if role == "prefill":  # one rank; each prompt gets max_new_tokens 1
            if self.engine_shapes:  # hcfjax's PrefillWorker: whole prompts, shortest first, no starvation bound
                common.update(spf_window_s=0.0, max_wait_s=math.inf)
            return SchedulerConfig(
                dp=1,
                max_slots=pool.max_slots,
                num_pages=num_pages,
                token_budget=pool.token_budget,
                max_prefill_rows=pool.max_prefill_rows,
                whole_prompts=self.engine_shapes,
                **common,
            )
        extra: dict[str, Any] = {"mixed_token_budget": pool.mixed_token_budget}
        budget, whole = pool.token_budget, bool(k)
        if role == "decode":  # admissions only: their prompts are prefilled elsewhere, whole
            budget, whole = 1 << 60, True
            extra.update(remote_prefill=True, mixed_token_budget=None)
        return SchedulerConfig(
            dp=pool.dp,
            max_slots=pool.max_slots,
            num_pages=num_pages,
            token_budget=budget,
            max_prefill_rows=pool.max_prefill_rows,
            step_tokens=k + 1,
            page_slack=k,
            whole_prompts=whole,
            balance=pool.balance,
            shapes=shapes,
            **common,
            **extra,
        )

    def engine_shapes_for(self, pool: Pool, cfg: ModelConfig) -> EngineShapes:
        _, max_pages, _ = self.engine_limits(pool, cfg)
        return EngineShapes(
            ranks=1,
            slots=pool.dp * pool.max_slots,
            keys=max_pages * pool.page_size,
            max_rows=pool.max_prefill_rows,
            token_budget=pool.token_budget,
            min_bucket=pool.min_bucket,
            spec_k=self.spec_k,
            min_decode_rows=pool.min_decode_rows,
        )

    def prefill_shapes_for(self, pool: Pool) -> PrefillShapes:
        return PrefillShapes(pool.page_size, pool.chunk, pool.min_bucket, self.spec_k)


def _pool(d: dict | None) -> Pool | None:
    if d is None:
        return None
    unknown = set(d) - {f.name for f in dataclasses.fields(Pool)}
    if unknown:
        raise ValueError(f"unknown pool keys {sorted(unknown)}")
    return Pool(**d)


def from_dict(d: dict) -> Deployment:
    d = dict(d)
    for key in ("colocated", "prefill", "decode"):
        d[key] = _pool(d.get(key))
    if "acceptance" in d:
        d["acceptance"] = tuple(d["acceptance"] or ())
    unknown = set(d) - {f.name for f in dataclasses.fields(Deployment)}
    if unknown:
        raise ValueError(f"unknown deployment keys {sorted(unknown)}")
    return Deployment(**d)
