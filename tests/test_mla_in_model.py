"""How the model reaches the MLA decode kernel (hcfjax.attention's absorbed decode): which mode Options selects, which
of the kernel's switches reach it for which heads, tokens and caches, and a 2-layer model's decode step with the
kernel in Mosaic GPU's interpreter against the reference path (tests/test_mla_kernel.py tests the kernel alone)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hcfjax import cache as kvcache
from pallas_kernels import mla_decode as M
from tests.test_mla_kernel import PAGE, rel

pytestmark = pytest.mark.usefixtures("reset_interpreter")


def test_selection_uses_the_reference_off_gpu():
    """Options.mode, the one selector: auto is the reference off a GPU (and where the kernel does not apply),
    a forced mode stands; the model's absorbed attention follows it (interpret runs the kernel)."""
    from hcfjax.attention import decode_mode
    from hcfjax.options import Options
    from hcfjax.random_model import preset_config

    assert Options().mode("mla", True) == "reference" and Options(mla="kernel").mode("mla", False) == "kernel"
    with pytest.raises(ValueError, match="Options.mla"):
        Options(mla="bogus")
    cfg = preset_config("tiny-v3", kv_lora_rank=128, qk_rope_head_dim=64)
    cache = kvcache.KVCache(jnp.zeros((1, 4, PAGE, 192), jnp.bfloat16))
    pt, lengths = jnp.zeros((2, 2), jnp.int32), jnp.ones(2, jnp.int32)
    assert decode_mode(cfg, cache, pt, lengths, (2, 1), Options()) == "reference"
    assert decode_mode(cfg, cache, pt, lengths, (2, 1), Options(mla="interpret")) == "interpret"


def test_qk8_and_converter_switches_reach_the_kernel_where_they_apply(monkeypatch):
    """Options.mla_qk8 reaches the kernel over an int8 cache only; Options.mla_converters over an int8 cache whose
    heads run in transposed tiles of one query token only (16 heads, not 64; not with qk8; not two tokens)."""
    from hcfjax import attention
    from hcfjax.attention import CacheContext
    from hcfjax.options import Options
    from hcfjax.random_model import preset_config, random_model

    seen = []

    def fake_kernel(q_lat, q_pe, *a, **k):  # records what it is asked for; an output of the kernel's shape
        seen.append((k["qk8"], k["converters"]))
        assert k["heads_first"] and q_lat.shape[:3] == (q_pe.shape[2],) + q_pe.shape[:2]
        return jnp.moveaxis(q_lat, 0, 2)

    monkeypatch.setattr(attention, "mla_decode", fake_kernel)
    cases = [  # (heads, tokens, qk8, converters, cache dtype) -> what the kernel is asked for
        ((16, 1, True, False, jnp.int8), (True, False)),
        ((16, 1, True, False, jnp.bfloat16), (False, False)),
        ((16, 1, False, False, jnp.int8), (False, False)),
        ((16, 1, False, True, jnp.int8), (False, True)),
        ((16, 2, False, True, jnp.int8), (False, False)),
        ((16, 1, False, True, jnp.bfloat16), (False, False)),
        ((16, 1, True, True, jnp.int8), (True, False)),
        ((64, 1, False, True, jnp.int8), (False, False)),
    ]
    for (heads, t, qk8, conv, dtype), want in cases:
        cfg = preset_config("tiny-v3", num_hidden_layers=1, kv_lora_rank=128, qk_rope_head_dim=64)
        cfg = dataclasses.replace(cfg, num_attention_heads=heads)
        layer = lambda cfg=cfg: jax.tree.map(lambda a: a[0], random_model(cfg, 3, jnp.bfloat16).params["segments"][0])
        p = jax.eval_shape(layer)["attn"]
        q_nope = jnp.zeros((1, t, heads, cfg.qk_nope_head_dim), jnp.bfloat16)
        q_pe = jnp.zeros((1, t, heads, cfg.qk_rope_head_dim), jnp.bfloat16)
        cache = kvcache.init_cache(cfg, 2, PAGE, dtype, num_layers=1)
        ctx = CacheContext(cache, jnp.zeros((1, 2), jnp.int32), jnp.ones(1, jnp.int32), jnp.ones((1, t), bool))
        opts = Options(mla="kernel", mla_qk8=qk8, mla_converters=conv)
        # traced only: what the kernel is asked for is decided while tracing, and nothing need compile
        pos = jnp.zeros((1, t), jnp.int32)
        attend = functools.partial(attention.attend_absorbed_paged, cfg=cfg, layer=0, positions=pos, opts=opts)
        jax.eval_shape(attend, p, q_nope=q_nope, q_pe=q_pe, ctx=ctx)
        assert seen.pop() == want, (heads, t, qk8, conv, dtype)


@pytest.fixture(scope="module")
def two_layer_model():
    """(cfg, model) of a random 2-layer tiny-v3 in bf16 (C=128, R=64), made once for the cases that read it."""
    from hcfjax.random_model import preset_config, random_model

    cfg = preset_config("tiny-v3", num_hidden_layers=2, kv_lora_rank=128, qk_rope_head_dim=64)
    return cfg, random_model(cfg, seed=3, dtype=jnp.bfloat16)


@pytest.mark.parametrize("int8", [False, True])
def test_model_decode_shares_one_plan_across_layers(monkeypatch, two_layer_model, int8):
    """A decode step of a 2-layer model (a dense and an MoE segment, so two scans) with the kernel in interpret mode:
    the forward builds one plan for both layers, leaves none behind, and gives the reference path's logits; also
    over an int8 cache, whose token-minor scales the kernel reads in place."""
    from hcfjax import attention
    from hcfjax.attention import CacheContext
    from hcfjax.model import hidden_states, logits
    from hcfjax.options import Options

    cfg, m = two_layer_model
    b, page, pages = 3, PAGE, 3
    kv = jax.random.normal(jax.random.key(5), (2, b * pages, page, 192), jnp.float32)
    if int8:
        entry, scales = kvcache.quantize_entry(kv[..., :128], kv[..., 128:])
        cache = kvcache.KVCache(entry, jnp.swapaxes(scales, -1, -2))  # [L, P, 2, page]
    else:
        cache = kvcache.KVCache(kv.astype(jnp.bfloat16))
    table = jnp.asarray(np.random.default_rng(2).permutation(b * pages).reshape(b, pages), jnp.int32)
    kv_len = jnp.array([1, 70, 190], jnp.int32)  # one token, mid-page, the last page's tail
    tok = jnp.array([[5], [9], [200]], jnp.int32)

    def step(mode):
        @jax.jit  # one compiled program, not one per op
        def forward(params, cache):
            ctx = CacheContext(cache, table, kv_len, jnp.ones((b, 1), bool))
            h, ctx = hidden_states(params, cfg, tok, (kv_len - 1)[:, None], ctx, absorbed=True, opts=Options(mla=mode))
            assert ctx.plan is None
            return logits(params, h[:, 0])

        return np.asarray(forward(m.params, cache), np.float32)

    calls = []
    counting = lambda f: lambda *a, **k: calls.append(1) or f(*a, **k)  # noqa: E731
    monkeypatch.setattr(attention, "mla_plan", counting(attention.mla_plan))
    monkeypatch.setattr(M, "mla_plan", counting(M.mla_plan))
    got = step("interpret")
    assert len(calls) == 1  # built once before the layers; neither layer built its own
    want = step("reference")
    assert len(calls) == 1  # the reference path builds none
    assert rel(got, want) < 2e-2
