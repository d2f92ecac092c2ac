"""The tokens' int8 quantisation kernels (pallas_kernels/int8_rows.py: alone, and after the RMSNorm) against
`quantize_int8` and `rms_norm`, bit for bit, run by Pallas's interpreter on the CPU, and lowered for Hopper; and the
decode layer's callers sharing them."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hcfjax import quant
from hcfjax.layers import rms_norm
from hcfjax.options import Options
from pallas_kernels.int8_quant import quantize_int8
from pallas_kernels.int8_rows import BLOCK, MAX_ROWS, norm_quantize_rows, quantize_rows
from tests.conftest import jaxpr_eqns, jit_as_eager


def _rows(rng, m, k, dtype):
    """Normal rows at scales from 1e-3 to 1e3, one of zeros, one whose every value is a tie (v.5 after scaling)."""
    x = rng.normal(size=(m, k)) * 10.0 ** rng.uniform(-3, 3, size=(m, 1))
    x[0] = 0.0
    ties = np.arange(k) % 254 - 126.5  # scale 127 / 127 = 1: the integers are these rounded, ties to even
    ties[0] = 127.0
    x[1] = ties
    return jnp.asarray(x, dtype)


@pytest.mark.parametrize(
    "m, k, dtype",
    [(6, 2048, jnp.bfloat16), (5, 2816, jnp.bfloat16), (4, 300, jnp.float32), (3, 2 * BLOCK + 100, jnp.bfloat16)],
)
def test_kernel_equals_quantize_int8(m, k, dtype):
    """Powers of two and not, one block and three (the last partial); zeros get the 1e-8 floor's scale, ties go to
    the even integer."""
    x = _rows(np.random.default_rng(k), m, k, dtype)
    q, s = quantize_rows(x, interpret=True)
    q0, s0 = quantize_int8(x)
    assert q.dtype == jnp.int8 and s.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(s), np.asarray(s0))
    np.testing.assert_array_equal(np.asarray(q), np.asarray(q0))
    assert int(q[1, 1]) == -126 and int(q[1, 2]) == -124  # -125.5 -> -126, -124.5 -> -124


@pytest.mark.parametrize("m, k", [(5, 2048), (3, 300), (2, 2 * BLOCK + 100)])
def test_norm_kernel_equals_rms_norm_then_quantize_int8(m, k):
    """The normed rows are rms_norm's, run op by op (each op rounds: a jitted rms_norm may skip the bf16 rounding
    before the weight, XLA's excess precision), with the weight read from row 2 of a stack of three; the integers
    and scales are quantize_int8's of those rows."""
    rng = np.random.default_rng(k)
    x = jnp.asarray(rng.normal(size=(m, k)) * 10.0 ** rng.uniform(-2, 2, size=(m, 1)), jnp.bfloat16)
    w = jnp.asarray(rng.normal(size=(3, k)), jnp.bfloat16)
    h, q, s = norm_quantize_rows(x, w, 1e-6, jnp.int32(2), interpret=True)
    with jax.disable_jit():
        h0 = rms_norm(x, w[2], 1e-6)
    q0, s0 = quantize_int8(h0)
    assert h.dtype == jnp.bfloat16 and q.dtype == jnp.int8 and s.shape == (m,)
    np.testing.assert_array_equal(np.asarray(h, np.float32), np.asarray(h0, np.float32))
    np.testing.assert_array_equal(np.asarray(s), np.asarray(s0))
    np.testing.assert_array_equal(np.asarray(q), np.asarray(q0))


def test_lowers_for_hopper_with_exact_division_and_rounding():
    """The Triton kernels lower for sm_90 on any host, one program per row, with IEEE division and ties-to-even
    rounding as inline PTX; the norm's weight is one operand, the whole stack."""
    from pallas_kernels.cross_lower import lower_triton_for_hopper

    spec = jax.ShapeDtypeStruct
    text = lower_triton_for_hopper(quantize_rows, spec((64, 2816), jnp.bfloat16))
    assert "__gpu$xla.gpu.triton" in text and "grid_x = 64" in text
    assert "div.rn.f32" in text and "cvt.rni.f32.f32" in text
    norm = lambda x, w, i: norm_quantize_rows(x, w, 1e-6, i)  # noqa: E731
    text = lower_triton_for_hopper(
        norm, spec((64, 2048), jnp.bfloat16), spec((27, 2048), jnp.bfloat16), spec((), jnp.int32)
    )
    assert "rms_norm_int8_rows" in text and "grid_x = 64" in text and "div.rn.f32" in text


