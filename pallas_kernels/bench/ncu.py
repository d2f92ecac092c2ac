"""Hardware counters of the kernels through Nsight Compute (`ncu`, on the GPU host; the H200 machines have it).

    python -m pallas_kernels.bench.ncu [--kernels mla:bf16:128x4096,moe:w4a8:fused:16x128x7168x2048] [--out DIR]

Each kernel spec (bench.ptx's: `mla:bf16|int8|int8q[:BxCTX]`, `moe:ACT:fused|single:ExMxKxN[:wgs=1+bm=64]`) runs once in
a child process under `ncu --clock-control none` (the card's clocks are left alone), which profiles the Mosaic GPU
launches (KERNELS) with the SECTIONS below; the report's details and raw pages go to ncu/<spec>.txt and .csv in
DIR/ncu.tar.gz (default DIR: $OUT; one archive, since the device tool brings back at most 8 files), and the printed
table has, for each launch longer than --min-us: duration, DRAM and SM throughput (% of peak), L2 hit rate, achieved
occupancy, cycles per issued instruction and the warp stall reasons that dominate.

Warp-specialised kernels need care in reading the stalls: a loader warpgroup waiting on a barrier counts as stalled
as much as a compute warpgroup waiting on its data.
"""

from __future__ import annotations

import argparse
import csv
import io
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

DEFAULT = (
    "moe:w4a8:fused:16x128x7168x2048",
    "moe:w4a8:single:16x128x2048x7168",
    "mla:bf16:128x4096",
    "mla:int8:128x4096",
)
COLUMNS = {  # printed name: the raw metric (the first of these names that the report has)
    "us": ("gpu__time_duration.sum",),
    "SM GHz": ("smsp__cycles_elapsed.avg.per_second", "gpc__cycles_elapsed.avg.per_second"),
    "DRAM TB/s": ("dram__bytes.sum.per_second",),
    "DRAM %": (
        "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed",
        "dram__throughput.avg.pct_of_peak_sustained_elapsed",
    ),
    "SM %": ("sm__throughput.avg.pct_of_peak_sustained_elapsed",),
    "L2 %": ("lts__throughput.avg.pct_of_peak_sustained_elapsed",),
    "L2 hit %": ("lts__t_sector_hit_rate.pct",),
    "issue %": (
        "smsp__issue_active.avg.pct_of_peak_sustained_active",
        "sm__inst_issued.avg.pct_of_peak_sustained_elapsed",
    ),
    "occupancy %": ("sm__warps_active.avg.pct_of_peak_sustained_active",),
    "cycles/issue": ("smsp__average_warp_latency_per_inst_issued.ratio",),
}
# Only the Mosaic GPU kernels (their host functions are "<name>_mosaic_gpu"), and sections without source-level
# sampling: `--set full` over every launch of a child (the inputs' XLA kernels too) ran past 140 s per kernel.
KERNELS = "mosaic"
SECTIONS = (
    "SpeedOfLight",
    "ComputeWorkloadAnalysis",
    "MemoryWorkloadAnalysis",
    "WarpStateStats",
    "Occupancy",
    "LaunchStats",
    "SchedulerStats",
)
STALL = re.compile(r"^smsp__average_warps_issue_stalled_(\w+?)_per_issue_active\.ratio$")
# The tensor pipe's busy cycles (% of peak while the SM is active), from ComputeWorkloadAnalysis, by sub-pipe: the
# busiest is reported (Hopper's bf16 wgmma counts as "gmma", int8 wgmma on the H200 as "imma").
TENSOR = re.compile(r"^sm__pipe_tensor_op_(gmma|imma|hmma)?\w*cycles_active\.avg\.pct_of_peak_sustained_active$")


