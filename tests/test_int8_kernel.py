"""The dense int8 kernel (pallas_kernels/moe_fp8.py's int8 per-channel form: w4a8c8 / w8a8's dense linears) against
the exact product in float64, run by Mosaic GPU's interpreter on the CPU, and lowered for Hopper."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hcfjax import quant
from hcfjax.options import Options
from pallas_kernels.moe_fp8 import (
    BLOCK,
    INT8_MAX_ROWS,
    SMS,
    Fp8Tiling,
    int8_gated_matmul,
    int8_matmul,
    int8_tiling,
)

INTERPRET = Options(moe="interpret")


def _silu(v):
    return v / (1.0 + np.exp(-v))


def _exact(xq, xs, q, s):
    """(xq . q) * xs * s in float64: the int64 products are the exact sums."""
    acc = np.asarray(xq, np.int64) @ np.asarray(q, np.int64).T
    return acc * np.asarray(xs, np.float64)[:, None] * np.asarray(s, np.float64).reshape(1, -1)


def _close(y, want):
    """bf16 output: within a rounding or two of the largest value."""
    np.testing.assert_allclose(np.asarray(y, np.float64), want, rtol=0, atol=8e-3 * np.abs(want).max())


def _int8_weight(rng, n, k):
    return jnp.asarray(rng.integers(-127, 128, (n, k)), jnp.int8), jnp.asarray(
        rng.uniform(1e-3, 1e-2, (1, n)), jnp.float32
    )


@pytest.mark.usefixtures("reset_interpreter")
@pytest.mark.parametrize("tiling", [None, Fp8Tiling(16, 64, 2, splits=2), Fp8Tiling(32, 128, 2)])
def test_kernel_is_the_exact_product_with_both_scales(tiling):
    """Rows not a multiple of the token block (the last block's rows past M are neither read nor written), three
    K blocks: split in two, the second split's second step loads past K (zeros); without it the third block is lost,
    a third of every sum. Tokens at full int8 range, so the int32 sums are far from small."""
    rng = np.random.default_rng(0)
    m, k, n = 40, 3 * BLOCK, 256
    xq = jnp.asarray(rng.integers(-127, 128, (m, k)), jnp.int8)
    xs = jnp.asarray(rng.uniform(0.01, 0.1, m), jnp.float32)
    (gq, gs), (uq, us) = _int8_weight(rng, n, k), _int8_weight(rng, n, k)
    y = int8_matmul(xq, xs, gq, gs, interpret=True, tiling=tiling)
    h = int8_gated_matmul(xq, xs, (gq, gs), (uq, us), interpret=True, tiling=tiling)
    want = _exact(xq, xs, gq, gs)
    assert y.shape == (m, n) and y.dtype == jnp.bfloat16
    _close(y, want)
    _close(h, _silu(want) * _exact(xq, xs, uq, us))


@pytest.mark.usefixtures("reset_interpreter")
def test_model_linears_take_the_kernel_where_options_say():
    """quant.linear and quant.gated_linear run int8 per-channel weights on the kernel (interpreted) where the options
    say and the shapes suit it, with the same per-row quantisation as XLA's path: the one-weight product is that
    path's bits, the gated one its f32 function rounded once. Elsewhere (bf16 weights, K not whole 128-channel
    blocks, more than INT8_MAX_ROWS rows, float32 tokens, CPUs by default) XLA's path."""
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(3, 7, 256)), jnp.bfloat16)
    g, u = (quant.quantize(jnp.asarray(rng.normal(size=(256, 128)) * 0.05), bits=8, act="int8") for _ in range(2))
    assert quant.int8_kernel_mode(x, g, INTERPRET) == "interpret"
    assert quant.int8_kernel_mode(x, g) == "reference"  # auto on a CPU
    assert quant.int8_kernel_mode(x, quant.dequantize(g), INTERPRET) == "reference"
    assert (
        quant.int8_kernel_mode(x[..., :192], quant.quantize(jnp.ones((192, 128)), 8, "int8"), INTERPRET) == "reference"
    )
    assert quant.int8_kernel_mode(jnp.zeros((INT8_MAX_ROWS + 1, 256), jnp.bfloat16), g, INTERPRET) == "reference"
    assert quant.int8_kernel_mode(x.astype(jnp.float32), g, INTERPRET) == "reference"  # the kernel writes bf16
    np.testing.assert_array_equal(np.asarray(quant.linear(x, g, INTERPRET)), np.asarray(quant.linear(x, g)))
    xq, xs = quant.quantize_int8(x.reshape(-1, 256))
    want = _silu(_exact(xq, xs, g.q, g.scale)) * _exact(xq, xs, u.q, u.scale)
    _close(quant.gated_linear(x, g, u, INTERPRET).reshape(-1, 128), want)


