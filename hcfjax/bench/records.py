"""What a step launches, from the GPU records `bench.engine_loop --profile --records FILE` writes: per kernel name,
launches and microseconds per step, and the idle time before its launches (what the GPU waited between the end of
the previous record and this one), the largest first.

    python -m hcfjax.bench.records FILE --steps N [--top 40] [--max-gap-us 50]

Gaps longer than --max-gap-us are the host between steps, not a step's own launches: they are left out of the
per-name gaps and summed apart.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses

from hcfjax.bench.common import idle_gaps


@dataclasses.dataclass
class Launches:
    count: int = 0
    busy_us: float = 0.0  # the records' durations
    gap_us: float = 0.0  # the GPU idle before each of them (gaps up to max_gap_us)


def read_records(path: str) -> list[tuple[str, float, float]]:
    """(name, start us, duration us) per line of a records file, in start order."""
    rows = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            parts = line.rstrip("\n").split("\t")
            if len(parts) != 3:
                raise ValueError(f"{path}:{n}: expected name, start and duration separated by tabs, got {line!r}")
            rows.append((parts[0], float(parts[1]), float(parts[2])))
    return sorted(rows, key=lambda r: r[1])


def summarise(rows, max_gap_us: float = 50.0) -> tuple[dict[str, Launches], float]:
    """-> (Launches per name, the idle microseconds in gaps longer than max_gap_us)."""
    per: dict[str, Launches] = collections.defaultdict(Launches)
    for name, _, dur in rows:
        per[name].count += 1
        per[name].busy_us += dur
    between = 0.0
    for gap, _, name in idle_gaps((start, start + dur, name) for name, start, dur in rows):
        if gap > max_gap_us:
            between += gap
        else:
            per[name].gap_us += gap
    return dict(per), between


def table(per: dict[str, Launches], between: float, steps: int, top: int) -> str:
    busy = sum(e.busy_us for e in per.values()) / steps
    gaps = sum(e.gap_us for e in per.values()) / steps
    launches = sum(e.count for e in per.values()) / steps
    lines = [
        f"per step: {launches:,.0f} launches, {busy / 1e3:.3f} ms busy, {gaps / 1e3:.3f} ms of gaps between them; "
        f"{between / steps / 1e3:.3f} ms idle between steps",
        "",
        "| kernel | launches a step | us a step | share of busy | gap before, us a step |",
        "|---|---|---|---|---|",
    ]
    order = sorted(per.items(), key=lambda kv: -(kv[1].busy_us + kv[1].gap_us))
    for name, e in order[:top]:
        lines.append(
            f"| {name[:70]} | {e.count / steps:.1f} | {e.busy_us / steps:,.1f} | {e.busy_us / steps / busy:.1%} "
            f"| {e.gap_us / steps:,.1f} |"
        )
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("file")
    ap.add_argument("--steps", type=int, required=True, help="the steps the file holds (engine_loop's --steps)")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--max-gap-us", type=float, default=50.0)
    args = ap.parse_args(argv)
    if args.steps < 1:
        ap.error("--steps must be at least 1")
    per, between = summarise(read_records(args.file), args.max_gap_us)
    print(table(per, between, args.steps, args.top))


if __name__ == "__main__":
    main()
