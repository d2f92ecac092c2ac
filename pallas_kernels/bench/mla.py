"""MLA decode kernel benchmark: one table of kernel vs XLA reference (and FlashInfer when installed), bf16 and int8.

    python -m pallas_kernels.bench.mla [--check] [--cases bf16:1x4096,bf16:32x16384:mixed,int8:128x4096:h16:t2,...]
                                       [--reps 20] [--versions 3p,3pq] [--device-time | --kernel-time] [--rounds N]

C=512, R=64, page size 64, shuffled page tables. A case is cache:BxCTX[:lengths][:hH]: `full` rows (every row CTX
tokens), `mixed` (lengths uniform in 1..CTX, fixed seed), `skew` (one row of CTX tokens, the rest CTX/16); the page
table is always CTX wide, so mixed and skew rows leave most of it unused (what the length-aware split schedule is for).
H query heads, 128 (DeepSeek-V3) unless `hH` says otherwise (h16: V2-Lite; the kernel runs heads in 64-row tiles, so
below 64 its MMAs do 64 heads' work, which TFLOP/s does not count). `tT`: T query tokens per row (MTP verification:
the row's last T positions, causal), FlashInfer likewise (qo_indptr of T a row, causal).
Cache `int8` uses hcfjax.cache's token-minor scales [P, 2, page] (read where they lie), `int8g` token-major ones [P,
page, 2] (the wrapper gathers and transposes the table's scales per call).

Bandwidth is cache bytes actually read (sum of lengths x (c_kv + k_pe), plus 8 bytes of scales per int8 token) over
the time. Times are the mean of `reps` back-to-back calls with one sync at the end (device time plus launch gaps; a
per-call sync would add the host round trip, tens of us, which swamped the batch-1 rows of the first run);
--device-time chains the calls in one jitted loop (about 18 us a call of that is the loop's own;
FlashInfer's CUDA events see its kernels plus their launch gaps); --kernel-time sums the kernel records
of one jax.profiler trace (CUPTI records FlashInfer's torch kernels too; a torch profiler beside it would fail, CUPTI
takes one subscriber per process), the GPU's kernels alone. The
ceilings are measured in the same run: torch's device-to-device copy (read + write) and XLA's int8 and bf16 matmul
rates. The kernel is checked against the reference on the device before it is timed (rel = ||out - ref|| / ||ref||).
FlashInfer (BatchMLAPagedAttentionWrapper, backend fa3, else auto) runs on the same shapes and lengths with its own
random data when `import flashinfer` works; its plan() (host-side scheduling) is outside the timing. --check only
compiles and checks small and full shapes.

--versions times each variant of the kernel (3, mla_kernel's leader/follower schedule, the only version; a p or n suffix
runs it with or without paired head tiles, the multicast cluster; a q suffix, int8 rows only, runs Q.K on int8 tensor
cores, mla_decode's qk8; a t or h suffix, below 64 heads, runs the MMAs transposed (cache tokens as M) or not (heads as
M, padded to 64), where the default is mla_decode.transposes; a c suffix, int8 transposed rows only, runs two converter
warpgroups (mla_decode's converters); "@256/208/40" with that register split of WG0/WG1/loader[/WG3], e.g.
3p,3p@232/232/40 against another split) on every case, one row each, so one run compares them.
A variant other than 3 and 3n is first run on small shapes (PREFLIGHT) in a child process with a timeout: a kernel
that hangs there is dropped from the run instead of hanging it.
--rounds N times each case's kernel rows N times, interleaved, and keeps each row's best (the H200's times of one call
vary between runs; side-by-side variants should see the same spells). --min-blocks sets the smallest work unit in
64-token blocks (it decides the split only when the batch has fewer than num_sms / 2 x min_blocks blocks in all, e.g.
batch 1 x 4096). "kernel us" is the kernel given a plan built beforehand (what every layer costs: the model makes one
plan per forward; FlashInfer's column excludes its plan() the same way, and "vs FlashInfer" is its time over ours);
"call us" also makes the plan inside the call, and "plan us" is the plan alone.
"""

from __future__ import annotations

import argparse
import functools
import subprocess
import sys
import time
import traceback

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
from pallas_kernels.bench.mla_cases import (
    CASES,
    TABLE_HEAD,
    Row,
    cache_bytes,
    flashinfer_time,
    for_case,
    make_inputs,
    parse_case,
    parse_version,
    rel_err,
    table_row,
)
from pallas_kernels.mla_decode import mla_decode, mla_decode_reference, mla_plan


def timed_async(fn, *args, reps: int = 20) -> float:
    """Mean seconds per call over `reps` calls dispatched back to back, after a warm-up call (which also compiles)."""
    jax.block_until_ready(fn(*args))
    t0 = time.perf_counter()
    out = None
    for _ in range(reps):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / reps


