"""MLA decode kernel benchmark: one table of kernel vs XLA reference (and FlashInfer when installed), bf16 and int8.

    python -m pallas_kernels.bench.mla [--check] [--cases bf16:1x4096,bf16:32x16384:mixed,int8:128x4096:h16,...]
                                       [--reps 20] [--versions 3p,3pq] [--device-time | --kernel-time] [--rounds N]

C=512, R=64, page size 64, shuffled page tables. A case is cache:BxCTX[:lengths][:hH]: `full` rows (every row CTX
tokens), `mixed` (lengths uniform in 1..CTX, fixed seed), `skew` (one row of CTX tokens, the rest CTX/16); the page
table is always CTX wide, so mixed and skew rows leave most of it unused (what the length-aware split schedule is for).
H query heads, 128 (DeepSeek-V3) unless `hH` says otherwise (h16: V2-Lite; the kernel runs heads in 64-row tiles, so
below 64 its MMAs do 64 heads' work, which TFLOP/s does not count).
Cache `int8` uses hcfjax.cache's scale layout [P, page, 2] (the wrapper gathers and transposes the table's scales per
call), `int8t` the proposed token-minor [P, 2, page] (no per-call pass).

Bandwidth is cache bytes actually read (sum of lengths x (c_kv + k_pe), plus 8 bytes of scales per int8 token) over
the time. Times are the mean of `reps` back-to-back calls with one sync at the end (device time plus launch gaps; a
per-call sync would add the host round trip, tens of us, which swamped the batch-1 rows of the first run);
--device-time chains the calls in one jitted loop (about 18 us a call of that is the loop's own, measured
2026-11-30; FlashInfer's CUDA events see its kernels plus their launch gaps); --kernel-time sums the kernel records
of one jax.profiler trace (CUPTI records FlashInfer's torch kernels too; a torch profiler beside it would fail, CUPTI
takes one subscriber per process), the GPU's kernels alone. The
ceilings are measured in the same run: torch's device-to-device copy (read + write) and XLA's int8 and bf16 matmul
rates. The kernel is checked against the reference on the device before it is timed (rel = ||out - ref|| / ||ref||).
FlashInfer (BatchMLAPagedAttentionWrapper, backend fa3, else auto) runs on the same shapes and lengths with its own
random data when `import flashinfer` works; its plan() (host-side scheduling) is outside the timing. --check only
compiles and checks small and full shapes.

--versions times each variant of the kernel (3, mla_kernel's leader/follower schedule, the only version since the
seesaw v4 was dropped; a p or n suffix runs it with or without paired head tiles, the multicast cluster;
a q suffix, int8 rows only, runs Q.K on int8 tensor cores, mla_decode's qk8; "@256/208/40" with that register split of
WG0/WG1/loader, e.g. 3p,3p@232/232/40 against the split before 2026-11-30) on every case, one row each, so one run
compares them. A variant other than 3 and 3n is first run on three small shapes in a child process with a timeout: a
kernel that hangs there is dropped from the run instead of hanging it. --rounds N times each case's kernel rows N
times, interleaved, and keeps each row's best (the H200's times of one call vary between runs; side-by-side variants
should see the same spells). --min-blocks sets the smallest work unit in 64-token blocks (it decides the split only
when the batch has fewer than num_sms / 2 x min_blocks blocks in all, e.g. batch 1 x 4096). "kernel us" is the kernel
given a plan built beforehand (what every layer costs: the model makes one plan per forward; FlashInfer's column
excludes its plan() the same way, and "vs FlashInfer" is its time over ours); "call us" also makes the plan inside the
call, and "plan us" is the plan alone. Before 2026-11-30 the tables' "kernel us" was the call with its plan, and "w/
plan us" the kernel given its plan.
"""

from __future__ import annotations

import argparse
import functools
import subprocess
import sys
import time
import traceback
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from hcfjax.bench.common import (
    device_timer,
    header,
    kernel_time,
    matmul_flops,
    repeats_exactly,
    timed,
    torch_copy_bandwidth,
)
from hcfjax.cache import quantize_int8
from pallas_kernels.mla_decode import mla_decode, mla_decode_reference, mla_plan

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


MIN_BLOCKS = 4  # mla_decode's min_blocks_per_split (--min-blocks)


def parse_version(text):
    """--versions token -> mla_decode's (pair, registers, qk8): "3" the kernel (the only version since v4's removal on
    2026-12-01), "3p" / "3n" with / without paired head tiles (multicast), "3p@232/232/40" with that register split
    (WG0/WG1/loader), a q (e.g. "3q", "3pq") with Q.K on int8 tensor cores for int8 caches (`qk8`), None the
    defaults."""
    if text is None:
        return None, None, False
    base, _, regs = str(text).partition("@")
    registers = tuple(int(v) for v in regs.split("/")) if regs else None
    qk8, base = "q" in base, base.replace("q", "")
    if base.rstrip("pn") != "3":
        raise ValueError(f"version token {text!r}: 3 with p, n, q or @split (version 4 was dropped)")
    return {"p": True, "n": False}.get(base[-1]), registers, qk8


