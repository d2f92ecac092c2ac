"""PD KV-transfer benchmark: bandwidth of each transport, and the latency the decode side sees after prefill ends,
whole-cache vs layerwise, as a function of prompt length.

    python -m hcfjax.bench.pd_transfer [--quick] [--kinds socket,jax] [--lengths 1024,...,32768]
                                       [--us-per-token-layer 0.4] [--reps 2] [--plot PATH]

Two processes share the device: this one is the prefill side (Sender), a child started from this module is the
decode side (Receiver). Per token the cache holds DeepSeek-V3's 61 layers x 576 (kv_lora 512 + rope 64) in bf16
(70 KB/token) or int8 with two f32 scales (35 KB/token), in pages of 64 tokens.

The prefill is a real per-layer workload on the device: layer l's "KV" is a chain of tanh(x @ W) steps on
x [T, 576], with the number of steps set per prompt length so that a layer takes about T x --us-per-token-layer
(measured time in the table). Whole mode sends the stacked cache after the last layer; layerwise mode sends each
layer as soon as it is dispatched (the sender's thread waits for it), overlapping the remaining layers. The
latency is from the moment the last layer's compute is done (prefill end) to the moment the decode process holds
the request's whole cache on its device (take() plus, for the host-staged socket transport, device_put).
Clocks: CLOCK_MONOTONIC, shared by both processes of one host.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

LAYERS, KV_DIM, PAGE = 61, 576, 64


def receiver_main(kind: str) -> None:
    """The decode side: prints its address, then for each {"key"} line takes the key onto the device and prints
    the time it was done."""
    import jax

    from hcfjax.pd.transport import make_transport

    dev = jax.devices()[0]
    rx = make_transport(kind, timeout=120.0).receiver()
    print(json.dumps({"address": rx.address}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if "key" not in cmd:
            break
        kv, scale = rx.take(cmd["key"], timeout=120.0)
        kv, scale = jax.block_until_ready(jax.device_put((kv, scale), dev))
        print(json.dumps({"key": cmd["key"], "t": time.monotonic()}), flush=True)
    rx.close()


class Decode:
    """The child process holding the receiver."""

    def __init__(self, kind: str, env: dict | None = None):
        cmd = [sys.executable, "-m", "hcfjax.bench.pd_transfer", "--role", "receiver", "--kinds", kind]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.address = json.loads(self.proc.stdout.readline())["address"]

    def expect(self, key: str) -> None:
        self.proc.stdin.write(json.dumps({"key": key}) + "\n")
        self.proc.stdin.flush()

    def done_at(self, key: str) -> float:
        reply = json.loads(self.proc.stdout.readline())
        assert reply["key"] == key, reply
        return reply["t"]

    def close(self) -> None:
        self.proc.stdin.write("{}\n")
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


def run(args) -> str:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from hcfjax.bench.common import header
    from hcfjax.cache import quantize_int8
    from hcfjax.pd.transport import Piece, make_transport

    @jax.jit
    def layer(x, w, steps):
        """One layer's stand-in: `steps` tanh(x @ w) passes; its KV [1, pages, PAGE, 576] (and scales)."""
        x = jax.lax.fori_loop(0, steps, lambda i, x: jnp.tanh(x @ w), x)
        kv = x.reshape(1, -1, PAGE, KV_DIM)
        return x, kv

    @jax.jit
    def layer_int8(x, w, steps):
        x, kv = layer(x, w, steps)
        qc, sc = quantize_int8(kv[..., :512])
        qr, sr = quantize_int8(kv[..., 512:])
        return x, jnp.concatenate([qc, qr], -1), jnp.stack([sc, sr], -2)  # scales token-minor, as the cache keeps them

    w = jax.random.normal(jax.random.key(0), (KV_DIM, KV_DIM), jnp.bfloat16) / KV_DIM**0.5
    inputs = {t: jax.random.normal(jax.random.key(t), (t, KV_DIM), jnp.bfloat16) for t in args.lengths}

    def steps_for(t: int) -> int:
        """Steps per layer so a layer takes ~ t x us-per-token-layer: time(steps) = a + b * steps, fitted."""
        times = {}
        for s in (4, 36):
            jax.block_until_ready(layer(inputs[t], w, s))
            t0 = time.perf_counter()
            for _ in range(3):
                jax.block_until_ready(layer(inputs[t], w, s))
            times[s] = (time.perf_counter() - t0) / 3
        b = max((times[36] - times[4]) / 32, 1e-9)
        a = times[4] - 4 * b
        return max(1, round((t * args.us_per_token_layer * 1e-6 - a) / b))

    steps = {t: steps_for(t) for t in args.lengths}

    def prefill(tx, dest, key, t, mode, dtype) -> float:
        """Runs the layers, sending as configured; returns the prefill end (last layer computed)."""
        x, outs = inputs[t], []
        for i in range(LAYERS):
            if dtype == "int8":
                x, kv, scale = layer_int8(x, w, steps[t])
            else:
                (x, kv), scale = layer(x, w, steps[t]), None
            if mode == "layerwise":
                tx.send(dest, Piece(key, (i, i + 1), kv, scale, LAYERS))
            else:
                outs.append((kv, scale))
        x.block_until_ready()
        end = time.monotonic()
        if mode == "whole":  # the request's pages gathered from the cache: one copy, then one transfer
            kv = jnp.concatenate([o[0] for o in outs])
            scale = None if dtype == "bf16" else jnp.concatenate([o[1] for o in outs])
            tx.send(dest, Piece(key, (0, LAYERS), kv, scale, LAYERS))
        return end

    rows, bw_rows, n = [], [], 0
    start = time.monotonic()
    for kind in args.kinds:
        decode = Decode(kind)
        tx = make_transport(kind, timeout=120.0).sender()
        for mb in args.sizes_mb:
            pages = max(1, mb * 2**20 // (PAGE * KV_DIM * 2))
            big = jnp.ones((1, pages, PAGE, KV_DIM), jnp.bfloat16).block_until_ready()
            times = []
            for _ in range(args.reps + 1):  # the first run warms the path up
                n += 1
                decode.expect(f"bw{n}")
                t0 = time.monotonic()
                tx.send(decode.address, Piece(f"bw{n}", (0, 1), big, None, 1))
                tx.flush(f"bw{n}", timeout=120)
                times.append(decode.done_at(f"bw{n}") - t0)
            bw_rows.append((kind, big.nbytes, big.nbytes / float(np.median(times[1:]))))
            del big
        for dtype in ("bf16", "int8"):
            for mode in ("whole", "layerwise"):
                for t in [args.lengths[0]] + args.lengths:  # the first length twice: warm-up
                    reps = args.reps if time.monotonic() - start < args.budget / 2 else 1
                    lat, pre = [], []
                    for _ in range(reps):
                        n += 1
                        key = f"r{n}"
                        decode.expect(key)
                        t0 = time.monotonic()
                        end = prefill(tx, decode.address, key, t, mode, dtype)
                        tx.flush(key, timeout=120)
                        lat.append(decode.done_at(key) - end)
                        pre.append(end - t0)
                    rows.append((kind, dtype, mode, t, float(np.median(pre)), float(np.median(lat))))
                rows.pop(-len(args.lengths) - 1)  # the warm-up
        tx.close()
        decode.close()

    per_token = LAYERS * KV_DIM * 2
    lines = [
        f"# PD KV transfer ({header()})",
        "",
        f"{LAYERS} layers x {KV_DIM} per token ({per_token / 1e3:.0f} KB/token bf16), pages of {PAGE}; prefill "
        f"stand-in {args.us_per_token_layer} us per token-layer; sender and receiver are two processes on one "
        f"device; median of {args.reps} (1 once past half the {args.budget:.0f} s budget); "
        f"total {time.monotonic() - start:.0f} s.",
        "",
        "| transport | message MB | GB/s |",
        "|---|---|---|",
        *[f"| {k} | {b / 2**20:.0f} | {g / 1e9:.2f} |" for k, b, g in bw_rows],
        "",
        "| transport | cache | mode | prompt tokens | cache MB | prefill ms | latency after prefill ms |",
        "|---|---|---|---|---|---|---|",
    ]
    for kind, dtype, mode, t, pre, lat in rows:
        mb = t * LAYERS * (KV_DIM * 2 if dtype == "bf16" else KV_DIM + 8) / 2**20
        lines.append(f"| {kind} | {dtype} | {mode} | {t} | {mb:.0f} | {pre * 1e3:.1f} | {lat * 1e3:.1f} |")
    if args.plot:
        plot(rows, args.plot)
        lines += ["", f"plot: {args.plot}"]
    return "\n".join(lines)


def plot(rows, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    colors = {}
    for kind, dtype, mode in sorted({r[:3] for r in rows}):
        pts = [(r[3], r[5] * 1e3) for r in rows if r[:3] == (kind, dtype, mode)]
        color = colors.setdefault((kind, mode), f"C{len(colors)}")  # one colour per transport and mode
        style = "-" if dtype == "bf16" else "--"
        marker = "o" if mode == "whole" else "s"
        ax.plot(*zip(*pts, strict=True), style, color=color, marker=marker, label=f"{kind} {mode} {dtype}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("decode-side latency after prefill end (ms)")
    ax.set_title("KV transfer: whole-cache vs layerwise")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--role", choices=["bench", "receiver"], default="bench")
    p.add_argument("--kinds", default="socket,jax")
    p.add_argument("--quick", action="store_true", help="small sizes, for a CPU run")
    p.add_argument("--lengths", default=None, help="prompt lengths, comma-separated (multiples of 64)")
    p.add_argument("--sizes-mb", default=None, help="bandwidth message sizes in MiB, comma-separated")
    p.add_argument("--us-per-token-layer", type=float, default=None, help="prefill stand-in cost")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--budget", type=float, default=150.0, help="seconds; past half of it, one rep per point")
    default_plot = os.path.join(os.environ["OUT"], "pd_transfer.png") if os.environ.get("OUT") else None
    p.add_argument("--plot", default=default_plot)
    args = p.parse_args(argv)
    # Two processes share one device: neither may take most of its memory up front.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    if args.role == "receiver":
        receiver_main(args.kinds)
        return
    args.kinds = args.kinds.split(",")
    quick = dict(lengths="256,512,1024", sizes_mb="4,32", us=2.0)
    full = dict(lengths="1024,2048,4096,8192,16384,32768", sizes_mb="64,256,1024", us=0.4)
    d = quick if args.quick else full
    args.lengths = [int(x) for x in (args.lengths or d["lengths"]).split(",")]
    args.sizes_mb = [int(x) for x in (args.sizes_mb or d["sizes_mb"]).split(",")]
    if args.us_per_token_layer is None:
        args.us_per_token_layer = d["us"]
    print(run(args))


if __name__ == "__main__":
    main()
