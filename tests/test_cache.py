"""Paged latent cache: cached prefill + decode equals teacher forcing; absorbed MLA equals expanded; page size and
page order do not change results."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hcfjax
from hcfjax import cache as kvcache
from hcfjax.attention import CacheContext
from hcfjax.model import hidden_states, logits
from tests.conftest import chunk_over_paged_cache, jaxpr_eqns, rel_err

step = jax.jit(hidden_states, static_argnames=("cfg", "absorbed"))


def run_cached(
    model,
    ids,
    prefix,
    page_size,
    page_order,
    absorbed_decode=True,
    prefill_absorbed=False,
    cache_dtype=jnp.float32,
    step=step,
):
    """Prefill ids[:, :prefix] then decode one token at a time (each forward a `step`); returns logits [B, T, V]
    for every position."""
    cfg, p = model.cfg, model.params
    b, t = ids.shape
    pages = -(-t // page_size)
    table = jnp.asarray(page_order[: b * pages].reshape(b, pages))
    cache = kvcache.init_cache(cfg, len(page_order), page_size, cache_dtype)
    pos = jnp.broadcast_to(jnp.arange(prefix), (b, prefix))
    lens = jnp.full((b,), prefix)
    ctx = CacheContext(cache, table, lens, jnp.ones((b, prefix), bool))
    h, ctx = step(p, cfg, ids[:, :prefix], pos, ctx, absorbed=prefill_absorbed)
    out = [logits(p, h)]
    for i in range(prefix, t):
        ctx = CacheContext(ctx.cache, table, jnp.full((b,), i + 1), jnp.ones((b, 1), bool))
        h, ctx = step(p, cfg, ids[:, i : i + 1], jnp.full((b, 1), i), ctx, absorbed=absorbed_decode)
        out.append(logits(p, h))
    return jnp.concatenate(out, axis=1), ctx.cache


@pytest.mark.parametrize("page_size,shuffle", [(4, False), (8, True), (16, True)])
def test_prefill_then_decode_equals_teacher_forcing(v3_model, page_size, shuffle):
    ids = jnp.asarray(np.load("tests/fixtures/tiny_v3/reference.npz")["ids"][:2, :21])
    ref = hcfjax.forward(v3_model, ids)
    n_pages = 2 * -(-21 // page_size) + 3
    order = np.random.default_rng(page_size).permutation(n_pages) if shuffle else np.arange(n_pages)
    got, _ = run_cached(v3_model, ids, prefix=9, page_size=page_size, page_order=order)
    assert rel_err(got, ref) < 1e-4
    assert bool(jnp.all(jnp.argmax(got, -1) == jnp.argmax(ref, -1)))


def test_absorbed_equals_expanded(v3_model):
    # the shapes of test_prefill_then_decode_equals_teacher_forcing[4-False]: its expanded prefill and absorbed decode
    # are compiled once for both tests
    ids = jnp.asarray(np.load("tests/fixtures/tiny_v3/reference.npz")["ids"][:2, :21])
    order = np.arange(2 * -(-21 // 4) + 3)
    expanded, _ = run_cached(v3_model, ids, prefix=9, page_size=4, page_order=order, absorbed_decode=False)
    absorbed, _ = run_cached(
        v3_model, ids, prefix=9, page_size=4, page_order=order, absorbed_decode=True, prefill_absorbed=True
    )
    assert rel_err(absorbed, expanded) < 1e-5


def test_int8_cache_error_is_quantisation_sized(v3_model):
    """Per-token int8 has about 3x the rounding error of bf16 on Gaussian-like latents; the logits' error through
    the whole (chaotic, random) model must stay within that ratio's neighbourhood, not blow up."""
    ids = jnp.asarray(np.load("tests/fixtures/tiny_v3/reference.npz")["ids"][:2, :16])
    ref = hcfjax.forward(v3_model, ids)
    run = lambda dt: run_cached(v3_model, ids, prefix=8, page_size=4, page_order=np.arange(8), cache_dtype=dt)
    got8, cache = run(jnp.int8)
    got16, _ = run(jnp.bfloat16)
    assert cache.kv.dtype == jnp.int8 and cache.scale.shape == kvcache.scale_shape(cache.kv.shape)
    err8, err16 = rel_err(got8, ref), rel_err(got16, ref)
    print("int8", err8, "bf16", err16)
    assert err8 < 6 * err16
    # and both are rounding-sized through this model (about 0.085 each on this model): a wrong conversion that both
    # 8- and 16-bit caches share would pass the ratio alone
    assert err8 < 0.15 and err16 < 0.15