def parse_raw(text: str, min_us: float = 5.0, top: int = 4) -> list[dict]:
    """ncu's raw page (CSV: a header row, a units row, one row per launch) -> one dict per launch of at least
    min_us: kernel name, the COLUMNS metrics found, and the `top` largest stall reasons (warps per issue)."""
    rows = list(csv.reader(io.StringIO(text)))
    head = next((i for i, r in enumerate(rows) if "Kernel Name" in r), None)
    if head is None:
        return []
    names, units = rows[head], rows[head + 1]
    scale = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3, "second": 1e6, "s": 1e6}
    per_second = {"Tbyte/s": 1.0, "Gbyte/s": 1e-3, "Mbyte/s": 1e-6, "Ghz": 1.0, "Mhz": 1e-3, "hz": 1e-9}
    out = []
    for r in rows[head + 2 :]:
        if len(r) != len(names):
            continue
        d = dict(zip(names, r, strict=True))
        u = dict(zip(names, units, strict=True))

        def num(metrics, d=d, u=u):  # TB/s and GHz whatever unit the report chose; "?" for a unit not known
            for m in (metrics,) if isinstance(metrics, str) else metrics:
                try:
                    v = float(d[m].replace(",", ""))
                except (KeyError, ValueError):
                    continue
                if "/" in u[m] or u[m].lower().endswith("hz"):
                    return v * per_second[u[m]] if u[m] in per_second else f"? {v} {u[m]}"
                return v
            return None

        us = num(COLUMNS["us"])
        if us is None:
            continue
        us *= scale.get(u.get(COLUMNS["us"][0], "nsecond"), 1e-3)
        if us < min_us:
            continue
        row = {"kernel": d["Kernel Name"][:40], "us": round(us, 1)}
        for label, metric in list(COLUMNS.items())[1:]:
            v = num(metric)
            row[label] = (
                v if v is None or isinstance(v, str) else round(v, 2 if label in ("SM GHz", "DRAM TB/s") else 1)
            )
            row[label] = "" if v is None else row[label]
        # the busiest tensor sub-pipe: bf16 wgmmas count as "gmma", int8 ones on the H200 as "imma" (the others 0)
        tensor = [v for v in (num(m) for m in names if TENSOR.match(m)) if isinstance(v, float)]
        row["tensor %"] = round(max(tensor), 1) if tensor else ""
        stalls = [(num(m), STALL.match(m).group(1)) for m in names if STALL.match(m)]
        stalls = sorted(((v, n) for v, n in stalls if v), reverse=True)[:top]
        row["top stalls (warps per issue)"] = ", ".join(f"{n} {v:.2f}" for v, n in stalls)
        out.append(row)
    return out


def table(rows: list[tuple[str, dict]]) -> str:
    if not rows:
        return "(no launches)"
    cols = ["kernel", *COLUMNS, "tensor %", "top stalls (warps per issue)"]
    out = ["| spec | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for spec, r in rows:
        out.append(f"| {spec} | " + " | ".join(str(r.get(c, "")) for c in cols) + " |")
    return "\n".join(out)


def profile(spec: str, out: Path, ncu: str, min_us: float, timeout: float) -> list[tuple[str, dict]]:
    name = spec.replace(":", "_")
    rep = out / f"{name}.ncu-rep"
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    cmd = [ncu, "--clock-control", "none", "--target-processes", "all", "--kernel-name", f"regex:{KERNELS}"]
    cmd += [a for s in SECTIONS for a in ("--section", s)] + ["-f", "-o", str(rep)]
    child = [sys.executable, "-m", "pallas_kernels.bench.ptx", "--one", spec]
    log = out / f"{name}.log"
    with log.open("w") as f:  # written as it runs, so a timeout leaves what ncu said
        try:
            r = subprocess.run(cmd + child, env=env, stdout=f, stderr=subprocess.STDOUT, check=False, timeout=timeout)
        except subprocess.TimeoutExpired:
            return [(spec, {"kernel": f"ncu ran past {timeout:.0f} s: {log.read_text()[-300:]!r}"})]
    if r.returncode or not rep.exists():
        return [(spec, {"kernel": f"ncu exit {r.returncode}: {log.read_text()[-300:]!r}"})]
    details = subprocess.run([ncu, "--import", str(rep), "--page", "details"], capture_output=True, text=True)
    (out / f"{name}.txt").write_text(details.stdout)
    raw = subprocess.run([ncu, "--import", str(rep), "--page", "raw", "--csv"], capture_output=True, text=True)
    (out / f"{name}.csv").write_text(raw.stdout)
    return [(spec, row) for row in parse_raw(raw.stdout, min_us)]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kernels", default=",".join(DEFAULT), help="comma-separated kernel specs (module docstring)")
    ap.add_argument("--out", help="where ncu.tar.gz goes (default: $OUT); the reports are made in a fresh folder there")
    ap.add_argument("--ncu", default=shutil.which("ncu") or "ncu")
    ap.add_argument("--min-us", type=float, default=5.0, help="leave shorter launches out of the table")
    ap.add_argument("--timeout", type=float, default=150.0, help="seconds per kernel spec, profiling included")
    args = ap.parse_args(argv)
    # Reports go to a fresh folder of their own (`--out` names where it is made), which is packed and removed at
    # the end: nothing else is deleted.
    parent = Path(args.out or os.environ.get("OUT", "."))
    parent.mkdir(parents=True, exist_ok=True)
    base = Path(tempfile.mkdtemp(prefix="ncu-", dir=parent))
    rows = []
    for spec in args.kernels.split(","):
        mine = profile(spec, base, args.ncu, args.min_us, args.timeout)
        print(table(mine), flush=True)
        rows += mine
    with tarfile.open(parent / "ncu.tar.gz", "w:gz") as tar:
        for f in base.iterdir():
            if f.suffix != ".ncu-rep":
                tar.add(f, arcname=f"ncu/{f.name}")
    shutil.rmtree(base)
    print(table(rows))


if __name__ == "__main__":
    main()
