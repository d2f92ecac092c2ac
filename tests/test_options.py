"""Options (hcfjax/options.py): read from the HCFJAX_* environment by the CLI, and the compiler options they
become."""

import pytest


def test_options_from_the_environment():
    """Only the CLI reads HCFJAX_* variables, into Options; a bad value names its variable."""
    from hcfjax.options import Options

    env = {"HCFJAX_MLA": "kernel", "HCFJAX_MLA_QK8": "1", "HCFJAX_INT4_KERNEL": "0", "HCFJAX_EP_EXCHANGE": "ragged"}
    got = Options.from_env({**env, "HCFJAX_PREFILL_ATTENTION": "fused", "HCFJAX_MLA_CONVERTERS": "0"}, two_rows=False)
    want = ("kernel", True, "reference", "ragged", False, "fused", False)
    assert (got.mla, got.mla_qk8, got.moe, got.ep_exchange, got.two_rows, got.prefill_attention) == want[:6]
    assert got.mla_converters is want[6] and Options().mla_converters is True
    assert Options().prefill_attention_mode() == "blocked"  # auto: fused on GPUs only
    assert Options.from_env({}) == Options() and hash(Options.from_env({})) == hash(Options())
    with pytest.raises(ValueError, match="HCFJAX_MLA_QK8"):
        Options.from_env({"HCFJAX_MLA_QK8": "yes"})
    with pytest.raises(ValueError, match="HCFJAX_MLA"):
        Options.from_env({"HCFJAX_MLA": "bogus"})
    with pytest.raises(ValueError, match="HCFJAX_PREFILL_ATTENTION"):
        Options.from_env({"HCFJAX_PREFILL_ATTENTION": "flash"})
    assert Options.from_env({"HCFJAX_XLA_GEMM": "triton"}).xla_gemm == "triton"
    with pytest.raises(ValueError, match="HCFJAX_XLA_GEMM"):
        Options.from_env({"HCFJAX_XLA_GEMM": "cutlass"})


def test_xla_gemm_compiler_options(monkeypatch):
    """Options.xla_gemm becomes a GPU compiler option: auto takes cuBLAS for decode-only programs only; no option on
    other backends, whatever it says."""
    from hcfjax import options
    from hcfjax.options import Options

    assert Options(xla_gemm="cublas").compiler_options() == Options().compiler_options() == ()
    assert Options(xla_gemm="cublas").xla_gemm_mode() == "default"
    monkeypatch.setattr(options, "on_gpu", lambda: True)
    cublas = (("xla_gpu_enable_triton_gemm", False),)
    got = {
        g: (Options(xla_gemm=g).compiler_options(), Options(xla_gemm=g).compiler_options(prefill=True))
        for g in ("auto", "cublas", "triton")
    }
    assert got == {"auto": (cublas, ()), "cublas": (cublas, cublas), "triton": ((), ())}
    assert [Options().xla_gemm_mode(), Options().xla_gemm_mode(prefill=True)] == ["cublas", "default"]
    with pytest.raises(ValueError, match="xla_gemm"):
        Options(xla_gemm="cutlass")


def test_fused_routing_is_on_for_gpus_unless_turned_off(monkeypatch):
    """Options.fused_routing: auto routes a decode step on its kernels on GPUs only; HCFJAX_FUSED_ROUTING=0 turns
    it off there, =1 on anywhere; a value other than auto, True or False is refused."""
    from hcfjax import moe, options
    from hcfjax.options import Options

    assert Options().fused_routing == "auto" and not Options().on("fused_routing")
    assert Options.from_env({"HCFJAX_FUSED_ROUTING": "1"}).on("fused_routing")
    monkeypatch.setattr(options, "on_gpu", lambda: True)
    assert Options().on("fused_routing") and not Options.from_env({"HCFJAX_FUSED_ROUTING": "0"}).on("fused_routing")
    assert moe.route_mode(64, 64, Options()) == "kernel"
    assert moe.route_mode(64, 64, Options.from_env({"HCFJAX_INT4_KERNEL": "0"})) == "reference"  # XLA's experts
    with pytest.raises(ValueError, match="fused_routing"):
        Options(fused_routing="yes")


def test_fused_cache_write_is_on_for_gpus_unless_turned_off(monkeypatch):
    """Options.fused_cache_write: auto is on for GPUs and off elsewhere; HCFJAX_FUSED_CACHE_WRITE=1 writes a decode
    step's latents into an int8 cache on the kernel, in the MLA kernels' mode, =0 on XLA; other values are
    refused."""
    import jax.numpy as jnp

    from hcfjax import attention, options
    from hcfjax import cache as kvcache
    from hcfjax.options import Options
    from hcfjax.random_model import preset_config

    cfg = preset_config("tiny-v3")
    cache, x = kvcache.init_cache(cfg, 2, 4, jnp.int8), jnp.zeros((2, 1, cfg.hidden_size), jnp.bfloat16)
    assert attention.latent_write_mode(cfg, cache, x, Options()) == "reference"
    forced = Options.from_env({"HCFJAX_FUSED_CACHE_WRITE": "1", "HCFJAX_MLA": "interpret"})
    assert attention.latent_write_mode(cfg, cache, x, forced) == "interpret"
    monkeypatch.setattr(options, "on_gpu", lambda: True)
    assert attention.latent_write_mode(cfg, cache, x, Options()) == "kernel"
    off = Options.from_env({"HCFJAX_FUSED_CACHE_WRITE": "0"})
    assert attention.latent_write_mode(cfg, cache, x, off) == "reference"
    with pytest.raises(ValueError, match="HCFJAX_FUSED_CACHE_WRITE"):
        Options.from_env({"HCFJAX_FUSED_CACHE_WRITE": "yes"})


def test_unroll_decode_takes_a_layer_count(monkeypatch):
    """Options.unroll_decode: one layer an iteration on a CPU and two on a GPU unless asked; True unrolls every
    layer, an int n runs n layers an iteration; HCFJAX_UNROLL_DECODE takes auto, all or n; zero, negative and other
    values are refused."""
    from hcfjax import options
    from hcfjax.options import Options

    assert [Options().decode_unroll(), Options(unroll_decode=True).decode_unroll()] == [1, True]
    assert [Options(unroll_decode=False).decode_unroll(), Options(unroll_decode=3).decode_unroll()] == [1, 3]
    env = [Options.from_env({"HCFJAX_UNROLL_DECODE": v}).decode_unroll() for v in ("auto", "all", "1", "2")]
    assert env == [1, True, 1, 2]
    for bad in (0, -1, 2.0, "on"):
        with pytest.raises(ValueError, match="unroll_decode"):
            Options(unroll_decode=bad)
    with pytest.raises(ValueError, match="not an on/off switch"):
        Options().on("unroll_decode")  # a layer count: decode_unroll() says it
    monkeypatch.setattr(options, "on_gpu", lambda: True)
    assert [Options().decode_unroll(), Options(unroll_decode=False).decode_unroll()] == [2, 1]
    assert Options.from_env({"HCFJAX_UNROLL_DECODE": "1"}).decode_unroll() == 1
    with pytest.raises(ValueError, match="HCFJAX_UNROLL_DECODE"):
        Options.from_env({"HCFJAX_UNROLL_DECODE": "0"})
