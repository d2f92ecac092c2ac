"""What a step launches, from the GPU records `bench.engine_loop --profile --records FILE` writes: per kernel name,
launches and microseconds per step, and the idle time before its launches (what the GPU waited between the end of
the previous record and this one), the largest first.

    python -m hcfjax.bench.records FILE --steps N [--top 40] [--max-gap-us 50] [--between NAME]

Gaps longer than --max-gap-us are the host between steps, not a step's own launches: they are left out of the
per-name gaps and summed apart. --between NAME also lists one span of launches in order, from a record whose name
holds NAME to the next such record (e.g. `--between mla_decode`: one layer, from one attention kernel to the next),
a span of the most common length from the middle of the file, each launch with its duration and the GPU idle before
it.
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


def span(rows, marker: str, max_gap_us: float = 50.0) -> list[tuple[str, float, float]]:
    """(name, gap before us, duration us) of the launches from one record whose name holds `marker` up to the next
    one: of the spans with the most common number of launches (a layer, not the one across a step's end), the
    middle one; [] with fewer than two markers. A gap longer than max_gap_us (the host between steps) shows as 0."""
    at = [i for i, (name, _, _) in enumerate(rows) if marker in name]
    if len(at) < 2:
        return []
    sizes = [b - a for a, b in zip(at, at[1:], strict=False)]
    common = collections.Counter(sizes).most_common(1)[0][0]
    typical = [k for k, size in enumerate(sizes) if size == common]
    k = typical[(len(typical) - 1) // 2]
    out, end = [], None
    for name, start, dur in rows[at[k] : at[k + 1]]:
        gap = 0.0 if end is None or start - end > max_gap_us else max(start - end, 0.0)
        out.append((name, gap, dur))
        end = start + dur if end is None else max(end, start + dur)
    return out


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
    ap.add_argument("--between", help="also list the launches from one record whose name holds this to the next")
    args = ap.parse_args(argv)
    if args.steps < 1:
        ap.error("--steps must be at least 1")
    rows = read_records(args.file)
    per, between = summarise(rows, args.max_gap_us)
    print(table(per, between, args.steps, args.top))
    if args.between:
        launches = span(rows, args.between, args.max_gap_us)
        if not launches:
            raise SystemExit(f"fewer than two records named like {args.between!r} in {args.file}")
        busy, idle = sum(d for *_, d in launches), sum(g for _, g, _ in launches)
        print(
            f"\nfrom one {args.between} to the next: {len(launches)} launches, {busy:.1f} us busy, {idle:.1f} us idle"
        )
        print("\n| # | kernel | us | idle before, us |\n|---|---|---|---|")
        for i, (name, gap, dur) in enumerate(launches):
            print(f"| {i} | {name[:70]} | {dur:.1f} | {gap:.1f} |")


if __name__ == "__main__":
    main()