def test_decode_layers_norm_and_quantise_on_one_kernel(monkeypatch):
    """Each block whose first products take int8 tokens (attention's q_a and kv_a, the dense MLP's gate/up, the
    routed and shared experts) has them from the norm's kernel, and quantises them nowhere else: the same bits as
    the norm in XLA and the tokens quantised on their own kernel (XLA compiling both without excess precision)."""
    from hcfjax import model
    from hcfjax.quantize import quantize_model
    from hcfjax.random_model import preset_config, random_model

    wide = dict(num_hidden_layers=3, first_k_dense_replace=1, hidden_size=128, q_lora_rank=128, kv_lora_rank=128)
    wide.update(qk_rope_head_dim=64, moe_intermediate_size=128, intermediate_size=128)
    wide.update(n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1)  # (interpreted: few experts)
    m = quantize_model(random_model(preset_config("tiny-v3", **wide), dtype=jnp.bfloat16), "w4a8c8")
    tokens, positions = jnp.asarray([[5, 9, 200]], jnp.int32), jnp.arange(3, dtype=jnp.int32)[None]

    def run():  # a new function each time: jax would reuse the first one's trace
        fwd = lambda p: model.hidden_states(p, m.cfg, tokens, positions, opts=Options(moe="interpret"))[0]  # noqa: E731
        jitted = jit_as_eager(fwd)
        eqns = jaxpr_eqns(jitted.trace(m.params).jaxpr.jaxpr)
        calls = [e for e, _ in eqns if e.primitive.name == "pallas_call"]
        names = [e.params["name"] for e in calls]
        weights = {e.invars[1].aval.shape for e in calls if e.params["name"] == "rms_norm_int8_rows"}
        return (
            np.asarray(jitted(m.params), np.float32),
            names.count("rms_norm_int8_rows"),
            names.count("quantize_int8_rows"),
            weights,
        )

    fused, norms, quantised, weights = run()
    monkeypatch.setattr(model, "int8_tokens", lambda *a, **k: False)
    alone, norms_alone, quantised_alone, _ = run()
    # Per segment traced (one dense layer, then two MoE layers in one loop). Alone: q_a and kv_a, q_b and o, the dense
    # MLP's gate/up and down, the experts', the shared gate/up and down. Fused: a norm kernel for each of the four
    # blocks; quantised alone only what no norm feeds: q_b's input (the normed q_a), o's (the attention's output) and
    # the down projections' hidden.
    assert (norms, norms_alone, quantised, quantised_alone) == (4, 0, 6, 13)
    assert weights == {(128,), (2 * 128,)}  # each segment's whole stack (one dense layer, two MoE), flattened
    np.testing.assert_array_equal(fused, alone)


def test_an_expert_parallel_moe_block_takes_no_int8_rows_for_its_experts():
    """model.int8_tokens: a w4a8 MoE block's routed experts take int8 tokens where they run locally; under an
    expert-parallel experts_fn (which ships bf16 tokens and quantises what it receives) nothing in the block does, so
    its norm writes no int8 rows (w4a8 keeps the shared experts bf16)."""
    from hcfjax import model
    from hcfjax.quantize import quantize_model
    from hcfjax.random_model import preset_config, random_model

    m = quantize_model(random_model(preset_config("tiny-v3", num_hidden_layers=2), dtype=jnp.bfloat16), "w4a8")
    moe_block = jax.tree.map(lambda a: a[0], m.params["segments"][1]["mlp"])
    x, opts = jnp.zeros((2, 1, m.cfg.hidden_size), jnp.bfloat16), Options(moe="interpret")
    assert model.int8_tokens(x, moe_block, opts) is True
    assert model.int8_tokens(x, moe_block, opts, local_experts=False) is False


def test_tokens_quantised_on_the_kernel_only_where_it_applies(monkeypatch):
    """quant.token_quant_mode under auto on a GPU: the kernel for a decode step's bf16 rows; XLA for f32 rows and
    prefill-sized chunks. quantize_tokens then gives quantize_int8's values either way."""
    from hcfjax import options

    monkeypatch.setattr(options, "on_gpu", lambda: True)
    auto = Options(moe="auto")
    assert quant.token_quant_mode(jnp.zeros((64, 256), jnp.bfloat16), auto) == "kernel"
    assert quant.token_quant_mode(jnp.zeros((2, 32, 256), jnp.bfloat16), auto) == "kernel"
    assert quant.token_quant_mode(jnp.zeros((64, 256), jnp.float32), auto) == "reference"
    assert quant.token_quant_mode(jnp.zeros((MAX_ROWS + 1, 256), jnp.bfloat16), auto) == "reference"
    assert quant.token_quant_mode(jnp.zeros((64, 256), jnp.bfloat16), Options(moe="reference")) == "reference"
    x = _rows(np.random.default_rng(0), 2 * 4, 256, jnp.bfloat16).reshape(2, 4, 256)
    for mode in ("interpret", "reference"):
        q, s = quant.quantize_tokens(x, mode)
        q0, s0 = quantize_int8(x)
        assert q.shape == x.shape and s.shape == x.shape[:-1]
        np.testing.assert_array_equal(np.asarray(q), np.asarray(q0))
        np.testing.assert_array_equal(np.asarray(s), np.asarray(s0))
