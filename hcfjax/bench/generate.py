"""Generation benchmark: decode tokens/s at several batch sizes and prefill tokens/s, through `hcfjax.generate`.

    python -m hcfjax.bench.generate [--preset v2-lite] [--scheme bf16|w4a16|w4a8|w4a8c8|w8a8|fp8] [--batches 1,32,128]
                                    [--prompt-len 512] [--new-tokens 128] [--prefill-len 4096] [--profile]
                                    [--out FILE]

Random weights of a real shape (default DeepSeek-V2-Lite: 27 layers, hidden 2048, 64 experts top-6, 2 shared,
kv_lora 512). Every figure is the second of two identical runs (the first compiles). The floor column is the time to
stream the bytes a decode step must read (weights of attention, dense and shared layers, the routed experts a batch
of that size touches in expectation, and the batch's KV cache) at the copy bandwidth measured in the same run.
--scheme quantises the random model as `hcfjax quantize` would (int4 experts run the Pallas grouped GEMM on a GPU;
w4a8c8 also decodes over an int8 cache); the MLA decode kernel runs on a GPU wherever its shapes apply
(HCFJAX_MLA, HCFJAX_INT4_KERNEL=0 turn the kernels off). --profile adds, per batch, where a decode step's GPU time
goes: the kernels of a profiler trace of the whole generate call less those of a one-token call (the prefill), per
decode step, longest first, and their sum against the step's wall time (the rest is launch gaps and host work).
Run it with XLA_FLAGS="--xla_dump_to=DIR --xla_dump_hlo_as_text" and the profile also says where each XLA fusion among
the longest came from (`hcfjax.bench.hlo_names`: the jax op and source line at its root).

--speculative K --forced-acceptance A1,..,AK (default batch 32, --context 2048) times instead the decode step of
k = 0..K MTP drafts at acceptance forced to those rates (benchmark only: the random model's heads are untrained), and
the output tokens/s it gives (hcfjax.bench.spec_step).
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import hcfjax
from hcfjax import cache as kvcache
from hcfjax.bench import spec_step
from hcfjax.bench.common import (
    copy_bandwidth,
    count,
    gpu_gaps,
    header,
    kernel_seconds,
    layers_per_iteration,
    matmul_flops,
    record_counts,
    torch_copy_bandwidth,
    traced_planes,
    write_records,
)
from hcfjax.bench.hlo_names import describe
from hcfjax.config import ModelConfig
from hcfjax.kernels import kernels_in_use
from hcfjax.options import Options
from hcfjax.quantize import default_cache_dtype
from hcfjax.random_model import PRESETS, preset_config, random_model
from hcfjax.tensor_specs import tensor_specs

SCHEMES = ("bf16", "w4a16", "w4a8", "w4a8c8", "w8a8", "fp8")


def decode_bytes(cfg: ModelConfig, params: dict, batch: int, context: int, cache_dtype=jnp.bfloat16) -> float:
    """Bytes one decode step must read at least: non-expert weights, expected touched experts, KV cache."""
    total = sum(x.nbytes for x in jax.tree.leaves(params))
    expert = sum(
        x.nbytes
        for seg in params["segments"]
        if "experts" in seg["mlp"]
        for x in jax.tree.leaves(seg["mlp"]["experts"])
    )
    e, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    touched = e * (1 - (1 - k / e) ** batch) / e if e else 0.0
    lm_and_embed = params["embed"].nbytes  # the embedding is gathered, not streamed
    kv = cfg.num_hidden_layers * batch * context * kvcache.entry_bytes(cfg.kv_dim, cache_dtype)
    return total - lm_and_embed - expert + expert * touched + kv


def decode_rate(
    model, batch: int, prompt_len: int, new_tokens: int, opts: Options, rng, max_prefill_tokens: int = 16384
) -> tuple[dict, Callable]:
    """Offline decoding of `batch` random prompts of `prompt_len` tokens for `new_tokens` each (no early stop; the mean
    context is prompt_len + new_tokens / 2), through `hcfjax.generate`: the stats of the second of two identical
    runs (decode_tokens_per_s, decode_s, ...; the first compiles), and the call that made them (gen(n)).
    max_prefill_tokens: generate's prefill groups (smaller: smaller MoE kernels to lower and compile; a server's
    token budget reuses the kernels its steps lowered)."""
    prompts = [list(rng.integers(2, model.cfg.vocab_size, prompt_len)) for _ in range(batch)]
    gen = lambda n: hcfjax.generate(  # noqa: E731
        model, prompts, max_new_tokens=n, stop_token_ids=[], options=opts, max_prefill_tokens=max_prefill_tokens
    )
    for _ in range(2):
        out = gen(new_tokens)
    return out.stats, gen


def run(args) -> str:
    opts = args.options
    n_mtp = (args.mtp_modules or args.speculative) if args.speculative else 0
    cfg = preset_config(args.preset, num_nextn_predict_layers=n_mtp)
    t0 = time.perf_counter()
    model = random_model(cfg, seed=0, dtype=jnp.bfloat16, scheme=None if args.scheme == "bf16" else args.scheme)
    n_params = sum(math.prod(s.shape) for s in tensor_specs(cfg))
    jax.block_until_ready(model.params)
    print(f"[random {args.preset} in {args.scheme}: {time.perf_counter() - t0:.0f} s]", file=sys.stderr, flush=True)
    if args.speculative:
        return spec_step.table(model, args.preset, args.scheme, n_params, args, opts, header())
    cache_dtype = default_cache_dtype(model)
    rng = np.random.default_rng(0)
    on_gpu = jax.devices()[0].platform == "gpu"  # the ceilings are a GPU's: a CPU's would make meaningless floors
    torch_bw = torch_copy_bandwidth() if on_gpu else None
    xla_bw = copy_bandwidth() if on_gpu else None
    bw = torch_bw or xla_bw
    flops = matmul_flops() if on_gpu else None

    kernels = kernels_in_use(cfg, model.params, cache_dtype, 64, opts)
    gb = sum(x.nbytes for x in jax.tree.leaves(model.params)) / 1e9
    weights = "bf16" if args.scheme == "bf16" else f"{args.scheme} ({gb:.2f} GB)"
    head = [
        f"## `python -m hcfjax.bench.generate --preset {args.preset} --scheme {args.scheme}`",
        "",
        f"{header()}; model {args.preset} with random weights, {count(n_params)} parameters, {weights}, "
        f"{jnp.dtype(cache_dtype).name} KV cache, page size 64; "
        + (f"{kernels}; " if "Pallas" in kernels else "")
        + f"batch-1 decode as two rows: {opts.on('two_rows')}, "
        f"decode layers a loop iteration: {layers_per_iteration(opts)}, "
        f"down projection's input quantised by the gate/up kernel: {opts.grouped_down_input}, "
        f"XLA's products (Options.xla_gemm) in decode: {opts.xla_gemm_mode()}, in prefill: "
        f"{opts.xla_gemm_mode(prefill=True)}.",
        "",
        ceilings_line(torch_bw, xla_bw, flops),
        "",
        "| phase | batch | tokens | tokens/s | time per step | floor | floor / time |",
        "|---|---|---|---|---|---|---|",
    ]
    print("\n".join(head), flush=True)

    rows, profiles, names = [], [], []
    for b in args.batches:
        s, gen = decode_rate(model, b, args.prompt_len, args.new_tokens, opts, rng)
        step = s["decode_s"] / (args.new_tokens - 1)
        context = args.prompt_len + args.new_tokens // 2
        floor = decode_bytes(cfg, model.params, b, context, cache_dtype) / bw if bw else None
        rows.append(
            f"| decode | {b} | {args.prompt_len} + {args.new_tokens} | {s['decode_tokens_per_s']:,.0f} | "
            f"{step * 1e3:.2f} ms | {floor_cells(floor, step, '.2f')} |"
        )
        print(rows[-1], flush=True)
        if args.profile:
            prof, top = step_profile(gen, args.new_tokens, b, step)
            profiles += prof
            names += [n for n in top if n not in names]
    if args.prefill_len:
        prompt = [list(rng.integers(2, cfg.vocab_size, args.prefill_len))]
        for _ in range(2):
            out = hcfjax.generate(model, prompt, max_new_tokens=1, stop_token_ids=[], options=opts)
        s = out.stats
        active = 2 * args.prefill_len * _active_params(cfg)
        attn = 2 * 2 * cfg.num_hidden_layers * cfg.num_attention_heads * args.prefill_len**2 * cfg.qk_head_dim / 2
        floor = (active + attn) / flops if flops else None
        rows.append(
            f"| prefill | 1 | {args.prefill_len} | {s['prefill_tokens_per_s']:,.0f} | "
            f"{s['prefill_s'] * 1e3:.1f} ms | {floor_cells(floor, s['prefill_s'], '.1f')} |"
        )
        print(rows[-1], flush=True)

    tail = [
        "",
        "decode floor = bytes a step must read (weights, expected routed experts touched, KV cache) / copy "
        "bandwidth; prefill floor = matmul FLOPs of active parameters + causal attention / bf16 matmul rate.",
    ]
    lines = tail
    if profiles:
        lines += [
            "",
            "Where a decode step's GPU time goes (--profile: kernel records of a profiler trace, per step):",
            "",
            "| batch | kernel | us per step | share of the step |",
            "|---|---|---|---|",
            *profiles,
        ]
    dump = re.search(r"--xla_dump_to=(\S+)", os.environ.get("XLA_FLAGS", ""))
    fusions = [n for n in names if "fusion" in n]
    if profiles and dump and fusions:
        lines += ["", f"Where those XLA fusions come from (`python -m hcfjax.bench.hlo_names {dump.group(1)} ...`):"]
        lines += ["", "```", *describe(Path(dump.group(1)), fusions), "```"]
    print("\n".join(lines), flush=True)
    return "\n".join(head + rows + lines)


def ceilings_line(torch_bw: float | None, xla_bw: float | None, flops: float | None) -> str:
    """The copy and matmul ceilings the floors divide by (bytes/s, FLOP/s), or why there are none."""
    if xla_bw is None or flops is None:
        return "Ceilings and floors: n/a on CPU (the copy bandwidth and matmul rate are measured on a GPU only)."
    bw = torch_bw or xla_bw
    return (
        f"Ceilings measured in this run: copy {bw / 1e12:.2f} TB/s ({'torch copy_' if torch_bw else 'XLA'}; "
        f"XLA elementwise {xla_bw / 1e12:.2f} TB/s), bf16 matmul {flops / 1e12:.0f} TFLOP/s (XLA, 8192^3)."
    )


def floor_cells(floor: float | None, took: float, fmt: str) -> str:
    """The table's "floor | floor / time" cells for a floor in seconds (None: no ceiling to derive it from)."""
    if floor is None:
        return "n/a | n/a"
    return f"{floor * 1e3:{fmt}} ms | {floor / took:.0%}"