@pytest.mark.usefixtures("reset_interpreter")
def test_split_k_partials_add_up_to_the_product():
    """int8_matmul(partials=True) gives a split-K tiling's f32 partial products over whole token blocks, whose sum in
    split order rounded to bf16 is the product's bits; quant.linear_partials gives them where linear runs the
    kernel with split-K (kv_a's K of 16 blocks over a few output tiles), and None where it would not split K or not
    run it. Gate and up's product has no partials."""
    rng = np.random.default_rng(5)
    m, k, n = 8, 8 * BLOCK, 128
    x = jnp.asarray(rng.normal(size=(2, m // 2, k)), jnp.bfloat16)
    w = quant.quantize(jnp.asarray(rng.normal(size=(k, n)) * 0.05), bits=8, act="int8")
    assert int8_tiling(m, 1, n, k).splits == 2
    xq, xs = quant.quantize_int8(x.reshape(m, k))
    parts = int8_matmul(xq, xs, w.q, w.scale, interpret=True, partials=True)
    assert parts.shape == (2, 16, n) and parts.dtype == jnp.float32  # a 16-row token block
    whole = int8_matmul(xq, xs, w.q, w.scale, interpret=True)
    np.testing.assert_array_equal(np.asarray((parts[0, :m] + parts[1, :m]).astype(jnp.bfloat16)), np.asarray(whole))
    _close(parts[:, :m].sum(0), _exact(xq, xs, w.q, w.scale))
    np.testing.assert_array_equal(np.asarray(quant.linear_partials(x, w, INTERPRET)), np.asarray(parts))
    from pallas_kernels.moe_fp8 import _run_int8

    with pytest.raises(ValueError, match="one weight"):
        _run_int8(xq, xs, ((w.q, w.scale), (w.q, w.scale)), True, None, partials=True)
    assert quant.linear_partials(x, w) is None  # XLA's product on a CPU by default
    short = quant.quantize(quant.dequantize(w)[: 2 * BLOCK], bits=8, act="int8")  # two K blocks: no split
    assert quant.linear_partials(x[..., : 2 * BLOCK], short, INTERPRET) is None


def test_tiling_and_errors():
    """The default tiling at V2-Lite's decode linears: split-K for the few output tiles of kv_a and the shared
    down projection, none for gate and up (88 CTAs already); every split has a K block and the CTAs fit the SMs.
    The wrapper names what is wrong with its operands."""
    assert int8_tiling(64, 1, 576, 2048).splits == 4
    assert int8_tiling(64, 2, 2816, 2048).splits == 1
    assert int8_tiling(64, 1, 2048, 2816).splits == 4
    for m in (1, 16, 64, 200, 1024):
        for nw, n, k in ((1, 576, 2048), (2, 1408, 2048), (1, 2048, 2816), (1, 1536, 7168)):
            t = int8_tiling(m, nw, n, k)
            kb, steps = k // BLOCK, -(-(k // BLOCK) // t.splits)
            assert (t.splits - 1) * steps < kb and t.bm >= min(m, t.bm) and t.bm % 16 == 0
            assert t.splits == 1 or n // t.bn * -(-m // t.bm) * nw * t.splits <= SMS
    rng = np.random.default_rng(2)
    q, s = _int8_weight(rng, 128, 256)
    xq, xs = jnp.zeros((8, 256), jnp.int8), jnp.ones((8,), jnp.float32)
    with pytest.raises(ValueError, match="tokens must be int8"):
        int8_matmul(xq.astype(jnp.float32), xs, q, s, interpret=True)
    with pytest.raises(ValueError, match="per output channel"):
        int8_matmul(xq, xs, q, jnp.ones((1, 64)), interpret=True)
    with pytest.raises(ValueError, match="a multiple of"):
        int8_matmul(xq, xs, q[:96], s[:, :96], interpret=True)
    with pytest.raises(ValueError, match="each of the splits"):
        int8_matmul(xq, xs, q, s, interpret=True, tiling=Fp8Tiling(16, 64, 2, splits=3))


@pytest.mark.parametrize("gated", [False, True])
def test_lowers_for_hopper_at_v2_lite_shapes(gated):
    """Mosaic GPU lowers the kernel for sm_90 at a decode step's shapes (64 rows; split-K for the one-weight
    kv_a-shaped product), on any host."""
    from pallas_kernels.cross_lower import lower_for_hopper

    spec = jax.ShapeDtypeStruct
    xq, xs = spec((64, 2048), jnp.int8), spec((64,), jnp.float32)
    if gated:
        w = (spec((2816, 2048), jnp.int8), spec((1, 2816), jnp.float32))
        text = lower_for_hopper(lambda a, b, g, u: int8_gated_matmul(a, b, g, u), xq, xs, w, w)
    else:
        text = lower_for_hopper(lambda a, b, q, s: int8_matmul(a, b, q, s), xq, xs, spec((576, 2048), jnp.int8),
                                spec((1, 576), jnp.float32))  # fmt: skip
    assert "dense_int8" in text
