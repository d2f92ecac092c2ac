"""train_mtp end to end on a tiny slice (CPU): corpus, joint pretraining, MTP-head training, evaluation.

The suite runs with 8 fake CPU devices, so every training step here is data parallel over an 8-device mesh."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hcfjax
from tests.test_corpus import make_lib
from train_mtp import evaluate, pretrain, train
from train_mtp.common import TrainConfig
from train_mtp.heads import module_for_depth

TINY = dict(
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=16,
    num_hidden_layers=2,
    q_lora_rank=32,
    kv_lora_rank=32,
    max_position_embeddings=256,
)


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("train")
    from train_mtp import corpus

    corpus.build(tmp / "data", vocab_size=300, root=make_lib(tmp, n=30))
    # 12 steps: the validation loss is ~1.6 nats by then (4.2 and 4.7 needed below), as it is after 24
    tc = TrainConfig(steps=12, batch_size=8, seq_len=32, lr=1e-2, warmup=4, eval_batches=2, ckpt_every=6)
    summary = pretrain.run(tmp / "ckpt", tmp / "work", tc, data_dir=tmp / "data", arch_overrides=TINY)
    return tmp, summary


def test_pretraining_lowers_the_loss_and_writes_a_checkpoint(pretrained):
    tmp, summary = pretrained
    assert summary["steps"] == 12
    # random init predicts ~uniformly: ln(300) = 5.7 nats; a few steps on this repetitive corpus must beat it clearly
    assert summary["val_main_loss"] < math.log(300) - 1.5
    assert summary["val_mtp_loss"] < math.log(300) - 1.0
    model = hcfjax.load(tmp / "ckpt", dtype=jnp.float32)
    assert model.cfg.num_mtp_layers == 1 and model.tokenizer is not None
    assert (tmp / "work" / "loss.png").stat().st_size > 0


def test_resume_continues_from_the_checkpoint(pretrained):
    tmp, _ = pretrained
    tc = TrainConfig(steps=15, batch_size=8, seq_len=32, lr=1e-2, warmup=4, eval_batches=2, ckpt_every=6)
    summary = pretrain.run(tmp / "ckpt2", tmp / "work", tc, data_dir=tmp / "data", arch_overrides=TINY)
    assert summary["steps"] == 15  # 3 more steps, not 15 from scratch
    # the log keeps the first run's final record (step 12), which a run from scratch would not write
    lines = (tmp / "work" / "log.jsonl").read_text().splitlines()
    assert sum('"step": 12,' in line for line in lines) == 1


def equal_trees(a, b) -> bool:
    """Exact equality of two pytrees, compared in numpy (jnp.array_equal compiles two programs per leaf shape)."""
    return all(jax.tree.leaves(jax.tree.map(lambda x, y: np.array_equal(np.asarray(x), np.asarray(y)), a, b)))


def changed_share(a, b) -> float:
    """The share of two pytrees' leaves that differ."""
    same = jax.tree.leaves(jax.tree.map(lambda x, y: np.array_equal(np.asarray(x), np.asarray(y)), a, b))
    return 1 - sum(same) / len(same)


@pytest.mark.parametrize("mode,modules", [("shared", 1), ("independent", 3)])
def test_mtp_heads_train_and_plug_into_the_checkpoint(pretrained, mode, modules):
    tmp, _ = pretrained
    # nothing below depends on how well the heads learn: a few steps past the warm-up train them
    tc = TrainConfig(steps=4, batch_size=8, seq_len=32, lr=3e-3, warmup=2, eval_batches=2)
    out = tmp / f"heads-{mode}"
    summary = train.run(tmp / "ckpt", 3, mode, out, tc, tmp / f"w-{mode}", data_dir=tmp / "data")
    assert {f"val_depth{k}_loss" for k in (1, 2, 3)} <= set(summary)
    heads = hcfjax.load(out, dtype=jnp.float32)
    base = hcfjax.load(tmp / "ckpt", dtype=jnp.float32)
    assert heads.cfg.num_mtp_layers == modules and len(heads.params["mtp"]) == modules
    # the base is frozen: identical to bf16 precision of the saved checkpoint
    assert equal_trees(base.params["segments"], heads.params["segments"])
    # and the heads are not: every module starts as a copy of the checkpoint's and most of its tensors moved (a
    # gradient that misses a module would leave it equal); independent modules each their own way
    for module in heads.params["mtp"]:
        assert changed_share(module, base.params["mtp"][0]) > 0.5
    for i in range(1, modules):
        assert changed_share(heads.params["mtp"][i], heads.params["mtp"][i - 1]) > 0.5
    # round trip of the written checkpoint
    hcfjax.save(heads, tmp / f"again-{mode}")
    again = hcfjax.load(tmp / f"again-{mode}", dtype=jnp.float32)
    assert equal_trees(heads.params, again.params)
    res = evaluate.evaluate(
        heads, np.load(tmp / "data" / "test.npy"), depth=3, windows=2, prefix=8, gen=8, loss_batches=1, seq_len=16
    )
    assert len(res["acceptance_per_depth"]) == 3 and all(0 <= a <= 1 for a in res["acceptance_per_depth"])
    assert res["mean_accepted_length"] == sorted(res["mean_accepted_length"])


def test_bad_mode_and_depth(pretrained):
    tmp, _ = pretrained
    with pytest.raises(ValueError, match="mode"):
        train.run(tmp / "ckpt", 2, "mixed", tmp / "x", TrainConfig(steps=1), tmp / "wx", tmp / "data")
    with pytest.raises(ValueError, match="depth"):
        train.run(tmp / "ckpt", 0, "shared", tmp / "x", TrainConfig(steps=1), tmp / "wx", tmp / "data")


def test_module_for_depth():
    assert [module_for_depth(1, k) for k in (1, 2, 5)] == [0, 0, 0]
    assert [module_for_depth(5, k) for k in (1, 3, 5)] == [0, 2, 4]
