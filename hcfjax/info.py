"""`hcfjax info MODEL`: what a DeepSeek model is and what serving it takes, from its config.json alone (no weights).

It prints the parameters (total and read per token; the main model and the MTP modules apart), the weights' bytes in
every format (bf16, each quantisation scheme as hcfjax holds it, fp8 as DeepSeek ships V3 and R1), and for each
sharding plan on a GPU: the weights one GPU holds, then the latent KV cache the rest of its memory holds, in tokens
and in requests of a given context. The numbers are the capacity simulator's (hcfjax/sim/weights.py, its CostModel
and Deployment.pages_per_rank), so `hcfjax info` and `hcfjax sim` agree on what fits.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from pathlib import Path

from hcfjax.config import QUANT_SCHEMES, ModelConfig
from hcfjax.engine.config import context_length
from hcfjax.sim.cost import CostModel
from hcfjax.sim.deployment import Deployment, Pool
from hcfjax.sim.gpus import DEEPSEEK_KERNELS, GPUS, gpu
from hcfjax.sim.weights import (
    bytes_per_gpu,
    count,
    fp8_bytes,
    holds_float_heads,
    main_weights,
    mtp_weights,
    total_bytes,
)

SCHEMES = ("bf16", *QUANT_SCHEMES)
DEFAULT_MESH = "decode:dp=8,ep=8"
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(Deployment)}
DESCRIPTION = (
    "Parameters, weight bytes per scheme, and what fits per GPU under a sharding plan, from a config.json; no "
    "weights are read. The numbers are the capacity simulator's (hcfjax/sim/): weights split as the sharding plans "
    f"split them, the KV cache in what {_DEFAULTS['mem_fraction']:g} of the GPU's memory leaves after them and a "
    f"{_DEFAULTS['activation_reserve_gb']:g} GB activation reserve."
)


def read_config(path: str | Path) -> ModelConfig:
    """The ModelConfig of a checkpoint directory or a config.json (DeepSeek's fp8 `quantization_config`, as V3 and
    R1 ship it, included: cfg.quantization.fp8)."""
    return ModelConfig.from_json(path)


def plan_pool(spec: str) -> Pool:
    """A --mesh plan as the simulator's pool: decode:dp=N[,ep=N] is N attention-DP ranks with the experts over
    them; prefill:tp=N[,ep=M] is N x M GPUs, attention over tp (M ranks of it), each expert over one tp group."""
    from hcfjax.serving.config import parse_meshes

    ((name, sizes),) = parse_meshes([spec], need_decode=False).items()
    if name == "decode":
        dp = sizes.get("dp", sizes.get("ep", 1))
        if sizes.get("ep", dp) != dp or dp < 1:
            raise ValueError(
                f"bad --mesh {spec!r}: the decode plan runs attention-DP and EP on the same ranks (dp == ep)"
            )
        return Pool(dp=dp, ep=dp)
    tp, ep = sizes.get("tp", 1), sizes.get("ep", 1)
    if tp < 1 or ep < 1:
        raise ValueError(f"bad --mesh {spec!r}: tp and ep must be >= 1")
    return Pool(tp=tp, dp=ep, ep=ep)


@dataclasses.dataclass(frozen=True)
class CacheFit:
    dtype: str  # "bf16" or "int8" (with two float32 scales per token and layer)
    bytes_per_token: float  # over every cache layer (the decoder's, plus one per draft depth)
    tokens: int  # per GPU (a DP rank's cache; TP ranks hold the same latent cache)
    requests: int  # of `context` tokens, per DP rank


@dataclasses.dataclass(frozen=True)
class PlanFit:
    mesh: str  # the plan, in full: decode:dp=N,ep=N or prefill:tp=N,ep=M
    deployment: Deployment  # the simulator's, colocated on the plan's pool
    weight_bytes: float  # per GPU
    expert_bytes: float  # of which routed experts
    kv_budget: float  # bytes per GPU left for the KV cache (negative: the weights do not fit)
    caches: tuple[CacheFit, ...]

    @property
    def pool(self) -> Pool:
        return self.deployment.colocated


def plan_fit(
    cfg: ModelConfig, mesh: str, gpu_name: str, scheme: str, context: int, spec_k: int = 0, page_size: int = 64
) -> PlanFit:
    """What one GPU holds under the plan `mesh`, with the simulator's deployment defaults (mem_fraction, the
    activation reserve): weights, then KV pages for a bf16 and an int8 cache. MLA's q_b / o are priced as the
    checkpoint holds them (sim.weights.holds_float_heads)."""
    pool = dataclasses.replace(plan_pool(mesh), page_size=page_size)
    mesh = f"prefill:tp={pool.tp},ep={pool.dp}" if mesh.startswith("prefill") else f"decode:dp={pool.dp},ep={pool.dp}"
    quant = None if scheme == "bf16" else scheme
    dep = Deployment(gpu=gpu_name, quant=quant, mode="colocated", colocated=pool)
    model = (cfg, gpu(gpu_name), DEEPSEEK_KERNELS, quant, pool.tp, pool.dp, pool.ep)
    caches, float_heads = [], holds_float_heads(cfg, quant)
    for dtype in ("bf16", "int8"):
        cost = CostModel(*model, spec_k=spec_k, kv_int8=dtype == "int8", float_heads=float_heads)
        pages = dep.pages_per_rank(pool, cost) if dep.kv_budget(cost) >= cost.kv_bytes(page_size) else 0
        caches.append(CacheFit(dtype, cost.kv_bytes(1), pages * page_size, pages // math.ceil(context / page_size)))
    experts = [w for w in main_weights(cfg) + (mtp_weights(cfg) if spec_k else []) if w.kind == "experts"]
    held, experts_held = cost.weight_bytes_per_gpu(), bytes_per_gpu(experts, quant, pool.tp, pool.gpus)
    return PlanFit(mesh, dep, held, experts_held, dep.kv_budget(cost), tuple(caches))


def _n(x: float) -> str:
    return f"{x / 1e9:.2f} B" if x >= 1e9 else f"{x / 1e6:.2f} M" if x >= 1e6 else f"{x:,.0f}"


def _gb(x: float) -> str:
    return f"{x / 1e9:.1f} GB" if abs(x) >= 1e8 else f"{x / 1e6:.1f} MB"


def report(
    cfg: ModelConfig,
    label: str,
    fits: list[PlanFit],
    gpu_name: str,
    scheme: str,
    context: int,
    spec_k: int,
) -> str:
    """The printed tables: the model, its parameters, its weights' bytes per format, then each plan's fit."""
    main, mtp = main_weights(cfg), mtp_weights(cfg)
    c = cfg
    n_moe = sum(c.is_moe_layer(i) for i in range(c.num_hidden_layers))
    experts = f"{c.n_routed_experts} routed experts (top {c.num_experts_per_tok})" if c.n_routed_experts else "dense"
    lines = [
        f"{label} ({c.model_type})",
        f"  {c.num_hidden_layers} layers ({c.num_hidden_layers - n_moe} dense), hidden {c.hidden_size}, "
        f"{c.num_attention_heads} heads, {experts} + {c.n_shared_experts} shared, "
        f"{c.num_mtp_layers} MTP module{'' if c.num_mtp_layers == 1 else 's'}, "
        f"vocab {c.vocab_size}",
    ]
    shipped = c.quantization.fp8 if c.quantization is not None else None  # DeepSeek's fp8 block
    block = shipped.weight_block_size if shipped else (128, 128)
    if shipped:
        lines.append(f"  shipped as fp8 {shipped.fmt}, {block[0]}x{block[1]} blocks")
    elif c.quantization is not None:
        heads = ", MLA's q_b / o in bf16" if holds_float_heads(c, c.quantization.scheme) else ""
        lines.append(f"  quantised by hcfjax: {c.quantization.scheme}{heads}")
    lines += ["", f"{'parameters':<26}{'total':>12}{'per token':>12}"]
    lines.append(f"{'  main model':<26}{_n(count(main)):>12}{_n(count(main, True)):>12}")
    if mtp:
        mtp_label = f"  MTP ({c.num_mtp_layers} module{'s' if c.num_mtp_layers > 1 else ''})"
        lines.append(f"{mtp_label:<26}{_n(count(mtp)):>12}{_n(count(mtp, True)):>12}")
        lines.append("  (MTP: its decoder layer, combiner, norms and own LM head; the embedding is shared)")
    lines += ["", f"{'weights':<26}{'main':>12}" + (f"{'MTP':>12}" if mtp else "")]

    def row(name, size):  # size: a list of Weights -> bytes
        lines.append(f"{'  ' + name:<26}{_gb(size(main)):>12}" + (f"{_gb(size(mtp)):>12}" if mtp else ""))

    row("bf16", lambda w: total_bytes(w, None))
    row("fp8 (as shipped)" if shipped else "fp8 (DeepSeek's format)", lambda w: fp8_bytes(w, block))
    for scheme_name in QUANT_SCHEMES:
        held = holds_float_heads(c, scheme_name)  # this checkpoint's scheme, as it holds q_b / o
        name = f"{scheme_name} (q_b / o bf16)" if held else scheme_name
        row(name, lambda w, s=scheme_name, f=held: total_bytes(w, s, f))
    lines.append("  (the fp8 checkpoint's bytes on disk; the rest as held in memory: fp8 keeps kv_b bf16, routers f32)")
    g = gpu(gpu_name)
    drafts = f"{spec_k} MTP drafts (MTP weights and {spec_k} cache layers counted)" if spec_k else "no MTP drafts"
    for f in fits:
        p, d = f.pool, f.deployment
        lines += [
            "",
            f"{f.mesh} on {p.gpus} x {gpu_name} ({g.hbm_gb:g} GB), {scheme} weights, {drafts}",
            f"  weights per GPU   {_gb(f.weight_bytes):>10}  (routed experts {_gb(f.expert_bytes)}, "
            f"the rest {_gb(f.weight_bytes - f.expert_bytes)})",
            f"  KV budget per GPU {_gb(f.kv_budget):>10}  ({d.mem_fraction:g} x {g.hbm_gb:g} GB - weights - "
            f"{d.activation_reserve_gb:g} GB activations)",
        ]
        if f.kv_budget <= 0:
            lines.append("  the weights do not fit: use more GPUs or a smaller scheme")
            continue
        lines.append(f"  {'KV cache':<10}{'bytes/token':>12}{'tokens/GPU':>15}   requests of {context:,} tokens")
        for k in f.caches:
            per = f"{k.requests:,} per rank, {k.requests * p.dp:,} in all" if p.dp > 1 else f"{k.requests:,}"
            lines.append(f"  {k.dtype:<10}{k.bytes_per_token:>12,.0f}{k.tokens:>15,}   {per}")
    return "\n".join(lines)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("model", nargs="?", help="a checkpoint directory or a config.json (default: the embedded model)")
    ap.add_argument("--preset", help="a shape by name instead: deepseek-v3, deepseek-r1, v2-lite, tiny-v3, stdlib-v3")
    ap.add_argument(
        "--scheme",
        choices=SCHEMES,
        help="the weights' format under the plans (default: the checkpoint's scheme, fp8 for DeepSeek's fp8 "
        "checkpoints, which hcfjax.load keeps fp8; else bf16)",
    )
    ap.add_argument(
        "--mesh",
        action="append",
        metavar="PLAN",
        help=f"decode:dp=N[,ep=N] or prefill:tp=N[,ep=M]; repeat for several (default: {DEFAULT_MESH})",
    )
    ap.add_argument("--gpu", default="H20", choices=sorted(GPUS), help="the GPU's datasheet (default: %(default)s)")
    ap.add_argument(
        "--context",
        type=int,
        help="tokens per request, for the requests that fit (default: min(the model's context, 4096), as serve's)",
    )
    ap.add_argument(
        "--speculative",
        type=int,
        default=0,
        metavar="K",
        help="K MTP draft tokens per step: the MTP weights and K more cache layers count (default: 0)",
    )
    ap.add_argument("--page-size", type=int, default=64, help="KV cache page, in tokens (default: %(default)s)")


def run(args) -> int:
    try:
        if args.preset and args.model:
            raise ValueError("give a MODEL path or --preset, not both")
        if args.context is not None and args.context < 1 or args.page_size < 1 or args.speculative < 0:
            raise ValueError("--context and --page-size must be >= 1, --speculative >= 0")
        if args.preset:
            from hcfjax.sim.deployment import model_config

            cfg, label = model_config(args.preset), f"preset {args.preset}"
        else:
            from hcfjax.api import DEFAULT_MODEL

            path = args.model or DEFAULT_MODEL
            cfg, label = read_config(path), str(path)
        if args.context is not None and args.context > cfg.max_position_embeddings:
            raise ValueError(
                f"--context {args.context} is longer than {label}'s context (max_position_embeddings"
                f" {cfg.max_position_embeddings})"
            )
        context = context_length(cfg.max_position_embeddings, args.context)
        if args.speculative and not cfg.num_mtp_layers:
            raise ValueError(f"--speculative {args.speculative} needs MTP layers; {label} has none")
        q = cfg.quantization
        if args.scheme and q is not None and q.fp8 is None and args.scheme != q.scheme:
            raise ValueError(
                f"{label} is quantised already ({q.scheme}), not to {args.scheme}: it is served in its own scheme only"
            )
        scheme = args.scheme or (q.scheme if q else "bf16")
        fits = [
            plan_fit(cfg, mesh, args.gpu, scheme, context, args.speculative, args.page_size)
            for mesh in args.mesh or [DEFAULT_MESH]
        ]
    except (OSError, ValueError) as e:  # ConfigError is a ValueError
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(report(cfg, label, fits, args.gpu, scheme, context, args.speculative))
    return 0
