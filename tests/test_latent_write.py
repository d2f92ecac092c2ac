"""The latent-write kernel (pallas_kernels/latent_write.py, Triton lowering, run by Pallas's interpreter here) against
the model's jnp path it replaces in a decode step: attention.project_kv's norm and rope, then cache.write into an
int8 cache; and a decode step on it against the step without it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hcfjax import cache as kvcache
from hcfjax.config import RopeConfig
from hcfjax.layers import apply_rope, rms_norm, rope_table
from pallas_kernels.latent_write import applies, write_latents

C, R, PAGE, PAGES, LAYERS = 64, 32, 4, 7, 3


def _case(rng, b, t):
    kv = jnp.asarray(rng.normal(size=(b, t, C + R)) * 3, jnp.bfloat16)
    weight = jnp.asarray(1 + 0.1 * rng.normal(size=(2, C)), jnp.bfloat16)
    cache = kvcache.KVCache(
        jnp.asarray(rng.integers(-127, 128, (LAYERS, PAGES, PAGE, C + R)), jnp.int8),
        jnp.asarray(rng.random((LAYERS, PAGES, 2, PAGE)), jnp.float32),
    )
    return kv, weight, cache


@pytest.mark.parametrize("interleave", [True, False])
def test_kernel_writes_the_entries_cache_write_writes(interleave):
    """Every byte of both caches as project_kv's norm and rope, then cache.write, leave them: the entries of valid
    tokens at their page and slot (a row of the stacked norm weight, another cache layer), nothing for a padding
    token, a position past the page table or a page outside the cache, and everything else untouched."""
    rng = np.random.default_rng(0)
    b, t = 3, 2
    kv, weight, cache = _case(rng, b, t)
    rope = RopeConfig(theta=10000.0, interleave=interleave)
    positions = jnp.asarray([[5, 6], [0, 11], [3, 12]], jnp.int32)  # [2, 1]: past the table's 3 pages
    valid = jnp.asarray([[True, True], [True, False], [True, True]])
    page_table = jnp.asarray([[1, 2, 0], [4, 3, 6], [PAGES, 5, 6]], jnp.int32)  # [2, 0]: not a page of the cache
    table = rope_table(positions, rope, R)
    got = write_latents(
        cache.kv, cache.scale, 2, kv, weight, 1, table, positions, valid, page_table,
        eps=1e-6, interleave=interleave, interpret=True,
    )  # fmt: skip
    ckv = rms_norm(kv[..., :C], weight[1], 1e-6)
    kpe = apply_rope(kv[..., C:], positions, rope, table)
    want = kvcache.write(cache, 2, ckv, kpe, positions, valid, page_table)
    np.testing.assert_array_equal(got[0], want.kv)
    np.testing.assert_array_equal(got[1], want.scale)
    changed = np.argwhere(np.asarray(got[0] != cache.kv).any(-1))
    assert {tuple(x) for x in changed} == {(2, 2, 1), (2, 2, 2), (2, 4, 0)}  # three entries written


def test_kernel_adds_split_k_partials_as_the_product_does():
    """Given the kv_a product's split-K partials [S, M, C + R] f32 over the tokens' rows and the kernel's padding rows
    (quant.linear_partials), the kernel writes the entries that their sum in split order, rounded to bf16 (the
    product the dense int8 kernel returns), gives it."""
    rng = np.random.default_rng(4)
    b, t = 2, 1
    _, weight, cache = _case(rng, b, t)
    parts = jnp.asarray(rng.normal(size=(3, b * t + 5, C + R)) * 2, jnp.float32)  # 5 padding rows
    rows = ((parts[0] + parts[1]) + parts[2])[: b * t].reshape(b, t, C + R).astype(jnp.bfloat16)
    assert (rows.astype(jnp.float32) != parts[:, : b * t].sum(0).reshape(rows.shape)).any()  # the kernel rounds
    positions, valid = jnp.asarray([[2], [9]], jnp.int32), jnp.ones((b, t), bool)
    page_table = jnp.asarray([[3, 1, 0], [6, 2, 5]], jnp.int32)
    table = rope_table(positions, RopeConfig(theta=10000.0), R)
    write = lambda kv: write_latents(  # noqa: E731
        cache.kv, cache.scale, 1, kv, weight, 0, table, positions, valid, page_table,
        eps=1e-6, interleave=True, interpret=True,
    )  # fmt: skip
    got, want = write(parts), write(rows)
    assert (np.asarray(want[0]) != np.asarray(cache.kv)).any()
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])
    with pytest.raises(ValueError, match="split-K partials"):
        write(parts.astype(jnp.bfloat16))


@pytest.mark.usefixtures("reset_interpreter")
def test_an_int8_kv_a_hands_its_partials_to_the_kernel(monkeypatch):
    """attention.write_new_latents with an int8 kv_a on the dense int8 kernel whose tiling splits K: the cache write
    takes the product's partials (one launch fewer a layer) and leaves the cache as the summed product does."""
    import dataclasses

    from hcfjax import attention, quant
    from hcfjax.attention import CacheContext
    from hcfjax.random_model import preset_config

    d, c, r = 1024, 128, 64  # kv_a: 8 K blocks over 3 output tiles, split in two
    cfg = dataclasses.replace(preset_config("tiny-v3"), hidden_size=d, kv_lora_rank=c, qk_rope_head_dim=r)
    rng = np.random.default_rng(6)
    p = {
        "kv_a": quant.quantize(jnp.asarray(rng.normal(size=(d, c + r)) * 0.05), bits=8, act="int8"),
        "kv_a_norm": jnp.asarray(1 + 0.1 * rng.normal(size=c), jnp.bfloat16),
    }
    b, page = 2, 4
    cache = kvcache.KVCache(jnp.zeros((2, 4, page, c + r), jnp.int8), jnp.zeros((2, 4, 2, page), jnp.float32))
    ctx = CacheContext(cache, jnp.asarray([[0, 1], [2, 3]], jnp.int32), jnp.asarray([3, 6]), jnp.ones((b, 1), bool))
    x = jnp.asarray(rng.normal(size=(b, 1, d)), jnp.bfloat16)
    positions = jnp.asarray([[2], [5]], jnp.int32)
    opts = attention.Options(mla="interpret", moe="interpret", fused_cache_write=True)
    assert attention.latent_write_mode(cfg, cache, x, opts) == "interpret"
    assert quant.linear_partials(x, p["kv_a"], opts).shape == (2, 16, c + r)  # a 16-row token block
    got = attention.write_new_latents(p, cfg, x, positions, ctx, 1, opts)
    monkeypatch.setattr(attention, "linear_partials", lambda *a, **k: None)
    want = attention.write_new_latents(p, cfg, x, positions, ctx, 1, opts)
    assert (np.asarray(want.kv) != 0).any(-1).sum() == b
    np.testing.assert_array_equal(got.kv, want.kv)
    np.testing.assert_array_equal(got.scale, want.scale)


