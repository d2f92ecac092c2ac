"""EP exchange benchmark: the decode plan's MoE layer with the dense all_to_all and with ragged_all_to_all.

    python -m hcfjax.bench.ep [--batches 32,128,256] [--reps 10] [--out FILE]     # GPUs (2 or more)
    python -m hcfjax.bench.ep --cpu-devices 4 --small                              # CPU smoke test, dense only

One DeepSeek-V3 MoE layer (hidden 7168; 256 routed experts of width 2048, top-8 within the top-4 of 8 groups,
noaux_tc; one shared expert; bf16 random weights, from the deepseek-v3 preset cut to that layer) under a decode plan
dp = ep = the devices (the largest power of two of them, so the 256 experts split evenly).

Checks, on a small batch (8 tokens per rank) with the router as initialised and with its bias pushed towards rank
0's experts (the receive buffer's worst case, as far as group-limited routing allows): the ragged and the dense
exchange give the same outputs, and both match the layer on one device (bf16 tolerance). A failed check prints
FAIL and makes the exit status 1.

Timings, per batch of tokens per rank and exchange (median of --reps after a warm-up):
  layer: routing, dispatch, the experts' grouped matmuls, combine and the shared expert;
  exchange alone: the same dispatch and combine (sort by slot, count exchange, both transfers) with the identity in
      place of the experts, on the layer's own routing; its share of the layer is the last column.
Rows sent per rank and direction: dense n_ranks x C (C = N x min(k, E_local), what the fixed capacity ships),
ragged the real N x k routed copies (including those a rank keeps). Rows are 7168 bf16 = 14 KiB.
XLA:CPU has no ragged_all_to_all, so on CPU only the dense exchange runs.
"""

from __future__ import annotations

import argparse
import sys
import time

SMALL = dict(  # --small: the same routing on tiny shapes
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_attention_heads=2,
    q_lora_rank=32,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=16,
    v_head_dim=16,
    n_routed_experts=64,
)


def moe_layer(small: bool):
    """(cfg, params of one MoE layer on the default device) in bf16."""
    import jax
    import jax.numpy as jnp

    from hcfjax.model import init_params
    from hcfjax.random_model import preset_config

    overrides = dict(num_hidden_layers=1, first_k_dense_replace=0, num_nextn_predict_layers=0, vocab_size=256)
    cfg = preset_config("deepseek-v3", **overrides, **(SMALL if small else {}))
    params = init_params(cfg, jax.random.key(0), jnp.bfloat16, mtp=False)
    (_, _, is_moe) = cfg.layer_segments[0]
    assert is_moe
    return cfg, jax.tree.map(lambda a: a[0], params["segments"][0]["mlp"])  # drop the stacking dim


