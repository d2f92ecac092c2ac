"""Lowering a Mosaic GPU or Pallas Triton kernel for a Hopper GPU on any host, to catch lowering errors without a GPU.

Mosaic GPU lowers (layout inference and the shared-memory size check included: without a device to ask, it assumes
Hopper's 227 KiB) on a CPU-only jaxlib; only the target architecture has to be given, since there is no GPU to infer
it from. Pallas's Triton lowering takes the GPU from an abstract mesh's device. Compiling to a cubin and running
still need the GPU.
"""

from __future__ import annotations

import contextlib

import jax
from jax._src import config as jax_config

_trace_only = jax_config.bool_state(
    "hcfjax_kernel_trace_only",
    False,
    "pallas_kernels.cross_lower.trace_for_hopper: kernels traced into the program, none lowered",
    include_in_trace_context=True,  # such a trace is never reused for a program to run
)


@contextlib.contextmanager
def target_arch(arch: tuple[int, int]):
    """Within: Mosaic GPU lowers for compute capability `arch` (major, minor) whatever the host has."""
    from jax.experimental.mosaic.gpu import utils

    saved = utils._infer_arch
    utils._infer_arch = lambda: arch
    try:
        yield
    finally:
        utils._infer_arch = saved


def hopper_arch():
    """Within: Mosaic GPU lowers for sm_90 (H100/H200)."""
    return target_arch((9, 0))


def lower_for_hopper(fn, *args) -> str:
    """The StableHLO text of fn(*args) lowered for CUDA on sm_90; args may be jax.ShapeDtypeStructs. Raises the
    lowering's error (e.g. a layout Mosaic cannot infer, an op it does not support, smem over 227 KiB)."""
    with hopper_arch():
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def lower_triton_for_hopper(fn, *args) -> str:
    """lower_for_hopper for Pallas Triton kernels: the GPU is an abstract H200 (a mesh's abstract device, which the
    Mosaic GPU lowering does not take)."""
    h200 = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=None, platform="cuda")
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",), abstract_device=h200)):
        return lower_for_hopper(fn, *args)


def trace_for_hopper(fn, *args) -> None:
    """Traces fn(*args) as for sm_90 without lowering it: the kernels' Python bodies run (their pipelines and
    block shapes are built), in a tenth of the time of lower_for_hopper, which also runs Mosaic's lowering. Within,
    pallas_kernels.lowering_cache lowers nothing either (`trace_only`)."""
    with hopper_arch(), _trace_only(True):
        jax.jit(fn).trace(*args)


def trace_only() -> bool:
    """Whether this is trace_for_hopper's trace, where a kernel launch traces its kernel into the program."""
    return _trace_only.value
