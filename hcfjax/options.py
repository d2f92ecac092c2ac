"""How the model runs, as opposed to what it computes: kernel or reference per op, the kernels' variants, the EP
exchange, the shape of the decode loop and the library behind XLA's own products.

One frozen, hashable object is passed down explicitly to every traced function that branches on it, so it is part
of every jit cache key (a static argument). Library code never reads the environment; the CLI builds Options from
its flags and from HCFJAX_* variables (`Options.from_env`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import jax

KERNEL_MODES = ("auto", "kernel", "interpret", "reference")
SWITCH = ("auto", True, False)  # the values a switch takes
SWITCHES = (
    "two_rows",
    "branch_free_sampling",
    "sort_free_routing",
    "fused_routing",
    "fused_cache_write",
)
# A GPU decode step's layers a loop iteration under unroll_decode=auto.
DECODE_LAYERS_ON_GPUS = 2
# The switches auto turns on on GPUs.
ON_GPUS = ("two_rows", "branch_free_sampling", "sort_free_routing", "fused_routing", "fused_cache_write")
EXCHANGES = ("dense", "ragged")
INT4_ACTS = ("bf16", "int8")
PREFILL_ATTENTION = ("auto", "fused", "blocked")
XLA_GEMMS = ("auto", "cublas", "triton")
CUBLAS_GEMMS = (("xla_gpu_enable_triton_gemm", False),)  # the compiler options that put XLA's products on cuBLAS


@dataclasses.dataclass(frozen=True)
class Options:
    """mla: the absorbed decode attention over the paged cache; auto runs the Pallas kernel on a GPU where the shapes
        suit it, else the jnp reference; kernel / interpret force the kernel (interpret: Mosaic GPU's interpreter).
    mla_qk8: the MLA kernel's Q.K over an int8 cache on the int8 tensor cores, the queries quantised per head (faster
        on long rows, less exact: opt-in).
    mla_pair: the MLA kernel's multicasting CTA pairs where the padded head count is a multiple of 128.
    mla_converters: the MLA kernel's two converter warpgroups where it runs an int8 cache in transposed tiles of one
        query token (16 heads; pallas_kernels.mla_kernel.KernelSpec.converters; mla_decode.converters_apply).
    moe: the GEMM kernels: the int4 experts (w4a16, w4a8), fp8 block-scaled weights (experts and dense linears,
        pallas_kernels/moe_fp8.py) and the dense int8 per-channel linears of w4a8c8 / w8a8 (the latter only where
        their shapes suit the kernel, `quant.int8_kernel_mode`): auto / kernel / interpret / reference, as for mla.
    int4_digits: w4a16 with few rows per expert runs as two int8 digits on the w4a8 kernel where that pays.
    fused_gate_up: the int4 activation modes whose gate/up + SiLU run as one fused kernel (else two kernel calls);
        w4a16 still runs fused where its int8 digits pay.
    grouped_down_input: w4a8 / w8a8 experts take the down projection's input quantised per row and 128 channels,
        written by the fused gate/up kernel where that pays (DeepSeek-V3's activation grouping), instead of per row.
    ep_exchange: how the decode plan moves routed tokens between ranks: dense (fixed-capacity all_to_all, runs
        everywhere) or ragged (lax.ragged_all_to_all of the real rows; GPU only).
    unroll_decode: decode forwards run several layers a loop iteration, or unroll the loop (True). Each iteration
        is a CUDA graph that the host updates before it runs (its layer's weights sit at a new offset): two layers
        an iteration halve the updates, the host's dispatch and the GPU's idle at the boundaries. Each layer of an
        iteration compiles its kernels apart (the whole loop unrolled: about five times a V2-Lite step's compile
        time). An int n >= 1 runs n layers an iteration. auto: two on GPUs (DECODE_LAYERS_ON_GPUS), one elsewhere.
    prefill_attention: a prefill chunk's attention over the paged cache: fused (jax.nn.dot_product_attention calls
        that keep the scores on chip: cuDNN's flash attention on a GPU, XLA's elsewhere; the chunk's own keys
        causally, then the cached ones a block at a time), blocked (jnp, an online softmax over 512-key blocks whose
        scores go through memory), or auto: fused on GPUs.
    two_rows: a one-token decode forward runs as the row and a copy of it that writes nothing: on GPUs XLA lowers a
        one-row product to a slow multiply-and-reduce, two rows to a GEMM. auto: on GPUs.
    branch_free_sampling: sampling filters and draws for every row and then selects, instead of skipping the draw
        for an all-greedy batch and the filters' sort when no row filters by a `lax.cond`: XLA's GPU runtime runs a
        conditional by reading its predicate back to the host and waiting for the stream, so a step with one returns
        from its dispatch only when the GPU is nearly done, and a server cannot prepare the next step meanwhile.
        The sort is skipped on the host's word instead: a batch that says no row filters (SamplingBatch.filters)
        traces a step without it, and the engine keeps a decode program of each kind.
        auto: on GPUs (on a CPU the branch costs nothing and the skipped sort a lot).
    sort_free_routing: a step's expert copies (up to moe.PAIRWISE_SORT_MAX) are put in expert order without a sort:
        each copy's position counted pairwise in one [M, M] reduction, where a GPU sort is several kernels of tens of
        microseconds a layer. auto: on GPUs (a CPU sorts a few thousand copies in a fiftieth of the comparisons'
        time).
    fused_routing: a decode step's routing (scores, top-k, the copies' expert order and their int8 rows) on two
        Pallas kernels (pallas_kernels/moe_route.py) where the GEMM kernels run, instead of XLA's dozen small
        kernels: fewer launches, and faster together (docs/kernels.md, "Routing on two kernels"). auto: on GPUs
        (a CPU runs the kernels only in Pallas's interpreter).
    fused_cache_write: a decode step over an int8 cache writes its new latents (the kv_a norm, the rope, the
        quantisation, the paged stores) on one Pallas kernel (pallas_kernels/latent_write.py) where the MLA kernel
        runs, instead of XLA's six kernels a layer (docs/kernels.md, "Cache entries in one kernel"), in caches the
        kernel's offsets address (up to 2 GiB or over 4 GiB; `latent_write.addressable`). auto: on GPUs.
    xla_gemm: the library behind XLA's own matrix products on GPUs (the projections the Pallas kernels do not run):
        cublas, or triton (XLA's default: Triton GEMM fusions). Inside the layer loop a product reads its layer's
        weight out of the stacked array: cuBLAS takes that slice where it lies (XLA's dynamic-slice fusion), a
        Triton fusion only after a copy of it, and the copies of every dense weight cost about a tenth of a
        V2-Lite decode step. auto: cublas for decode-only programs, XLA's default for those with a prefill part
        (whose products are large enough that the copies matter little). A jit compiler option
        (`compiler_options`), not a traced branch.
    """

    mla: str = "auto"
    mla_qk8: bool = False
    mla_pair: bool = True
    mla_converters: bool = True
    moe: str = "auto"
    int4_digits: bool = True
    fused_gate_up: tuple[str, ...] = ("int8",)
    grouped_down_input: bool = True
    ep_exchange: str = "dense"
    unroll_decode: bool | str | int = "auto"
    two_rows: bool | str = "auto"
    prefill_attention: str = "auto"
    branch_free_sampling: bool | str = "auto"
    sort_free_routing: bool | str = "auto"
    fused_routing: bool | str = "auto"
    fused_cache_write: bool | str = "auto"
    xla_gemm: str = "auto"

    def __post_init__(self):
        for name in ("mla", "moe"):
            if getattr(self, name) not in KERNEL_MODES:
                raise ValueError(f"Options.{name} must be one of {KERNEL_MODES}, got {getattr(self, name)!r}")
        for name in SWITCHES:
            value = getattr(self, name)
            if value not in SWITCH or type(value) is int:
                raise ValueError(f"Options.{name} must be auto, True or False, got {value!r}")
        u = self.unroll_decode
        if not (u >= 1 if type(u) is int else u in SWITCH):
            raise ValueError(f"Options.unroll_decode must be auto, True, False or a number of layers (>= 1), got {u!r}")
        if self.prefill_attention not in PREFILL_ATTENTION:
            raise ValueError(
                f"Options.prefill_attention must be one of {PREFILL_ATTENTION}, got {self.prefill_attention!r}"
            )
        if self.xla_gemm not in XLA_GEMMS:
            raise ValueError(f"Options.xla_gemm must be one of {XLA_GEMMS}, got {self.xla_gemm!r}")
        if self.ep_exchange not in EXCHANGES:
            raise ValueError(f"Options.ep_exchange must be one of {EXCHANGES}, got {self.ep_exchange!r}")
        if not set(self.fused_gate_up) <= set(INT4_ACTS):
            raise ValueError(f"Options.fused_gate_up takes activation modes of {INT4_ACTS}, got {self.fused_gate_up}")
        object.__setattr__(self, "fused_gate_up", tuple(sorted(set(self.fused_gate_up))))

    def mode(self, op: str, applies: bool = True) -> str:
        """The one kernel-or-reference selector: 'kernel', 'interpret' or 'reference' for op ('mla' or 'moe') where
        the kernel `applies` to the shapes at hand. auto takes the kernel on a GPU where it applies; a forced kernel
        mode stands (the kernel's wrapper then rejects shapes it does not support, with the reason)."""
        mode = getattr(self, op)
        if mode == "auto":
            return "kernel" if applies and on_gpu() else "reference"
        return mode

    def on(self, switch: str) -> bool:
        """One of SWITCHES resolved for this backend (auto: on for those of ON_GPUS on a GPU, else off)."""
        if switch not in SWITCHES:
            raise ValueError(f"{switch!r} is not an on/off switch of Options ({', '.join(SWITCHES)})")
        value = getattr(self, switch)
        if value == "auto":
            return switch in ON_GPUS and on_gpu()
        return bool(value)

    def decode_unroll(self) -> int | bool:
        """A decode forward's layers a loop iteration (model.run_layers' unroll): True (every layer, no loop), or a
        number of layers."""
        value = self.unroll_decode
        if type(value) is int:
            return value
        if value == "auto":
            return DECODE_LAYERS_ON_GPUS if on_gpu() else 1
        return True if value else 1

    def prefill_attention_mode(self) -> str:
        """prefill_attention resolved for this backend: 'fused' or 'blocked'."""
        if self.prefill_attention == "auto":
            return "fused" if on_gpu() else "blocked"
        return self.prefill_attention

    def xla_gemm_mode(self, prefill: bool = False) -> str:
        """xla_gemm resolved for a program with a prefill part or decode only: 'cublas', or 'default' (XLA's own
        choice: Triton GEMM fusions on GPUs; always, on other backends)."""
        cublas = self.xla_gemm == "cublas" or (self.xla_gemm == "auto" and not prefill)
        return "cublas" if cublas and on_gpu() else "default"

    def compiler_options(self, prefill: bool = False) -> tuple[tuple[str, object], ...]:
        """XLA compiler options for a program run with these options, with a prefill part or decode only
        (jax.jit's compiler_options, as sorted items so that they can key a cache)."""
        return CUBLAS_GEMMS if self.xla_gemm_mode(prefill) == "cublas" else ()

    def replace(self, **changes) -> Options:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_env(cls, environ: Mapping[str, str], **overrides) -> Options:
        """Options from HCFJAX_* variables (for the CLI and benchmark scripts; library code takes Options):
        HCFJAX_MLA=auto|kernel|interpret|reference, HCFJAX_MLA_QK8=0|1, HCFJAX_MLA_CONVERTERS=0|1,
        HCFJAX_INT4_KERNEL=0|1 (0: reference experts and fp8 linears), HCFJAX_INT4_DIGITS=0|1, HCFJAX_FUSED_ROUTING=0|1,
        HCFJAX_FUSED_CACHE_WRITE=0|1, HCFJAX_EP_EXCHANGE=dense|ragged, HCFJAX_PREFILL_ATTENTION=auto|fused|blocked,
        HCFJAX_XLA_GEMM=auto|cublas|triton, HCFJAX_UNROLL_DECODE=auto|all|N (N layers a loop iteration). overrides
        win over the environment."""
        got, source = {}, {}
        if "HCFJAX_MLA" in environ:
            got["mla"], source["mla"] = environ["HCFJAX_MLA"], "HCFJAX_MLA"
        flags = (
            ("HCFJAX_MLA_QK8", "mla_qk8"),
            ("HCFJAX_MLA_CONVERTERS", "mla_converters"),
            ("HCFJAX_INT4_DIGITS", "int4_digits"),
            ("HCFJAX_FUSED_ROUTING", "fused_routing"),
            ("HCFJAX_FUSED_CACHE_WRITE", "fused_cache_write"),
        )
        for var, name in flags:
            if var in environ:
                got[name], source[name] = _flag(var, environ[var]), var
        if "HCFJAX_INT4_KERNEL" in environ:
            on = _flag("HCFJAX_INT4_KERNEL", environ["HCFJAX_INT4_KERNEL"])
            got["moe"], source["moe"] = "auto" if on else "reference", "HCFJAX_INT4_KERNEL"
        if environ.get("HCFJAX_PREFILL_ATTENTION"):
            got["prefill_attention"] = environ["HCFJAX_PREFILL_ATTENTION"]
            source["prefill_attention"] = "HCFJAX_PREFILL_ATTENTION"
        if environ.get("HCFJAX_XLA_GEMM"):
            got["xla_gemm"], source["xla_gemm"] = environ["HCFJAX_XLA_GEMM"], "HCFJAX_XLA_GEMM"
        if environ.get("HCFJAX_UNROLL_DECODE"):
            v = environ["HCFJAX_UNROLL_DECODE"]
            got["unroll_decode"] = True if v == "all" else _layers(v)
            source["unroll_decode"] = "HCFJAX_UNROLL_DECODE"
        if environ.get("HCFJAX_EP_EXCHANGE"):
            got["ep_exchange"], source["ep_exchange"] = environ["HCFJAX_EP_EXCHANGE"], "HCFJAX_EP_EXCHANGE"
        try:
            return cls(**{**got, **overrides})
        except ValueError as e:
            named = ", ".join(f"{source[k]}={environ[source[k]]!r}" for k in got if k not in overrides)
            raise ValueError(f"{e} (from the environment: {named})" if named else str(e)) from e


def on_gpu() -> bool:
    return jax.default_backend() == "gpu"


def _flag(var: str, value: str) -> bool:
    if value not in ("0", "1"):
        raise ValueError(f"{var} must be 0 or 1, got {value!r}")
    return value == "1"


def _layers(value: str) -> int | str:
    """A positive layer count, else the text as given (auto, or a value Options refuses, naming it)."""
    return int(value) if value.isdigit() and int(value) >= 1 else value


DEFAULT = Options()
