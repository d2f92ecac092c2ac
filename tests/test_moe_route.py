"""The routing kernels (pallas_kernels/moe_route.py, Triton lowering, run by Pallas's interpreter here) against the
jnp routing the model runs elsewhere (`route_reference`, itself checked against DeepSeek's gate in
test_moe_gate.py) and a stable argsort of the copies; and the MoE block on them against the block without them."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.moe_route import (
    RouteSpec,
    adds_partials,
    applies,
    copies_reference,
    route_copies,
    route_reference,
)

V3_GATE = RouteSpec(top_k=4, scoring="sigmoid", groups=4, top_groups=2, group_score="top2", normalise=True, factor=2.5)
V2_GATE = RouteSpec(top_k=6, groups=8, top_groups=3, normalise=True)  # DeepSeek-V2's 160 experts, group-limited
V3_FULL = RouteSpec(top_k=8, scoring="sigmoid", groups=8, top_groups=4, group_score="top2", normalise=True, factor=2.5)
CASES = [  # tokens, experts, spec, bias, row width (0: no int8 rows)
    (37, 64, RouteSpec(top_k=6, factor=1.5), False, 160),  # V2-Lite's gate, tokens over three programs
    (20, 32, V3_GATE, True, 96),  # noaux_tc: sigmoid, a bias, groups scored by their best two
    (3, 20, RouteSpec(top_k=3, normalise=True), False, 64),  # experts not a power of two
    (17, 160, V2_GATE, False, 0),
    (16, 256, V3_FULL, True, 0),  # DeepSeek-V3's gate
]


@pytest.mark.parametrize("n, e, spec, bias, d", CASES)
def test_kernel_routes_and_orders_as_the_references(n, e, spec, bias, d):
    """Same ids, group sizes, places, source tokens and int8 rows as the references, weights within an ulp, the
    scales' tail zeros; the padding tokens' copies after every real one, in token order. Ties in the logits
    (repeated values) take the lower expert first, as lax.top_k."""
    rng = np.random.default_rng(n)
    logits = rng.normal(size=(n, e)).astype(np.float32)
    logits[:, e // 2] = logits[:, 1]  # ties
    logits = jnp.asarray(logits)
    b = jnp.asarray(rng.normal(size=e).astype(np.float32)) if bias else None
    real = jnp.asarray(rng.random(n) < 0.75)
    x_q = None
    if d:
        x_q = (jnp.asarray(rng.integers(-127, 128, (n, d), dtype=np.int8)), jnp.asarray(rng.random(n, np.float32)))
    tail = 3 * n  # the scales' zero tail: not a power of two, longer than a block
    w, ids, sizes, pos, token, rows = route_copies(logits, spec, b, real, x_q, interpret=True, scales_tail=tail)
    want_w, want_ids = route_reference(logits, spec, b)
    want_sizes, want_pos, want_token, want_rows = copies_reference(want_ids, e, real, x_q)
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_allclose(w, want_w, rtol=3e-7, atol=0)
    np.testing.assert_array_equal(sizes, want_sizes)
    np.testing.assert_array_equal(pos, want_pos)
    np.testing.assert_array_equal(token, want_token)
    real_copies = int(np.asarray(real).sum()) * spec.top_k
    assert (np.asarray(pos).reshape(n, -1)[~np.asarray(real)] >= real_copies).all()
    if d:
        np.testing.assert_array_equal(rows[0], want_rows[0])
        np.testing.assert_array_equal(rows[1][: n * spec.top_k], want_rows[1])
        np.testing.assert_array_equal(rows[1][n * spec.top_k :], np.zeros(tail, np.float32))
    else:
        assert rows is None


@pytest.mark.parametrize("hidden", [128, 256])  # the router's product whole, and as two partial products
def test_moe_block_on_the_kernel_equals_the_block_without_it(hidden):
    """moe.moe with Options.fused_routing and the GEMM kernels' mode 'interpret' routes a decode batch on the
    kernels (two pallas_calls, the choice and the places, no argsort or pairwise order left, no sum of the router's
    partial products); its output and load are the XLA routing's, padding rows zero. Without the option, or past
    `applies`, XLA routes."""
    import dataclasses

    from hcfjax import moe
    from hcfjax.options import Options
    from hcfjax.random_model import preset_config, random_model
    from tests.conftest import jaxpr_eqns

    cfg = dataclasses.replace(preset_config("tiny-v3"), hidden_size=hidden)
    layer = jax.tree.map(lambda a: a[0], random_model(cfg, dtype=jnp.float32).params["segments"][1]["mlp"])
    x = jax.random.normal(jax.random.key(1), (6, cfg.hidden_size), jnp.float32)
    real = jnp.asarray([True, True, False, True, True, False])

    def block(opts):
        return jax.jit(lambda p, x: moe.moe(p, cfg, x, with_load=real, opts=opts, real=real))

    fused = Options(moe="interpret", fused_routing=True)
    got, load = block(fused)(layer, x)
    want, want_load = block(Options(moe="reference"))(layer, x)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(load, want_load)
    eqns = [e for e, _ in jaxpr_eqns(block(fused).trace(layer, x).jaxpr.jaxpr)]
    names = [e.params["name"] for e in eqns if e.primitive.name == "pallas_call"]
    assert names.count("moe_route_choose") == names.count("moe_route_place") == 1
    assert not any(e.primitive.name in ("sort", "scatter") for e in eqns)
    partial_sums = [e for e in eqns if e.primitive.name == "reduce_sum" and e.invars[0].aval.shape[1:] == (6, 16)]
    assert not partial_sums  # the router's partial products [C, 6 tokens, 16 experts] added by the choice kernel
    casts = [e for e in eqns if e.primitive.name == "convert_element_type" and e.invars[0].aval.shape == (6,)]
    assert not casts  # the real-rows mask goes into the kernels as it is (a cast is a launch each layer)
    ep = lambda p, x, w, i, opts: jnp.zeros_like(x)  # noqa: E731  (an expert-parallel plan's experts_fn)
    ep_eqns = jax.make_jaxpr(lambda p, x: moe.moe(p, cfg, x, experts_fn=ep, opts=fused))(layer, x).jaxpr
    assert not any(str(e.params.get("name")).startswith("moe_route") for e, _ in jaxpr_eqns(ep_eqns))
    assert moe.route_mode(6, cfg.n_routed_experts, fused) == "interpret"
    assert moe.route_mode(6, cfg.n_routed_experts, Options(moe="interpret")) == "reference"  # auto: GPUs only
    assert moe.route_mode(257, cfg.n_routed_experts, fused) == "reference"
    from hcfjax.kernels import kernels_in_use  # what `serve` and the benchmarks say a decode step runs

    params = {"embed": jnp.zeros((1, cfg.hidden_size)), "segments": [{"mlp": {"experts": layer["experts"]}}]}
    said = [kernels_in_use(cfg, params, jnp.float32, 16, o) for o in (fused, Options(moe="interpret"))]
    assert said[0].endswith("XLA ragged_dot experts, Pallas routing") and "routing" not in said[1]
    assert applies(256, 64) and applies(256, 256) and not applies(257, 64) and not applies(64, 4096)


def test_lowers_for_hopper():
    """The kernels lower for sm_90 at a decode step's shapes (V2-Lite at batch 256 with its int8 rows, V3's gate at
    batch 64, V2's 160 experts in groups at batch 32), one program per 16 tokens each, with IEEE division."""
    from pallas_kernels.cross_lower import lower_triton_for_hopper

    spec = jax.ShapeDtypeStruct
    v2 = lambda lg, r, q, s: route_copies(lg, RouteSpec(top_k=6), None, r, (q, s))  # noqa: E731
    text = lower_triton_for_hopper(
        v2,
        spec((256, 64), jnp.float32),
        spec((256,), jnp.bool_),
        spec((256, 2048), jnp.int8),
        spec((256,), jnp.float32),
    )
    assert "moe_route_choose" in text and "moe_route_place" in text and "div.rn.f32" in text
    assert text.count("grid_x = 16") == 2
    v3 = RouteSpec(top_k=8, scoring="sigmoid", groups=8, top_groups=4, group_score="top2", normalise=True, factor=2.5)
    text = lower_triton_for_hopper(
        lambda lg, b: route_copies(lg, v3, b), spec((64, 256), jnp.float32), spec((256,), jnp.float32)
    )
    assert text.count("grid_x = 4") == 2
    text = lower_triton_for_hopper(lambda lg: route_copies(lg, V2_GATE), spec((32, 160), jnp.float32))  # groups looped
    assert text.count("grid_x = 2") == 2