def decode_profile(gen, new_tokens: int, records: str | None = None) -> dict:
    """generate's decode under the profiler, per decode step: a trace of gen(new_tokens) less one of gen(1) (the
    prefill and the first token), over its new_tokens - 1 steps. -> {"kernels": seconds by kernel name, "idle": GPU
    idle seconds, "counts": record_counts}; records: also write the gen(new_tokens) trace's records there."""
    sync = lambda _: None  # noqa: E731 (generate returns host values)
    whole = traced_planes(lambda: gen(new_tokens), reps=1, wait=sync)
    first = traced_planes(lambda: gen(1), reps=1, wait=sync)
    if records:
        write_records(records, whole)
    steps = new_tokens - 1

    def per_step(measure) -> dict[str, float]:
        before = measure(first)
        return {k: (v - before.get(k, 0.0)) / steps for k, v in measure(whole).items()}

    idle = (gpu_gaps(whole)[0] - gpu_gaps(first)[0]) / steps
    return {"kernels": per_step(kernel_seconds), "idle": idle, "counts": per_step(record_counts)}


def step_profile(gen, new_tokens: int, batch: int, step: float, top: int = 8) -> tuple[list[str], list[str]]:
    """Table rows: the decode's kernels per step (a trace of gen(new_tokens) less one of gen(1), the prefill and the
    first token), the `top` longest, then all of them against the step's wall time; and the `top` kernels' names."""
    per = {k: v for k, v in decode_profile(gen, new_tokens)["kernels"].items() if v > 0}
    if not per:
        return [f"| {batch} | (no GPU kernels in the trace) | | |"], []
    longest = sorted(per.items(), key=lambda kv: -kv[1])[:top]
    rows = [f"| {batch} | {name[:60]} | {t * 1e6:,.1f} | {t / step:.1%} |" for name, t in longest]
    total = sum(per.values())
    return rows + [f"| {batch} | all {len(per)} kernels | {total * 1e6:,.1f} | {total / step:.1%} |"], [
        name for name, _ in longest
    ]


