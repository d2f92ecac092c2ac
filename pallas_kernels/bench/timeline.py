"""Where each warpgroup of the MLA kernel spends its time, from Mosaic GPU's in-kernel profiler (on the GPU host).

    python -m pallas_kernels.bench.timeline [--cases bf16:128x4096,int8:128x4096] [--versions 3p,3pq] [--ranges 100]

For each case and version the kernel is built with Mosaic GPU's profiler (mla_decode's profile): thread 0 of every
warpgroup writes the SM clock at the start and end of each named region of the v3 loops (`mla_kernel.scope`: the
leader's "qk" (inside it its waits for the block's parts, "qk > wait_A", "wait_B", "wait_R"; with qk8 its "mma" and
"scale"), "softmax", "wait_v", "pv"; WG1's "wait_qk", "convert", "wait_v", "wait_p", "pv"; the loader's "wait_slot",
"wait_qk", "convert"; with converters (four warpgroups) WG1's and WG3's "convert"; with an int8 cache "convert > land",
the wait for a part's TMA inside its conversion) into shared memory, and a callback writes the trace (Perfetto JSON)
after the run.
Only --ranges regions per warpgroup and CTA fit beside the kernel's buffers (100 does for bf16, int8 and qk8; later
regions are dropped), so long rows are seen over their first blocks: the steady state, without the drain.

The table has, per warpgroup and region: the mean clock cycles of one occurrence, occurrences per CTA, and the
share of the warpgroup's recorded window (its first region's start to its last region's end) that the region takes;
"(between)" is the rest of the window, code outside every region. The clock is the SM's (cycles, not ns).
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import tempfile

import numpy as np

ROLES = ("WG0 (leader)", "WG1", "loader", "WG3")  # (WG3: the converter warpgroup of KernelSpec.converters)


def summarise(trace: dict, warpgroups: int = 3) -> dict:
    """{role: {region: (mean cycles, occurrences per CTA, share of the window)}} of one Mosaic GPU trace, where a
    CTA's warpgroup w has trace id 1 + w + warpgroups x CTA. A region inside another is named by its path ("qk >
    mma") and left out of "(between)", the window's time outside every outermost region. Unclosed regions (a
    truncated trace) are skipped."""
    by_trace = collections.defaultdict(list)
    for ev in trace["traceEvents"]:
        by_trace[ev["tid"]].append(ev)
    totals = [collections.defaultdict(float) for _ in range(warpgroups)]
    counts = [collections.Counter() for _ in range(warpgroups)]
    outer = [set() for _ in range(warpgroups)]
    windows, traces = [0.0] * warpgroups, [0] * warpgroups
    for tid, events in by_trace.items():
        w = (tid - 1) % warpgroups
        stack = []  # (name, start) of the open regions, outermost first
        for ev in sorted(events, key=lambda e: e["ts"]):
            if ev["ph"] == "B":
                stack.append((ev["name"], ev["ts"]))
            elif stack and stack[-1][0] == ev["name"]:
                _, start = stack.pop()
                path = " > ".join([name for name, _ in stack] + [ev["name"]])
                totals[w][path] += (ev["ts"] - start) * 1e3  # ts is cycles / 1000
                counts[w][path] += 1
                if not stack:
                    outer[w].add(path)
        stamps = [ev["ts"] for ev in events]
        windows[w] += (max(stamps) - min(stamps)) * 1e3
        traces[w] += 1
    out = {}
    for w in range(warpgroups):
        if not traces[w]:
            continue
        rows = {
            name: (totals[w][name] / counts[w][name], counts[w][name] / traces[w], totals[w][name] / windows[w])
            for name in totals[w]
        }
        rows["(between)"] = (float("nan"), float("nan"), 1.0 - sum(rows[name][2] for name in outer[w]))
        out[ROLES[w] if warpgroups in (3, 4) else f"WG{w}"] = rows
    return out


def table(title: str, summary: dict) -> str:
    lines = [f"{title}", "", "| warpgroup | region | cycles | per CTA | share |", "| --- | --- | --- | --- | --- |"]
    for role, rows in summary.items():
        for name, (mean, per, share) in sorted(rows.items(), key=lambda kv: -kv[1][2]):
            cyc = "" if np.isnan(mean) else f"{mean:.0f}"
            per_cta = "" if np.isnan(per) else f"{per:.1f}"
            lines.append(f"| {role} | {name} | {cyc} | {per_cta} | {100 * share:.1f}% |")
    return "\n".join(lines)


def kernel_warpgroups(version) -> int:
    """The warpgroups of the attention kernel a bench version (as it applies to the case: for_case) runs: 4 with
    converters, else 3."""
    from pallas_kernels.bench.mla import parse_version

    return 4 if parse_version(version)[4] else 3


def run_case(case: str, version: str, ranges: int, out_dir: str) -> dict:
    import jax

    from pallas_kernels.bench.mla import fns, for_case, make_inputs, parse_case

    dtype, b, ctx, kind, heads, t = parse_case(case)
    if dtype == "bf16" and "q" in version:
        raise ValueError(f"version {version} (qk8) needs an int8 cache, got case {case}")
    version = for_case(version, dtype, heads)
    warpgroups = kernel_warpgroups(version)
    os.makedirs(out_dir, exist_ok=True)
    where = tempfile.mkdtemp(prefix="trace-", dir=out_dir)
    qn, qp, kv, pt, lengths, scales = make_inputs(jax.random.key(0), b, ctx, heads, dtype=dtype, t=t, kind=kind)
    kern, _ = fns(1 / 24.0, version, profile=f"{where}:{ranges}")
    kern(qn, qp, kv, pt, lengths, scales=scales)[0].block_until_ready()
    jax.effects_barrier()  # the trace is written by a host callback
    summaries = []
    for path in sorted(glob.glob(os.path.join(where, "*-trace.json"))):
        with open(path) as f:
            summaries.append(summarise(json.load(f), warpgroups))
    if not summaries:
        raise RuntimeError(f"no trace was written into {where}")
    # the attention kernel's (a merge kernel, when the rows are split, has no regions)
    return max(summaries, key=lambda s: sum(len(v) for v in s.values()))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="bf16:128x4096,int8:128x4096")
    ap.add_argument("--versions", default="3p,3pq", help="bench.mla's version tokens; q tokens run on int8 cases only")
    ap.add_argument("--ranges", type=int, default=100, help="profiled regions per warpgroup and CTA")
    ap.add_argument("--out", default=os.environ.get("OUT") or tempfile.gettempdir(), help="where traces go")
    args = ap.parse_args()
    reports = []
    for case in args.cases.split(","):
        for version in args.versions.split(","):
            if "q" in version and case.startswith("bf16"):
                continue
            summary = run_case(case, version, args.ranges, args.out)
            reports.append(table(f"### {case}, version {version}", summary))
            print(reports[-1] + "\n", flush=True)
    with open(os.path.join(args.out, "timeline.md"), "w") as f:
        f.write("\n\n".join(reports) + "\n")


if __name__ == "__main__":
    main()
