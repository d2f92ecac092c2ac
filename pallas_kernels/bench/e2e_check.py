"""The model's decode with the MLA kernel against the jnp reference, end to end on the GPU.

    python pallas_kernels/bench/e2e_check.py

A V2-Lite-shaped model (3 layers, random weights, bf16: 16 heads, C 512, R 64, the shapes the kernel takes) greedily
continues 8 random prompts for 48 tokens with HCFJAX_MLA=reference and =kernel, bf16 and int8 caches, in separate
processes; prints how many rows are identical and where the first differences are (bf16 near-ties may flip).
"""

import json
import os
import subprocess
import sys

CODE = r"""
import json, jax, jax.numpy as jnp, numpy as np, hcfjax
from hcfjax.random_model import preset_config, random_model
m = random_model(preset_config("v2-lite", num_hidden_layers=3), seed=0, dtype=jnp.bfloat16)
rng = np.random.default_rng(0)
ps = [rng.integers(1, m.cfg.vocab_size, n).tolist() for n in (5, 17, 64, 100, 3, 250, 31, 77)]
a = hcfjax.generate(m, ps, max_new_tokens=48, stop_token_ids=[]).tokens
b = hcfjax.generate(m, ps, max_new_tokens=48, stop_token_ids=[], cache_dtype=jnp.int8).tokens
print(json.dumps([a, b]))
"""


def main():
    res = {}
    for mode in ("reference", "kernel"):
        r = subprocess.run(
            [sys.executable, "-c", CODE], env=dict(os.environ, HCFJAX_MLA=mode), capture_output=True, text=True
        )
        if r.returncode:
            raise SystemExit(f"{mode} failed:\n{r.stderr[-2000:]}")
        res[mode] = json.loads(r.stdout.strip().splitlines()[-1])
    for i, name in enumerate(("bf16", "int8")):
        ref, ker = res["reference"][i], res["kernel"][i]
        same = sum(x == y for x, y in zip(ref, ker, strict=True))
        first = [
            next((j for j, (u, v) in enumerate(zip(x, y, strict=True)) if u != v), len(x))
            for x, y in zip(ref, ker, strict=True)
        ]
        print(f"{name} cache: {same}/{len(ref)} rows identical to the reference path; first difference at {first}")


if __name__ == "__main__":
    main()
