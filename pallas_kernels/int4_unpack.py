"""Packed int4 weight tiles -> wgmma A operands in registers, with integer and bf16x2 ops only (moe_int4.py's inner
loop).

Why: an H100/H200 SM converts 16 values per clock between integer and float types (I2F, F2F), against 128 lanes of
integer or float arithmetic. Streaming int4 weights at the copy ceiling brings about 32 packed bytes per ns to each
SM, 64 weights: one I2F and one f32 -> bf16 conversion per weight would take about twice that long. Here a weight
costs about 2 full-rate operations (w4a16: 1 integer, 1 bf16x2) or 0.4 (w4a8), and nothing goes through shared
memory.

A group tile is int8 [64, G/2 = 64]: byte j of a row holds k = j (low nibble) and k = j + G/2 (high nibble) of the
group. Loaded in the layout of a wgmma A operand for one K half, each thread holds exactly the bytes whose two
nibbles its fragments of both halves need, so unpacking never moves data between threads:

- w4a16, WGMMA layout (two bytes per register): a nibble u put into the mantissa of a bf16 with exponent 2^7,
  0x4300 | (u ^ 8), reads as 136 + q for the two's complement value q of u; subtracting 136 (exact) gives q, and one
  multiply by the group scale rounded to bf16 the weight: round(q * bf16(s)), where the reference rounds q * s once
  (the two differ by at most one bf16 rounding of s, a relative 2^-9).
- w4a8, WGMMA_8BIT layout (four bytes per register): r & 0xF0F0F0F0 holds 16 q_hi in every byte and
  (r << 4) & 0xF0F0F0F0 holds 16 q_lo, both exact int8. The kernel folds the factor 16 into the group scale
  (s / 16, exact).

On the GPU the bit extraction runs through `plgpu.inline_mgpu`: Mosaic GPU has no 8-bit shifts and no way to read a
pair of int8 as one int16 or int32 otherwise. GPU interpret mode cannot run inline_mgpu, so there (`fast=False`) the
same bits come from int16 ops. Both share `bf16_bits` / `int8_lo_bits`, written once over an `ops` object that is
either MLIR (the kernel) or numpy (`NumpyOps`, the tests' model of the kernel's bit manipulation).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

LOW_NIBBLES = 0x000F000F  # the low nibble of each 16-bit lane
BF16_136 = 0x43084308  # bf16x2 (136, 136); XOR-ing a nibble u into it gives 0x4300 | (u ^ 8) = 136 + q
SPREAD = 0x4140  # prmt selector: bytes 0 and 1 of a register to bytes 0 and 2 (the low bytes of two 16-bit lanes),
# zeros (byte 4, from the zero second operand) to bytes 1 and 3
HIGH_NIBBLES = 0xF0F0F0F0  # the high nibble of each byte


def bf16_bits(r, ops):
    """r: two packed bytes (b0 | b1 << 8) in a 32-bit word -> the bf16x2 bit patterns 136 + q of their low nibbles
    and of their high nibbles (lane i from byte i): one prmt (b0 | b1 << 16), then per half a mask-and-xor (one lop3)
    and for the high half a shift first. Four integer ops per four weights."""
    spread = ops.prmt(r, SPREAD)
    return [ops.xor(ops.and_(v, LOW_NIBBLES), BF16_136) for v in (spread, ops.shr(spread, 4))]


def int8_lo_bits(r, ops):
    """r: four packed bytes in a 32-bit word -> 16 x their low nibbles, four int8 (16 x the high ones is
    r & HIGH_NIBBLES)."""
    return ops.and_(ops.shl(r, 4), HIGH_NIBBLES)


class NumpyOps:
    """The operations of bf16_bits and int8_f16.f16_bits on uint32 numpy arrays (prmt's second operand b supplies
    bytes 4-7: zero for bf16_bits, 0x64 for f16_bits)."""

    @staticmethod
    def prmt(a, sel, b=0):
        out = np.zeros_like(a)
        for i in range(4):  # result byte i is byte (sel >> 4i) & 7 of (b : a); selectors here are < 8 (no sign mode)
            src = (sel >> (4 * i)) & 0xF
            byte = (a >> (8 * src)) & 0xFF if src < 4 else (np.uint32(b) >> np.uint32(8 * (src - 4))) & 0xFF
            out |= byte << (8 * i)
        return out

    and_ = staticmethod(lambda a, m: a & np.uint32(m))
    xor = staticmethod(lambda a, m: a ^ np.uint32(m))
    shr = staticmethod(lambda a, n: a >> np.uint32(n))
    shl = staticmethod(lambda a, n: a << np.uint32(n))


class _MlirOps:
    def __init__(self):
        from jax.experimental.mosaic.gpu import utils
        from jaxlib.mlir import ir
        from jaxlib.mlir.dialects import arith

        self.i32 = ir.IntegerType.get_signless(32)
        self.arith, self.utils = arith, utils

    def c(self, v):
        return self.arith.constant(self.i32, v - (1 << 32) if v >= 1 << 31 else v)

    def prmt(self, a, sel, b=0):
        return self.utils.prmt(a, self.c(b), self.c(sel))

    def and_(self, a, m):
        return self.arith.andi(a, self.c(m))

    def xor(self, a, m):
        return self.arith.xori(a, self.c(m))

    def shr(self, a, n):
        return self.arith.shrui(a, self.c(n))

    def shl(self, a, n):
        return self.arith.shli(a, self.c(n))


def _map_registers(p, fn, n_out, dtype):
    """Applies fn (MLIR i32 -> n_out MLIR i32) to every register of the int8 FragmentedArray p; the results keep p's
    layout, with each register's bits reinterpreted as dtype."""
    from jax.experimental.mosaic.gpu import fragmented_array as fa
    from jax.experimental.mosaic.gpu import utils
    from jaxlib.mlir import ir
    from jaxlib.mlir.dialects import arith, vector

    ops = _MlirOps()
    outs = [np.empty_like(p.registers) for _ in range(n_out)]
    for idx, reg in np.ndenumerate(p.registers):
        (lanes,) = ir.VectorType(reg.type).shape
        if lanes == 2:  # two bytes: widen to 32 bits
            i16 = ir.IntegerType.get_signless(16)
            r = arith.extui(ops.i32, vector.extract(vector.bitcast(ir.VectorType.get((1,), i16), reg), [], [0]))
        else:
            r = utils.bitcast(reg, ops.i32)
        for out, v in zip(outs, fn(ops, r), strict=True):
            out[idx] = utils.bitcast(v, ir.VectorType.get((32 // ir.IntegerType(dtype).width,), dtype))
    return [fa.FragmentedArray(_registers=o, _layout=p.layout, _is_signed=True) for o in outs]


def _bf16_bits_gpu(p):
    import jax.experimental.pallas.mosaic_gpu as plgpu
    from jaxlib.mlir import ir

    out = plgpu.ShapeDtypeStruct(p.shape, jnp.int16, layout=plgpu.Layout.WGMMA)

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA,), return_type=(out, out))
    def run(ctx, p):
        return tuple(_map_registers(p, lambda ops, r: bf16_bits(r, ops), 2, ir.IntegerType.get_signless(16)))

    return run(p)


def _int8_lo_gpu(p):
    import jax.experimental.pallas.mosaic_gpu as plgpu
    from jaxlib.mlir import ir

    out = plgpu.ShapeDtypeStruct(p.shape, jnp.int8, layout=plgpu.Layout.WGMMA_8BIT)

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA_8BIT,), return_type=out)
    def run(ctx, p):
        fn = lambda ops, r: [int8_lo_bits(r, ops)]  # noqa: E731
        return _map_registers(p, fn, 1, ir.IntegerType.get_signless(8))[0]

    return run(p)


