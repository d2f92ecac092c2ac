"""GPU specs (public datasheets) and efficiency profiles (what fraction of them a software stack reaches).

Datasheet numbers are dense (no 2:4 sparsity). `nvlink_gbs` is the datasheet's total NVLink bandwidth per GPU (both
directions); one direction is half of it. `rdma_gbs` is one direction of the GPU's own NIC: HGX H800 / H20 / H200
servers pair each GPU with a 400 Gb/s ConnectX-7 (50 GB/s).

Sources: NVIDIA H100/H800 SXM datasheets (989 TFLOP/s bf16, 1979 TOP/s fp8/int8, 3.35 TB/s; NVLink 900 GB/s,
400 GB/s on the export-limited H800); NVIDIA H200 SXM datasheet (same compute, 141 GB HBM3e at 4.8 TB/s); NVIDIA
H20 datasheet (148 TFLOP/s bf16, 296 TOP/s fp8/int8, 96 GB HBM3 at 4.0 TB/s, NVLink 900 GB/s).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class GPU:
    name: str
    bf16_tflops: float
    int8_tops: float  # also fp8
    hbm_gb: float
    hbm_tbs: float
    nvlink_gbs: float  # total, both directions
    rdma_gbs: float = 50.0  # one direction, the GPU's NIC
    per_node: int = 8

    def flops(self, int8: bool) -> float:
        return (self.int8_tops if int8 else self.bf16_tflops) * 1e12

    @property
    def hbm_bytes_s(self) -> float:
        return self.hbm_tbs * 1e12

    @property
    def nvlink_bytes_s(self) -> float:
        """One direction."""
        return self.nvlink_gbs / 2 * 1e9

    @property
    def rdma_bytes_s(self) -> float:
        return self.rdma_gbs * 1e9


GPUS = {
    "H20": GPU("H20", 148, 296, 96, 4.0, 900),
    "H800": GPU("H800", 989, 1979, 80, 3.35, 400),
    "H100": GPU("H100", 989, 1979, 80, 3.35, 900),
    "H200": GPU("H200", 989, 1979, 141, 4.8, 900),
}


def gpu(name: str) -> GPU:
    if name not in GPUS:
        raise ValueError(f"unknown GPU {name!r} (known: {sorted(GPUS)})")
    return GPUS[name]


@dataclasses.dataclass(frozen=True)
class Efficiency:
    """Fractions of the datasheet a stack reaches, per kind of work, and fixed costs.

    gemm_*: dense linears (attention projections, dense MLPs, shared experts, LM head); moe_*: the routed experts'
    grouped GEMMs; attn_*: the attention core (MLA over the cache); each compute (of the tensor-core rate) and memory
    (of HBM bandwidth). nvlink / rdma: of one direction's bandwidth for all-to-all, all-reduce and KV transfer;
    comm_latency_s: fixed cost of one all-to-all call (dispatch or combine) or all-reduce. layer_overhead_s /
    step_overhead_s: launch and glue time per layer and per step that no roofline explains. host_dispatch_s: host
    time to plan and launch a step; host_process_s: host time to read back and stream a step's tokens (the engine
    overlaps them with the device, see instances.py). transfer_gbs / transfer_latency_s: a KV transfer link measured
    as a whole (GB/s, and fixed seconds per transfer), e.g. hcfjax's host-staged transports; transfer_gbs 0 means
    the GPU's NIC at `rdma` plus comm_latency_s."""

    gemm_compute: float = 0.7
    gemm_memory: float = 0.7
    moe_compute: float = 0.7
    moe_memory: float = 0.7
    attn_compute: float = 0.6
    attn_memory: float = 0.9
    nvlink: float = 0.8
    rdma: float = 0.9
    comm_latency_s: float = 30e-6
    layer_overhead_s: float = 0.0
    step_overhead_s: float = 0.0
    host_dispatch_s: float = 0.0
    host_process_s: float = 0.0
    transfer_gbs: float = 0.0
    transfer_latency_s: float = 0.0
    source: str = ""

    def replace(self, **kw) -> Efficiency:
        unknown = set(kw) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise ValueError(f"unknown efficiency fields {sorted(unknown)}")
        return dataclasses.replace(self, **kw)


# DeepSeek's open kernels, from their READMEs (all measured on H800 SXM5):
# - FlashMLA: 3000 GB/s memory-bound (0.90 of 3.35 TB/s), 580 TFLOP/s compute-bound (0.59 of 989; 660 after the
#   2025-04 update, 0.67).
# - DeepGEMM: up to 1550 TFLOP/s fp8 (0.78 of 1979). Memory-bound GEMMs (decode, few tokens per expert) are not
#   quoted as one number; 0.7 is an assumption.
# - DeepEP: normal kernels 153-158 GB/s over NVLink (0.77-0.79 of one direction's 200 GB/s) and 43-58 GB/s over
#   RDMA (about 0.9 of 50 GB/s). Low-latency kernels at 128 tokens/rank, EP16: dispatch 118 us, combine 195 us;
#   a 40 us fixed latency with rdma 0.9 gives 106 + 172 us (tests/test_sim_cost.py checks the sum within 15%).
DEEPSEEK_KERNELS = Efficiency(
    gemm_compute=0.78,
    gemm_memory=0.7,
    moe_compute=0.78,
    moe_memory=0.7,
    attn_compute=0.62,
    attn_memory=0.9,
    nvlink=0.78,
    rdma=0.9,
    comm_latency_s=40e-6,
    layer_overhead_s=20e-6,  # CUDA graphs: a few us of launch gaps per layer (assumed)
    step_overhead_s=1e-3,  # sampling, MTP bookkeeping, the DP all-reduce of batch sizes (assumed)
    source="DeepSeek FlashMLA / DeepGEMM / DeepEP READMEs (H800); gemm memory, overheads assumed",
)

# This project on the H200 (docs/results.md):
# XLA bf16 matmul 596 TFLOP/s (0.60 of 989), XLA int8 matmul 806 TOP/s (0.41 of 1979), torch copy 4.13 TB/s (0.86
# of 4.8); the XLA MLA decode reference at 128 x 4096 bf16: 322 GB/s (0.067) and 78 TFLOP/s (0.079). The routed
# experts (XLA ragged_dot) and the per-layer overhead are not measured alone (docs/results.md: a batch-1 decode step
# takes 25 ms against a 1.2 ms floor), so this profile predicts the engine too fast; `python -m
# hcfjax.bench.sim_validate` fits every factor to the engine's step times on a device and writes a profile JSON.
HCFJAX_XLA_H200_MICRO = Efficiency(
    gemm_compute=0.60,
    gemm_memory=0.86,
    moe_compute=0.60,
    moe_memory=0.86,
    attn_compute=0.079,
    attn_memory=0.067,
    source="hcfjax XLA path on H200: microbenchmarks in docs/results.md",
)
