"""The cases and kernel rows of the MoE bench (`python -m pallas_kernels.bench.moe`, whose docstring says what it
times): the expert shapes, the sweep's alternative tilings, each row's tiling label, and --lower, which lowers every
kernel row for sm_90 on any host."""

from __future__ import annotations

import os

HEADLINE = [(16, 128, 7168, 2048), (32, 4096, 7168, 2048), (16, 1024, 7168, 2048), (32, 16384, 7168, 2048)]
SHAPES = [(7168, 2048), (2048, 7168)]
EXPERTS = (16, 32)
TOKENS = (128, 1024, 4096, 16384)
CHECK_TOL = 2e-2  # max |kernel - ref| / max |ref|: a few bf16 roundings of the output


def sweep_tilings(act: str, e: int, m: int, k: int, n: int, nw: int = 1) -> list:
    """Alternatives to the default tiling worth timing next to it (what the next tuning step would choose from):
    decode: one K group per step with 1, 2 or 4 K splits, two with 1 or 2, 64, 128 or 256 weight rows per CTA (the fused
    kernel, nw = 2: 64 rows, also with stages for 2 CTAs per SM, and 128 rows with the deep pipeline of one CTA per SM);
    otherwise, for one weight: 64 weight rows with larger token blocks (the other side of the registers' trade) or
    with the same ones (more CTAs per SM), 64- and 48-row token blocks (less padding per expert, more CTAs per SM);
    for both kernels 80-row blocks (one block per expert up to 72 rows), for w4a8 also on two compute warpgroups of
    64 rows, and the fused kernel's 48-row blocks. Then the default tiling with A through smem (nw = 1: what the
    registers path gains) and, for w4a8, with each tile unpacked just before its wgmmas (what unpacking a step's
    tiles first gains), in prefill with the other choice of Tiling.narrow (a group's last block at the narrowest width
    that holds its rows) and of Tiling.wgs (one compute warpgroup per CTA, or two sharing each token tile).
    (Persistent CTAs were slower in every regime timed; docs/kernels.md says more.)"""
    import dataclasses

    from pallas_kernels.moe_int4_tiling import default_tiling

    kg, d = k // 128, default_tiling(act, m, n, k // 128, e, nw)
    if d.bm <= 32:
        alts = [dict(gps=1, splits=s) for s in (1, 2, 4)] + [dict(gps=2, splits=s) for s in (1, 2)]
        alts += [dict(bn=b) for b in (64, 128, 256)] if nw == 1 else [dict(bn=64), dict(bn=64, ctas=2), dict(ctas=1)]
    else:  # bn=64 alone takes the larger token blocks its registers allow; with bm: more CTAs per SM
        alts = [dict(bn=64), dict(bn=64, bm=d.bm), dict(bm=64), dict(bm=48)] if nw == 1 else []
        # one block per expert up to 72 rows: the most the registers allow a CTA of 128 rows of one weight, or of 64
        # rows of both (one compute warpgroup, or two sharing the token tile)
        alts += [dict(bm=80)] if nw == 1 else [dict(bm=80, bn=64, wgs=1), dict(bm=80, bn=64), dict(bm=48, bn=64)]
        if nw == 1 and act == "int8":  # two compute warpgroups of 64 weight rows each, one block per expert
            alts += [dict(bm=80, bn=64, wgs=2), dict(bm=96, bn=64, wgs=2)]
        if act == "int8":  # the other choice of compute warpgroups per CTA (one, or two sharing each token tile)
            alts += [dict(wgs=1)] if d.wgs > 1 else [dict(wgs=2, bn=d.bn)] if n % (2 * d.bn) == 0 else []
    out = [default_tiling(act, m, n, kg, e, nw, **a) for a in alts if n % a.get("bn", 64) == 0]
    out += [dataclasses.replace(d, a_regs=False)] if nw == 1 else []
    out += [dataclasses.replace(d, unpack_first=False)] if act == "int8" else []
    out += [dataclasses.replace(d, narrow=not d.narrow)] if d.bm > 32 else []
    out = [t for t in out if t.splits == 1 or kg % (t.gps * t.splits) == 0]  # K = 1408 (V2-Lite's down): 11 groups
    return [t for i, t in enumerate(out) if t != d and t not in out[:i]]


