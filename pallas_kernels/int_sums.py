"""int32 sums of int8 wgmmas read as f32 without a conversion instruction (the int4 MoE's w4a8 and the MLA
kernel's int8 Q.K).

An SM converts 16 values per clock between int and float, against 128 lanes of float arithmetic. An accumulator
started at MAGIC instead of 0 holds MAGIC + v after the MMA, and for |v| < 2^22 those bits read as the f32
1.5 * 2^23 + v exactly (the f32 ulp there is 1), so one FADD of -MAGIC_F gives v. GPU interpret mode cannot store
to an accumulator: there the MMA starts at 0 and MAGIC is added before the bitcast.
"""

MAGIC = 0x4B400000  # int32 bits of the f32 1.5 * 2^23: MAGIC + v reads as 1.5 * 2^23 + v for |v| < 2^22
MAGIC_F = 12582912.0  # 1.5 * 2^23
