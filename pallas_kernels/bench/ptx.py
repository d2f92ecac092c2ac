"""What ptxas made of the kernels: their PTX dumped on the GPU host, ptxas's report summarised, SASS read anywhere.

    python -m pallas_kernels.bench.ptx [--kernels mla:bf16,moe:w4a8:fused:16x128x7168x2048,...] [--out DIR]
    python -m pallas_kernels.bench.ptx --sass DIR [--ptxas PATH] [--cuobjdump PATH]

On the GPU host (first form) each kernel is compiled once in a child process with Mosaic GPU's dumps on
(MOSAIC_GPU_DUMP_PTX, MOSAIC_GPU_DUMP_PTXAS, MOSAIC_GPU_DUMP_TO), into DIR/<kernel>/ (default $OUT/ptx); the MLIR
pass logs (about 100 MB each) are deleted, the PTX and ptxas's report kept. The table: registers per thread, spilled
bytes, and how often ptxas had to inject a `wgmma.wait_group` (C7517: an in-flight wgmma's registers reused, which
serialises the MMAs) or a `warpgroup.arrive` (C7519).

Anywhere (second form, no GPU): every DIR/*/*.ptx is assembled for sm_90a with a local ptxas and disassembled with
cuobjdump; the table adds the wgmma instructions (HGMMA, IGMMA) and the waits on them (WARPGROUP.DEPBAR) in the SASS,
and the .sass files are written beside the PTX. The PTX is version 9.0 (CUDA 13): `pip download nvidia-cuda-nvcc
nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm` and unzip them for ptxas and cuobjdump, with nvdisasm on PATH (cuobjdump
runs it; CUDA 12's ptxas rejects the PTX). ptxas can also be rerun
on a hand-edited copy of the PTX (instructions moved, setmaxnreg values changed) to try a change before the next GPU
run: docs/kernels.md, "Working method".

Kernels: mla:bf16|int8|int8q[:BxCTX] (the MLA decode kernel at H = 128, by default 4 rows x 1024 tokens: the same
code as at larger shapes; int8q with int8 Q.K, mla_decode's qk8) and moe:ACT:fused|single:ExMxKxN[:OVERRIDES] (ACT
w4a8 or w4a16; the default tiling of that shape, or with OVERRIDES such as "wgs=1+bm=64" default_tiling's choices
given).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

DEFAULT = (
    "mla:bf16",
    "mla:int8",
    "moe:w4a8:fused:16x128x7168x2048",
    "moe:w4a8:single:16x128x7168x2048",
    "moe:w4a16:single:16x128x7168x2048",
    "moe:w4a8:single:32x4096x7168x2048",
)


def ptxas_report(text: str) -> dict:
    """ptxas -v output -> registers, spill store/load bytes, injected waits (C7517) and arrives (C7519)."""
    regs = re.findall(r"Used (\d+) registers", text)
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    return dict(
        registers=int(regs[-1]) if regs else None,
        spill_stores=int(spills[-1][0]) if spills else 0,
        spill_loads=int(spills[-1][1]) if spills else 0,
        injected_waits=len(re.findall(r"\(C7517\)", text)),
        injected_arrives=len(re.findall(r"\(C7519\)", text)),
    )


def sass_counts(sass: str) -> dict:
    """wgmma instructions and the waits on them in a cuobjdump -sass listing."""
    return dict(
        wgmma=len(re.findall(r"\b[HI]GMMA\.", sass)),
        wgmma_waits=len(re.findall(r"WARPGROUP\.DEPBAR", sass)),
    )


def tiling_overrides(text: str) -> dict:
    """A moe spec's optional fifth field, "wgs=1+bm=64": `default_tiling`'s keyword choices for the kernel (joined by
    "+": the specs themselves are comma-separated)."""
    out = {}
    for item in filter(None, text.split("+")):
        key, _, value = item.partition("=")
        if key not in ("bm", "bn", "gps", "splits", "ctas", "wgs") or not value.isdigit():
            raise ValueError(f"a tiling override is bm|bn|gps|splits|ctas|wgs=INT, got {item!r}")
        out[key] = int(value)
    return out


def run_one(spec: str) -> None:
    """Runs the kernel of `spec` once on this host's GPU (so Mosaic compiles it with the dumps the parent set, or
    Nsight Compute profiles it: bench.ncu)."""
    import jax

    kind, *rest = spec.split(":")
    if kind == "mla":
        from pallas_kernels.bench.mla import make_inputs
        from pallas_kernels.mla_decode import mla_decode

        batch, context = map(int, (rest[1] if len(rest) > 1 else "4x1024").split("x"))
        dtype, qk8 = rest[0].removesuffix("q"), rest[0] == "int8q"  # int8q: the int8 cache with int8 Q.K (qk8)
        qn, qp, kv, pt, lengths, sc = make_inputs(jax.random.key(0), batch, context, dtype=dtype)
        jax.block_until_ready(mla_decode(qn, qp, kv, pt, lengths, 512**-0.5, scales=sc, qk8=qk8))
    elif kind == "moe":
        from hcfjax import quant
        from pallas_kernels.bench.moe_worker import problem
        from pallas_kernels.moe_int4 import int4_gated_ragged_dot, int4_ragged_dot
        from pallas_kernels.moe_int4_tiling import default_tiling

        act, fused, shape, *opts = rest
        dims = tuple(map(int, shape.split("x")))
        w, x, gs = problem(*dims)  # the bench's weights, tokens and routing
        q4 = quant.quantize(w, 4, "bf16")
        a = {"w4a8": "int8", "w4a16": "bf16"}[act]
        e, m, k, n = dims
        nw = 2 if fused == "fused" else 1
        t = default_tiling(a, m, n, k // 128, e, nw, **tiling_overrides(opts[0])) if opts else None
        if nw == 2:  # up's weights differ from gate's (the same twice would be half read from L2)
            u4 = quant.quantize(problem(*dims, seed=1)[0], 4, "bf16")
            y = int4_gated_ragged_dot(x, (q4.q, q4.scale), (u4.q, u4.scale), gs, act=a, tiling=t)
        else:
            y = int4_ragged_dot(x, q4.q, q4.scale, gs, act=a, tiling=t)
        jax.block_until_ready(y)
    else:
        raise ValueError(f"kernel must be mla:... or moe:..., got {spec!r}")


def dump(kernels, out: Path) -> list[tuple[str, dict]]:
    rows = []
    for spec in kernels:
        d = out / spec.replace(":", "_")
        d.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, MOSAIC_GPU_DUMP_PTX="1", MOSAIC_GPU_DUMP_PTXAS="1", MOSAIC_GPU_DUMP_TO=str(d))
        r = subprocess.run([sys.executable, "-m", "pallas_kernels.bench.ptx", "--one", spec], env=env, check=False)
        for junk in ("*mlir-passes.log", "*constraint_system.txt", "*layout_inference.txt"):
            for f in d.glob(junk):
                f.unlink()
        reports = sorted(d.glob("*.ptxas"))
        if r.returncode or not reports:
            rows.append((spec, dict(error=f"exit {r.returncode}, {len(reports)} ptxas reports")))
            continue
        for rep in reports:  # one per Mosaic kernel the call compiled
            rows.append((f"{spec} ({rep.stem})", ptxas_report(rep.read_text())))
    return rows


def sass(root: Path, ptxas: str, cuobjdump: str) -> list[tuple[str, dict]]:
    rows = []
    for ptx in sorted(root.glob("*/*.ptx")):
        cubin = ptx.with_suffix(".cubin")
        r = subprocess.run([ptxas, "-arch=sm_90a", "-O3", "-v", str(ptx), "-o", str(cubin)], capture_output=True)
        info = ptxas_report(r.stdout.decode() + r.stderr.decode())
        if r.returncode:
            rows.append((f"{ptx.parent.name}/{ptx.stem}", dict(error=r.stderr.decode()[-300:])))
            continue
        listing = subprocess.run([cuobjdump, "-sass", str(cubin)], capture_output=True, check=True).stdout.decode()
        ptx.with_suffix(".sass").write_text(listing)
        rows.append((f"{ptx.parent.name}/{ptx.stem}", info | sass_counts(listing)))
    return rows


def table(rows) -> str:
    cols = ["registers", "spill_stores", "spill_loads", "injected_waits", "injected_arrives", "wgmma", "wgmma_waits"]
    used = [c for c in cols if any(c in r for _, r in rows)]
    out = ["| kernel | " + " | ".join(used) + " |", "|---" * (len(used) + 1) + "|"]
    for name, r in rows:
        cells = [r["error"]] if "error" in r else [str(r.get(c, "")) for c in used]
        out.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kernels", default=",".join(DEFAULT), help="comma-separated kernel specs (module docstring)")
    ap.add_argument("--out", help="dump directory (default: $OUT/ptx)")
    ap.add_argument("--sass", metavar="DIR", help="assemble and disassemble DIR/*/*.ptx here (no GPU needed)")
    ap.add_argument("--ptxas", default=shutil.which("ptxas") or "ptxas", help="CUDA 13 ptxas")
    ap.add_argument("--cuobjdump", default=shutil.which("cuobjdump") or "cuobjdump")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:
        run_one(args.one)
        return
    if args.sass:
        print(table(sass(Path(args.sass), args.ptxas, args.cuobjdump)))
        return
    import jax

    if jax.default_backend() != "gpu":
        sys.exit("bench.ptx dumps need a GPU: Mosaic GPU compiles kernels to PTX only there (--sass reads dumps here)")
    out = Path(args.out or Path(os.environ.get("OUT", ".")) / "ptx")
    print(table(dump(args.kernels.split(","), out)))
    print(f"PTX and ptxas reports under {out}")


if __name__ == "__main__":
    main()