def test_int8_quantisation_round_trip():
    x = jax.random.normal(jax.random.key(0), (5, 7, 64)) * jnp.linspace(0.1, 10, 7)[:, None]
    q, s = kvcache.quantize_int8(x)
    back = q.astype(jnp.float32) * s[..., None]
    assert q.dtype == jnp.int8 and s.shape == (5, 7)
    assert float(jnp.max(jnp.abs(back - x) / s[..., None])) <= 0.5 + 1e-5  # within half a quantisation step


def test_int8_entry_is_each_part_quantised_alone():
    """quantize_entry's one reduction over both parts (k_pe padded with zeros) gives quantize_int8's values and
    scales bit for bit, also for an all-zero rope part and parts of very different magnitudes."""
    key_c, key_r = jax.random.split(jax.random.key(3))
    ckv = jax.random.normal(key_c, (4, 3, 512)) * jnp.array([1e-3, 1.0, 300.0])[:, None]
    kpe = jax.random.normal(key_r, (4, 3, 64)) * jnp.array([50.0, 1e-4, 0.0])[:, None]
    entry, scales = kvcache.quantize_entry(ckv, kpe)
    (qc, sc), (qr, sr) = kvcache.quantize_int8(ckv), kvcache.quantize_int8(kpe)
    np.testing.assert_array_equal(np.asarray(entry), np.asarray(jnp.concatenate([qc, qr], axis=-1)))
    np.testing.assert_array_equal(np.asarray(scales), np.asarray(jnp.stack([sc, sr], axis=-1)))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.int8])
def test_cache_entries_are_computed_before_their_scatter(v3_model, dtype):
    """Each scatter into the cache takes its entries from an optimization_barrier, so XLA cannot fuse the entries'
    producers (norm, rope, quantisation: row reductions) into the scatter, which would recompute them per byte."""
    cfg = v3_model.cfg
    cache = kvcache.init_cache(cfg, 4, 4, dtype)
    ckv, kpe = jnp.ones((2, 3, cfg.kv_lora_rank)), jnp.ones((2, 3, cfg.qk_rope_head_dim))
    pos, valid, table = jnp.zeros((2, 3), jnp.int32), jnp.ones((2, 3), bool), jnp.zeros((2, 2), jnp.int32)
    jaxpr = jax.make_jaxpr(kvcache.write, static_argnums=1)(cache, 0, ckv, kpe, pos, valid, table).jaxpr
    barriers = {v for e in jaxpr.eqns if e.primitive.name == "optimization_barrier" for v in e.outvars}
    scatters = [e for e in jaxpr.eqns if e.primitive.name == "scatter"]
    assert len(scatters) == (2 if dtype == jnp.int8 else 1)
    assert all(e.invars[2] in barriers for e in scatters)


def test_padding_and_mock_rows_never_write(v3_model):
    """Tokens marked invalid (right padding, idle rows) leave every page untouched."""
    cfg = v3_model.cfg
    cache = kvcache.init_cache(cfg, 4, 4, jnp.float32)
    poison = jnp.full_like(cache.kv, 7.0)
    table = jnp.array([[0, 1], [2, 3]])
    valid = jnp.array([[True] * 3 + [False] * 5, [False] * 8])
    ctx = CacheContext(kvcache.KVCache(poison), table, jnp.array([3, 0]), valid)
    ids = jnp.ones((2, 8), jnp.int32) * 5
    _, ctx = step(v3_model.params, cfg, ids, jnp.broadcast_to(jnp.arange(8), (2, 8)), ctx)
    kv = np.asarray(ctx.cache.kv)
    assert not np.any(kv[:, 0, :3] == 7.0)  # the 3 valid tokens were written
    assert np.all(kv[:, 0, 3:] == 7.0) and np.all(kv[:, 1:] == 7.0)  # nothing else was


