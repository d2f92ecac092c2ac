"""The MLA decode kernel's wrapper (pallas_kernels.mla_decode): the inputs it rejects, its register splits and
benchmark cases, and its lowering for sm_90 on a CPU (tests/test_mla_kernel.py runs it in the interpreter)."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from pallas_kernels import mla_decode as M
from pallas_kernels import mla_kernel

C, R, PAGE = 128, 64, 64


def _args(b=2, t=1, h=16, c=C, r=R, page=PAGE, dtype=jnp.bfloat16, scales=None, pt_rows=None, lengths_dtype=jnp.int32):
    qn = jnp.zeros((b, t, h, c), jnp.bfloat16)
    qp = jnp.zeros((b, t, h, r), jnp.bfloat16)
    kv = jnp.zeros((4, page, c + r), dtype)
    pt = jnp.zeros((b if pt_rows is None else pt_rows, 2), jnp.int32)
    return (qn, qp, kv, pt, jnp.ones((b,), lengths_dtype), 0.1), dict(scales=scales)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(c=96), "multiple of 128"),
        (dict(r=32), "qk_rope_head_dim"),
        (dict(page=48), "page size"),
        (dict(dtype=jnp.float32), "bfloat16 or int8"),
        (dict(dtype=jnp.int8), "scales"),
        (dict(scales=jnp.zeros((4, PAGE, 2), jnp.float32)), "only for an int8"),
        (dict(pt_rows=3), "page_table"),
        (dict(lengths_dtype=jnp.float32), "lengths"),
    ],
)
def test_wrapper_rejects_bad_inputs(kwargs, match):
    args, kw = _args(**kwargs)
    with pytest.raises(ValueError, match=match):
        M.mla_decode(*args, **kw, interpret=True)
    assert not M.kernel_applies(*args[:5], kw["scales"])


def test_int8_qk_and_f16_need_an_int8_cache():
    args, kw = _args()
    with pytest.raises(ValueError, match="qk8 needs an int8 cache"):
        M.mla_decode(*args, **kw, interpret=True, qk8=True)
    with pytest.raises(ValueError, match="f16 needs an int8 cache"):
        M.mla_decode(*args, **kw, interpret=True, f16=True)
    args, kw = _args(dtype=jnp.int8, scales=jnp.ones((4, PAGE, 2), jnp.float32))
    with pytest.raises(ValueError, match="f16 and qk8"):
        M.mla_decode(*args, **kw, interpret=True, qk8=True, f16=True)


def test_kernel_needs_a_positive_softmax_scale():
    # the bf16 softmax takes the scale on its row max, which only commutes with a positive scale
    (qn, qp, kv, pt, lengths, _), kw = _args()
    with pytest.raises(ValueError, match="sm_scale must be positive"):
        M.mla_decode(qn, qp, kv, pt, lengths, 0.0, **kw, interpret=True)


def test_wrapper_rejects_unabsorbed_query():
    args, kw = _args()
    with pytest.raises(ValueError, match="absorb W_UK"):
        M.mla_decode(*args, kv_lora_rank=256, interpret=True)


@pytest.mark.parametrize(
    "b,ctx,dtype,layer,minor,qk8,pair,h,t,conv",
    [
        (128, 4096, "bf16", False, False, False, None, 128, 1, False),
        (4, 4096, "int8", True, True, False, None, 128, 1, False),
        (2, 256, "int8", True, False, False, None, 128, 1, False),
        (32, 4096, "bf16", True, False, False, False, 128, 1, False),
        (
            128,
            4096,
            "int8",
            False,
            False,
            True,
            None,
            128,
            1,
            None,
        ),  # int8 Q.K: int8 Q in smem, three int32 accumulators
        # V2-Lite's 16 heads at the engine's batch (the sparse merge): Q and the outputs as 16 of a tile's rows
        # (KernelSpec.q_heads), in the kernel and in the combine kernel
        (64, 2048, "int8", True, False, False, None, 16, 1, False),
        (64, 2048, "int8", True, False, True, None, 16, 1, False),
        # MTP verification at 16 heads: 3 tokens stacked in one tile (KernelSpec.stack), through the combine kernel
        (64, 2048, "int8", True, False, False, None, 16, 3, False),
        (32, 4096, "bf16", False, False, False, None, 16, 2, False),
        # int8 transposed tiles with two converter warpgroups (KernelSpec.converters): four warpgroups
        (64, 2048, "int8", True, False, False, None, 16, 1, True),
    ],
)
def test_kernel_lowers_for_hopper(b, ctx, dtype, layer, minor, qk8, pair, h, t, conv, monkeypatch):
    # Mosaic GPU's lowering for sm_90 on the CPU (layout inference and the 227 KiB smem check) at V3's shapes,
    # with the work list's scalar reads, both int8 scale layouts, and each merge path (sparse, dense, direct). At
    # 128 heads the head tiles run as multicasting CTA pairs unless told not to (GPU interpret mode cannot run
    # those: the lowering and the bench's device checks are their tests). The kernel's loops must open the named
    # regions bench.timeline reads (the profiler's host callback does not lower on a CPU, so its regions are
    # recorded here as the lowering opens them).
    import contextlib

    from jax import ShapeDtypeStruct as S
    from jax.experimental.mosaic.gpu import launch_context

    from pallas_kernels.cross_lower import lower_for_hopper

    regions, named_region = set(), launch_context.LaunchContext.named_region

    @contextlib.contextmanager
    def record(self, name, *args, **kwargs):
        regions.add(name)
        with named_region(self, name, *args, **kwargs):
            yield

    monkeypatch.setattr(launch_context.LaunchContext, "named_region", record)
    page, c, n = 64, 512, ctx // 64
    lead = (2,) if layer else ()
    kv = S(lead + (b * n, page, c + R), jnp.int8 if dtype == "int8" else jnp.bfloat16)
    sc = None if dtype == "bf16" else S(lead + ((b * n, 2, page) if minor else (b * n, page, 2)), jnp.float32)
    # q_nope heads first ([H, B, T, C], the model's layout; with qk8 the wrapper moves it back) in every case but
    # 128 heads over a bf16 cache at batch 128, which keeps the [B, T, H, C] layout covered
    heads_first = (b, h, dtype) != (128, 128, "bf16")
    qn = S((h, b, t, c) if heads_first else (b, t, h, c), jnp.bfloat16)
    qp = S((b, t, h, R), jnp.bfloat16)

    def f(qn, qp, kv, pt, lengths, sc):
        lay = jnp.int32(1) if layer else None
        kw = dict(num_sms=132, pair=pair, qk8=qk8, converters=conv, heads_first=heads_first)
        return M.mla_decode(qn, qp, kv, pt, lengths, 0.04, scales=sc, layer=lay, **kw)

    text = lower_for_hopper(f, qn, qp, kv, S((b, n), jnp.int32), S((b,), jnp.int32), sc)
    assert "mosaic_gpu" in text
    assert ("cluster_block_id" in text) == (pair is None and h == 128)
    want = {"qk", "softmax", "pv", "wait_slot"} | (set() if conv else {"wait_p"})  # (converters: no WG1 P.V)
    want |= {"bf16": {"wait_v"}, "int8": {"convert"}}[dtype]
    want |= {"wait_v", "wait_qk", "mma", "scale"} if qk8 else {"wait_A", "wait_B", "wait_R"}
    want |= {"land"} if dtype == "int8" and not qk8 else set()
    assert want <= regions, want - regions


def test_register_splits_fit_the_cta():
    # setmaxnreg takes multiples of 8 in [24, 256], and the three warpgroups together may hold at most the 504 x 128
    # registers the CTA launches with (a split asking for more leaves setmaxnreg waiting forever on the GPU).
    from pallas_kernels.bench.mla import parse_version
    from pallas_kernels.mla_kernel import REGISTERS, check_registers
    from pallas_kernels.mla_kernel_spec import CONVERTER_REGISTERS

    for split in REGISTERS.values():
        assert check_registers(split) == split
    # four warpgroups (converters) launch with 128 a thread: the leader grows, the loader shrinks, 512 in all
    assert check_registers(CONVERTER_REGISTERS, 4) == CONVERTER_REGISTERS
    for bad in [(168, 128, 56), (176, 128, 64, 152), (128, 128, 56, 152), (168, 128, 128, 88)]:
        with pytest.raises(ValueError, match="register split"):
            check_registers(bad, 4)
    for bad in [(256, 216, 40), (236, 228, 40), (168, 232, 40), (232, 232, 264), (232, 232)]:
        with pytest.raises(ValueError, match="register split"):
            check_registers(bad)
    args, kw = _args(h=128)
    with pytest.raises(ValueError, match="register split"):  # checked before anything runs
        M.mla_decode(*args, **kw, interpret=True, registers=(256, 256, 40))
    assert parse_version("3p@232/232/40") == (True, (232, 232, 40), False, None, False)
    assert parse_version("3") == (None, None, False, None, False)
    assert parse_version("3pq") == (True, None, True, None, False)
    assert parse_version("3t") == (None, None, False, True, False)
    assert parse_version("3h@248/176/80") == (None, (248, 176, 80), False, False, False)
    assert parse_version("3tc@168/128/56/152") == (None, (168, 128, 56, 152), False, True, True)
    with pytest.raises(ValueError, match="version 4 was dropped"):
        parse_version("4")


def test_bench_cases_name_their_head_count():
    # bench.mla's cases: cache:BxCTX[:lengths][:hH], and the versions as each case can run them (the bench then
    # labels a 3p row below 128 heads as 3, so int8 rows find their bf16 counterpart).
    from pallas_kernels.bench.mla import for_case, parse_case

    assert parse_case("bf16:128x4096") == ("bf16", 128, 4096, "full", 128, 1)
    assert parse_case("int8:32x16384:mixed:h16") == ("int8", 32, 16384, "mixed", 16, 1)
    assert parse_case("int8g:1x4096:h64") == ("int8g", 1, 4096, "full", 64, 1)
    assert parse_case("bf16:64x4096:mixed:t3") == ("bf16", 64, 4096, "mixed", 128, 3)
    assert parse_case("bf16:64x4096:h16:t2") == ("bf16", 64, 4096, "full", 16, 2)
    for bad in ["bf16", "fp8:1x4096", "bf16:1x4096:ragged", "bf16:1x4096:mixed:skew", "bf16:1x4096:h0", "bf16:1x64:t0"]:
        with pytest.raises(ValueError):
            parse_case(bad)
    assert for_case("3pq", "int8", 128) == "3pq"
    assert for_case("3pq", "bf16", 128) == "3p"
    assert for_case("3pq@256/176/72", "int8", 16) == "3q@256/176/72"
    assert for_case(None, "int8", 16) is None
    assert for_case("3t", "int8", 16) == "3t"
    assert for_case("3t", "int8", 128) == for_case("3h", "bf16", 64) == "3"
    assert for_case("3qt", "int8", 16) == "3q"
    assert for_case("3tc", "int8", 16) == "3tc"
    assert for_case("3tc", "bf16", 16) == "3t"
    assert for_case("3hc", "int8", 16) == "3h"
    assert for_case("3c@168/128/56/152", "int8", 64) == "3@168/128/56/152"


def test_head_tile_pairs_need_128_heads_and_a_gpu():
    args, kw = _args(h=128)
    with pytest.raises(ValueError, match="pair=True needs"):
        M.mla_decode(*args, **kw, interpret=True, pair=True)
    args, kw = _args(h=64)
    with pytest.raises(ValueError, match="pair=True needs"):
        M.mla_decode(*args, **kw, pair=True)


def test_tiles_of_at_most_32_query_rows_run_transposed():
    assert M.transposes(16, 1) and M.transposes(8, 2) and M.transposes(16, 2) and M.transposes(32, 1)
    assert not M.transposes(16, 3) and not M.transposes(48, 1) and not M.transposes(0, 1)
    assert not M.transposes(16, 1, qk8=True)
    args, kw = _args(h=128)
    with pytest.raises(ValueError, match="transposed needs fewer than 64 heads"):
        M.mla_decode(*args, **kw, interpret=True, transposed=True)
    spec = dict(c=C, r=R, t=1, heads=64, page_size=PAGE, max_pages=1, units=1, batch=1, slots=0, quant=False)
    with pytest.raises(ValueError, match="transposed needs q_heads"):
        mla_kernel.KernelSpec(**spec, sm_scale=0.1, interpret=True, transposed=True)
    assert mla_kernel.KernelSpec(**spec, sm_scale=0.1, interpret=True, q_heads=16, transposed=True).q_rows == 16