def fns(scale, version=None, profile=""):
    pair, registers, qk8 = parse_version(version)
    kern = jax.jit(
        functools.partial(
            mla_decode,
            sm_scale=scale,
            pair=pair,
            registers=registers,
            qk8=qk8,
            min_blocks_per_split=MIN_BLOCKS,
            profile=profile,
        )
    )
    ref = jax.jit(functools.partial(mla_decode_reference, sm_scale=scale))
    return kern, ref


def for_case(version, dtype, heads):
    """The version token as it applies to a case: without p below 128 heads (head tiles pair only in multiples of
    128), without q for a bf16 cache (int8 Q.K is for int8 caches)."""
    if version is None:
        return None
    base, at, regs = str(version).partition("@")
    if heads % 128:
        base = base.replace("p", "")
    if dtype == "bf16":
        base = base.replace("q", "")
    return base + at + regs


def check(batch, context, dtype, heads=128, c=512, r=64, t=1, kind="full", version=None):
    version = for_case(version, dtype, heads)
    qn, qp, kv, pt, lengths, sc = make_inputs(
        jax.random.key(batch * 7 + context), batch, context, heads, c, r, dtype=dtype, t=t, kind=kind
    )
    kern, ref = fns(c**-0.5, version)
    out = kern(qn, qp, kv, pt, lengths, scales=sc)
    if not repeats_exactly(lambda *a: kern(*a, scales=sc), (qn, qp, kv, pt, lengths), out):
        raise RuntimeError("the kernel's outputs differ between runs (a race)")
    want = ref(qn.astype(jnp.float32), qp.astype(jnp.float32), kv, pt, lengths, scales=sc)
    return rel_err(out, want)


# Small shapes that take each merge path (dense: 2 x 512; sparse, with the combine kernel: 40 x 4096) and int8.
PREFLIGHT = (
    dict(batch=2, context=512, dtype="bf16", kind="mixed"),
    dict(batch=40, context=4096, dtype="bf16", kind="mixed"),
    dict(batch=2, context=512, dtype="int8"),
)


def preflight(version: str, timeout_s: float = 90.0) -> bool:
    """Runs `version` on two small shapes in a child process; False (and why) if it fails, is wrong or hangs."""
    cmd = [sys.executable, "-m", "pallas_kernels.bench.mla", "--check", "--preflight", f"--versions={version}"]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        print(f"version {version}: preflight timed out after {timeout_s:.0f} s (hang?); dropped", flush=True)
        return False
    ok = res.returncode == 0
    print(f"version {version} preflight {'ok' if ok else 'FAILED, dropped'}:\n{res.stdout.strip()[-1500:]}", flush=True)
    if not ok:
        print(res.stderr[-3000:], flush=True)
    return ok


def run_checks(versions=(None,), quick=False) -> bool:
    bad = False
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
        dict(batch=128, context=4096, dtype="int8", kind="mixed"),
    ]
    for version in versions:
        for case in PREFLIGHT if quick else cases:
            try:
                err = check(**case, version=version)
                bad |= not err < 2e-2
                print(f"check v{version} {case}: rel {err:.2e}{'' if err < 2e-2 else ' FAILED'}", flush=True)
            except Exception as e:  # noqa: BLE001 (report every case)
                bad = True
                print(f"check v{version} {case}: FAILED {type(e).__name__}: {str(e)[:3000]}", flush=True)
                traceback.print_exc(limit=3)
    return not bad


def flashinfer_time(lengths, context, reps, heads=128, c=512, r=64, page=64, kernels=False):
    """Seconds per call of FlashInfer's MLA decode on the same shape and lengths (its own random data), or None:
    CUDA events around `reps` calls (kernels plus launch gaps), or with `kernels` its kernels' summed times in a
    jax.profiler trace (kernel_time, as --kernel-time measures ours)."""
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


