"""Re-run the PD simulation of a finished `hcfjax.bench.sim_validate --pd` run, without a GPU: after a change to
the simulator, does it predict what that run measured?

    python -m hcfjax.bench.sim_resimulate --profiles NAME [--trace DIR] [--transport jax|socket] \\
        [sim_validate's workload and engine flags]

NAME-prefill.json and NAME-decode.json are the profiles the run fitted (sim_validate's --profile, default
sim-profile); the workload and the workers' configs are rebuilt from the same flags sim_validate took (its defaults
unless given), so the simulated requests are the run's. With --trace (the run's HCFJAX_TRACE_DIR) the TTFT
breakdown compares the measured marks with the simulated ones.
"""

from __future__ import annotations

import argparse

from hcfjax.bench.serve_pd import pd_configs
from hcfjax.bench.sim_profile import predicted
from hcfjax.bench.sim_validate import add_settings
from hcfjax.bench.sim_validate_pd import breakdown, deployment, request_marks
from hcfjax.sim import Workload, simulate
from hcfjax.sim.deployment import model_config


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m hcfjax.bench.sim_resimulate", description=__doc__.split("\n")[0])
    ap.add_argument("--profiles", required=True, help="NAME: the run's NAME-prefill.json and NAME-decode.json")
    ap.add_argument("--trace", help="the run's trace directory (HCFJAX_TRACE_DIR) for the TTFT breakdown")
    ap.add_argument("--transport", default="jax", choices=["jax", "socket"])
    ap.add_argument("--model-name", default="v2-lite", help="the simulated model's shape (sim_validate's --preset)")
    add_settings(ap)
    args = ap.parse_args(argv)
    pre_cfg, dec_cfg = pd_configs(args)
    cfg = model_config(args.model_name)
    wl = Workload(args.requests, args.rate, args.seed, args.scale, args.max_model_len, cfg.vocab_size)
    profiles = {"prefill": f"{args.profiles}-prefill.json", "decode": f"{args.profiles}-decode.json"}
    dep = deployment(args.model_name, args.gpu, pre_cfg, dec_cfg, profiles, args.transport)
    marks: dict[str, dict[str, float]] = {}
    res = simulate(dep, wl, trace=lambda ev, rid, t: marks.setdefault(rid, {}).setdefault(ev, t))
    print(f"PD 1P1D ({args.transport}; transfer_waits_for_step={dep.transfer_waits_for_step}), predicted:")
    for k, v in predicted(res).items():
        print(f"  {k}: {v:.3f}")
    if args.trace:
        from hcfjax.trace import read

        print("\n".join(["", *breakdown(request_marks(read(args.trace), "bench-"), marks)]))


if __name__ == "__main__":
    main()
