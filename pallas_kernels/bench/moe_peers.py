"""The MoE bench's peers: torch's grouped GEMMs on the bench's own problem, when torch with CUDA is installed (never a
dependency of the project).

- `torch._grouped_mm`: bf16 x bf16 (CUTLASS), the weights as the bench draws them;
- `torch._scaled_grouped_mm`: fp8 e4m3 x fp8 e4m3 with a scale per token row and per expert output column (row-wise
  scaling, CUTLASS), the tokens and weights quantised beforehand (as the "x quantised by the caller" kernel rows);
- the same fp8 product for gate and up at once (each expert's two weights side by side, [K, 2N]: one launch, as a
  user would run it) and SiLU(gate) * up: the peer of the fused gate/up kernel rows.

Each expert's rows are padded to a multiple of ALIGN (the fp8 kernel's group alignment; the bf16 one gets the same
layout), the padding counted in neither bytes nor FLOPs. Each peer is checked against the f32 product of the same
bf16 weights and timed like the jax rows (calls back to back, one wait; with --kernel-time, the summed kernel
records of a profiler trace).
"""

from __future__ import annotations

import numpy as np

ALIGN = 16
FP8_TOL = 0.08  # max error over the max of the product: e4m3 keeps 3 mantissa bits of the tokens and the weights


def padded_rows(group_sizes, align: int = ALIGN) -> tuple[np.ndarray, np.ndarray]:
    """Group sizes [E] -> (rows [M']: the token row each padded row holds, -1 for padding; ends [E] int32: where
    each expert's padded rows end), every group's rows padded to a multiple of `align`."""
    sizes = np.asarray(group_sizes, np.int64)
    padded = -(-sizes // align) * align
    rows = np.full(int(padded.sum()), -1, np.int64)
    start = 0
    for first, n, p in zip(np.cumsum(sizes) - sizes, sizes, padded, strict=True):
        rows[start : start + n] = np.arange(first, first + n)
        start += p
    return rows, np.cumsum(padded).astype(np.int32)


def fp8_rowwise(t, dim: int):
    """t (float) -> (e4m3 values, f32 scales with `dim` reduced: t ~ values * scales)."""
    import torch

    amax = t.float().abs().amax(dim=dim, keepdim=True).clamp(min=1e-12)
    scale = amax / torch.finfo(torch.float8_e4m3fn).max
    return (t.float() / scale).to(torch.float8_e4m3fn), scale.squeeze(dim)


def peer_rows(x, w, gs, timed, kernel_timer=None, need_cuda: bool = True) -> list[dict]:
    """The peers' rows for the bench's problem (arrays on the GPU, jax's or torch's: x [M, K] bf16, w [E, K, N]
    bf16, gs [E] int32): dicts as the worker's rows (name, nbytes, int8, check, t, td) or with an error.
    timed(fn, wait) -> seconds per call; kernel_timer(fn, wait) -> the kernels' seconds per call, or None.
    need_cuda=False runs them where torch is (its CPU has a bf16 grouped GEMM, no fp8 one)."""
    try:
        import torch
    except ImportError:
        return [dict(name="torch grouped GEMMs (peers)", error="skipped: torch is not installed")]
    if need_cuda and not torch.cuda.is_available():
        return [dict(name="torch grouped GEMMs (peers)", error="skipped: torch has no CUDA device")]
    xt, wt = torch.from_dlpack(x), torch.from_dlpack(w)
    gs = np.asarray(torch.from_dlpack(gs).cpu())
    rows, ends = padded_rows(gs)
    index = torch.from_numpy(rows).to(xt.device)
    a = xt[index.clamp(min=0)] * (index >= 0)[:, None].to(xt.dtype)  # [M', K], padding rows zero
    offs = torch.from_numpy(ends).to(xt.device)
    touched = int((gs > 0).sum())
    e, k, n = wt.shape
    ref = _reference(a, wt, ends)
    sync = torch.cuda.synchronize if torch.cuda.is_available() else lambda: None
    wait = lambda _: sync()  # noqa: E731
    out = []

    def row(name, fn, nbytes, int8, tol, want=ref, mult=1):
        r = dict(name=name, nbytes=nbytes, int8=int8, mult=mult)
        try:
            y = fn()
            sync()
            d = (y.float() - want)[index >= 0]
            real = want[index >= 0]
            r["check"] = c = dict(
                max_rel=float(d.abs().max() / real.abs().max()),
                rel=float(d.norm() / real.norm()),
                finite=bool(torch.isfinite(y).all()),
            )
            c["ok"] = c["finite"] and c["max_rel"] < tol
            r["t"] = timed(fn, wait)
            if kernel_timer is not None:
                r["td"] = kernel_timer(fn, wait)
        except Exception as ex:  # noqa: BLE001 - a peer that fails is reported, the bench goes on
            r["error"] = f"{type(ex).__name__}: {str(ex)[:600]}"
        out.append(r)

    w_cm = column_major(wt)
    bf16 = lambda: torch._grouped_mm(a, w_cm, offs=offs)  # noqa: E731
    row(f"torch _grouped_mm bf16 (peer, groups padded to {ALIGN})", bf16, touched * k * n * 2, False, 1e-2)
    aq, sa = fp8_rowwise(a, -1)
    wq_rows, sw = fp8_rowwise(wt, 1)  # per expert and output column
    wq = column_major(wq_rows)
    sw = sw.contiguous()

    def fp8():
        return torch._scaled_grouped_mm(aq, wq, sa, sw, offs=offs, out_dtype=torch.bfloat16, use_fast_accum=True)

    nbytes = touched * (k * n + n * 4)
    row(f"torch _scaled_grouped_mm fp8 row-wise (peer, x quantised by the caller, groups padded to {ALIGN})", fp8,
        nbytes, True, FP8_TOL)  # fmt: skip
    if k <= n:  # a down shape: no gate/up
        return out
    # gate and up: the bench's weight twice, side by side (the fused kernel rows' second weight has the same size)
    wq2 = column_major(torch.cat([wq_rows.view(torch.uint8)] * 2, -1).view(wq_rows.dtype))  # (bytes: cat of e4m3)
    sw2 = torch.cat([sw, sw], -1).contiguous()

    def fp8_gated():
        y = torch._scaled_grouped_mm(aq, wq2, sa, sw2, offs=offs, out_dtype=torch.bfloat16, use_fast_accum=True)
        return torch.nn.functional.silu(y[:, :n]) * y[:, n:]

    gated_ref = torch.nn.functional.silu(ref) * ref
    row(f"torch _scaled_grouped_mm fp8 gate|up in one product + SiLU (peer, groups padded to {ALIGN})", fp8_gated,
        2 * nbytes, True, FP8_TOL, gated_ref, mult=2)  # fmt: skip
    return out


def column_major(w):
    """w [E, K, N] with K contiguous (column-major per expert), the layout the grouped GEMMs take."""
    return w.transpose(-2, -1).contiguous().transpose(-2, -1)


def _reference(a, w, ends):
    """The f32 product of each expert's padded rows with its weights: [M', N]."""
    import torch

    out = torch.zeros(a.shape[0], w.shape[-1], dtype=torch.float32, device=a.device)
    start = 0
    for i, end in enumerate(ends.tolist()):
        if end > start:
            out[start:end] = a[start:end].float() @ w[i].float()
        start = end
    return out
