"""MLA decode kernel benchmark: one table of kernel vs XLA reference (and FlashInfer when installed), bf16 and int8.

    python -m pallas_kernels.bench.mla [--check] [--cases bf16:1x4096,bf16:32x16384:mixed,...] [--reps 20]

H=128, C=512, R=64, page size 64, shuffled page tables. A case is cache:BxCTX[:lengths]: `full` rows (every row CTX
tokens), `mixed` (lengths uniform in 1..CTX, fixed seed), `skew` (one row of CTX tokens, the rest CTX/16); the page
table is always CTX wide, so mixed and skew rows leave most of it unused (what the length-aware split schedule is for).
Cache `int8` uses hcfjax.cache's scale layout [P, page, 2] (the wrapper gathers and transposes the table's scales per
call), `int8t` the proposed token-minor [P, 2, page] (no per-call pass).

Bandwidth is cache bytes actually read (sum of lengths x (c_kv + k_pe), plus 8 bytes of scales per int8 token) over
the time. Times are the mean of `reps` back-to-back calls with one sync at the end (device time plus launch gaps; a
per-call sync would add the host round trip, tens of us, which swamped the batch-1 rows of the first run). The
ceilings are measured in the same run: torch's device-to-device copy (read + write) and XLA's int8 and bf16 matmul
rates. The kernel is checked against the reference on the device before it is timed (rel = ||out - ref|| / ||ref||).
FlashInfer (BatchMLAPagedAttentionWrapper, backend fa3, else auto) runs on the same shapes and lengths with its own
random data when `import flashinfer` works; its plan() (host-side scheduling) is outside the timing. --check only
compiles and checks small and full shapes.
"""

from __future__ import annotations

import argparse
import functools
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from hcfjax.bench.common import header, matmul_flops, timed, torch_copy_bandwidth
from hcfjax.cache import quantize_int8
from pallas_kernels.mla_decode import mla_decode, mla_decode_reference

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
    "int8t:32x4096",
    "int8:128x4096",
    "int8t:128x4096",
    "int8:1x16384",
    "bf16:64x16384",
)


def timed_async(fn, *args, reps: int = 20) -> float:
    """Mean seconds per call over `reps` calls dispatched back to back, after a warm-up call (which also compiles)."""
    jax.block_until_ready(fn(*args))
    t0 = time.perf_counter()
    out = None
    for _ in range(reps):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / reps


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


def int8_matmul_ops(n: int = 8192) -> float:
    a = jax.random.randint(jax.random.key(1), (n, n), -127, 127, jnp.int8)
    b = jax.random.randint(jax.random.key(2), (n, n), -127, 127, jnp.int8)
    f = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.int32))
    return 2 * n**3 / timed(f, a, b)


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
    if dtype in ("int8", "int8t"):
        qc, sc = quantize_int8(kv[..., :c])
        qr, sr = quantize_int8(kv[..., c:])
        kv, scales = jnp.concatenate([qc, qr], -1), jnp.stack([sc, sr], -1)
        if dtype == "int8t":
            scales = jnp.swapaxes(scales, 1, 2)  # the proposed token-minor cache layout [P, 2, page]
    return qn, qp, kv, pt, lengths, scales


def cache_bytes(tokens, c=512, r=64, dtype="bf16") -> int:
    per_token = (c + r) * 2 if dtype == "bf16" else (c + r) + 8
    return int(tokens) * per_token


def rel_err(out, ref) -> float:
    o, r = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    if np.isnan(o).any():
        return float("nan")
    return float(np.linalg.norm(o - r) / np.linalg.norm(r))


def fns(scale):
    kern = jax.jit(functools.partial(mla_decode, sm_scale=scale))
    ref = jax.jit(functools.partial(mla_decode_reference, sm_scale=scale))
    return kern, ref


def check(batch, context, dtype, heads=128, c=512, r=64, t=1, kind="full"):
    qn, qp, kv, pt, lengths, sc = make_inputs(
        jax.random.key(batch * 7 + context), batch, context, heads, c, r, dtype=dtype, t=t, kind=kind
    )
    kern, ref = fns(c**-0.5)
    out = kern(qn, qp, kv, pt, lengths, scales=sc)
    want = ref(qn.astype(jnp.float32), qp.astype(jnp.float32), kv, pt, lengths, scales=sc)
    return rel_err(out, want)


def run_checks():
    cases = [
        dict(batch=2, context=256, dtype="bf16", heads=16, c=128, r=64),
        dict(batch=2, context=256, dtype="int8", heads=16, c=128, r=64),
        dict(batch=3, context=512, dtype="bf16", heads=128, t=3, kind="mixed"),
        dict(batch=3, context=512, dtype="int8t", heads=128, t=3, kind="mixed"),
        dict(batch=4, context=4096, dtype="bf16"),
        dict(batch=4, context=4096, dtype="int8"),
        dict(batch=1, context=16384, dtype="bf16"),
        dict(batch=40, context=4096, dtype="bf16", kind="mixed"),
        dict(batch=32, context=16384, dtype="bf16", kind="skew"),
    ]
    for case in cases:
        try:
            print(f"check {case}: rel {check(**case):.2e}", flush=True)
        except Exception as e:  # noqa: BLE001 (report every case)
            print(f"check {case}: FAILED {type(e).__name__}: {str(e)[:3000]}", flush=True)
            traceback.print_exc(limit=3)