def test_applies_to_decode_tokens_in_bf16_and_caches_it_addresses():
    """Decode tokens in bf16, and an int8 cache up to 2 GiB or over 4 GiB: in between, the lowering's signed 32-bit
    element offsets would wrap (V2-Lite's 27 layers of 2,432 pages of 64 tokens are 2.4 GiB)."""
    assert applies(64, 512, 64, jnp.bfloat16) and applies(1024, 512, 64, jnp.bfloat16)
    assert not applies(1025, 512, 64, jnp.bfloat16)  # a prefill chunk
    assert not applies(64, 512, 64, jnp.float32) and not applies(64, 96, 64, jnp.bfloat16)
    v2_lite = 27 * 2432 * 64 * 576
    assert applies(64, 512, 64, jnp.bfloat16, 2**31) and applies(64, 512, 64, jnp.bfloat16, 2**32 + 1)
    assert not applies(64, 512, 64, jnp.bfloat16, v2_lite) and not applies(64, 512, 64, jnp.bfloat16, 2**32)
    spec = jax.ShapeDtypeStruct
    kv, weight, rope = spec((1, 1, 576), jnp.bfloat16), spec((1, 512), jnp.bfloat16), spec((1, 1, 32), jnp.float32)
    rows, valid, table = spec((1, 1), jnp.int32), spec((1, 1), bool), spec((1, 38), jnp.int32)

    def write(cache, scale, kv, weight, cos, sin, positions, valid, table):
        return write_latents(
            cache, scale, 0, kv, weight, 0, (cos, sin), positions, valid, table, eps=1e-6, interleave=True
        )

    with pytest.raises(ValueError, match="4 GiB"):  # V2-Lite's cache at 64 slots and 2k context
        cache, scale = spec((27, 2432, 64, 576), jnp.int8), spec((27, 2432, 2, 64), jnp.float32)
        jax.eval_shape(write, cache, scale, kv, weight, rope, rope, rows, valid, table)