def swept_tilings(act: str, e: int, m: int, k: int, n: int, nw: int = 1) -> list:
    """sweep_tilings, less those whose row label has none of --sweep-only's texts (separated by "|"; the workers read
    it from the environment)."""
    only = os.environ.get("MOE_BENCH_SWEEP_ONLY", "")
    return [t for t in sweep_tilings(act, e, m, k, n, nw) if any(o in tiling_label(t) for o in only.split("|"))]


def all_cases() -> list[tuple[int, int, int, int]]:
    rest = [(e, m, k, n) for k, n in SHAPES for e in EXPERTS for m in TOKENS]
    return HEADLINE + [c for c in rest if c not in HEADLINE]


def tiling_label(t) -> str:
    gps = f" gps={t.gps}" if t.gps > 1 else ""
    gps += f" split-K {t.splits}" if t.splits > 1 else ""
    via = ("" if t.a_regs else " A via smem") + ("" if t.inline else " int16")
    via += "" if t.unpack_first else " unpacked per tile"
    via += " narrow tails" if t.narrow else (" full-width tails" if t.bm > 32 else "")
    via += f" {t.wgs} compute warpgroups" if t.wgs > 1 else ""
    return f"bm={t.bm} bn={t.bn} st={t.stages}{gps}{via}"


def kernel_configs(e: int, m: int, k: int, n: int, sweep: bool):
    """(act, nw, tiling) of every kernel row a case times, in order."""
    from pallas_kernels.moe_int4_tiling import default_tiling

    out = [(act, 1, default_tiling(act, m, n, k // 128, e)) for act in ("bf16", "int8")]
    for act in ("bf16", "int8"):
        out += [(act, 1, t) for t in (swept_tilings(act, e, m, k, n) if sweep else [])]
    for act in ("bf16", "int8") if k > n else ():
        out += [(act, 2, t) for t in [default_tiling(act, m, n, k // 128, e, nw=2)]]
        out += [(act, 2, t) for t in (swept_tilings(act, e, m, k, n, nw=2) if sweep else [])]
    return out


def lower_all(cases, sweep: str) -> bool:
    """Lowers every kernel the bench would run for sm_90 on this host (no GPU: layout inference, the ops Mosaic
    supports, smem), one line each; the pre-flight check for a GPU run."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels.cross_lower import lower_for_hopper
    from pallas_kernels.moe_int4 import int4_gated_ragged_dot, int4_ragged_dot
    from pallas_kernels.moe_int4_tiling import smem_bytes

    s, ok = jax.ShapeDtypeStruct, True
    for e, m, k, n in cases:
        spec = f"{e}x{m}x{k}x{n}"
        x, gs = s((m, k), jnp.bfloat16), s((e,), jnp.int32)
        w = (s((e, n, k // 2), jnp.uint8), s((e, k // 128, n), jnp.float32))
        for act, nw, t in kernel_configs(e, m, k, n, sweep == "all" or spec in sweep.split(",")):
            if nw == 1:
                fn = lambda x, w, gs, act=act, t=t: int4_ragged_dot(x, *w, gs, act=act, tiling=t)  # noqa: E731
            else:
                fn = lambda x, w, gs, act=act, t=t: int4_gated_ragged_dot(x, w, w, gs, act=act, tiling=t)  # noqa: E731
            try:
                lower_for_hopper(fn, x, w, gs)
                r = "ok"
            except Exception as ex:  # noqa: BLE001 - reported, the others still lower
                r, ok = f"FAIL {type(ex).__name__}: {str(ex)[:300]}", False
            print(f"{spec} {act} nw={nw} {tiling_label(t)} smem={smem_bytes(act, t, nw=nw)}: {r}", flush=True)
    return ok