def bf16_halves(p, s, fast: bool):
    """p int8 [64, G/2] (WGMMA layout), s f32 [64] (the rows' group scales, WGMMA row layout) -> the two K halves
    [64, G/2] bf16 (WGMMA layout): round(q * bf16(s))."""
    if fast:
        bits = _bf16_bits_gpu(p)
    else:
        p16 = p.astype(jnp.int16)  # sign-extended; the nibbles are masked out of it
        nib = (p16 & 0xF, lax.shift_right_arithmetic(p16, jnp.int16(4)) & 0xF)
        bits = [v ^ jnp.int16(BF16_136 & 0xFFFF) for v in nib]
    sb = lax.broadcast_in_dim(s.astype(jnp.bfloat16), p.shape, [0])
    return [(lax.bitcast_convert_type(b, jnp.bfloat16) - jnp.bfloat16(136)) * sb for b in bits]


def int8_halves(p, fast: bool):
    """p int8 [64, G/2] (WGMMA_8BIT layout) -> the two K halves as int8 16 q [64, G/2] (same layout)."""
    hi = p & jnp.int8(-16)  # an 8-bit bitwise op, which Mosaic GPU has
    if fast:
        return _int8_lo_gpu(p), hi
    lo = lax.shift_right_arithmetic(lax.shift_left(p.astype(jnp.int16), jnp.int16(12)), jnp.int16(8))
    return lo.astype(jnp.int8), hi
