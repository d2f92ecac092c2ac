"""A decode step's routing on its kernels (pallas_kernels.moe_route, `Options.fused_routing`) against XLA's
kernels as the model runs it without them (hcfjax.moe: the sum of the router's partial products, the jnp routing,
the experts' counts, the pairwise order and its inverse, the gathers of the copies' int8 rows and scales), on the
GPU.

    python -m pallas_kernels.bench.route [--tokens 64,256] [--gates v2-lite,deepseek-v3] [--warps 4,8,16]

A gate is a model preset's (hcfjax.random_model): its experts, top-k, scoring, group limit and row width. Each row
gives the kernels' time (CUPTI records, `hcfjax.bench.common.kernel_seconds`: the kernels alone, no gaps), the
launches a call runs (each a gap in a step), and whether the outputs equal XLA's: ids, group sizes, places, source
tokens and int8 rows exactly, weights within 1e-6. The kernels' label gives the choice's and the places' times
apart. --warps times the kernels at each warp count (default: theirs).
On a CPU the kernels run in Pallas's interpreter and only the checks are made.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from hcfjax.bench.common import header, kernel_seconds, record_counts, traced_planes
from hcfjax.moe import order_copies, route_on_kernels, route_spec
from hcfjax.options import Options
from hcfjax.random_model import preset_config
from pallas_kernels.moe_route import applies, default_warps, route_reference


def xla_routing(spec, e: int):
    """The model's routing without the kernel, as hcfjax.moe runs it on a GPU (pairwise order)."""

    def run(partials, bias, real, x_q):
        w, ids = route_reference(partials.sum(0), spec, bias)
        sizes, pos, token = order_copies(jnp.where(real[:, None], ids, e), e, Options(sort_free_routing=True))
        return w, ids, sizes, pos, token, (x_q[0][token], x_q[1][token])

    return jax.jit(run)


def inputs(cfg, n: int, rng):
    """The router's partial products (as hcfjax.moe.router_partials makes them: a slice of 128 of D each; dyadic, so
    that their sum is exact in any order), the bias, which rows are real, the tokens' int8 rows."""
    e, d = cfg.n_routed_experts, cfg.hidden_size
    partials = np.round(rng.normal(size=(d // 128, n, e)) * 2**10) / 2**12
    logits = jnp.asarray(partials.astype(np.float32))
    bias = jnp.asarray(rng.normal(size=e).astype(np.float32) * 0.1) if cfg.topk_method == "noaux_tc" else None
    real = jnp.asarray(np.arange(n) % 8 != 7)  # every eighth row padding, as a decode batch's idle slots
    x_q = (jnp.asarray(rng.integers(-127, 128, (n, d), dtype=np.int8)), jnp.asarray(rng.random(n, np.float32)))
    return logits, bias, real, x_q


def check(got, want) -> str:
    """'ok' where the kernels' outputs equal XLA's (weights within 1e-6 relative), else what differs."""
    names = ("weights", "ids", "group sizes", "places", "tokens", "rows")
    bad = []
    for name, a, b in zip(names, got, want, strict=True):
        if name == "weights":
            same = np.allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=0)
        elif name == "rows":  # the kernels' scales have a zero tail
            same = np.array_equal(np.asarray(a[0]), np.asarray(b[0]))
            same &= np.array_equal(np.asarray(a[1])[: len(b[1])], np.asarray(b[1]))
        else:
            same = np.array_equal(np.asarray(a), np.asarray(b))
        if not same:
            bad.append(name)
    return "ok" if not bad else "DIFFERS: " + ", ".join(bad)


def timed(fn, args) -> tuple[float | None, float | None, dict[str, float]]:
    """(microseconds of kernels a call, launches a call, microseconds by kernel name) on the GPU; (None, None, {})
    elsewhere."""
    if jax.default_backend() != "gpu":
        return None, None, {}
    planes = traced_planes(fn, *args, reps=50)
    per = {name: sec * 1e6 for name, sec in kernel_seconds(planes, 50).items()}
    return sum(per.values()), record_counts(planes, 50)["kernels"], per


def kernels_label(warps: int, per: dict[str, float]) -> str:
    """E.g. 'kernels, 4 warps (choose 4.1 + place 4.5)': the routing kernels' microseconds apart, where timed."""
    parts = [f"{name.removeprefix('moe_route_')} {us:.1f}" for name, us in per.items() if name.startswith("moe_route")]
    return f"kernels, {warps} warps" + (" (" + " + ".join(parts) + ")" if parts else "")


def run_case(gate: str, n: int, warps: list[int | None], rng) -> list[list[str]]:
    cfg = preset_config(gate)
    spec, e = route_spec(cfg), cfg.n_routed_experts
    if not applies(n, e):
        return [[gate, str(n), "kernels", "n/a", "n/a", f"past the kernels' tables ({n} x {e})"]]
    args = inputs(cfg, n, rng)
    want = xla_routing(spec, e)(*args)
    gpu = jax.default_backend() == "gpu"
    rows = []
    for w in warps:

        def kernel(partials, bias, real, x_q, w=w):  # as hcfjax.moe.moe routes on the kernels
            return route_on_kernels(partials, spec, bias, real, x_q, not gpu, num_warps=w)

        fn = jax.jit(kernel)
        us, launches, per = timed(fn, args)
        label = kernels_label(w or default_warps(n, e), per)
        rows.append([gate, str(n), label, _num(us), _num(launches, 0), check(fn(*args), want)])
    us, launches, _ = timed(xla_routing(spec, e), args)
    rows.append([gate, str(n), "XLA (the model without it)", _num(us), _num(launches, 0), "reference"])
    return rows


def _num(value, digits: int = 1) -> str:
    return "n/a (no GPU)" if value is None else f"{value:.{digits}f}"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="64,256", help="decode batches (tokens routed at once)")
    ap.add_argument("--gates", default="v2-lite,deepseek-v3", help="model presets whose gates route")
    ap.add_argument("--warps", default="", help="the kernels' warp counts to time (default: theirs)")
    args = ap.parse_args(argv)
    warps = [int(w) for w in args.warps.split(",") if w] or [None]
    rng = np.random.default_rng(0)
    print(header(), flush=True)
    lines = ["| gate | tokens | routing | us | launches | check |", "|---|---|---|---|---|---|"]
    for gate in args.gates.split(","):
        for n in (int(t) for t in args.tokens.split(",")):
            for row in run_case(gate, n, warps, rng):
                lines.append("| " + " | ".join(row) + " |")
                print(lines[-1], flush=True)
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    main()
