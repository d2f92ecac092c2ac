"""Name the XLA kernels of a profile: where in the jax source each fusion came from.

    XLA_FLAGS="--xla_dump_to=DIR --xla_dump_hlo_as_text" python -m hcfjax.bench.generate --profile ...
    python -m hcfjax.bench.hlo_names DIR input_reduce_fusion_8 loop_multiply_fusion_1 ...

A profiler trace names XLA's kernels after their fusion instruction (`input_reduce_fusion_8` for HLO's
`%input_reduce_fusion.8`), which says nothing about the model. The optimised HLO that XLA dumps keeps, on each
instruction, the jax op name (the `jit(...)/...` path with named scopes) and a stack frame id that the module's
FileLocations / StackFrames tables resolve to source lines. This prints, for each name and each module that
defines it (names repeat across modules): the fusion's shape, its root op's name and call stack (innermost first),
and the distinct op names inside the fused computation.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(\S+)\s+\w+\(")
_COMP = re.compile(r"^%([\w.\-]+)\s.*\{\s*$")
_OP = re.compile(r'op_name="([^"]*)"')
_FRAME = re.compile(r"stack_frame_id=(\d+)")
_CALLS = re.compile(r"calls=%([\w.\-]+)")
_ROW = re.compile(r"^(\d+) (.*)$")


def _tables(lines: list[str]) -> dict[str, dict[int, str]]:
    """The module's FileNames, FunctionNames, FileLocations and StackFrames tables, id -> text."""
    tables: dict[str, dict[int, str]] = {}
    current = None
    for line in lines:
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            current = tables.setdefault(line, {})
        elif current is not None and (m := _ROW.match(line)):
            current[int(m.group(1))] = m.group(2)
        elif line.startswith("%") or line.startswith("ENTRY"):
            break
        else:
            current = None if not line.strip() else current
    return tables


def _stack(tables: dict[str, dict[int, str]], frame: int, depth: int = 4) -> str:
    """'file:line (function) < caller ...' for a stack frame id, innermost first, jax's own frames left out."""
    field = lambda text, key: re.search(rf"{key}=(\d+)", text)  # noqa: E731
    out, seen = [], set()
    while frame and frame not in seen and len(out) < depth:
        seen.add(frame)
        entry = tables.get("StackFrames", {}).get(frame, "")
        loc = tables.get("FileLocations", {}).get(int(field(entry, "file_location_id").group(1)), "") if entry else ""
        if loc:
            file = tables["FileNames"].get(int(field(loc, "file_name_id").group(1)), "?").strip('"')
            func = tables["FunctionNames"].get(int(field(loc, "function_name_id").group(1)), "?").strip('"')
            if "/jax/" not in file:
                out.append(f"{file.split('site-packages/')[-1]}:{field(loc, 'line').group(1)} ({func})")
        parent = field(entry, "parent_frame_id") if entry else None
        frame = int(parent.group(1)) if parent and int(parent.group(1)) != frame else 0
    return " < ".join(out) or "?"


def fusion_sources(dump: Path, names: list[str]) -> dict[str, list[str]]:
    """For each kernel name, one description per module of the dump that defines it."""
    want = {n.replace(".", "_"): n for n in names}
    found: dict[str, list[str]] = {n: [] for n in names}
    for path in sorted(dump.glob("*after_optimizations.txt")):
        module = path.name.split(".")[1] if path.name.count(".") > 2 else path.stem
        lines = path.read_text(errors="replace").splitlines()
        tables = _tables(lines)
        comps: dict[str, list[str]] = {}
        current = None
        for line in lines:
            if m := _COMP.match(line):
                current = comps.setdefault(m.group(1), [])
            elif current is not None:
                current.append(line)
        for line in lines:
            m = _INSTR.match(line)
            key = m.group(1).replace(".", "_") if m else None
            if key not in want:
                continue
            op, frame, calls = _OP.search(line), _FRAME.search(line), _CALLS.search(line)
            inner = comps.get(calls.group(1), []) if calls else []
            named = [o.group(1) for body in inner if (o := _OP.search(body))]
            ops = sorted({o.rsplit("/", 1)[-1] for o in named if "/" in o})
            found[want[key]].append(
                f"{module}: {m.group(2)} {op.group(1) if op else '?'}\n"
                f"    at {_stack(tables, int(frame.group(1))) if frame else '?'}\n"
                f"    ops: {', '.join(ops) or '-'}"
            )
    return found


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m hcfjax.bench.hlo_names", description=__doc__.split("\n")[0])
    ap.add_argument("dump", type=Path, help="the --xla_dump_to directory (with --xla_dump_hlo_as_text)")
    ap.add_argument("names", nargs="+", help="kernel names from a profile (e.g. input_reduce_fusion_8)")
    args = ap.parse_args(argv)
    if not args.dump.is_dir():
        raise SystemExit(f"{args.dump}: not a directory")
    print("\n".join(describe(args.dump, args.names)))


def describe(dump: Path, names: list[str]) -> list[str]:
    """fusion_sources as printable lines: each name, then its distinct hits indented (a hit found in several modules,
    e.g. the same loop compiled for several batch sizes, once, with the count)."""
    lines = []
    for name, hits in fusion_sources(dump, names).items():
        lines.append(f"{name}:")
        counts = {hit: hits.count(hit) for hit in hits}
        lines += [f"  {hit}" + (f"  (x{n})" if n > 1 else "") for hit, n in counts.items()]
        lines += ["  (not in any *after_optimizations.txt)"] if not hits else []
    return lines


if __name__ == "__main__":
    main()
