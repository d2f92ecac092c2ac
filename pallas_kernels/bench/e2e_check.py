"""The model's decode with a Pallas kernel against the jnp reference path, end to end on the GPU.

    python pallas_kernels/bench/e2e_check.py [--kernel mla|int4] [--scheme w4a16|w4a8] [--preset v2-lite]
                                             [--layers 3] [--new 48] [--quick]

Each mode prints its time as it ends; a full MLA check took 111 s on the H200 (give it `timeout 400`: compiles vary),
`--quick` (bf16 cache only, no greedy runs) about half.

A V2-Lite-shaped model (3 layers, random weights, bf16: 16 heads, C 512, R 64, 64 experts of 2048 x 1408, the shapes
the kernels take) runs in two processes, reference and kernel (the selection is read when a step traces):
- `--kernel mla` (default): HCFJAX_MLA=reference vs =kernel, bf16 and int8 caches (with HCFJAX_MLA_QK8=1 in the
  environment the kernel's int8-cache runs take int8 Q.K, `mla_decode`'s qk8);
- `--kernel int4`: the model quantised with --scheme (int4 experts), HCFJAX_INT4_KERNEL=0 vs =1, bf16 cache, and the
  MLA reference in both, so only the grouped GEMM differs.

1. Greedy: continues 8 random prompts for --new tokens; prints how many rows are identical and where the first
   differences are. bf16 near-ties may flip a token, after which the rows diverge.
2. Teacher-forced logits: the prompts plus fixed random continuations go through prefill and then one decode step
   per continuation token (absorbed MLA over a shuffled paged cache, the model's decode path), every step's logits
   kept. The yardstick for bf16 noise is the reference path's own error: its logits against the same steps run in
   float32 (the same weights, whose bf16 values are exact in f32, and a float32 cache). The kernel passes when its
   error against that truth is within 1.5x the reference's, its difference from the reference within 2x the
   reference's error (relative L2 and max abs), and every top-1 it changes from the reference's was a near-tie
   (reference top-1/top-2 margin below the yardstick's max abs difference).

On a CPU, `--modes reference,reference --preset tiny-v3 --layers 2 --new 4 --quick` is a smoke test of this script
(the kernels need V2-Lite's attention shapes, which GPU interpret mode runs too slowly here).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

CODE = r"""
import json, os, sys, functools, jax, jax.numpy as jnp, numpy as np, hcfjax
from hcfjax import cache as kvcache
from hcfjax.options import Options
from hcfjax.attention import CacheContext
from hcfjax.generate import bucket
from hcfjax.model import hidden_states, logits
from hcfjax.random_model import preset_config, random_model

preset, layers, new, out, want_truth, scheme, quick = sys.argv[1:]
layers, new, want_truth, quick = int(layers), int(new), want_truth == "1", quick == "1"
opts = Options.from_env(os.environ)  # this mode's HCFJAX_MLA / HCFJAX_INT4_KERNEL
m = random_model(preset_config(preset, num_hidden_layers=layers), seed=0, dtype=jnp.bfloat16)
if scheme != "none":
    from hcfjax.quantize import quantize_model
    m = quantize_model(m, scheme)
caches = (("bf16", jnp.bfloat16),) if scheme != "none" or quick else (("bf16", jnp.bfloat16), ("int8", jnp.int8))
cfg = m.cfg
rng = np.random.default_rng(0)
ps = [rng.integers(1, cfg.vocab_size, n).tolist() for n in (5, 17, 64, 100, 3, 250, 31, 77)]
conts = [rng.integers(1, cfg.vocab_size, new).tolist() for _ in ps]
greedy = [] if quick else [
    hcfjax.generate(m, ps, max_new_tokens=new, stop_token_ids=[], cache_dtype=d, options=opts).tokens
    for _, d in caches
]


@functools.partial(jax.jit, static_argnames=("cfg",), donate_argnames=("cache",))
def prefill(params, cfg, tokens, lengths, cache, table):
    b, t = tokens.shape
    pos = jnp.broadcast_to(jnp.arange(t), (b, t))
    ctx = CacheContext(cache, table, lengths, pos < lengths[:, None])
    _, ctx = hidden_states(params, cfg, tokens, pos, ctx, opts=opts)
    return ctx.cache


@functools.partial(jax.jit, static_argnames=("cfg",), donate_argnames=("cache",))
def step(params, cfg, tok, kv_len, cache, table):
    # the token at position kv_len - 1, attending to the cache up to and including itself (the decode loop's step)
    ctx = CacheContext(cache, table, kv_len, jnp.ones((tok.shape[0], 1), bool))
    h, ctx = hidden_states(params, cfg, tok[:, None], (kv_len - 1)[:, None], ctx, absorbed=True, opts=opts)
    return logits(params, h[:, 0]), ctx.cache


lengths = np.array([len(p) for p in ps], np.int32)
b, t, page = len(ps), bucket(int(lengths.max())), 64
tokens = np.zeros((b, t), np.int32)
for i, p in enumerate(ps):
    tokens[i, : len(p)] = p
