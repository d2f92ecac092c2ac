"""On a GPU: a batch's padding routed past the last expert (moe.moe's real mask) through the Pallas int4 MoE
kernels at DeepSeek-V2-Lite's expert shapes: the real tokens' outputs are bit for bit those of the real tokens
alone, the padding's zero (the kernels leave rows past the groups unwritten). Skipped elsewhere (the CPU suite
checks the same through the reference and the kernels' interpreter, tests/test_quant.py); run on the GPU machine
with `JAX_PLATFORMS=cuda python -m pytest tests/test_gpu_moe_padding.py`."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hcfjax import moe, quant
from hcfjax.options import Options

pytestmark = pytest.mark.skipif(jax.default_backend() != "gpu", reason="the Mosaic GPU kernels need a GPU")


@pytest.mark.parametrize("act", ["int8", "bf16"])  # w4a8 (the fused gate/up kernel) and w4a16
def test_padding_skips_the_kernels_groups(act):
    n, d, f, e, k = 40, 2048, 1408, 64, 6
    keys = jax.random.split(jax.random.key(0), 5)
    shapes = (("gate", (e, d, f)), ("up", (e, d, f)), ("down", (e, f, d)))
    p = {
        name: quant.quantize(jax.random.normal(kk, s) / 16, 4, act) for (name, s), kk in zip(shapes, keys, strict=False)
    }
    x = jax.random.normal(keys[3], (n, d)).astype(jnp.bfloat16)
    ids = jax.random.randint(keys[4], (n, k), 0, e)
    w = jnp.full((n, k), 1 / k, jnp.float32)
    real = np.arange(n) % 5 != 2
    run = jax.jit(lambda p, x, w, i: moe.experts(p, x, w, i, Options(moe="kernel")))
    got = np.asarray(run(p, x, w, jnp.where(real[:, None], ids, e)), np.float32)
    alone = np.asarray(run(p, x[real], w[real], ids[real]), np.float32)
    np.testing.assert_array_equal(got[real], alone)
    np.testing.assert_array_equal(got[~real], 0.0)