def flashinfer_time(lengths, context, reps, heads=128, c=512, r=64, page=64):
    """Seconds per call of FlashInfer's MLA decode on the same shape and lengths (its own random data), or None."""
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
    qo_indptr = torch.arange(b + 1, dtype=torch.int32, device=dev)
    kv_len = torch.tensor(np.asarray(lengths), dtype=torch.int32, device=dev)
    ckv = torch.randn(b * n, page, c, dtype=torch.bfloat16, device=dev)
    kpe = torch.randn(b * n, page, r, dtype=torch.bfloat16, device=dev)
    q_nope = torch.randn(b, heads, c, dtype=torch.bfloat16, device=dev)
    q_pe = torch.randn(b, heads, r, dtype=torch.bfloat16, device=dev)
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
                False,
                c**-0.5,
                torch.bfloat16,
                torch.bfloat16,
            )
            w.run(q_nope, q_pe, ckv, kpe)
            torch.cuda.synchronize()
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


def parse_case(text):
    parts = text.split(":")
    dtype, shape = parts[0], parts[1]
    kind = parts[2] if len(parts) > 2 else "full"
    b, ctx = (int(v) for v in shape.split("x"))
    if dtype not in ("bf16", "int8", "int8t"):
        raise ValueError(f"cache must be bf16, int8 or int8t, got {dtype!r}")
    return dtype, b, ctx, kind


TABLE_HEAD = (
    "| cache | B | ctx | lengths | kernel us | kernel GB/s | % copy | TFLOP/s | XLA ref us | speedup | "
    "FlashInfer us | FlashInfer GB/s | rel err |\n"
    "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"
)


def table_row(row, copy_bw) -> str:
    dtype, b, ctx, kind, tk, bwk, tr, _bwr, sp, fl, err, tf = row
    pct = f"{100 * bwk / copy_bw:.0f}" if copy_bw else "-"
    fi = (f"{tf * 1e6:.1f}", f"{bwk * tk / tf / 1e9:.0f}") if tf else ("", "")
    return (
        f"| {dtype} | {b} | {ctx} | {kind} | {tk * 1e6:.1f} | {bwk / 1e9:.0f} | {pct} | {fl / 1e12:.0f} | "
        f"{tr * 1e6:.1f} | {sp:.1f}x | {fi[0]} | {fi[1]} | {err:.1e} |"
    )


def bench(cases, reps, use_flashinfer=True):
    copy_bw = torch_copy_bandwidth(4.0)
    i8 = int8_matmul_ops()
    bf = matmul_flops()
    print(header())
    print(
        f"ceilings: copy {copy_bw / 1e12 if copy_bw else float('nan'):.2f} TB/s (torch copy_, read+write), "
        f"int8 matmul {i8 / 1e12:.0f} TOP/s, bf16 matmul {bf / 1e12:.0f} TFLOP/s (XLA, 8192^3)",
        flush=True,
    )
    try:
        import flashinfer

        print(f"flashinfer {getattr(flashinfer, '__version__', '?')}", flush=True)
    except ImportError:
        use_flashinfer = False
        print("flashinfer: not installed (column empty)", flush=True)
    print(TABLE_HEAD, flush=True)  # each row is printed as it finishes, so a run cut short still leaves a table
    rows = []
    for dtype, batch, context, kind in cases:
        t0 = time.perf_counter()
        try:
            qn, qp, kv, pt, lengths, sc = make_inputs(
                jax.random.key(batch + context), batch, context, dtype=dtype, kind=kind
            )
            kern, ref = fns(512**-0.5)
            err = rel_err(kern(qn, qp, kv, pt, lengths, scales=sc), ref(qn, qp, kv, pt, lengths, scales=sc))
            tk = timed_async(functools.partial(kern, scales=sc), qn, qp, kv, pt, lengths, reps=reps)
            tr = timed_async(functools.partial(ref, scales=sc), qn, qp, kv, pt, lengths, reps=reps)
            tokens = int(np.sum(np.asarray(lengths)))
            tf = flashinfer_time(np.asarray(lengths), context, reps) if use_flashinfer and dtype == "bf16" else None
        except Exception as e:  # noqa: BLE001 (report the case, go on)
            print(f"{dtype}:{batch}x{context}:{kind}: FAILED {type(e).__name__}: {str(e)[:2000]}", flush=True)
            if "CUDA" in str(e):
                raise  # a CUDA error leaves the context unusable; the rest would fail too
            continue
        nb = cache_bytes(tokens, dtype=dtype)
        flops = tokens * 128 * (576 + 512) * 2
        rows.append((dtype, batch, context, kind, tk, nb / tk, tr, nb / tr, tr / tk, flops / tk, err, tf))
        print(table_row(rows[-1], copy_bw), f"({time.perf_counter() - t0:.0f} s)", flush=True)
        del qn, qp, kv, pt, sc
    lines = ["", TABLE_HEAD] + [table_row(row, copy_bw) for row in rows]
    by = {(d, b, c, k): tk for d, b, c, k, tk, *_ in rows}
    pairs = [
        f"{d}/bf16 {b}x{c}{'' if k == 'full' else ' ' + k} {by[('bf16', b, c, k)] / tk:.2f}x"
        for (d, b, c, k), tk in by.items()
        if d != "bf16" and ("bf16", b, c, k) in by
    ]
    if pairs:
        lines += ["", "int8 speedup over bf16: " + ", ".join(pairs)]
    print("\n".join(lines), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--no-flashinfer", action="store_true")
    args = ap.parse_args()
    if args.check:
        run_checks()
        return
    bench([parse_case(c) for c in args.cases.split(",")], args.reps, not args.no_flashinfer)


if __name__ == "__main__":
    main()
