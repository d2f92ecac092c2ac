"""The EP exchanges of sharding/ep.py on fake CPU devices: dense (all_to_all) and ragged (ragged_all_to_all) give
the single-device experts' outputs, also when every token goes to one rank, with mock rows and with EPLB replicas.

XLA:CPU has no ragged_all_to_all (jax 0.11), so the ragged path runs here on `ragged_all_to_all_reference`, the
collective's documented semantics built from all_gather and a gather, which also rejects inconsistent offsets; the
real collective is checked to lower for CUDA."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import hcfjax
from hcfjax.moe import experts
from sharding.ep import ep_experts
from sharding.plans import decode_plan
from tests.conftest import FIXTURES, rel_err


def ragged_all_to_all_reference(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name):
    """lax.ragged_all_to_all as its docstring defines it, for one slice per peer, from all_gather and a gather: the
    receiver writes source i's operand[input_offsets_i[me] :][: recv_sizes[i]] at output_offsets_i[me] over
    `output`. Inconsistent arguments poison the whole result with NaN: recv_sizes that differ from what the sources
    send, a slice read outside its sender's operand or written outside the output, two slices writing one row."""
    n, me = jax.lax.axis_size(axis_name), jax.lax.axis_index(axis_name)
    if input_offsets.shape != (n,):
        raise ValueError("the reference sends one slice per peer")
    mine = lambda a: jax.lax.all_gather(a, axis_name)[:, me]  # [source]: what each source passed about me
    operands = jax.lax.all_gather(operand, axis_name)  # [source, N, ...]
    read_at, sent, write_at = mine(input_offsets), mine(send_sizes), mine(output_offsets)
    rows = jnp.arange(output.shape[0])[:, None]
    inside = (rows >= write_at) & (rows < write_at + recv_sizes)  # [M, source]
    source = jnp.argmax(inside, axis=1)
    read = jnp.clip(read_at[source] + rows[:, 0] - write_at[source], 0, operand.shape[0] - 1)
    got = operands[source, read]
    result = jnp.where(inside.any(1).reshape((-1,) + (1,) * (output.ndim - 1)), got, output)
    bad = (sent != recv_sizes) | (read_at < 0) | (read_at + sent > operand.shape[0])
    bad = bad | (write_at < 0) | (write_at + recv_sizes > output.shape[0])
    return jnp.where(bad.any() | (inside.sum(1) > 1).any(), jnp.nan, result)


def shard_run(ranks: int, fn, args, specs):
    mesh = decode_plan(ranks).mesh
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=specs, out_specs=P("ep")))(*args)


def test_reference_follows_the_documented_example():
    """The two-rank example of lax.ragged_all_to_all's docstring; and a size mismatch poisons the result."""
    args = [
        [[1, 2, 2], [3, 4, 0]],  # operand
        [[0] * 4, [0] * 4],  # output
        [[0, 1], [0, 1]],  # input_offsets
        [[1, 2], [1, 1]],  # send_sizes
        [[0, 0], [1, 2]],  # output_offsets
        [[1, 1], [2, 1]],  # recv_sizes
    ]
    args = [jnp.asarray(a, jnp.float32 if i < 2 else jnp.int32).reshape(-1) for i, a in enumerate(args)]
    fn = lambda *a: ragged_all_to_all_reference(*a, axis_name="ep")
    out = shard_run(2, fn, args, (P("ep"),) * 6)
    assert out.tolist() == [1, 3, 0, 0, 2, 2, 4, 0]
    args[5] = args[5].at[0].set(2)  # rank 0 expects 2 rows from itself, which sends 1
    assert np.isnan(np.asarray(shard_run(2, fn, args, (P("ep"),) * 6))[:4]).all()


def random_layer(experts_n: int, d: int = 16, f: int = 8, seed: int = 0) -> dict:
    ks = jax.random.split(jax.random.key(seed), 3)
    return {
        "gate": jax.random.normal(ks[0], (experts_n, d, f)) * d**-0.5,
        "up": jax.random.normal(ks[1], (experts_n, d, f)) * d**-0.5,
        "down": jax.random.normal(ks[2], (experts_n, f, d)) * f**-0.5,
    }


def routing(tokens: int, k: int, choices, seed: int):
    """k distinct experts per token drawn from `choices`, positive weights."""
    rng = np.random.default_rng(seed)
    ids = np.stack([rng.choice(choices, k, replace=False) for _ in range(tokens)]).astype(np.int32)
    weights = rng.uniform(0.1, 1.0, (tokens, k)).astype(np.float32)
    x = rng.standard_normal((tokens, 16)).astype(np.float32)
    return jnp.asarray(x), jnp.asarray(weights), jnp.asarray(ids)


def run_ep(exchange, ranks: int, p: dict, x, weights, ids):
    specs = {w: P("ep") if w in ("gate", "up", "down") else P() for w in p}
    fn = lambda p, x, w, i: ep_experts("ep", exchange)(p, x, w, i)
    return shard_run(ranks, fn, (p, x, weights, ids), (specs, P("ep"), P("ep"), P("ep")))


EXCHANGES = {"dense": "dense", "ragged": ragged_all_to_all_reference}


@pytest.mark.parametrize("ranks,k,skew", [(4, 4, None), (8, 4, None), (8, 4, 5), (4, 3, 0), (8, 2, 7)])
def test_exchanges_equal_single_device_experts(ranks, k, skew):
    """32 experts, 5 tokens per rank. skew = r: every token's experts on rank r, which then receives the worst
    case (k = E_l fills its receive buffer exactly: every source's block full) and the other ranks nothing."""
    p = random_layer(32)
    e_local = 32 // ranks
    choices = np.arange(32) if skew is None else np.arange(skew * e_local, (skew + 1) * e_local)
    x, weights, ids = routing(5 * ranks, k, choices, seed=ranks + k)
    want = experts(p, x, weights, ids)
    outs = {name: run_ep(ex, ranks, p, x, weights, ids) for name, ex in EXCHANGES.items()}
    assert np.array_equal(outs["dense"], outs["ragged"])  # same rows, in the same order, through the same matmuls
    assert rel_err(outs["ragged"], want) < 1e-5