def _active_params(cfg: ModelConfig) -> int:
    """Parameters a token multiplies by (routed experts: only its top-k; the embedding gather excluded)."""
    d, h = cfg.hidden_size, cfg.num_attention_heads
    q = d * cfg.q_lora_rank + cfg.q_lora_rank * h * cfg.qk_head_dim if cfg.q_lora_rank else d * h * cfg.qk_head_dim
    attn = q + d * cfg.kv_dim + cfg.kv_lora_rank * h * (cfg.qk_nope_head_dim + cfg.v_head_dim) + h * cfg.v_head_dim * d
    dense = 3 * d * cfg.intermediate_size
    moe = 3 * d * cfg.moe_intermediate_size * (cfg.num_experts_per_tok + cfg.n_shared_experts)
    n_moe = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    return cfg.num_hidden_layers * attn + n_moe * moe + (cfg.num_hidden_layers - n_moe) * dense + d * cfg.vocab_size


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m hcfjax.bench.generate",
        description=__doc__.split("\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ap.add_argument("--preset", default="v2-lite", choices=sorted(PRESETS), help="the random model's shape")
    ap.add_argument("--scheme", default="bf16", choices=SCHEMES, help="quantise the random model first")
    ap.add_argument("--profile", action="store_true", help="also show where a decode step's GPU time goes")
    ap.add_argument(
        "--batches", type=lambda s: [int(x) for x in s.split(",")], help="default 1,32,128 (--speculative: 32)"
    )
    ap.add_argument("--prompt-len", type=int, default=512, help="tokens of each decode row's prompt")
    ap.add_argument("--new-tokens", type=int, default=128, help="tokens each decode row generates")
    ap.add_argument("--prefill-len", type=int, default=4096, help="0: no prefill row")
    ap.add_argument("--out", help="append the table to this markdown file")
    ap.add_argument(
        "--two-rows",
        default="auto",
        choices=("auto", "on", "off"),
        help="batch-1 decode as two identical rows (Options.two_rows; auto: on GPUs)",
    )
    ap.add_argument(
        "--unroll-decode",
        metavar="{auto,on,off,N}",
        type=lambda s: s if s in ("auto", "on", "off") else int(s),
        help="unroll the decode step's layer loops, or run N layers a loop iteration (Options.unroll_decode; "
        "default: HCFJAX_UNROLL_DECODE, else auto: two layers on GPUs)",
    )
    ap.add_argument(
        "--grouped-down-input",
        default="default",
        choices=("default", "on", "off"),
        help="w4a8 experts: the gate/up kernel quantises the down projection's input in 128-channel groups "
        "(Options.grouped_down_input)",
    )
    spec = ap.add_argument_group("speculative step cost at forced acceptance (benchmark only)")
    spec.add_argument("--speculative", type=int, default=0, metavar="K", help="time k = 0..K MTP drafts per step")
    spec.add_argument(
        "--forced-acceptance",
        type=lambda s: tuple(float(x) for x in s.split(",")),
        metavar="A1,..,AK",
        help="probability that draft depth i is accepted given depth i-1 was (the simulator's acceptance), e.g. "
        "0.85,0.65,0.45",
    )
    spec.add_argument("--context", type=int, default=2048, help="tokens in every row's cache at the first step")
    spec.add_argument("--mtp-modules", type=int, help="MTP modules of the random model (default K: one per depth)")
    spec.add_argument("--spec-method", default="exact", choices=("exact", "rejection", "typical", "tuned"))
    spec.add_argument("--steps", type=int, default=16, help="decode steps timed per k")
    args = ap.parse_args(argv)
    if args.speculative:
        if args.forced_acceptance is None or len(args.forced_acceptance) < args.speculative:
            ap.error(f"--speculative {args.speculative} needs --forced-acceptance with {args.speculative} rates")
        if args.profile:
            ap.error("--profile covers plain decoding only")
    args.batches = args.batches or ([32] if args.speculative else [1, 32, 128])
    flag = {"auto": "auto", "on": True, "off": False}
    changes = dict(two_rows=flag[args.two_rows])
    if args.unroll_decode is not None:
        changes["unroll_decode"] = flag.get(args.unroll_decode, args.unroll_decode)
    if args.grouped_down_input != "default":
        changes["grouped_down_input"] = flag[args.grouped_down_input]
    args.options = Options.from_env(os.environ, **changes)  # HCFJAX_MLA etc. (hcfjax.options)
    table = run(args)  # plain decoding prints it as it goes: the header, each row as it is measured, the rest
    if args.speculative:
        print(table)
    if args.out:
        path = Path(args.out)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as f:
            f.write(table + "\n\n")


if __name__ == "__main__":
    main()
