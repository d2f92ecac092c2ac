"""The cases, inputs and table of the MLA decode benchmark (`python -m pallas_kernels.bench.mla`, whose docstring
says what it times): case and version tokens, random queries over a paged cache, FlashInfer on the same shapes (the
peer), and the table's rows."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from hcfjax.bench.common import kernel_time
from hcfjax.cache import quantize_int8

# Priority order (the run prints each row as it finishes): small batches and ragged batches first.
CASES = (
    "bf16:1x4096",
    "bf16:1x16384",
    "bf16:4x4096",
    "bf16:4x16384",
    "bf16:32x4096",
    "bf16:32x16384",
    "bf16:128x4096",
    "bf16:128x4096:mixed",
    "bf16:32x16384:mixed",
    "bf16:32x16384:skew",
    "int8:32x4096",
    "int8g:32x4096",
    "int8:128x4096",
    "int8g:128x4096",
    "int8:1x16384",
    "bf16:64x16384",
    "bf16:32x4096:t2",
    "bf16:128x4096:mixed:t3",
)


def case_lengths(batch, context, kind, t=1):
    if kind == "full":
        return np.full((batch,), context, np.int32)
    if kind == "mixed":
        return np.random.default_rng(batch + context).integers(t, context + 1, batch).astype(np.int32)
    if kind == "skew":
        out = np.full((batch,), max(t, context // 16), np.int32)
        out[batch // 2] = context
        return out
    raise ValueError(f"lengths kind must be full, mixed or skew, got {kind!r}")


def make_inputs(key, batch, context, heads=128, c=512, r=64, page=64, dtype="bf16", t=1, kind="full"):
    """Random queries and a cache of CTX-wide page tables in shuffled pages, rows of `kind` lengths."""
    ks = jax.random.split(key, 5)
    n = context // page
    qn = jax.random.normal(ks[0], (batch, t, heads, c), jnp.bfloat16)
    qp = jax.random.normal(ks[1], (batch, t, heads, r), jnp.bfloat16)
    kv = jax.random.normal(ks[2], (batch * n, page, c + r), jnp.bfloat16)
    pt = jax.random.permutation(ks[3], batch * n).reshape(batch, n).astype(jnp.int32)
    lengths = jnp.asarray(case_lengths(batch, context, kind, t))
    scales = None
    if dtype in ("int8", "int8g"):
        qc, sc = quantize_int8(kv[..., :c])
        qr, sr = quantize_int8(kv[..., c:])
        kv, scales = jnp.concatenate([qc, qr], -1), jnp.stack([sc, sr], -1)
        if dtype == "int8":
            scales = jnp.swapaxes(scales, 1, 2)  # hcfjax.cache's token-minor layout [P, 2, page]
    return qn, qp, kv, pt, lengths, scales


def cache_bytes(tokens, c=512, r=64, dtype="bf16") -> int:
    per_token = (c + r) * 2 if dtype == "bf16" else (c + r) + 8
    return int(tokens) * per_token


def rel_err(out, ref) -> float:
    o, r = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    if np.isnan(o).any():
        return float("nan")
    return float(np.linalg.norm(o - r) / np.linalg.norm(r))


def parse_version(text):
    """--versions token -> mla_decode's (pair, registers, qk8, transposed, converters): "3" the kernel (the only
    version), "3p" / "3n" with / without paired head tiles (multicast), "3p@232/232/40" with that register split
    (WG0/WG1/loader[/WG3]), a q (e.g. "3q", "3pq") with Q.K on int8 tensor cores for int8 caches (`qk8`), a t / h below
    64 heads with the MMAs transposed (cache tokens as M) / not (heads as M, padded to 64), a c (int8, transposed) with
    two converter warpgroups, None the defaults."""
    if text is None:
        return None, None, False, None, False
    base, _, regs = str(text).partition("@")
    registers = tuple(int(v) for v in regs.split("/")) if regs else None
    qk8, base = "q" in base, base.replace("q", "")
    transposed = True if "t" in base else False if "h" in base else None
    converters = "c" in base
    base = base.replace("t", "").replace("h", "").replace("c", "")
    if base.rstrip("pn") != "3":
        raise ValueError(f"version token {text!r}: 3 with p, n, q, t, h, c or @split (version 4 was dropped)")
    return {"p": True, "n": False}.get(base[-1]), registers, qk8, transposed, converters


def for_case(version, dtype, heads):
    """The version token as it applies to a case: without p below 128 heads (head tiles pair only in multiples of
    128), without q for a bf16 cache (int8 Q.K is for int8 caches), without t and h from 64 heads (a tile's rows
    are then all heads) or with q (int8 Q.K is not transposed), without c where the tile is not transposed or the
    cache is bf16 (converters convert int8 parts of transposed tiles)."""
    if version is None:
        return None
    base, at, regs = str(version).partition("@")
    if heads % 128:
        base = base.replace("p", "")
    if dtype == "bf16":
        base = base.replace("q", "")
    if heads >= 64 or "q" in base:
        base = base.replace("t", "").replace("h", "")
    if dtype == "bf16" or heads >= 64 or "q" in base or "h" in base:
        base = base.replace("c", "")
    return base + at + regs


def parse_case(text):
    """A case's text, cache:BxCTX[:lengths][:hH][:tT] -> (cache, B, CTX, lengths, H, T); H, the query heads,
    defaults to DeepSeek-V3's 128, T, the query tokens per row (MTP verification: the row's last T positions,
    causal), to 1."""
    parts = text.split(":")
    if len(parts) < 2:
        raise ValueError(f"case {text!r}: cache:BxCTX[:full|mixed|skew][:hH][:tT], e.g. int8:128x4096:h16:t2")
    dtype, shape, rest = parts[0], parts[1], parts[2:]
    heads, t = 128, 1
    if rest and rest[-1].startswith("t"):
        t = int(rest.pop()[1:])
    if rest and rest[-1].startswith("h"):
        heads = int(rest.pop()[1:])
    kind = rest[0] if rest else "full"
    b, ctx = (int(v) for v in shape.split("x"))
    if dtype not in ("bf16", "int8", "int8g"):
        raise ValueError(f"cache must be bf16, int8 or int8g, got {dtype!r}")
    if kind not in ("full", "mixed", "skew") or len(rest) > 1:
        raise ValueError(f"case {text!r}: lengths must be full, mixed or skew")
    if heads < 1 or t < 1:
        raise ValueError(f"case {text!r}: the head and token counts must be positive")
    return dtype, b, ctx, kind, heads, t


def flashinfer_time(lengths, context, reps, heads=128, c=512, r=64, page=64, kernels=False, t=1):
    """Seconds per call of FlashInfer's MLA decode on the same shape and lengths (its own random data), or None:
    CUDA events around `reps` calls (kernels plus launch gaps), or with `kernels` its kernels' summed times in a
    jax.profiler trace (kernel_time, as --kernel-time measures ours). t > 1: t query tokens per row, causal (the
    row's last t positions)."""
    try:
        import flashinfer
        import torch
    except ImportError:
        return None
    dev = "cuda"
    b = len(lengths)
    n = context // page
    pages = torch.randperm(b * n, device=dev, dtype=torch.int32).reshape(b, n)
    used = [-(-int(x) // page) for x in lengths]
    kv_indices = torch.cat([pages[i, : used[i]] for i in range(b)])
    kv_indptr = torch.tensor(np.concatenate([[0], np.cumsum(used)]), dtype=torch.int32, device=dev)
    qo_indptr = torch.arange(b + 1, dtype=torch.int32, device=dev) * t
    kv_len = torch.tensor(np.asarray(lengths), dtype=torch.int32, device=dev)
    ckv = torch.randn(b * n, page, c, dtype=torch.bfloat16, device=dev)
    kpe = torch.randn(b * n, page, r, dtype=torch.bfloat16, device=dev)
    q_nope = torch.randn(b * t, heads, c, dtype=torch.bfloat16, device=dev)
    q_pe = torch.randn(b * t, heads, r, dtype=torch.bfloat16, device=dev)
    ws = torch.empty(128 * 1024 * 1024, dtype=torch.int8, device=dev)
    for backend in ("fa3", "auto"):
        try:
            w = flashinfer.mla.BatchMLAPagedAttentionWrapper(ws, backend=backend)
            w.plan(
                qo_indptr,
                kv_indptr,
                kv_indices,
                kv_len,
                heads,
                c,
                r,
                page,
                t > 1,  # causal: each query token sees the keys up to its own position
                c**-0.5,
                torch.bfloat16,
                torch.bfloat16,
            )
            w.run(q_nope, q_pe, ckv, kpe)
            torch.cuda.synchronize()
            if kernels:
                sync = lambda _: torch.cuda.synchronize()  # noqa: E731
                return kernel_time(lambda w=w: w.run(q_nope, q_pe, ckv, kpe), reps=reps, wait=sync)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(reps):
                w.run(q_nope, q_pe, ckv, kpe)
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end) / 1e3 / reps
        except Exception as e:  # noqa: BLE001 (fa3 needs sm_90 and a matching build; try auto)
            print(f"flashinfer backend {backend}: {type(e).__name__}: {str(e)[:300]}", flush=True)
    return None


# kernel us: the kernel given its plan, as every layer of a forward runs it (the model makes one plan per forward,
# attention.with_decode_plan); GB/s, % copy, TFLOP/s, speedup and "vs FlashInfer" (its time over ours: > 1 is
# faster) are of that time. call us: one call that also makes its plan (plan us alone).
TABLE_HEAD = (
    "| cache | H | T | B | ctx | lengths | ver | kernel us | GB/s | % copy | TFLOP/s | plan us | call us | "
    "XLA ref us | speedup | FlashInfer us | FlashInfer GB/s | vs FlashInfer | rel err |\n"
    "|" + " --- |" * 19
)


class Row(NamedTuple):
    """One timed kernel version on one case: seconds per call (the call with its plan, the kernel given its plan, the
    plan alone, the XLA reference, FlashInfer or None) and what the rates are of (cache bytes read, FLOPs)."""

    dtype: str
    batch: int
    context: int
    kind: str
    heads: int
    tokens: int  # query tokens per row
    ver: str
    t_call: float
    t_kern: float
    t_plan: float
    t_ref: float
    t_fi: float | None
    nbytes: int
    flops: int
    err: float


def table_row(row: Row, copy_bw) -> str:
    tk, tf = row.t_kern, row.t_fi
    bwk = row.nbytes / tk
    pct = f"{100 * bwk / copy_bw:.0f}" if copy_bw else "-"
    fi = (f"{tf * 1e6:.1f}", f"{row.nbytes / tf / 1e9:.0f}", f"{tf / tk:.2f}x") if tf else ("", "", "")
    return (
        f"| {row.dtype} | {row.heads} | {row.tokens} | {row.batch} | {row.context} | {row.kind} | {row.ver} | "
        f"{tk * 1e6:.1f} | "
        f"{bwk / 1e9:.0f} | {pct} | {row.flops / tk / 1e12:.0f} | {row.t_plan * 1e6:.1f} | {row.t_call * 1e6:.1f} | "
        f"{row.t_ref * 1e6:.1f} | {row.t_ref / tk:.1f}x | {' | '.join(fi)} | {row.err:.1e} |"
    )
