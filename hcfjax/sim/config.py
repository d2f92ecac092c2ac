"""A simulation config file (YAML): the deployment, the workload, the SLO, and optionally the rate search and the
sweep grid. See hcfjax/sim/configs/ for examples; every key maps to a dataclass field of the same name."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import yaml

from hcfjax.sim.deployment import Deployment, from_dict
from hcfjax.sim.sweep import Search
from hcfjax.sim.workload import SLO, Workload

TOP = {"name", "deployment", "workload", "slo", "search", "sweep"}


@dataclasses.dataclass(frozen=True)
class Config:
    name: str
    deployment: Deployment
    workload: Workload
    slo: SLO
    search: Search
    grid: dict  # sweep keys -> values (sweep.candidates)
    total_gpus: int | None  # the sweep's GPU budget
    refine: dict = dataclasses.field(default_factory=dict)  # sweep keys -> the finest step (sweep.refine_best)


def _build(cls, d: dict | None, what: str):
    d = d or {}
    unknown = set(d) - {f.name for f in dataclasses.fields(cls)}
    if unknown:
        raise ValueError(f"unknown {what} keys {sorted(unknown)}")
    return cls(**d)


def from_mapping(d: dict, name: str = "sim") -> Config:
    unknown = set(d) - TOP
    if unknown:
        raise ValueError(f"unknown top-level keys {sorted(unknown)} (expected {sorted(TOP)})")
    sweep = dict(d.get("sweep") or {})
    total = sweep.pop("total_gpus", None)
    grid = sweep.pop("grid", {})
    refine = sweep.pop("refine", {})
    if sweep:
        raise ValueError(f"unknown sweep keys {sorted(sweep)} (expected total_gpus, grid, refine)")
    return Config(
        d.get("name", name),
        from_dict(d.get("deployment") or {}),
        _build(Workload, d.get("workload"), "workload"),
        _build(SLO, d.get("slo"), "slo"),
        _build(Search, d.get("search"), "search"),
        grid,
        total,
        refine,
    )


def load_config(path: str | Path) -> Config:
    path = Path(path)
    return from_mapping(yaml.safe_load(path.read_text()) or {}, path.stem)
