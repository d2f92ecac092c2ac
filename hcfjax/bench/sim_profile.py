"""What the colocated and PD validations (sim_validate, sim_validate_pd) share: an efficiency profile fitted to
measured step times, and the metrics they compare, as measured by a client and as the simulator predicts them."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from hcfjax.bench.serve import pct
from hcfjax.sim.cost import CostModel, Work
from hcfjax.sim.gpus import Efficiency, gpu

FITTED = ("gemm_compute", "moe_compute", "attn_compute", "attn_memory", "layer_overhead_s", "step_overhead_s")


def fit(cfg, gpu_name: str, points: list[tuple[list[Work], float]], base: Efficiency) -> Efficiency:
    """The efficiency factors that best explain measured step times: points are (the step's works, seconds)."""
    from scipy.optimize import least_squares

    g = gpu(gpu_name)
    x0 = np.log([0.3, 0.1, 0.1, 0.1, 1e-4, 1e-3])

    def eff_of(x):
        return base.replace(**dict(zip(FITTED, np.exp(x).tolist(), strict=True)), gemm_memory=base.gemm_memory)

    def residuals(x):
        cm = CostModel(cfg, g, eff_of(x))
        return [np.log(cm.step(w).seconds / s) for w, s in points]

    lo = np.log([1e-6, 1e-6, 1e-6, 1e-6, 1e-9, 1e-9])
    hi = np.log([1.0, 1.0, 1.0, 1.0, 1.0, 10.0])
    res = least_squares(residuals, x0, bounds=(lo, hi))
    return eff_of(res.x).replace(source=f"fitted by hcfjax.bench.sim_validate to {len(points)} step times")


def fitted(eff: Efficiency) -> str:
    return ", ".join(f"{k} {getattr(eff, k):.3g}" for k in (*FITTED, "host_dispatch_s", "host_process_s"))


def write_profile(path: str, eff: Efficiency) -> None:
    Path(path).write_text(json.dumps(dataclasses.asdict(eff), indent=1))


def metrics(record: list[dict], wall: float) -> dict[str, float]:
    """What the table compares, from client records (ttft, tpot, out) over a run of `wall` seconds."""
    return {
        "output tok/s": sum(r["out"] for r in record) / wall,
        "QPM": len(record) / wall * 60,
        "TTFT p50 (s)": pct([r["ttft"] for r in record], 50),
        "TPOT p50 (ms)": pct([r["tpot"] for r in record], 50) * 1e3,
    }


def predicted(res) -> dict[str, float]:
    return {
        "output tok/s": res.output_tok_s,
        "QPM": res.qpm,
        "TTFT p50 (s)": res.ttft[50],
        "TPOT p50 (ms)": res.tpot[50] * 1e3,
    }