per_seq = -(-(int(lengths.max()) + new) // page)
table = jnp.asarray(np.random.default_rng(1).permutation(b * per_seq).astype(np.int32).reshape(b, per_seq))
def teacher_forced(params, dtype):
    cache = kvcache.init_cache(cfg, b * per_seq, page, dtype)
    cache = prefill(params, cfg, jnp.asarray(tokens), jnp.asarray(lengths), cache, table)
    got = []
    for i in range(new):
        tok = jnp.asarray([c[i] for c in conts], jnp.int32)
        lg, cache = step(params, cfg, tok, jnp.asarray(lengths + i + 1), cache, table)
        got.append(np.asarray(lg, np.float32))
    return np.stack(got, 1)  # [B, new, V]: the logits after continuation token i


res = {name: teacher_forced(m.params, dtype) for name, dtype in caches}
if want_truth:  # the same weights (bf16 values, exact in f32; int4 codes kept) and steps in float32: the truth
    f32 = lambda x: x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x
    res["f32"] = teacher_forced(jax.tree.map(f32, m.params), jnp.float32)
np.savez(out, **res)
print(json.dumps(greedy))
"""


def mode_env(kernel: str, mode: str) -> dict:
    if kernel == "mla":
        return dict(os.environ, HCFJAX_MLA=mode)
    if mode not in ("reference", "kernel"):
        raise SystemExit(f"--kernel int4 takes the modes reference and kernel, got {mode!r}")
    return dict(os.environ, HCFJAX_MLA="reference", HCFJAX_INT4_KERNEL="1" if mode == "kernel" else "0")


def run_mode(mode, args, path, want_truth):
    scheme = args.scheme if args.kernel == "int4" else "none"
    argv = [
        args.preset,
        str(args.layers),
        str(args.new),
        path,
        "1" if want_truth else "0",
        scheme,
        str(int(args.quick)),
    ]
    t0 = time.perf_counter()
    r = subprocess.run(
        [sys.executable, "-c", CODE, *argv],
        env=mode_env(args.kernel, mode),
        capture_output=True,
        text=True,
    )
    if r.returncode:
        raise SystemExit(f"{mode} failed:\n{r.stderr[-3000:]}")
    print(f"[e2e_check] {mode} mode ran in {time.perf_counter() - t0:.0f} s", flush=True)
    return json.loads(r.stdout.strip().splitlines()[-1]), dict(np.load(path))


def compare(a, b):
    """a against b ([B, N, V] logits): relative L2, max abs difference, top-1 agreement, b's margins where a differs."""
    top_a, top_b = a.argmax(-1), b.argmax(-1)
    srt = np.sort(b, -1)
    margin = srt[..., -1] - srt[..., -2]
    flips = top_a != top_b
    return {
        "rel": float(np.linalg.norm(a - b) / np.linalg.norm(b)),
        "max_abs": float(np.abs(a - b).max()),
        "top1": float(1 - flips.mean()),
        "flip_margins": sorted(float(x) for x in margin[flips]),
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kernel", choices=("mla", "int4"), default="mla")
    ap.add_argument("--scheme", choices=("w4a16", "w4a8"), default="w4a16", help="int4 only")
    ap.add_argument("--preset", default="v2-lite")
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--new", type=int, default=48)
    ap.add_argument("--modes", default="reference,kernel", help="the reference mode, then the mode under test")
    ap.add_argument("--quick", action="store_true", help="the bf16 cache only, no greedy runs (about half the time)")
    args = ap.parse_args()
    ref_mode, test_mode = args.modes.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        ref_greedy, ref = run_mode(ref_mode, args, os.path.join(tmp, "ref.npz"), True)
        ker_greedy, ker = run_mode(test_mode, args, os.path.join(tmp, "ker.npz"), False)
    ok = True
    names = [n for n in ("bf16", "int8") if n in ref]
    if ref_greedy:
        print(f"greedy, {args.new} tokens per row:")
    for i, name in enumerate(names if ref_greedy else []):
        r, k = ref_greedy[i], ker_greedy[i]
        same = sum(x == y for x, y in zip(r, k, strict=True))
        first = [
            next((j for j, (u, v) in enumerate(zip(x, y, strict=True)) if u != v), len(x))
            for x, y in zip(r, k, strict=True)
        ]
        print(f"  {name} cache: {same}/{len(r)} rows identical to the reference path; first difference at {first}")
    print("teacher-forced logits (relative L2, max abs, top-1 agreement, reference margins at changed top-1s):")
    yard = compare(ref["bf16"], ref["f32"])
    rows = [
        ("yardstick: reference (bf16) vs float32 truth", yard, None),
        (f"{test_mode} (bf16) vs float32 truth", compare(ker["bf16"], ref["f32"]), yard),
        *((f"{test_mode} vs reference, {n} cache", compare(ker[n], ref[n]), yard) for n in names),
    ]
    if "int8" in ref:
        rows.append(
            ("reference int8 cache vs bf16 cache (quantisation, for scale)", compare(ref["int8"], ref["bf16"]), None)
        )
    print("| comparison | rel L2 | max abs | top-1 agree | margins at flips | pass |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, c, bar in rows:
        verdict = ""
        if bar is not None:
            f = 1.5 if "truth" in name else 2.0
            good = (
                c["rel"] <= f * bar["rel"]
                and c["max_abs"] <= f * bar["max_abs"]
                and ("truth" in name or all(m < bar["max_abs"] for m in c["flip_margins"]))
            )
            if test_mode != ref_mode and c["max_abs"] == 0:
                good = False  # identical logits: the kernel did not run (unsupported shape?)
            ok &= good
            verdict = "yes" if good else "NO"
        margins = ", ".join(f"{m:.3f}" for m in c["flip_margins"][:6]) or "-"
        print(f"| {name} | {c['rel']:.2e} | {c['max_abs']:.3f} | {c['top1']:.4f} | {margins} | {verdict} |")
    print("PASS" if ok else "FAIL")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
