"""Per-rank expert load with and without live EPLB, from the serving engine under a decode plan.

    python -m hcfjax.bench.eplb --cpu-devices 8 [--ranks 8] [--experts 64] [--redundant 16] [--slots 8]
        [--requests 64] [--new-tokens 48] [--interval 8] [--window 32] [--nodes 1] [--skew 0.5] [--out FILE]

A random tiny-v3-shaped model with `--experts` routed experts (8 groups, top-8, like DeepSeek-V3's routing) gets a
skewed router: each MoE layer's bias (noaux_tc's e_score_correction_bias) favours experts Zipf-like (bias of the
k-th hottest = skew / k^1.2), with a different hot set per layer. The engine serves --requests random prompts on
--ranks attention-DP / EP ranks with EPLB re-placing the experts every --interval steps from the last --window
steps' routed loads, in E + --redundant physical slots; with --nodes > 1 the ranks span that many nodes and the
placement is hierarchical (groups packed onto nodes, replicas kept on their group's node).

Each step's routed tokens per expert (the engine's own counters, real rows only) give the tokens per rank under two
layouts: without EPLB (experts in order, E / ranks per rank, no replicas: the plain decode plan) and with the
placement that step actually ran with. Routing does not depend on the placement (the engine's tokens equal
generate's), so both rows are the same tokens. Imbalance = max / mean tokens per rank, averaged over MoE layers;
reported per step (mean over steps) and over the whole run; EPLB's rows cover the steps after its first
re-placement. An expert's tokens spread over its replicas round-robin (sharding/ep.py), counted here as an even split.
"""

from __future__ import annotations

import argparse
import sys
import time


def skewed_model(experts: int, skew: float, seed: int):
    import jax.numpy as jnp
    import numpy as np

    from hcfjax.random_model import preset_config, random_model

    cfg = preset_config("tiny-v3", n_routed_experts=experts, n_group=8, topk_group=4, num_experts_per_tok=8)
    model = random_model(cfg, seed=seed, dtype=jnp.float32)
    rng = np.random.default_rng(seed)
    zipf = skew / np.arange(1, experts + 1) ** 1.2
    segments = []
    for seg, (_, count, is_moe) in zip(model.params["segments"], cfg.layer_segments, strict=True):
        if is_moe:
            bias = np.stack([rng.permutation(zipf) for _ in range(count)]).astype(np.float32)  # [count, E]
            seg = dict(seg, mlp=dict(seg["mlp"], router_bias=jnp.asarray(bias)))
        segments.append(seg)
    return type(model)(cfg, dict(model.params, segments=segments), model.tokenizer)


def run(args) -> str:
    import jax
    import numpy as np

    from hcfjax.bench.common import header
    from hcfjax.engine import Engine, EngineConfig
    from sharding.eplb import gpu_loads, imbalance
    from sharding.plans import decode_plan

    model = skewed_model(args.experts, args.skew, args.seed)
    cfg = model.cfg
    config = EngineConfig(
        max_slots=args.slots,
        dp=args.ranks,
        token_budget=args.slots * args.ranks * 32,
        max_prefill_rows=args.slots,
        max_model_len=256,
        eplb_interval=args.interval,
        eplb_redundant=args.redundant,
        eplb_window=args.window,
        eplb_nodes=args.nodes,
    )
    engine = Engine(model, config, decode_plan=decode_plan(args.ranks))
    eplb = engine.runner.eplb
    rng = np.random.default_rng(args.seed)
    for _ in range(args.requests):
        prompt = rng.integers(2, cfg.vocab_size, int(rng.integers(8, 32))).tolist()
        engine.submit(prompt, max_new_tokens=args.new_tokens, stop_token_ids=[])
    t0 = time.perf_counter()
    placements = {}  # engine step -> the placement it was dispatched with
    loads = {}  # engine step -> its routed tokens per expert [L, E]
    while engine.has_work() or engine._inbox:
        placement = eplb.placement
        engine.step()
        placements[engine.steps] = placement
        w = eplb.window
        if w.step not in loads and w.step:  # the step processed in this iteration (one step late)
            loads[w.step] = w.counts[(w.step - 1) % len(w.counts)].copy()
    seconds = time.perf_counter() - t0

    e, r = cfg.n_routed_experts, args.ranks
    static = (np.tile(np.arange(e), (len(loads[1]), 1)), None, np.ones((len(loads[1]), e)))  # no EPLB
    first = eplb.history[0][0] if eplb.history else len(loads)
    after = [s for s in sorted(loads) if s > first]  # dispatched after the first re-placement
    rows = []
    for name, steps, layout in (
        ("without EPLB (E / ranks experts per rank), all steps", sorted(loads), lambda s: static),
        ("without EPLB, the steps after the first re-placement", after, lambda s: static),
        (
            f"live EPLB (+{args.redundant} slots, every {args.interval} steps, {args.nodes} node(s)), same steps",
            after,
            placements.get,
        ),
    ):
        per_rank = [gpu_loads(loads[s], layout(s)[0], layout(s)[2], r) for s in steps]  # [L, ranks] each
        per_step = np.mean([imbalance(x) for x in per_rank]) if steps else float("nan")
        total = imbalance(np.sum(per_rank, 0)) if steps else float("nan")
        rows.append(f"| {name} | {len(steps)} | {per_step:.2f} | {total:.2f} |")
    predicted = ", ".join(f"{b:.2f} -> {a:.2f}" for _, b, a in list(eplb.history)[:6])
    return "\n".join(
        [
            f"{header()}, {jax.device_count()} devices; decode plan dp = ep = {r}",
            f"model: tiny-v3 shape, {e} routed experts, top-{cfg.num_experts_per_tok}, {cfg.n_group} groups "
            f"(top-{cfg.topk_group}), {len(loads[1])} MoE layers, router bias skew {args.skew}; "
            f"{args.requests} requests x {args.new_tokens} tokens, {args.slots} slots per rank; "
            f"{engine.steps} steps in {seconds:.0f} s, {eplb.rebalances} re-placements "
            f"(window {args.window} steps), compiles {engine.snapshot()['compiles']}",
            "",
            "| layout | steps | imbalance per step (mean) | imbalance over the steps |",
            "|---|---|---|---|",
            *rows,
            "",
            f"EPLB's own estimate on its window at the first re-placements (current -> new): {predicted}",
        ]
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hcfjax.bench.eplb", description=__doc__.split("\n")[0])
    ap.add_argument("--cpu-devices", type=int, help="fake this many CPU devices")
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--redundant", type=int, default=16)
    ap.add_argument("--slots", type=int, default=8, help="decode slots per rank")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--interval", type=int, default=8)
    ap.add_argument("--window", type=int, default=32)
    ap.add_argument(
        "--nodes", type=int, default=1, help="nodes the ranks span (hierarchical EPLB if it divides 8 groups)"
    )
    ap.add_argument("--skew", type=float, default=0.5, help="router bias of each layer's hottest expert")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="also append the table to this file")
    args = ap.parse_args(argv)
    if args.cpu_devices:
        import jax

        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", args.cpu_devices)
    text = run(args)
    print(text)
    if args.out:
        with open(args.out, "a") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