def test_batch_one_decode_as_two_rows_changes_nothing(v3_model):
    """hidden_states runs a one-token cached forward as the row and a copy, its layers unrolled (Options.two_rows and
    unroll_decode; two rows by default on GPUs): the same logits, cache and expert loads as one row over the layer
    loops."""
    from hcfjax import model as model_mod
    from hcfjax.options import Options

    cfg, p = v3_model.cfg, v3_model.params
    ids = jnp.asarray(np.load("tests/fixtures/tiny_v3/reference.npz")["ids"][:1, :14])
    order = np.random.default_rng(1).permutation(8)
    runs = {}
    for on in (False, True):
        opts = Options(two_rows=on, unroll_decode=on)
        assert model_mod.two_rows(ids[:, :1], object(), None, opts) == on
        step_fn = jax.jit(functools.partial(hidden_states, opts=opts), static_argnames=("cfg", "absorbed", "with_load"))
        got, cache = run_cached(v3_model, ids, prefix=9, page_size=4, page_order=order, step=step_fn)
        ctx = CacheContext(cache, jnp.asarray(order[:4].reshape(1, 4)), jnp.array([15]), jnp.ones((1, 1), bool))
        h, ctx2, load = step_fn(p, cfg, ids[:, 13:14], jnp.array([[14]]), ctx, absorbed=True, with_load=True)
        runs[on] = got, cache, load, ctx2
    (one, c1, l1, _), (two, c2, l2, x2) = runs[False], runs[True]
    assert one.shape == two.shape == (1, 14, cfg.vocab_size)
    assert rel_err(two, one) < 1e-5
    # (two rows change the projections' GEMM shapes, so float32 sums round differently: a few 1e-6)
    np.testing.assert_allclose(np.asarray(c2.kv), np.asarray(c1.kv), rtol=1e-4, atol=1e-5)
    assert bool(jnp.all(l1 == l2)) and int(l2.sum()) == cfg.num_experts_per_tok * l2.shape[0]  # one token counted
    assert x2.page_table.shape == (1, 4) and x2.kv_len.shape == (1,)  # the caller's view comes back


def test_decode_layers_in_twos_and_threes_change_nothing(v3_model):
    """Options.unroll_decode=n runs n layers a loop iteration (the tiny model's runs of two dense and three MoE
    layers leave a remainder at 2 and 3): the same hidden states, cache and expert loads as one layer an
    iteration."""
    from hcfjax.options import Options

    cfg, p = v3_model.cfg, v3_model.params
    rng = np.random.default_rng(2)
    cache = kvcache.init_cache(cfg, 8, 4, jnp.float32)
    cache = kvcache.KVCache(jnp.asarray(rng.normal(size=cache.kv.shape), jnp.float32), cache.scale)
    ids = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 1)))
    ctx = CacheContext(cache, jnp.asarray(rng.permutation(8).reshape(2, 4)), jnp.array([6, 11]), jnp.ones((2, 1), bool))
    runs = {}
    for n in (1, 2, 3):
        step_fn = jax.jit(
            functools.partial(hidden_states, opts=Options(unroll_decode=n)), static_argnames=("cfg", "absorbed")
        )
        counted = jnp.ones((2, 1), bool)
        h, out, load = step_fn(p, cfg, ids, jnp.array([[5], [10]]), ctx, absorbed=True, with_load=counted)
        runs[n] = np.asarray(h), np.asarray(out.cache.kv), np.asarray(load)
    assert runs[1][2].shape == (3, cfg.n_routed_experts) and (runs[1][2].sum(1) == 2 * cfg.num_experts_per_tok).all()
    for n in (2, 3):
        assert rel_err(runs[n][0], runs[1][0]) < 1e-6
        np.testing.assert_array_equal(runs[n][1], runs[1][1])
        np.testing.assert_array_equal(runs[n][2], runs[1][2])
    assert not np.array_equal(runs[1][1], np.asarray(cache.kv))  # the step wrote its entries


