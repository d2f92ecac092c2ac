"""Re-run the PD simulation of a finished `hcfjax.sim.validate --pd` run, without a GPU: after a change to the
simulator, does it predict what that run measured?

    python -m hcfjax.sim.resimulate --profiles NAME [--trace DIR] [--transport jax|socket] [validate's workload flags]

NAME-prefill.json and NAME-decode.json are the profiles the run fitted (validate's --profile, default sim-profile);
the workload and the workers' settings are rebuilt from the same flags validate took (its defaults unless given), so
the simulated requests are the run's. With --trace (the run's HCFJAX_TRACE_DIR) the TTFT breakdown compares the
measured marks with the simulated ones.
"""

from __future__ import annotations

import argparse

from hcfjax.bench.serve import pd_role_args
from hcfjax.sim import Workload, simulate
from hcfjax.sim.deployment import model_config
from hcfjax.sim.validate import _parser, predicted
from hcfjax.sim.validate_pd import breakdown, deployment, request_marks, worker_configs


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m hcfjax.sim.resimulate", description=__doc__.split("\n")[0])
    ap.add_argument("--profiles", required=True, help="NAME: the run's NAME-prefill.json and NAME-decode.json")
    ap.add_argument("--trace", help="the run's trace directory (HCFJAX_TRACE_DIR) for the TTFT breakdown")
    ap.add_argument("--transport", default="jax", choices=["jax", "socket"])
    ap.add_argument("--model-name", default="v2-lite", help="the simulated model's shape (validate's --preset)")
    args, rest = ap.parse_known_args(argv)
    run = _parser().parse_args(["--pd", args.transport, *rest])
    pre_cfg, dec_cfg = worker_configs(*pd_role_args(run))
    cfg = model_config(args.model_name)
    wl = Workload(run.requests, run.rate, run.seed, run.scale, run.max_model_len, cfg.vocab_size)
    profiles = {"prefill": f"{args.profiles}-prefill.json", "decode": f"{args.profiles}-decode.json"}
    dep = deployment(args.model_name, run.gpu, pre_cfg, dec_cfg, profiles, args.transport)
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