def test_a_nan_row_still_gives_every_copy_one_place():
    """A token whose scores are NaN (bad input) still gets K distinct experts, and every copy a place of its own: the
    places are a permutation, each place's token and int8 row are its copy's, and the other tokens route as the
    reference routes them (no write lands outside the outputs or on another token's row)."""
    n, e, k, d = 9, 16, 4, 32
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(n, e)).astype(np.float32)
    logits[2, 5] = np.nan
    x_q = (jnp.asarray(rng.integers(-127, 128, (n, d), dtype=np.int8)), jnp.asarray(rng.random(n, np.float32)))
    spec = RouteSpec(top_k=k)
    _, ids, _, pos, token, rows = route_copies(jnp.asarray(logits), spec, x_q=x_q, interpret=True)
    ids, pos, token = np.asarray(ids), np.asarray(pos), np.asarray(token)
    assert all(len(set(row)) == k and row.min() >= 0 and row.max() < e for row in ids)
    np.testing.assert_array_equal(np.sort(pos), np.arange(n * k))
    np.testing.assert_array_equal(token[pos], np.arange(n * k) // k)
    np.testing.assert_array_equal(np.asarray(rows[0])[pos], np.repeat(np.asarray(x_q[0]), k, axis=0))
    clean = np.arange(n) != 2
    np.testing.assert_array_equal(ids[clean], np.asarray(route_reference(jnp.asarray(logits), spec)[1])[clean])


@pytest.mark.parametrize("e", [20, 32])  # groups scored by loops (experts not a power of two) and as one 3-D view
def test_groups_scored_minus_infinity_are_still_picked_in_order(e):
    """A bias of -inf leaves group 0 one finite expert pair and group 1 one finite expert (its top-2 score -inf),
    the others none: the second group kept is the lowest of the -inf ones not yet kept, as the reference keeps it,
    not group 0 again."""
    spec = RouteSpec(top_k=6, scoring="sigmoid", groups=4, top_groups=2, group_score="top2")
    size = e // 4
    bias = np.full(e, -np.inf, np.float32)
    bias[:size] = 0
    bias[2 * size - 1] = 0
    logits = jnp.asarray(np.linspace(-1, 1, 2 * e, dtype=np.float32).reshape(2, e))
    _, ids, *_ = route_copies(logits, spec, jnp.asarray(bias), interpret=True)
    np.testing.assert_array_equal(ids, route_reference(logits, spec, jnp.asarray(bias))[1])


def test_the_choice_adds_the_routers_partial_products():
    """Given the router's product as partial products [C, N, E] (V2-Lite's slices of D), the kernels route as from
    their sum: dyadic partials, so the sum is exact in any order and the outputs must be equal. V3's larger sums are
    left to XLA (`adds_partials`)."""
    n, e, c, d = 21, 64, 16, 32
    rng = np.random.default_rng(5)
    partials = jnp.asarray(np.round(rng.normal(size=(c, n, e)) * 2**10).astype(np.float32) / 2**12)
    real = jnp.asarray(rng.random(n) < 0.8)
    x_q = (jnp.asarray(rng.integers(-127, 128, (n, d), dtype=np.int8)), jnp.asarray(rng.random(n, np.float32)))
    spec = RouteSpec(top_k=6, factor=1.5)
    got = route_copies(partials, spec, None, real, x_q, interpret=True)
    want = route_copies(partials.sum(0), spec, None, real, x_q, interpret=True)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(a, b)
    assert adds_partials(16, 64, 64) and adds_partials(16, 256, 64) and not adds_partials(56, 64, 256)