def test_layers_in_runs_equal_lax_scan():
    """model._scan_in_runs (n steps a loop iteration, each indexing the whole of xs and given its index) computes
    what lax.scan over (xs, arange) does, carry and stacked outputs, for runs that leave a remainder and for several
    iterations of the loop."""
    from hcfjax.model import _scan_in_runs

    def body(carry, xs):
        (w, b), k = xs
        h = jnp.tanh(carry["h"] @ w + b + k)
        return {"h": h, "n": carry["n"] + 1}, (h.sum(), k * 2)

    rng = np.random.default_rng(3)
    length = 7
    ws = (jnp.asarray(rng.normal(size=(length, 4, 4)), jnp.float32), jnp.asarray(rng.normal(size=(length, 4))))
    carry = {"h": jnp.asarray(rng.normal(size=(2, 4)), jnp.float32), "n": jnp.int32(0)}
    want = jax.jit(lambda c, x: jax.lax.scan(body, c, (x, jnp.arange(length))))(carry, ws)
    np.testing.assert_array_equal(want[1][1], 2 * np.arange(length))
    for n in (2, 3):
        got = jax.jit(functools.partial(_scan_in_runs, body, length=length, n=n))(carry, ws)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), got, want)


@pytest.mark.parametrize("cache_dtype", [jnp.float32, jnp.int8])
def test_blockwise_prefill_attention_equals_dense(v3_model, cache_dtype):
    """A prefill chunk attends over the paged cache block by block (attend_expanded_paged, an online softmax over
    as many blocks as the longest row needs) as attention over the whole gathered page table at once does: rows
    of different lengths spanning several blocks, chunks that continue a prompt, pages out of order."""
    from hcfjax.attention import attend_expanded, attend_expanded_paged

    cfg = v3_model.cfg
    page_size, max_pages, t = 4, 12, 6
    lens = np.array([37, 12, 6])  # keys per row after this chunk; the chunk is each row's last t positions
    table = jnp.asarray(np.random.default_rng(0).permutation(3 * max_pages).reshape(3, max_pages))

    @jax.jit  # one compiled program, not one per op
    def got_and_want(p):
        cache = kvcache.init_cache(cfg, 3 * max_pages, page_size, cache_dtype)
        all_pos = jnp.broadcast_to(jnp.arange(max_pages * page_size), (3, max_pages * page_size))
        key = jax.random.split(jax.random.key(0), 4)
        ckv = jax.random.normal(key[0], (*all_pos.shape, cfg.kv_lora_rank))
        kpe = jax.random.normal(key[1], (*all_pos.shape, cfg.qk_rope_head_dim))
        cache = kvcache.write(cache, 0, ckv, kpe, all_pos, all_pos < lens[:, None], table)
        h = cfg.num_attention_heads
        q_nope = jax.random.normal(key[2], (3, t, h, cfg.qk_nope_head_dim))
        q_pe = jax.random.normal(key[3], (3, t, h, cfg.qk_rope_head_dim))
        positions = jnp.asarray(lens[:, None] - t + np.arange(t))
        ctx = CacheContext(cache, table, jnp.asarray(lens), jnp.ones((3, t), bool))
        got = attend_expanded_paged(p, cfg, q_nope, q_pe, ctx, 0, positions, key_block=8)  # 2 pages a block: 5 blocks
        keys, kpes = kvcache.read(cache, 0, table, cfg.kv_lora_rank, jnp.float32)
        key_pos = jnp.arange(keys.shape[1])[None, None, :]
        mask = (key_pos <= positions[:, :, None]) & (key_pos < ctx.kv_len[:, None, None])
        return got, attend_expanded(p, cfg, q_nope, q_pe, keys, kpes, mask)

    got, want = got_and_want(jax.tree.map(lambda a: a[0], v3_model.params["segments"][0]["attn"]))
    assert rel_err(got, want) < 1e-5