def parse_case(text):
    """A case's text, cache:BxCTX[:lengths][:hH] -> (cache, B, CTX, lengths, H); H, the query heads, defaults to
    DeepSeek-V3's 128."""
    parts = text.split(":")
    if len(parts) < 2:
        raise ValueError(f"case {text!r}: cache:BxCTX[:full|mixed|skew][:hH], e.g. int8:128x4096:h16")
    dtype, shape, rest = parts[0], parts[1], parts[2:]
    heads = 128
    if rest and rest[-1].startswith("h"):
        heads = int(rest.pop()[1:])
    kind = rest[0] if rest else "full"
    b, ctx = (int(v) for v in shape.split("x"))
    if dtype not in ("bf16", "int8", "int8t"):
        raise ValueError(f"cache must be bf16, int8 or int8t, got {dtype!r}")
    if kind not in ("full", "mixed", "skew") or len(rest) > 1:
        raise ValueError(f"case {text!r}: lengths must be full, mixed or skew")
    if heads < 1:
        raise ValueError(f"case {text!r}: the head count must be positive")
    return dtype, b, ctx, kind, heads


# kernel us: the kernel given its plan, as every layer of a forward runs it (the model makes one plan per forward,
# attention.with_decode_plan); GB/s, % copy, TFLOP/s, speedup and "vs FlashInfer" (its time over ours: > 1 is
# faster) are of that time. call us: one call that also makes its plan (plan us alone).
TABLE_HEAD = (
    "| cache | H | B | ctx | lengths | ver | kernel us | GB/s | % copy | TFLOP/s | plan us | call us | "
    "XLA ref us | speedup | FlashInfer us | FlashInfer GB/s | vs FlashInfer | rel err |\n"
    "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"
)


class Row(NamedTuple):
    """One timed kernel version on one case: seconds per call (the call with its plan, the kernel given its plan, the
    plan alone, the XLA reference, FlashInfer or None) and what the rates are of (cache bytes read, FLOPs)."""

    dtype: str
    batch: int
    context: int
    kind: str
    heads: int
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
        f"| {row.dtype} | {row.heads} | {row.batch} | {row.context} | {row.kind} | {row.ver} | {tk * 1e6:.1f} | "
        f"{bwk / 1e9:.0f} | {pct} | {row.flops / tk / 1e12:.0f} | {row.t_plan * 1e6:.1f} | {row.t_call * 1e6:.1f} | "
        f"{row.t_ref * 1e6:.1f} | {row.t_ref / tk:.1f}x | {' | '.join(fi)} | {row.err:.1e} |"
    )


