"""The routing kernel (pallas_kernels/moe_route.py) against XLA's routing, on the GPU: checked, then timed.

`python -m hcfjax.bench.routing [--presets v2-lite,deepseek-v3] [--tokens 64,256]`: random tokens and router weights of
each preset's shape, some tokens padding. Each case checks that both sides choose the same experts (a row may
differ only where its k-th and next scores are within 1e-6: a tie that the last bit decides), the same weights to
1e-6, the same counts, and that the kernel's order sorts the copies by expert with pos its inverse; then times
`moe.route_kernel` against `moe.route` + `moe.expert_counts` + `moe.by_expert` (what a decode step runs), by kernel
time (CUPTI) and by device time (a jitted loop: launches included).
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from hcfjax import moe
from hcfjax.bench.common import device_time, header, kernel_times
from hcfjax.random_model import preset_config


def xla_routing(p, cfg, x, real):
    weights, ids = moe.route(p, cfg, x)
    e = p["router"].shape[-1]
    routed = jnp.where(real[:, None], ids, e).reshape(-1)
    order, pos = moe.by_expert(routed, e, pairwise=True)
    return weights, ids, (moe.expert_counts(routed, e), order, pos)


def kernel_routing(p, cfg, x, real):
    return moe.route_kernel(p, cfg, x, real, interpret=jax.default_backend() != "gpu")


def check(cfg, got, want, real) -> str:
    """'ok', or what differs."""
    (w1, i1, (g1, o1, p1)), (w0, i0, (g0, _, _)) = jax.tree.map(np.asarray, (got, want))
    e = cfg.n_routed_experts
    same = (np.sort(i1, -1) == np.sort(i0, -1)).all(-1)
    if not same.all():
        return f"{(~same).sum()} rows choose other experts"
    if not np.array_equal(i1, i0):
        return "the same experts in another order"
    if np.abs(w1 - w0).max() > 1e-6 * max(np.abs(w0).max(), 1.0):
        return f"weights differ by {np.abs(w1 - w0).max():.2e}"
    if not np.array_equal(g1, g0):
        return "counts differ"
    key = np.where(real[:, None], i1, e).reshape(-1)
    if not (np.diff(key[o1]) >= 0).all() or not np.array_equal(o1[p1], np.arange(key.size)):
        return "order is not by expert"
    return "ok"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--presets", default="v2-lite,deepseek-v3")
    ap.add_argument("--tokens", default="64,256")
    args = ap.parse_args(argv)
    print(header())
    rows = ["| preset | tokens | check | kernel: kernel time | XLA: kernel time (kernels) | kernel: device time | XLA |"]
    rows.append("|---|---|---|---|---|---|---|")
    for name in args.presets.split(","):
        cfg = preset_config(name)
        keys = jax.random.split(jax.random.key(0), 3)
        e, d = cfg.n_routed_experts, cfg.hidden_size
        p = {"router": jax.random.normal(keys[0], (d, e), jnp.float32) / np.sqrt(d)}
        if cfg.topk_method == "noaux_tc":
            p["router_bias"] = jax.random.normal(keys[1], (e,), jnp.float32) * 0.01
        for n in map(int, args.tokens.split(",")):
            x = jax.random.normal(jax.random.fold_in(keys[2], n), (n, d), jnp.float32).astype(jnp.bfloat16)
            real = jnp.arange(n) % 16 != 15
            fk = jax.jit(lambda p, x, r, cfg=cfg: kernel_routing(p, cfg, x, r))
            fx = jax.jit(lambda p, x, r, cfg=cfg: xla_routing(p, cfg, x, r))
            verdict = check(cfg, fk(p, x, real), fx(p, x, real), np.asarray(real))
            tk, tx = kernel_times(fk, p, x, real), kernel_times(fx, p, x, real)
            dk, dx = device_time(fk, p, x, real), device_time(fx, p, x, real)
            rows.append(
                f"| {name} | {n} | {verdict} | {sum(tk.values()) * 1e6:.1f} us ({len(tk)}) | "
                f"{sum(tx.values()) * 1e6:.1f} us ({len(tx)}) | {dk * 1e6:.1f} us | {dx * 1e6:.1f} us |"
            )
            print(rows[-1], flush=True)
    print("\n".join(rows))


if __name__ == "__main__":
    main()