@pytest.mark.parametrize("cache_dtype", [jnp.float32, jnp.int8])
def test_fused_prefill_attention_equals_dense(v3_model, cache_dtype):
    """attend_expanded_fused (fused attention calls merged by their log-sum-exps: the chunk's own keys causally, the
    cached prefix a block at a time; XLA's implementation here, cuDNN's on a GPU) equals attention over the whole
    gathered page table: rows with a prefix spanning several blocks, one not page aligned, one without a prefix,
    one chunk shorter than the padded width and a padding row (no queries), pages out of order."""
    from hcfjax.attention import attend_expanded, attend_expanded_fused

    cfg = v3_model.cfg
    start = np.array([31, 0, 9, 0])  # cached tokens before each row's chunk
    n = np.array([6, 6, 3, 0])  # real tokens in each row's chunk

    @jax.jit  # one compiled program, not one per op
    def got_and_want(p):
        chunk = chunk_over_paged_cache(cfg, start, n, 6, 4, 12, cache_dtype, seed=1)
        q_nope, q_pe, ckv, kpe, ctx, positions, valid = chunk
        got = attend_expanded_fused(p, cfg, q_nope, q_pe, ckv, kpe, ctx, 0, positions, key_block=8)  # 4 prefix blocks
        keys, kpes = kvcache.read(ctx.cache, 0, ctx.page_table, cfg.kv_lora_rank, jnp.float32)
        key_pos = jnp.arange(keys.shape[1])[None, None, :]
        mask = (key_pos <= positions[:, :, None]) & (key_pos < ctx.kv_len[:, None, None])
        return got, attend_expanded(p, cfg, q_nope, q_pe, keys, kpes, mask), valid

    got, want, valid = got_and_want(jax.tree.map(lambda a: a[0], v3_model.params["segments"][0]["attn"]))
    real = np.asarray(valid)
    assert rel_err(got[real], want[real]) < 1e-5
    assert bool(jnp.all(got[~real] == 0))  # padding queries: zeros, not garbage


@pytest.mark.parametrize("absorbed", [False, True])
def test_one_rope_table_for_every_layer(v3_model, absorbed):
    """A cached forward rotates every layer's queries and keys by one rope table made before the layer loop: the
    loop's body computes no cos or sin (XLA would make the table again in every layer). Rotating by the table gives
    the same bits as rotating by the positions."""
    from hcfjax.layers import apply_rope, rope_table

    cfg, p = v3_model.cfg, v3_model.params
    cache = kvcache.init_cache(cfg, 4, 4, jnp.float32)
    ctx = CacheContext(cache, jnp.array([[0, 1], [2, 3]]), jnp.array([3, 2]), jnp.ones((2, 1), bool))
    tokens, pos = jnp.ones((2, 1), jnp.int32), jnp.array([[2], [1]])
    jaxpr = jax.make_jaxpr(lambda t, q, c: hidden_states(p, cfg, t, q, c, absorbed=absorbed))(tokens, pos, ctx)
    trig = ["scan" in within for e, within in jaxpr_eqns(jaxpr.jaxpr) if e.primitive.name in ("cos", "sin")]
    assert trig and not any(trig)

    r = cfg.qk_rope_head_dim
    x = jax.random.normal(jax.random.key(0), (2, 3, 4, r), jnp.bfloat16)
    at = jnp.array([[0, 5, 4000], [7, 1, 163839]])
    by_table = apply_rope(x, at, cfg.rope, rope_table(at, cfg.rope, r))
    np.testing.assert_array_equal(np.asarray(by_table), np.asarray(apply_rope(x, at, cfg.rope)))
