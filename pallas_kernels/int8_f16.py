"""int8 -> fp16, exact, in 1.25 integer-or-half operations per value (the MLA kernel's int8 cache: mla_kernel.py).

Why fp16: its 10 mantissa bits hold a whole byte under the exponent of 1024, so the bits 0x64XX read as 1024 + XX for
every byte XX. bf16 has 7: Mosaic GPU's int8 -> bf16 path folds the byte's top bit into the exponent and takes it out
again (a prmt, two ands and a bf16x2 subtract per pair, and ptxas adds a select: 2.5 instructions per value in the
kernel's SASS), which made the conversion the int8 kernel's critical path (docs/kernels.md).

Per 32-bit word of four int8 v (two's complement): one xor with 0x80808080 turns each byte into v + 128; two prmt put
bytes 0, 1 and bytes 2, 3 each under 0x64, i.e. fp16x2 (1152 + v, 1152 + v'); one fp16x2 subtract of 1152 each
(exact: every value is an integer below 2048). The prmt's second operand supplies the 0x64 bytes.

On the GPU the bit steps run through `plgpu.inline_mgpu` (Mosaic GPU has no byte permute otherwise); GPU interpret
mode cannot run it, so there (`fast=False`) the values come from a plain conversion. `f16_bits` is written once over
an `ops` object, MLIR in the kernel or int4_unpack.NumpyOps in the tests (which check every byte).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from pallas_kernels.int4_unpack import _MlirOps

SIGN = 0x80808080  # xor: two's complement byte v -> v + 128
F16_1024_HIGH = 0x64  # the high byte of fp16 1024 (0x6400), the prmt's second operand
PAIRS = (0x4140, 0x4342)  # prmt selectors: bytes 0, 1 (resp. 2, 3) to the low bytes of two 16-bit lanes, 0x64 above
OFFSET = 1152.0  # 1024 + 128, what the bit patterns read as for v = 0


def f16_bits(r, ops):
    """r: four packed int8 in a 32-bit word -> two words of fp16x2 bit patterns OFFSET + v (bytes 0, 1 and 2, 3)."""
    u = ops.xor(r, SIGN)
    return [ops.prmt(u, sel, F16_1024_HIGH) for sel in PAIRS]


def _f16_bits_gpu(x):
    import jax.experimental.pallas.mosaic_gpu as plgpu

    layout = plgpu.Layout.WGMMA_8BIT
    out = plgpu.ShapeDtypeStruct(x.shape, jnp.float16, layout=layout)

    @plgpu.inline_mgpu(arg_types=(layout,), return_type=out)
    def run(ctx, p):
        from jax.experimental.mosaic.gpu import fragmented_array as fa
        from jax.experimental.mosaic.gpu import utils
        from jaxlib.mlir import ir
        from jaxlib.mlir.dialects import vector

        ops = _MlirOps()
        f16x2 = ir.VectorType.get((2,), ir.F16Type.get())
        regs = np.empty_like(p.registers)
        for idx, reg in np.ndenumerate(p.registers):
            (lanes,) = ir.VectorType(reg.type).shape  # four bytes per word
            words = vector.bitcast(ir.VectorType.get((lanes // 4,), ops.i32), reg)
            pairs = []
            for i in range(lanes // 4):
                pairs += [utils.bitcast(v, f16x2) for v in f16_bits(vector.extract(words, [], [i]), ops)]
            regs[idx] = utils.vector_concat(pairs)
        return fa.FragmentedArray(_registers=regs, _layout=p.layout, _is_signed=None)

    return run(x)


def to_f16(x, fast: bool):
    """x int8 [rows, cols] in the WGMMA_8BIT layout -> the same values as fp16 (same layout), exactly."""
    if not fast:
        return x.astype(jnp.float16)
    return _f16_bits_gpu(x) - jnp.float16(OFFSET)
