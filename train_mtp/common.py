"""The training loop shared by base pretraining and MTP-head training.

Optax AdamW with linear warmup and cosine decay, one jitted step, data parallel over every local device through a
1-D mesh (the batch is sharded over "data", params and optimizer state replicated; XLA inserts the gradient
all-reduce), orbax checkpoints with resume, periodic held-out evaluation, a tqdm progress bar, a JSON-lines log and a
loss-curve PNG. Deterministic for a seed: batches are drawn by a numpy generator seeded by (seed, step).
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from tqdm import tqdm


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = 2000
    batch_size: int = 64  # sequences per step, split over the devices
    seq_len: int = 256
    lr: float = 3e-3
    warmup: int = 100
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    eval_every: int = 200
    eval_batches: int = 8
    ckpt_every: int = 500
    seed: int = 0
    time_limit_s: float = 0.0  # stop (and checkpoint) after this long; 0 = no limit


def add_train_args(ap, steps: int, lr: float) -> None:
    """The command-line flags every training script shares."""
    ap.add_argument("--steps", type=int, default=steps)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--lr", type=float, default=lr)
    ap.add_argument("--time-limit", type=float, default=0.0, help="seconds; stop and save when reached")
    ap.add_argument("--seed", type=int, default=0)


def train_config(args, warmup: int, **overrides) -> TrainConfig:
    """TrainConfig from add_train_args' flags, warmup capped at a tenth of the steps."""
    return TrainConfig(
        steps=args.steps,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        lr=args.lr,
        seed=args.seed,
        time_limit_s=args.time_limit,
        warmup=min(warmup, args.steps // 10),
        **overrides,
    )


def windows(tokens: np.ndarray, batch: int, length: int, rng: np.random.Generator) -> np.ndarray:
    """`batch` random windows of `length` tokens from one token stream -> int32 [batch, length]."""
    if tokens.size < length + 1:
        raise ValueError(f"token stream of {tokens.size} is shorter than a window of {length}")
    starts = rng.integers(0, tokens.size - length, batch)
    return np.stack([tokens[s : s + length] for s in starts]).astype(np.int32)


def eval_windows(tokens: np.ndarray, batches: int, batch: int, length: int) -> list[np.ndarray]:
    """Fixed held-out windows (the same every evaluation)."""
    rng = np.random.default_rng(12345)
    return [windows(tokens, batch, length, rng) for _ in range(batches)]


def optimizer(tc: TrainConfig) -> optax.GradientTransformation:
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, tc.lr, tc.warmup, max(tc.steps, tc.warmup + 1), end_value=tc.lr * tc.min_lr_ratio
    )
    # Norm gains and biases are not decayed.
    mask = lambda params: jax.tree.map(lambda x: x.ndim >= 2, params)
    return optax.chain(
        optax.clip_by_global_norm(tc.grad_clip),
        optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=tc.weight_decay, mask=mask),
    )


def data_mesh() -> jax.sharding.Mesh:
    return jax.make_mesh((jax.local_device_count(),), ("data",), axis_types=(jax.sharding.AxisType.Auto,))


LossFn = Callable[[dict, jax.Array], tuple[jax.Array, dict]]  # (trainable params, batch [B, T]) -> (loss, metrics)


def train(
    loss_fn: LossFn,
    params: dict,
    tc: TrainConfig,
    train_tokens: np.ndarray,
    val_tokens: np.ndarray,
    window_len: int,
    workdir: str | Path,
    desc: str = "train",
) -> tuple[dict, list[dict]]:
    """Trains `params` (the trainable pytree) to minimise loss_fn; resumes from workdir's latest checkpoint.

    Returns (params, log records). workdir gets checkpoints/, log.jsonl and loss.png.
    """
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    mesh = data_mesh()
    if tc.batch_size % mesh.size:
        raise ValueError(f"batch_size {tc.batch_size} is not divisible by {mesh.size} devices")
    replicated = NamedSharding(mesh, P())
    sharded = NamedSharding(mesh, P("data"))
    opt = optimizer(tc)
    state = {"params": params, "opt": opt.init(params), "step": jnp.int32(0)}
    state = jax.device_put(state, replicated)

    manager = ocp.CheckpointManager(
        (workdir / "checkpoints").absolute(), options=ocp.CheckpointManagerOptions(max_to_keep=2)
    )
    if manager.latest_step() is not None:
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
        state = manager.restore(manager.latest_step(), args=ocp.args.StandardRestore(abstract))
    start = int(state["step"])

    @jax.jit
    def step_fn(state, batch):
        (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"], batch)
        updates, opt_state = opt.update(grads, state["opt"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        return {"params": params, "opt": opt_state, "step": state["step"] + 1}, loss, metrics

    eval_fn = jax.jit(loss_fn)
    held_out = [
        jax.device_put(w, sharded) for w in eval_windows(val_tokens, tc.eval_batches, tc.batch_size, window_len)
    ]

    def evaluate(params) -> dict:
        sums: dict[str, float] = {}
        for w in held_out:
            loss, metrics = eval_fn(params, w)
            for k, v in {"loss": loss, **metrics}.items():
                sums[k] = sums.get(k, 0.0) + float(v) / len(held_out)
        return sums

    log_path = workdir / "log.jsonl"
    records = [json.loads(line) for line in log_path.read_text().splitlines()] if log_path.exists() else []
    records = [r for r in records if r["step"] <= start]
    t0 = time.perf_counter()
    bar = tqdm(range(start, tc.steps), initial=start, total=tc.steps, desc=desc, mininterval=2.0)
    for step in bar:
        rng = np.random.default_rng([tc.seed, step])
        batch = jax.device_put(windows(train_tokens, tc.batch_size, window_len, rng), sharded)
        state, loss, metrics = step_fn(state, batch)
        done = step + 1
        out_of_time = tc.time_limit_s and time.perf_counter() - t0 > tc.time_limit_s
        if done % 20 == 0 or done == tc.steps or out_of_time:
            rec = {"step": done, "train_loss": float(loss), **{k: float(v) for k, v in metrics.items()}}
            if done % tc.eval_every == 0 or done == tc.steps or out_of_time:
                rec.update({f"val_{k}": v for k, v in evaluate(state["params"]).items()})
            records.append(rec)
            bar.set_postfix(
                loss=f"{rec['train_loss']:.3f}", **({"val": f"{rec['val_loss']:.3f}"} if "val_loss" in rec else {})
            )
        if done % tc.ckpt_every == 0 or done == tc.steps or out_of_time:
            manager.save(done, args=ocp.args.StandardSave(state))
        if out_of_time:
            print(f"time limit of {tc.time_limit_s:.0f}s reached at step {done}")
            break
    manager.wait_until_finished()
    log_path.write_text("".join(json.dumps(r) + "\n" for r in records))
    plot_losses(records, workdir / "loss.png", desc)
    return state["params"], records


def plot_losses(records: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    keys = sorted({k for r in records for k in r if k.endswith("loss") and k != "step"})
    for k in keys:
        pts = [(r["step"], r[k]) for r in records if k in r]
        if pts:
            ax.plot(*zip(*pts, strict=True), label=k, marker="." if k.startswith("val") else None)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy: logits [..., V] f32, targets [...] int."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))