@pytest.mark.parametrize("exchange", EXCHANGES)
@pytest.mark.parametrize("skew", [None, 2])
def test_received_rows_and_their_experts(exchange, skew):
    """What a rank hands its experts: a compute that answers each row with (its local expert, the rank's rows
    with an expert) shows every copy reached the right expert, and the padding of the receive buffer none."""
    ranks, k, e_local = 4, 4, 8
    choices = np.arange(32) if skew is None else np.arange(skew * e_local, (skew + 1) * e_local)
    x, _, ids = routing(5 * ranks, k, choices, seed=1)
    ones = jnp.ones(ids.shape, jnp.float32)

    def probe(p, rows, expert, opts):
        real = (expert < e_local).sum()
        return jnp.zeros_like(rows).at[:, 0].set(expert).at[:, 1].set(real)

    specs = ({w: P("ep") for w in ("gate", "up", "down")}, P("ep"), P("ep"), P("ep"))
    fn = lambda p, x, w, i: ep_experts("ep", EXCHANGES[exchange], compute=probe)(p, x, w, i)
    out = np.asarray(shard_run(ranks, fn, (random_layer(32), x, ones, ids), specs))
    copies_to = np.bincount(np.asarray(ids).reshape(-1) // e_local, minlength=ranks)
    assert np.array_equal(out[:, 0], (np.asarray(ids) % e_local).sum(1))
    assert np.array_equal(out[:, 1], copies_to[np.asarray(ids) // e_local].sum(1))


def test_exchanges_with_eplb_replicas():
    """16 experts in 24 physical slots over 8 ranks (hot experts replicated, a token's copies spread over them),
    with a skewed routing onto the hot experts."""
    from sharding.eplb import pad_log2phy, rebalance_experts
    from tests.test_eplb import zipf_loads

    phy2log, log2phy, logcnt = rebalance_experts(zipf_loads(1, 16, seed=3), 24, 4, 2, 8)
    assert logcnt.max() > 1
    logical = random_layer(16, seed=1)
    placed = {w: a[phy2log[0]] for w, a in logical.items()}
    placed["log2phy"] = jnp.asarray(pad_log2phy(log2phy, 24)[0], jnp.int32)
    placed["logcnt"] = jnp.asarray(logcnt[0], jnp.int32)
    hot = np.argsort(-logcnt[0])[:6]
    x, weights, ids = routing(8 * 6, 4, hot, seed=5)
    want = experts(logical, x, weights, ids)
    outs = {name: run_ep(ex, 8, placed, x, weights, ids) for name, ex in EXCHANGES.items()}
    assert np.array_equal(outs["dense"], outs["ragged"])
    assert rel_err(outs["ragged"], want) < 1e-5


@pytest.mark.parametrize("eplb", [False, True])
def test_ragged_decode_plan_with_mock_rows_matches_the_reference(eplb):
    """The whole model under the decode plan with the ragged exchange: 3 rows over 8 ranks (5 ranks only mock
    rows), optionally with EPLB replicas; the logits equal the transformers reference."""
    from sharding.eplb import apply_placement, rebalance_experts
    from sharding.forward import decode_plan_logits
    from sharding.plans import shard_params
    from tests.test_eplb import zipf_loads

    model = hcfjax.load(FIXTURES / "tiny_v3", dtype=jnp.float32)
    ref = np.load(FIXTURES / "tiny_v3" / "reference.npz")
    params = model.params
    if eplb:
        n_moe = sum(model.cfg.is_moe_layer(i) for i in range(model.cfg.num_hidden_layers))
        params = apply_placement(params, model.cfg, *rebalance_experts(zipf_loads(n_moe, 16, seed=3), 24, 4, 2, 8))
    plan = decode_plan(8)
    lg = decode_plan_logits(plan, shard_params(params, plan), model.cfg, ref["ids"][:3], ragged_all_to_all_reference)
    assert rel_err(lg, ref["logits"][:3]) < 1e-4


def test_ragged_exchange_lowers_for_cuda():
    """The real lax.ragged_all_to_all (which XLA:CPU cannot run) lowers for CUDA under a 4-rank shard_map."""
    p = random_layer(16)
    x, weights, ids = routing(12, 2, np.arange(16), seed=0)
    specs = (P("ep"), P("ep"), P("ep"), P("ep"))
    fn = lambda p, x, w, i: ep_experts("ep", "ragged")(p, x, w, i)
    sm = jax.shard_map(fn, mesh=decode_plan(4).mesh, in_specs=specs, out_specs=P("ep"))
    text = jax.jit(sm).trace(p, x, weights, ids).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("custom_call @ragged_all_to_all") == 2  # there and back


def test_exchange_choice():
    """Dense is the default (Options.ep_exchange); an unknown exchange is an error, in Options and in ep_experts."""
    from hcfjax.options import Options

    assert Options().ep_exchange == "dense" and Options(ep_exchange="ragged").ep_exchange == "ragged"
    for bad in ("sparse", "auto", None):
        with pytest.raises(ValueError, match="exchange"):
            Options(ep_exchange=bad)
        with pytest.raises(ValueError, match="EP exchange"):
            ep_experts("ep", bad)