def toward_rank0(p: dict, ranks: int) -> dict:
    """The layer with its router bias raised on rank 0's experts: routing as skewed as the group limit allows."""
    e = p["router_bias"].shape[0]
    return dict(p, router_bias=p["router_bias"].at[: e // ranks].add(10.0))


def run(args) -> tuple[str, bool]:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from hcfjax.bench.common import header, timed
    from hcfjax.moe import moe, route
    from sharding.ep import ep_experts
    from sharding.plans import decode_plan, param_specs, shard_params

    gpu = jax.default_backend() == "gpu"
    exchanges = ["dense", "ragged"] if gpu else ["dense"]
    ranks = 1 << (jax.device_count().bit_length() - 1)
    if ranks < 2:
        raise SystemExit("needs 2 or more devices (on CPU: --cpu-devices 4)")
    t_start = time.perf_counter()
    cfg, p = moe_layer(args.small)
    plan = decode_plan(ranks)
    specs = param_specs(p, plan)
    rows = NamedSharding(plan.mesh, P("ep"))
    d, k = cfg.hidden_size, cfg.num_experts_per_tok
    e_local = cfg.n_routed_experts // ranks
    print(f"{header()}; {ranks} ranks, {e_local} experts per rank; exchanges {exchanges}", flush=True)

    def layer(exchange):
        local = lambda p, x: moe(p, cfg, x, experts_fn=ep_experts("ep", exchange))
        return jax.jit(jax.shard_map(local, mesh=plan.mesh, in_specs=(specs, P("ep")), out_specs=P("ep")))

    def exchange_alone(exchange):
        run_ex = ep_experts("ep", exchange, compute=lambda p, r, e, opts: r)
        in_specs = (specs["experts"], P("ep"), P("ep"), P("ep"))
        return jax.jit(jax.shard_map(run_ex, mesh=plan.mesh, in_specs=in_specs, out_specs=P("ep")))

    def tokens(per_rank: int, seed: int):
        return jax.random.normal(jax.random.key(seed), (ranks * per_rank, d), jnp.bfloat16)

    # checks
    ok = True
    rel = lambda a, b: float(np.linalg.norm(a - b) / np.linalg.norm(b))
    single = jax.jit(lambda p, x: moe(p, cfg, x))
    layers = {ex: layer(ex) for ex in exchanges}
    for name, q in (("router as initialised", p), ("router biased to rank 0", toward_rank0(p, ranks))):
        x = tokens(8, 1)
        want = np.asarray(single(q, x), np.float32)
        q_sh = shard_params(q, plan)
        outs = {ex: np.asarray(f(q_sh, jax.device_put(x, rows)), np.float32) for ex, f in layers.items()}
        ids = np.asarray(jax.jit(lambda q, x: route(q, cfg, x)[1])(q, x))
        to_rank0 = float(np.mean(ids // e_local == 0))
        for ex, out in outs.items():
            err = rel(out, want)
            # ragged and dense feed the experts the same rows in the same order; only the combine's scatter-add
            # (atomics on a GPU) may round differently
            same = "" if ex == "dense" else f", vs dense {rel(out, outs['dense']):.2e}"
            good = err < 2e-2 and (ex == "dense" or rel(out, outs["dense"]) < 1e-3)
            ok &= good
            print(
                f"check {name} ({to_rank0:.0%} of copies to rank 0), {ex}: rel. error vs one device {err:.2e}"
                f"{same}: {'OK' if good else 'FAIL'}",
                flush=True,
            )
        del q_sh
    p_sh = shard_params(p, plan)

    table = []
    for b in args.batches:
        x = jax.device_put(tokens(b, 2), rows)
        weights, ids = jax.jit(lambda p, x: route(p, cfg, x))(p_sh, x)
        cap = b * min(k, e_local)
        for ex in exchanges:
            t_layer = timed(layers[ex], p_sh, x, reps=args.reps)
            t_ex = timed(exchange_alone(ex), p_sh["experts"], x, weights, ids, reps=args.reps)
            sent = ranks * cap if ex == "dense" else b * k
            row = (
                f"| {b} | {ex} | {sent} ({sent * d * 2 / 2**20:.1f} MiB) | {t_layer * 1e3:.3f} | {t_ex * 1e3:.3f} "
                f"| {t_ex / t_layer:.0%} |"
            )
            print(row, flush=True)
            table.append(row)
    shape = f"hidden {d}, {cfg.n_routed_experts} experts x width {cfg.moe_intermediate_size}, top-{k}"
    text = "\n".join(
        [
            "",
            f"{header()}; {jax.device_count()} devices, decode plan dp = ep = {ranks}; MoE layer {shape}"
            f"{' (--small)' if args.small else ''}, bf16; median of {args.reps}; checks "
            f"{'passed' if ok else 'FAILED'}; {time.perf_counter() - t_start:.0f} s in all",
            "",
            "| tokens per rank | exchange | rows sent per rank and direction | MoE layer (ms) | exchange alone (ms) "
            "| exchange share |",
            "|---|---|---|---|---|---|",
            *table,
        ]
    )
    return text, ok


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hcfjax.bench.ep", description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=lambda s: [int(v) for v in s.split(",")], default=[32, 128, 256])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--small", action="store_true", help="tiny shapes (a smoke test)")
    ap.add_argument("--cpu-devices", type=int, help="fake this many CPU devices")
    ap.add_argument("--out", help="also append the table to this file")
    args = ap.parse_args(argv)
    if args.cpu_devices:
        import jax

        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", args.cpu_devices)
    text, ok = run(args)
    print(text)
    if args.out:
        with open(args.out, "a") as f:
            f.write(text + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