@pytest.mark.parametrize("splits", [None, 4])
def test_lowers_for_hopper(splits):
    """The kernel lowers for sm_90 at V2-Lite's decode shapes, into a cache of 4.8 GiB (64-bit offsets), with IEEE
    division: from the bf16 projection, and from kv_a's four split-K partials."""
    from pallas_kernels.cross_lower import lower_triton_for_hopper

    spec = jax.ShapeDtypeStruct
    b, c, r = 64, 512, 64

    def step(kv_cache, scale, kv, weight, cos, sin, positions, valid, page_table):
        return write_latents(
            kv_cache, scale, 3, kv, weight, 2, (cos, sin), positions, valid, page_table, eps=1e-6, interleave=True
        )

    kv = spec((b, 1, c + r), jnp.bfloat16) if splits is None else spec((splits, b, c + r), jnp.float32)
    text = lower_triton_for_hopper(
        step,
        spec((27, 4864, 64, c + r), jnp.int8),
        spec((27, 4864, 2, 64), jnp.float32),
        kv,
        spec((26, c), jnp.bfloat16),
        spec((b, 1, r // 2), jnp.float32),
        spec((b, 1, r // 2), jnp.float32),
        spec((b, 1), jnp.int32),
        spec((b, 1), jnp.bool_),
        spec((b, 38), jnp.int32),
    )
    assert "latent_write" in text and "div.rn.f32" in text


def test_a_decode_step_writes_its_latents_on_the_kernel(monkeypatch):
    """A cached decode step of a bf16 model over an int8 cache (model.hidden_states, absorbed) with its latents
    written by the kernel (one launch in each layer loop's body, the kv_a norm read in place from its stack) leaves
    the cache and the hidden states the step through project_kv and cache.write leaves (XLA compiling both without
    excess precision); a float32 model, or a bf16 cache, keeps XLA's write."""
    from hcfjax import attention, model
    from hcfjax.attention import CacheContext
    from hcfjax.random_model import preset_config, random_model
    from tests.conftest import jaxpr_eqns, jit_as_eager

    m = random_model(preset_config("tiny-v3"), dtype=jnp.bfloat16)
    cfg, b, pages, page = m.cfg, 3, 2, 4
    table = jnp.asarray(np.random.default_rng(1).permutation(b * pages).reshape(b, pages), jnp.int32)
    cache = kvcache.init_cache(cfg, b * pages, page, jnp.int8)
    ids = jnp.asarray(np.random.default_rng(2).integers(0, cfg.vocab_size, (b, 6)), jnp.int32)
    prefill = CacheContext(cache, table, jnp.full((b,), 5), jnp.ones((b, 5), bool))
    _, ctx = model.hidden_states(m.params, cfg, ids[:, :5], jnp.broadcast_to(jnp.arange(5), (b, 5)), prefill)
    ctx = CacheContext(ctx.cache, table, jnp.asarray([6, 6, 5]), jnp.asarray([[True], [True], [False]]))
    positions = jnp.full((b, 1), 5, jnp.int32)

    def step(mode):
        monkeypatch.setattr(attention, "latent_write_mode", lambda *a, **k: mode)
        fwd = lambda p, c: model.hidden_states(p, cfg, ids[:, 5:], positions, c, absorbed=True)  # noqa: E731
        jitted = jit_as_eager(fwd)
        eqns = [e for e, _ in jaxpr_eqns(jitted.trace(m.params, ctx).jaxpr.jaxpr)]
        names = [e.params.get("name") for e in eqns]
        stacks = [e for e in eqns if e.primitive.name == "concatenate" and e.outvars[0].aval.shape == (2,)]
        assert not stacks  # the layer and the norm's row go in apart (a stack of them is a launch each layer)
        h, out = jitted(m.params, ctx)
        return np.asarray(h, np.float32), out.cache, names.count("latent_write")

    h, got, launches = step("interpret")
    want_h, want, none = step("reference")
    assert (launches, none) == (2, 0)  # the dense layer's loop and the MoE layers' loop
    assert (np.asarray(got.kv) != np.asarray(ctx.cache.kv)).any(-1).sum() == 2 * cfg.num_hidden_layers  # 2 rows
    np.testing.assert_array_equal(got.kv, want.kv)
    np.testing.assert_array_equal(got.scale, want.scale)
    np.testing.assert_array_equal(h, want_h)
    monkeypatch.undo()
    x = jnp.zeros((b, 1, cfg.hidden_size), jnp.bfloat16)
    interpret = attention.Options(mla="interpret", fused_cache_write=True)
    assert attention.latent_write_mode(cfg, cache, x, interpret) == "interpret"
    assert attention.latent_write_mode(cfg, cache, x, attention.Options(mla="interpret")) == "reference"  # CPU
    assert attention.latent_write_mode(cfg, cache, x.astype(jnp.float32), interpret) == "reference"
    bf16_cache = kvcache.init_cache(cfg, 2, page, jnp.bfloat16)
    assert attention.latent_write_mode(cfg, bf16_cache, x, interpret) == "reference"
    assert attention.latent_write_mode(cfg, cache, x, attention.Options()) == "reference"  # auto: GPUs only
    from hcfjax.kernels import kernels_in_use  # what `serve` and the benchmarks say a decode step runs

    said = kernels_in_use(cfg, m.params, jnp.int8, page, interpret, cache.kv.shape)
    assert said.endswith(", Pallas cache writes")
    wraps = (27, 2432, 64, 576)  # a 2.4 GiB cache: XLA writes it
    assert "cache writes" not in kernels_in_use(cfg, m.params, jnp.int8, page, interpret, wraps)
    assert "cache writes" not in kernels_in_use(cfg, m.params, jnp.int8, page, attention.Options(mla="interpret"))
