"""Dense int8 linears (w4a8c8 / w8a8: int8 weights per output channel, tokens per row) on the GPU: the Mosaic GPU
kernel (pallas_kernels.moe_fp8.int8_matmul, the gated form for gate and up) against XLA's int8 GEMM (the model's
path without it, on cuBLAS as in a decode step) and torch's `_int_mm` (cuBLASLt int8), each timed as the model runs
it, from bf16 tokens: the per-row quantisation, the product and its scales (and the split-K sum, the SiLU product).
The tokens' quantisation is also timed alone, on its kernel (pallas_kernels.int8_rows) and in XLA, each checked
against its arithmetic in IEEE f32.

    python -m pallas_kernels.bench.dense8 [--cases NAME:MxKxN[g],...] [--sweep] [--out FILE]

Cases: V2-Lite's decode linears at 64 and 256 rows (kv_a 2048 -> 576, the shared experts' gate and up 2048 -> 2 x
2816 with SiLU, their down 2816 -> 2048), DeepSeek-V3's q_a (7168 -> 1536) at 64 rows, and one 4096-row prefill
chunk of the shared gate/up (above INT8_MAX_ROWS: the model keeps it on XLA, and its kernel row says so). `g`
marks the gated form. --sweep also times the kernel at other split counts and at
128 weight rows a CTA.

Times are CUPTI kernel records of a profiler trace (`hcfjax.bench.common.kernel_time`): the kernels alone, summed,
no launch gaps; `launches` is the kernels a call runs (each costs a gap in a step). Bandwidth counts the weights'
bytes (int8 values and f32 scales) over the time, against torch's copy_ in the same run. Every row is checked
against the exact int32 product with both scales (f32), within bf16's rounding.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from hcfjax import quant
from hcfjax.bench.common import header, kernel_seconds, record_counts, torch_copy_bandwidth, traced_planes
from hcfjax.options import CUBLAS_GEMMS, Options
from pallas_kernels.int8_quant import INV_127
from pallas_kernels.moe_fp8 import INT8_MAX_ROWS, int8_matmul_reference, int8_tiling, split_steps

CASES = (
    "v2lite-kv_a:64x2048x576,v2lite-shared-gate_up:64x2048x2816g,v2lite-shared-down:64x2816x2048,"
    "v2lite-kv_a:256x2048x576,v2lite-shared-gate_up:256x2048x2816g,v2lite-shared-down:256x2816x2048,"
    "v3-q_a:64x7168x1536,v2lite-shared-gate_up:4096x2048x2816g"
)
TOL = 1.2e-2  # bf16 output: a few roundings of the largest value


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    m: int
    k: int
    n: int
    gated: bool

    @classmethod
    def parse(cls, text: str) -> Case:
        name, shape = text.split(":")
        gated = shape.endswith("g")
        m, k, n = (int(v) for v in shape.rstrip("g").split("x"))
        return cls(name, m, k, n, gated)

    def label(self) -> str:
        return f"{self.name} {self.m}x{self.k}x{self.n}{' gated' if self.gated else ''}"


def _weights(case: Case, rng):
    """The case's QWeights (int8 per channel, int8 activations): one, or gate and up."""
    return [
        quant.quantize(jnp.asarray(rng.normal(size=(case.k, case.n)) * 0.03, jnp.float32), bits=8, act="int8")
        for _ in range(2 if case.gated else 1)
    ]


def _want(x, ws):
    """The exact function in f32: the int32 products of the quantised tokens and weights, both scales."""
    xq, xs = quant.quantize_int8(x)
    ys = [int8_matmul_reference(xq, xs, w.q, w.scale) for w in ws]
    return jax.nn.silu(ys[0]) * ys[1] if len(ys) == 2 else ys[0]


def _torch_peer(x, ws):
    """torch's int8 GEMM (`torch._int_mm`, cuBLASLt) with the same quantisation, gate and up as one product over
    their weights side by side (as vLLM merges gate_up_proj); None without torch on CUDA."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    xt = torch.from_numpy(np.asarray(x, np.float32)).cuda().to(torch.bfloat16)
    wq = torch.cat([torch.from_numpy(np.array(w.q)) for w in ws], 0).cuda()  # [nw N, K], K contiguous
    wt, sw = wq.t(), torch.cat([torch.from_numpy(np.array(w.scale)).reshape(-1) for w in ws]).cuda()
    n = ws[0].n

    def run():
        s = xt.float().abs().amax(-1, keepdim=True).clamp(min=1e-8) / 127
        xq = torch.round(xt.float() / s).clamp(-127, 127).to(torch.int8)
        y = torch._int_mm(xq, wt).float() * s * sw
        if len(ws) == 2:
            y = torch.nn.functional.silu(y[:, :n]) * y[:, n:]
        return y.to(torch.bfloat16)

    return run, torch.cuda.synchronize


def _timed(name, fn, error, ok, wait=None) -> dict:
    """A table row for fn(): its error(output) (ok(error) says whether it passes), kernel time and launches; or the
    exception it raised."""
    try:
        y = fn()
        if wait:
            wait()
        err = error(y)
        planes = traced_planes(fn, reps=20, wait=(lambda _: wait()) if wait else None)
    except Exception as ex:  # noqa: BLE001 - a row that fails is reported, the bench goes on
        return dict(name=name, error=f"{type(ex).__name__}: {str(ex)[:300]}")
    secs = sum(kernel_seconds(planes, 20).values())
    return dict(name=name, us=secs * 1e6, launches=record_counts(planes, 20)["kernels"], err=err, ok=ok(err))


def _row(name, fn, want, wbytes, copy, wait=None):
    """A product's row: its largest error relative to want's largest value, and its weights' bytes over copy."""

    def error(y):
        y = np.asarray(y.float().cpu() if hasattr(y, "cpu") else y, np.float32)
        return float(np.abs(y - want).max() / np.abs(want).max())

    r = _timed(name, fn, error, lambda err: err < TOL, wait)
    if copy and "error" not in r:
        r["copy_pct"] = 100 * wbytes / (r["us"] * 1e-6) / copy
    return r


