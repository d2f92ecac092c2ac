"""On a GPU: the MLA decode kernel with two leaders (KernelSpec.leaders, WG0 and WG1 leading every other block, merged
at the end) gives one leader's attention at V2-Lite's decode (16 heads over an int8 cache, converter warpgroups), to
the rounding of the merge, and the same bits on every run (no race between the leaders, the converter and the
loader over the two slots and WG1's handover). Skipped elsewhere (the CPU suite checks the schedule in interpret
mode, tests/test_mla_kernel.py); run on the GPU machine with `JAX_PLATFORMS=cuda python -m pytest
tests/test_gpu_mla_two_leaders.py`."""

import jax
import numpy as np
import pytest

from pallas_kernels.bench.mla_cases import make_inputs
from pallas_kernels.mla_decode import mla_decode

pytestmark = pytest.mark.skipif(jax.default_backend() != "gpu", reason="the Mosaic GPU kernels need a GPU")


@pytest.mark.parametrize("batch,context,kind", [(64, 2048, "full"), (256, 2048, "full"), (32, 8192, "mixed")])
def test_two_leaders_give_one_leaders_attention(batch, context, kind):
    qn, qp, kv, pt, lengths, sc = make_inputs(jax.random.key(batch), batch, context, 16, dtype="int8", kind=kind)

    def run(leaders):
        kw = dict(scales=sc, return_lse=True, converters=True, leaders=leaders)
        call = jax.jit(lambda *a: mla_decode(*a, 512**-0.5, **kw))
        return [np.asarray(x, np.float64) for x in call(qn, qp, kv, pt, lengths)]

    one, two, again = run(1), run(2), run(2)
    for a, b in zip(two, again, strict=True):
        np.testing.assert_array_equal(a, b)
    # (bf16 outputs, merged in another order: a dropped or doubled leader's share is off by its whole weight)
    assert np.linalg.norm(two[0] - one[0]) / np.linalg.norm(one[0]) < 1e-2
    np.testing.assert_allclose(two[1], one[1], rtol=1e-4, atol=1e-4)
