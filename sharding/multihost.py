"""Multi-process start-up: the same plans run with one JAX process per host (or per GPU).

    python -m sharding.multihost --coordinator 127.0.0.1:PORT --num-processes 2 --process-id I [--cpu-devices 4]

initialises jax.distributed (gloo collectives on CPU), builds the decode plan over every process's devices, and
checks against the single-device model computed locally: one decode-plan forward (relative error of the logits)
and a greedy generation whose decode loop runs across the processes (tokens identical). It also loads the model
under the plan, which logs how many tensors this process read (its own experts only), and compares every local
shard with the plan's placement of the whole model. Used by the 2-process test; on GPU hosts the same calls run
over NCCL.
"""

from __future__ import annotations

import argparse
import logging
import sys


def initialize(coordinator: str, num_processes: int, process_id: int, cpu_devices: int | None = None) -> None:
    import jax

    if cpu_devices:
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", cpu_devices)
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator, num_processes=num_processes, process_id=process_id)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m sharding.multihost", description=__doc__.split("\n")[0])
    ap.add_argument("--coordinator", required=True)
    ap.add_argument("--num-processes", type=int, required=True)
    ap.add_argument("--process-id", type=int, required=True)
    ap.add_argument("--cpu-devices", type=int)
    ap.add_argument("--model", required=True)
    args = ap.parse_args(argv)
    initialize(args.coordinator, args.num_processes, args.process_id, args.cpu_devices)

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import multihost_utils

    import hcfjax
    from hcfjax.generate import _forward
    from sharding.forward import decode_plan_logits
    from sharding.generate import generate_planned
    from sharding.plans import decode_plan, shard_params

    model = hcfjax.load(args.model, dtype=jnp.float32)
    ids = np.arange(3 * 12).reshape(3, 12) % model.cfg.vocab_size
    plan = decode_plan(jax.device_count())
    lg = decode_plan_logits(plan, shard_params(model.params, plan), model.cfg, ids)
    got = multihost_utils.process_allgather(lg, tiled=True)
    with jax.default_device(jax.local_devices()[0]):
        want = np.asarray(_forward(jax.device_put(model.params, jax.local_devices()[0]), model.cfg, jnp.asarray(ids)))
    err = float(np.linalg.norm(got - want) / np.linalg.norm(want))
    logging.getLogger("hcfjax.checkpoint").setLevel(logging.INFO)
    logging.getLogger("hcfjax.checkpoint").addHandler(logging.StreamHandler(sys.stdout))
    streamed = hcfjax.load(args.model, dtype=jnp.float32, plan=plan).params
    shards = [
        (a, b)
        for x, y in zip(jax.tree.leaves(streamed), jax.tree.leaves(shard_params(model.params, plan)), strict=True)
        for a, b in zip(x.addressable_shards, y.addressable_shards, strict=True)
    ]
    same_shards = all(a.index == b.index and np.array_equal(a.data, b.data) for a, b in shards)
    prompts = [[5, 9, 2, 33, 7], [8] * 13, [100, 3]]
    planned = generate_planned(model, prompts, plan, max_new_tokens=6, stop_token_ids=[]).tokens
    with jax.default_device(jax.local_devices()[0]):
        local = hcfjax.Model(model.cfg, jax.device_put(model.params, jax.local_devices()[0]))
        same = planned == hcfjax.generate(local, prompts, max_new_tokens=6, stop_token_ids=[]).tokens
    print(
        f"process {jax.process_index()} of {jax.process_count()}: {jax.device_count()} devices, "
        f"rel err {err:.2e}, greedy tokens identical: {same}, streamed shards identical: {same_shards}"
    )


if __name__ == "__main__":
    main()
