"""A decode step's cache write on the latent-write kernel (pallas_kernels.latent_write, `Options.fused_cache_write`)
against XLA's path it replaces (hcfjax.attention.project_kv's norm and rope, then hcfjax.cache.write), on the GPU,
into int8 caches of several sizes.

    python -m pallas_kernels.bench.latent_write [--preset v2-lite] [--tokens 64] [--cache-gib 0.1,4.5]

A cache has the preset's layers, pages of 64 tokens and as many pages as make its size; the tokens are written in
its last layer at its last pages, where the offsets are largest. Each row gives both paths' kernel time (CUPTI
records, `hcfjax.bench.common.kernel_seconds`) and launches, and how the caches they leave differ: every byte and
scale of the whole cache is compared, so an entry stored anywhere but its place shows. A size between 2 and 4 GiB
is one the kernel refuses (`latent_write.addressable`): only XLA's path runs there.
On a CPU the kernel runs in Pallas's interpreter and only the checks are made; caches over 1 GiB are checked, not
timed.
"""

from __future__ import annotations

import argparse
import math

import jax
import jax.numpy as jnp
import numpy as np

from hcfjax import cache as kvcache
from hcfjax.bench.common import header, kernel_seconds, record_counts, traced_planes
from hcfjax.layers import apply_rope, rms_norm, rope_table
from hcfjax.random_model import preset_config
from pallas_kernels.latent_write import addressable, write_latents

PAGE = 64


def filled_cache(shape) -> kvcache.KVCache:
    """An int8 cache of `shape` [L, P, page, C + R] with every byte set (a pattern made on the device, no host copy
    of gigabytes), and its scales."""

    def make():
        idx = sum(jax.lax.broadcasted_iota(jnp.int32, shape, d) * (7 + 2 * d) for d in range(len(shape)))
        scales = jax.lax.broadcasted_iota(jnp.float32, (shape[0], shape[1], 2, shape[2]), 3) + 1.0
        return kvcache.KVCache((idx % 255 - 127).astype(jnp.int8), scales)

    return jax.jit(make)()


def inputs(cfg, n: int, pages: int, rng):
    """n tokens' kv_a outputs, the stacked norm weight, positions, which are valid, and a page table of a page a
    token, each its own among the cache's last n."""
    if pages < n:
        raise ValueError(f"a cache of {pages} pages is too small for {n} tokens on pages of their own")
    c, r = cfg.kv_lora_rank, cfg.qk_rope_head_dim
    kv = jnp.asarray(rng.normal(size=(n, 1, c + r)) * 3, jnp.bfloat16)
    weight = jnp.asarray(1 + 0.1 * rng.normal(size=(2, c)), jnp.bfloat16)
    table = (pages - 1 - rng.permutation(n)).astype(np.int32)[:, None]
    positions = jnp.asarray(rng.integers(0, PAGE, (n, 1)), jnp.int32)
    valid = jnp.asarray(np.arange(n)[:, None] % 8 != 7)  # every eighth row padding, as a batch's idle slots
    return kv, weight, positions, valid, jnp.asarray(table)


def paths(cfg, layer: int, interpret: bool):
    """(kernel, XLA) cache writes of the tokens in `layer`, the norm weight's row 1."""
    c, r, eps = cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.rms_norm_eps

    def kernel(cache, kv, weight, positions, valid, table):
        rope = rope_table(positions, cfg.rope, r)
        k, s = write_latents(
            cache.kv, cache.scale, layer, kv, weight, 1, rope, positions, valid, table,
            eps=eps, interleave=cfg.rope.interleave, interpret=interpret,
        )  # fmt: skip
        return kvcache.KVCache(k, s)

    def xla(cache, kv, weight, positions, valid, table):
        ckv = rms_norm(kv[..., :c], weight[1], eps)
        kpe = apply_rope(kv[..., c:], positions, cfg.rope, rope_table(positions, cfg.rope, r))
        return kvcache.write(cache, layer, ckv, kpe, positions, valid, table)

    # As a decode step compiles it: XLA keeps the model's bf16 roundings.
    return jax.jit(kernel), jax.jit(xla, compiler_options={"xla_allow_excess_precision": False})


def differences(got: kvcache.KVCache, want: kvcache.KVCache) -> str:
    """'identical', or how many bytes and scales of the caches differ and by how much at most."""
    count = jax.jit(lambda a, b: (jnp.sum(a.kv != b.kv), jnp.max(jnp.abs(a.kv.astype(jnp.int32) - b.kv)),
                                  jnp.sum(a.scale != b.scale)))  # fmt: skip
    nk, most, ns = (int(v) for v in count(got, want))
    if nk == ns == 0:
        return "identical"
    return f"{nk} bytes differ (by at most {most}), {ns} scales"


def timed(fn, args):
    """(microseconds of kernels a call, launches a call) on the GPU; (None, None) elsewhere, and for a cache over
    1 GiB (the timing keeps every call's output cache; the time does not depend on the cache's size)."""
    if jax.default_backend() != "gpu" or args[0].kv.size > 2**30:
        return None, None
    planes = traced_planes(fn, *args, reps=20)
    return sum(kernel_seconds(planes, 20).values()) * 1e6, record_counts(planes, 20)["kernels"]


def run_case(preset: str, n: int, gib: float, rng) -> list[list[str]]:
    cfg = preset_config(preset)
    layers, width = cfg.num_hidden_layers, cfg.kv_lora_rank + cfg.qk_rope_head_dim
    pages = math.ceil(gib * 2**30 / (layers * PAGE * width))
    shape = (layers, pages, PAGE, width)
    size = f"{math.prod(shape) / 2**30:.2f}"
    args = inputs(cfg, n, pages, rng)
    cache = filled_cache(shape)
    kernel, xla = paths(cfg, layers - 1, jax.default_backend() != "gpu")
    want = xla(cache, *args)
    us, launches = timed(xla, (cache, *args))
    rows = [[size, "XLA (the model without it)", _num(us), _num(launches, 0), "reference"]]
    if not addressable(math.prod(shape)):
        return rows + [[size, "kernel", "n/a", "n/a", "refused: 32-bit offsets would wrap (2-4 GiB)"]]
    got = kernel(cache, *args)
    check = differences(got, want)
    del got
    us, launches = timed(kernel, (cache, *args))
    return rows + [[size, "kernel", _num(us), _num(launches, 0), check]]


def _num(value, digits: int = 1) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="v2-lite", help="model preset whose latent and layers the cache has")
    ap.add_argument("--tokens", type=int, default=64, help="tokens written (a decode batch)")
    ap.add_argument("--cache-gib", default="0.1,4.5", help="cache sizes in GiB")
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    print(header(), flush=True)
    lines = ["| cache GiB | cache write | us | launches | against XLA's |", "|---|---|---|---|---|"]
    for gib in (float(g) for g in args.cache_gib.split(",")):
        for row in run_case(args.preset, args.tokens, gib, rng):
            lines.append("| " + " | ".join(row) + " |")
            print(lines[-1], flush=True)
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    main()
