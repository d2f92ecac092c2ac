"""Capacity simulator: the engine's own Scheduler driven by a simulated clock, with a cost model in place of the
model step, for colocated and PD deployments at scales this project cannot run.

    from hcfjax.sim import Deployment, Pool, Workload, simulate, load_config
    dep, wl, slo = load_config("hcfjax/sim/configs/reference-h20.yaml")
    print(simulate(dep, wl, slo).output_tok_s)

Files, one job each: gpus.py (datasheets, efficiency profiles), weights.py (parameter counts, bytes per format, the
share of them a GPU holds), cost.py (step time from FLOPs and bytes), work.py (what a StepPlan computes), workload.py
(the requests and the SLO), instances.py (the engine loop, PD prefill and decode instances), simulator.py (routing,
the run, metrics), deployment.py (the deployment as data), sweep.py (rate search, m:n and batch-limit sweeps,
plots), config.py (YAML), cli.py (`hcfjax sim`). The calibration against the real engine on a device is a
benchmark: hcfjax/bench/sim_validate.py.
"""

from hcfjax.sim.deployment import Deployment, Pool
from hcfjax.sim.simulator import Result, simulate
from hcfjax.sim.workload import SLO, Workload

__all__ = ["SLO", "Deployment", "Pool", "Result", "Workload", "simulate"]