def _quantised_ieee(x):
    """quantize_int8's values in numpy's IEEE f32 arithmetic: (q [M, K] int8, scale [M] f32)."""
    xf = np.asarray(x, np.float32)
    s = np.maximum(np.abs(xf).max(-1), np.float32(1e-8)) * np.float32(INV_127)
    inv = np.float32(1.0) / s
    return np.clip(np.rint(xf * inv[:, None]), -127, 127).astype(np.int8), s


quant_xla = jax.jit(quant.quantize_int8)


def quant_rows(x) -> list[dict]:
    """The tokens' quantisation alone, on its kernel (pallas_kernels.int8_rows) and in XLA (quantize_int8 jitted),
    each against quantize_int8's arithmetic in IEEE f32 (numpy): `err` is the fraction of integers that differ
    (the scales too, if any differs)."""
    from pallas_kernels.int8_rows import quantize_rows

    q0, s0 = _quantised_ieee(x)

    def mismatch(out):
        q, s = (np.asarray(v) for v in out)
        return float(np.mean(q != q0)) + float(np.any(s != s0))

    impls = (("  tokens' quantisation, kernel (int8_rows)", quantize_rows), ("  the same in XLA", quant_xla))
    return [_timed(name, functools.partial(fn, x), mismatch, lambda err: err == 0) for name, fn in impls]


def run_case(case: Case, sweep: bool, copy: float | None, rng) -> list[dict]:
    ws = _weights(case, rng)
    x = jnp.asarray(rng.normal(size=(case.m, case.k)), jnp.bfloat16)
    want = np.asarray(_want(x, ws), np.float32)
    wbytes = sum(w.q.nbytes + w.scale.nbytes for w in ws)

    def model(opts):
        layer = (
            (lambda x, ws: quant.gated_linear(x, *ws, opts))
            if case.gated
            else (lambda x, ws: quant.linear(x, ws[0], opts))
        )
        run = jax.jit(layer, compiler_options=dict(CUBLAS_GEMMS))
        return lambda: run(x, ws)

    rows = []
    t = int8_tiling(case.m, len(ws), case.n, case.k)
    if quant.int8_kernel_mode(x, ws[0], Options(moe="kernel")) == "reference":  # the model keeps it on XLA
        rows.append(dict(name=f"kernel {t}", error="not taken by the model at this shape (quant.int8_kernel_mode)"))
    else:
        rows.append(_row(f"kernel {t}", model(Options(moe="kernel")), want, wbytes, copy))
    if sweep:
        from pallas_kernels.moe_fp8 import int8_gated_matmul, int8_matmul

        xq, xs = quant.quantize_int8(x)
        for bn in (64, 128):
            for splits in (1, 2, 4, 8, 16):
                steps = split_steps(case.k // 128, splits)
                if steps is None or case.n % bn:
                    continue
                s = dataclasses.replace(t, bn=bn, splits=splits, stages=min(4, steps))
                if s == t:
                    continue
                pairs = [(w.q, w.scale) for w in ws]
                if case.gated:
                    f = functools.partial(int8_gated_matmul, xq, xs, *pairs, tiling=s)
                else:
                    f = functools.partial(int8_matmul, xq, xs, *pairs[0], tiling=s)
                rows.append(_row(f"  kernel alone (tokens quantised) {s}", f, want, wbytes, copy))
    rows.append(
        _row(
            "XLA int8 GEMM (cuBLAS), the model without the kernel", model(Options(moe="reference")), want, wbytes, copy
        )
    )
    if case.m <= INT8_MAX_ROWS:
        rows.extend(quant_rows(x))
    peer = _torch_peer(x, ws)
    if peer is not None:
        rows.append(_row("torch _int_mm (cuBLASLt, peer)", peer[0], want, wbytes, copy, wait=peer[1]))
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default=CASES)
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    print(header(), flush=True)
    copy = torch_copy_bandwidth()
    print(
        f"copy ceiling (torch copy_): {copy / 1e12:.2f} TB/s" if copy else "copy ceiling: no torch on CUDA", flush=True
    )
    rng = np.random.default_rng(0)
    lines = [
        "| case | implementation | time (us) | launches | weights / copy | max error |",
        "|---|---|---|---|---|---|",
    ]
    results = []
    for text in args.cases.split(","):
        case = Case.parse(text)
        for r in run_case(case, args.sweep, copy, rng):
            r["case"] = case.label()
            results.append(r)
            print(json.dumps(r), flush=True)
            if "error" in r:
                lines.append(f"| {case.label()} | {r['name']} | error: {r['error'][:80]} | | | |")
                continue
            pct = f"{r['copy_pct']:.0f}%" if "copy_pct" in r else "-"
            bad = "" if r["ok"] else " (FAILS)"
            lines.append(
                f"| {case.label()} | {r['name']} | {r['us']:.1f} | {r['launches']:.0f} | {pct} | {r['err']:.1e}{bad} |"
            )
    print("\n".join(lines), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(header=header(), copy=copy, rows=results), f, indent=1)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "dense8.md"), "w") as f:
            f.write(header() + "\n\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