def int8_matmul_ops(n: int = 8192) -> float:
    a = jax.random.randint(jax.random.key(1), (n, n), -127, 127, jnp.int8)
    b = jax.random.randint(jax.random.key(2), (n, n), -127, 127, jnp.int8)
    f = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.int32))
    return 2 * n**3 / timed(f, a, b)


MIN_BLOCKS = 4  # mla_decode's min_blocks_per_split (--min-blocks)


def fns(scale, version=None, profile=""):
    pair, registers, qk8, transposed, converters = parse_version(version)
    kern = jax.jit(
        functools.partial(
            mla_decode,
            sm_scale=scale,
            pair=pair,
            registers=registers,
            qk8=qk8,
            transposed=transposed,
            converters=converters,
            min_blocks_per_split=MIN_BLOCKS,
            profile=profile,
        )
    )
    ref = jax.jit(functools.partial(mla_decode_reference, sm_scale=scale))
    return kern, ref


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


# Small shapes that take each merge path (dense: 2 x 512; sparse, with the combine kernel: 40 x 4096) and int8, at
# 128 heads and at 16 (one tile of fewer rows: transposed or not; three tokens stacked).
PREFLIGHT = (
    dict(batch=2, context=512, dtype="bf16", kind="mixed"),
    dict(batch=40, context=4096, dtype="bf16", kind="mixed"),
    dict(batch=2, context=512, dtype="int8"),
    dict(batch=2, context=512, dtype="int8", heads=16),
    dict(batch=40, context=4096, dtype="int8", heads=16, t=3, kind="mixed"),
    dict(batch=40, context=4096, dtype="bf16", heads=16, kind="mixed"),
)


def preflight(version: str, timeout_s: float = 180.0) -> bool:
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
        dict(batch=3, context=512, dtype="int8g", heads=128, t=3, kind="mixed"),
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
    for dtype, batch, context, kind, heads, t in cases:
        t0 = time.perf_counter()
        name = f"{dtype}:{batch}x{context}:{kind}:h{heads}:t{t}"
        try:
            qn, qp, kv, pt, lengths, sc = make_inputs(
                jax.random.key(batch + context), batch, context, heads, dtype=dtype, t=t, kind=kind
            )
            _, ref = fns(512**-0.5)
            want = ref(qn, qp, kv, pt, lengths, scales=sc)
            ref_fn = lambda qn, qp, kv, pt, n, sc, ref=ref: ref(qn, qp, kv, pt, n, scales=sc)  # arrays as arguments
            tr = timer(ref_fn, qn, qp, kv, pt, lengths, sc)
            plan_fn = jax.jit(
                functools.partial(
                    mla_plan, max_pages=pt.shape[1], page_size=64, heads=heads, t=t, min_blocks_per_split=MIN_BLOCKS
                )
            )
            tp = timer(plan_fn, lengths)
            plan = plan_fn(lengths)
            tokens = int(np.sum(np.asarray(lengths)))
            tf = (
                flashinfer_time(np.asarray(lengths), context, reps, heads, kernels=kernels, t=t)
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
            flops = t * tokens * heads * (576 + 512) * 2  # (the kernel pads heads to 64-row tiles: not counted)
            ver = "-" if version is None else version
            nbytes = cache_bytes(tokens, dtype=dtype)
            rows.append(Row(dtype, batch, context, kind, heads, t, ver, tc, tk, tp, tr, tf, nbytes, flops, err))
            print(table_row(rows[-1], copy_bw), f"({time.perf_counter() - t0:.0f} s)", flush=True)
            timed_rows.append((len(rows) - 1, *timers))
        for _ in range(rounds - 1):
            for i, t_call, t_kern in timed_rows:
                rows[i] = rows[i]._replace(t_call=min(rows[i].t_call, t_call()), t_kern=min(rows[i].t_kern, t_kern()))
        for i, *_ in timed_rows if rounds > 1 else ():
            print(table_row(rows[i], copy_bw), f"(best of {rounds} rounds)", flush=True)
        del qn, qp, kv, pt, sc, want, plan
    lines = ["", TABLE_HEAD] + [table_row(row, copy_bw) for row in rows]
    by = {(r.dtype, r.batch, r.context, r.kind, r.heads, r.tokens, r.ver): r.t_kern for r in rows}
    pairs = [
        f"{d}/bf16 {b}x{c}{'' if k == 'full' else ' ' + k}{'' if h == 128 else f' H={h}'}{'' if t == 1 else f' T={t}'}"
        f" v{v} {by[('bf16', b, c, k, h, t, for_case(v, 'bf16', h))] / tk:.2f}x"
        for (d, b, c, k, h, t, v), tk in by.items()
        if d != "bf16" and ("bf16", b, c, k, h, t, for_case(v, "bf16", h)) in by
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
