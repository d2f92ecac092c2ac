"""On a GPU: the MLA decode kernel given q_nope heads first ([H, B, T, C], as the model's absorbed product makes it)
gives the [B, T, H, C] layout's attention bit for bit: its TMA reads each head tile's rows at their stride. At
V2-Lite's decode (16 heads over an int8 cache, converter warpgroups; two stacked tokens) and V3's 128 heads (paired
head tiles, bf16 cache). Skipped elsewhere (the CPU suite checks the same in interpret mode, tests/test_mla_kernel.py,
which cannot run the TMA's strided read); run on the GPU machine with `JAX_PLATFORMS=cuda python -m pytest
tests/test_gpu_mla_heads_first.py`."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.bench.mla_cases import make_inputs
from pallas_kernels.mla_decode import converters_apply, mla_decode

pytestmark = pytest.mark.skipif(jax.default_backend() != "gpu", reason="the Mosaic GPU kernels need a GPU")


@pytest.mark.parametrize(
    "batch,context,heads,dtype,t",
    [(64, 2048, 16, "int8", 1), (64, 2048, 16, "int8", 2), (32, 4096, 128, "bf16", 1)],
)
def test_heads_first_queries_read_in_place(batch, context, heads, dtype, t):
    key = jax.random.key(batch + heads + t)
    qn, qp, kv, pt, lengths, sc = make_inputs(key, batch, context, heads, dtype=dtype, t=t)
    conv = converters_apply(heads, t, dtype == "int8")

    @jax.jit
    def both(qn, qp, kv, pt, lengths, sc):
        kw = dict(scales=sc, return_lse=True, converters=conv)
        want = mla_decode(qn, qp, kv, pt, lengths, 512**-0.5, **kw)
        got = mla_decode(jnp.moveaxis(qn, 2, 0), qp, kv, pt, lengths, 512**-0.5, heads_first=True, **kw)
        return want, got

    want, got = both(qn, qp, kv, pt, lengths, sc)
    for w, g in zip(want, got, strict=True):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))
