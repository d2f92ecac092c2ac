"""The tokens' int8 quantisation kernel (pallas_kernels/int8_rows.py) against `quantize_int8`, bit for bit, run by
Pallas's interpreter on the CPU, and lowered for Hopper; and the decode layer's callers sharing it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hcfjax import quant
from hcfjax.options import Options
from pallas_kernels.int8_quant import quantize_int8
from pallas_kernels.int8_rows import BLOCK, MAX_ROWS, quantize_rows


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


def test_lowers_for_hopper_with_exact_division_and_rounding():
    """The Triton kernel lowers for sm_90 on any host, one program per row, with IEEE division and ties-to-even
    rounding as inline PTX."""
    from pallas_kernels.cross_lower import lower_triton_for_hopper

    text = lower_triton_for_hopper(quantize_rows, jax.ShapeDtypeStruct((64, 2816), jnp.bfloat16))
    assert "__gpu$xla.gpu.triton" in text and "grid_x = 64" in text
    assert "div.rn.f32" in text and "cvt.rni.f32.f32" in text


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
