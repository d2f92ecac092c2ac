"""The routing kernel (pallas_kernels/moe_route.py, Options.routing_kernel) against XLA's routing (`moe.route`,
`expert_counts`, `by_expert`), run by Pallas's interpreter on the CPU and lowered for Hopper; and an MoE layer routed
by it, bit for bit the same as routed by XLA."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hcfjax import moe
from hcfjax.bench.routing import check, kernel_routing, xla_routing
from hcfjax.options import Options
from hcfjax.random_model import preset_config
from tests.conftest import FIXTURES

GATES = {
    "v2-lite greedy softmax": ("v2-lite", {}),
    "group-limited softmax, 40 experts": (
        "v2-lite",
        dict(n_routed_experts=40, topk_method="group_limited_greedy", n_group=8, topk_group=3),
    ),
    "noaux_tc sigmoid with bias": ("deepseek-v3", dict(n_routed_experts=64, n_group=8, topk_group=4)),
    "top-1 softmax": ("v2-lite", dict(num_experts_per_tok=1)),
}


@pytest.mark.parametrize("gate", list(GATES))
def test_kernel_routes_as_xla(gate):
    """Same experts in the same order, same weights and counts; the copies ordered by expert, padding tokens last.
    Rows of one token repeated check the tie rule (the lowest expert first among equal scores)."""
    preset, overrides = GATES[gate]
    cfg = dataclasses.replace(preset_config(preset), hidden_size=256, **overrides)
    rng = np.random.default_rng(len(gate))
    e, n = cfg.n_routed_experts, 24
    p = {"router": jnp.asarray(rng.normal(size=(256, e)) / 16, jnp.float32)}
    if cfg.topk_method == "noaux_tc":
        p["router_bias"] = jnp.asarray(rng.normal(size=e) * 0.05, jnp.float32)
    x = rng.normal(size=(n, 256))
    x[5] = 0.0  # every score equal
    x = jnp.asarray(x, jnp.bfloat16)
    real = jnp.asarray(np.arange(n) % 7 != 3)
    got = kernel_routing(p, cfg, x, real)
    assert check(cfg, got, jax.jit(xla_routing, static_argnums=1)(p, cfg, x, real), np.asarray(real)) == "ok"
    counts = np.asarray(got[2][0])
    assert counts.shape == (e,) and counts.sum() == (np.asarray(real).sum()) * cfg.num_experts_per_tok
    if gate == "v2-lite greedy softmax":
        np.testing.assert_array_equal(np.asarray(got[1][5]), np.arange(cfg.num_experts_per_tok))


@pytest.mark.parametrize("fixture", ["tiny_v3", "tiny_v2_lite"])
def test_moe_layer_routed_by_the_kernel_is_bit_equal(fixture):
    """A fixture's MoE layer (its first), padding tokens included: the kernel's copies of one expert may come in
    another order, which no row's product sees."""
    model = hcfjax_load(fixture)
    layer = next(s for s in model.params["segments"] if "experts" in s["mlp"])
    p = jax.tree.map(lambda a: a[0], layer["mlp"])
    x = jax.random.normal(jax.random.key(1), (2, 9, model.cfg.hidden_size), jnp.float32)
    real = jnp.arange(18).reshape(2, 9) % 5 != 4
    run = jax.jit(lambda p, x, real, opts: moe.moe(p, model.cfg, x, opts=opts, real=real), static_argnums=3)
    want = run(p, x, real, Options(routing_kernel=False))
    got = run(p, x, real, Options(routing_kernel=True))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def hcfjax_load(name):
    import hcfjax

    return hcfjax.load(FIXTURES / name, dtype=jnp.float32)


def test_lowers_for_hopper_one_program_a_token():
    """The kernel lowers for sm_90 on any host: a program a token, the counters' atomic adds, IEEE division."""
    from pallas_kernels.cross_lower import lower_triton_for_hopper
    from pallas_kernels.moe_route import route

    spec = jax.ShapeDtypeStruct
    run = lambda p, b, r: route(p, b, r, top_k=8, scoring="sigmoid", groups=8, keep=4, group_score="top2")  # noqa: E731
    text = lower_triton_for_hopper(run, spec((16, 64, 256), jnp.float32), spec((256,), jnp.float32), spec((64,), bool))
    assert "moe_route" in text and "grid_x = 64" in text and "atom" in text and "div.rn.f32" in text


def test_option_from_the_environment():
    assert Options.from_env({"HCFJAX_ROUTING_KERNEL": "1"}).routing_kernel is True
    assert not Options().on("routing_kernel")
    with pytest.raises(ValueError, match="HCFJAX_ROUTING_KERNEL"):
        Options.from_env({"HCFJAX_ROUTING_KERNEL": "yes"})