def bench(cases, reps, use_flashinfer=True, versions=(None,), device=False, rounds=1, kernels=False):
    """device: time on the device alone (hcfjax.bench.common.device_time: calls chained in one jitted loop, no
    host dispatch per call, as FlashInfer's CUDA-event timing); kernels: the GPU's kernel time, from a profiler
    trace's kernel records summed per call (kernel_times: device_time's loop adds about 18 us a call, which matters at
    small batches); else calls dispatched back to back. rounds > 1: each
    case's kernel rows are timed that many times, interleaved (every version, then every version again), and keep
    their best; the rows are printed again after the last round."""

    def again(fn, *args):  # a timer of fn(*args) to call once per round (device_timer compiles its loops once)
        if kernels:
            return lambda: kernel_time(fn, *args, reps=reps)
        return device_timer(fn, *args, reps=reps) if device else lambda: timed_async(fn, *args, reps=reps)

    def timer(fn, *args):  # one measurement
        return again(fn, *args)()

    copy_bw = torch_copy_bandwidth(4.0)
    i8 = int8_matmul_ops()
    bf = matmul_flops()
    print(header())
    how = "calls dispatched back to back"
    how = "on the device alone (device_time)" if device else how
    how = "the GPU's kernels alone (kernel_times: a profiler trace's kernel records)" if kernels else how
    print("times: " + how, flush=True)
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
    for dtype, batch, context, kind, heads in cases:
        t0 = time.perf_counter()
        name = f"{dtype}:{batch}x{context}:{kind}:h{heads}"
        try:
            qn, qp, kv, pt, lengths, sc = make_inputs(
                jax.random.key(batch + context), batch, context, heads, dtype=dtype, kind=kind
            )
            _, ref = fns(512**-0.5)
            want = ref(qn, qp, kv, pt, lengths, scales=sc)
            ref_fn = lambda qn, qp, kv, pt, n, sc, ref=ref: ref(qn, qp, kv, pt, n, scales=sc)  # arrays as arguments
            tr = timer(ref_fn, qn, qp, kv, pt, lengths, sc)
            plan_fn = jax.jit(
                functools.partial(
                    mla_plan, max_pages=pt.shape[1], page_size=64, heads=heads, min_blocks_per_split=MIN_BLOCKS
                )
            )
            tp = timer(plan_fn, lengths)
            plan = plan_fn(lengths)
            tokens = int(np.sum(np.asarray(lengths)))
            tf = (
                flashinfer_time(np.asarray(lengths), context, reps, heads, kernels=kernels)
                if use_flashinfer and dtype == "bf16"
                else None
            )
        except Exception as e:  # noqa: BLE001 (report the case, go on)
            print(f"{name}: FAILED {type(e).__name__}: {str(e)[:2000]}", flush=True)
            if "CUDA" in str(e):
                raise  # a CUDA error leaves the context unusable; the rest would fail too
            continue
        timed_rows = []  # (row index, kernel timer, with-plan timer) for the later rounds
        for version in dict.fromkeys(for_case(v, dtype, heads) for v in versions):  # (3p and 3 alike below 128)
            try:
                kern, _ = fns(512**-0.5, version)
                kern_fn = lambda qn, qp, kv, pt, n, sc, plan=None, k=kern: k(qn, qp, kv, pt, n, scales=sc, plan=plan)
                out = kern_fn(qn, qp, kv, pt, lengths, sc)
                err = rel_err(out, want)
                if not repeats_exactly(kern_fn, (qn, qp, kv, pt, lengths, sc), out):
                    print(f"{name} v{version}: outputs differ between runs", flush=True)
                    err = float("nan")  # shown as the row's rel err
                timers = again(kern_fn, qn, qp, kv, pt, lengths, sc), again(kern_fn, qn, qp, kv, pt, lengths, sc, plan)
                tc, tk = (t() for t in timers)  # the call (plan inside), the kernel given its plan
            except Exception as e:  # noqa: BLE001
                print(f"{name} v{version}: FAILED {type(e).__name__}: {str(e)[:2000]}")
                if "CUDA" in str(e):
                    raise
                continue
            flops = tokens * heads * (576 + 512) * 2  # (the kernel pads heads to 64-row tiles: not counted)
            ver = "-" if version is None else version
            nbytes = cache_bytes(tokens, dtype=dtype)
            rows.append(Row(dtype, batch, context, kind, heads, ver, tc, tk, tp, tr, tf, nbytes, flops, err))
            print(table_row(rows[-1], copy_bw), f"({time.perf_counter() - t0:.0f} s)", flush=True)
            timed_rows.append((len(rows) - 1, *timers))
        for _ in range(rounds - 1):
            for i, t_call, t_kern in timed_rows:
                rows[i] = rows[i]._replace(t_call=min(rows[i].t_call, t_call()), t_kern=min(rows[i].t_kern, t_kern()))
        for i, *_ in timed_rows if rounds > 1 else ():
            print(table_row(rows[i], copy_bw), f"(best of {rounds} rounds)", flush=True)
        del qn, qp, kv, pt, sc, want, plan
    lines = ["", TABLE_HEAD] + [table_row(row, copy_bw) for row in rows]
    by = {(r.dtype, r.batch, r.context, r.kind, r.heads, r.ver): r.t_kern for r in rows}
    pairs = [
        f"{d}/bf16 {b}x{c}{'' if k == 'full' else ' ' + k}{'' if h == 128 else f' H={h}'} v{v} "
        f"{by[('bf16', b, c, k, h, for_case(v, 'bf16', h))] / tk:.2f}x"
        for (d, b, c, k, h, v), tk in by.items()
        if d != "bf16" and ("bf16", b, c, k, h, for_case(v, "bf16", h)) in by
    ]
    if pairs:
        lines += ["", "int8 speedup over bf16: " + ", ".join(pairs)]
    print("\n".join(lines), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--preflight", action="store_true", help="with --check: only the three small shapes")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--no-flashinfer", action="store_true")
    ap.add_argument("--device-time", action="store_true", help="time on the device alone (no per-call dispatch)")
    ap.add_argument("--kernel-time", action="store_true", help="time the GPU's kernels alone (a profiler trace)")
    ap.add_argument(
        "--versions",
        default="",
        help="kernel variants to time side by side, e.g. 3p,3pq (p / n: with / without paired head tiles; q: qk8)",
    )
    ap.add_argument("--min-blocks", type=int, default=MIN_BLOCKS, help="min_blocks_per_split (units at small batch)")
    ap.add_argument("--rounds", type=int, default=1, help="time each case's kernel rows this many times, interleaved")
    args = ap.parse_args()
    globals()["MIN_BLOCKS"] = args.min_blocks
    versions = tuple(v for v in args.versions.split(",") if v) or (None,)
    if args.check:
        sys.exit(0 if run_checks(versions, quick=args.preflight) else 1)
    if len(versions) > 1 or versions != (None,):
        versions = tuple(v for v in versions if v in ("3", "3n") or preflight(v))
    cases = [parse_case(c) for c in args.cases.split(",")]
    bench(cases, args.reps, not args.no_flashinfer, versions, args.device_time, args.rounds, args.kernel_time)


if __name__ == "__main__":
    main()
