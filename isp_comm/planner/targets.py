"""Known targets: the devices a plan can be made for without being on one.

Each entry is what a vendor's data sheet and published collective benchmarks say, not
a measurement of this project: peak dense FLOP/s, memory, HBM bandwidth, the
per-GPU link bandwidths inside a node (NVLink) and across nodes (InfiniBand), and the
fraction of a link's bandwidth NCCL reaches by message size. The sources are named
beside each figure. ``--target NAME[xG]`` picks one (``h100x8``: 8 GPUs per node)
and ``--nodes N`` sets how many nodes.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Literal

GB = 1e9
GIB = 2**30
MIB = 2**20

NCCL_CURVE_NVLINK: tuple[tuple[int, float], ...] = (
    # Fraction of the link's unidirectional bandwidth an NCCL ring all-gather /
    # reduce-scatter reaches (busbw / link), by message size (bytes over the group).
    # Read off the published nccl-tests figures for 8-GPU NVSwitch nodes
    # (github.com/NVIDIA/nccl-tests, and vendors' cluster acceptance reports: 8x H100
    # SXM all_reduce busbw 360-370 GB/s without NVLS, 460-480 with it, against a
    # 450 GB/s link; 8x A100 SXM 230-250 GB/s against 300). Approximate, rounded.
    (1 << 16, 0.03),
    (1 << 20, 0.20),
    (1 << 23, 0.55),
    (1 << 26, 0.75),
    (1 << 29, 0.80),
    (1 << 33, 0.82),
)
NCCL_CURVE_IB: tuple[tuple[int, float], ...] = (
    # The same across nodes over one 400 Gb/s (NDR) or 200 Gb/s (HDR) NIC per GPU:
    # nccl-tests multi-node all_reduce busbw of 8-NIC nodes reaches about 85-92% of
    # the NIC's line rate at >= 1 GiB (NVIDIA DGX SuperPOD reference figures); the
    # small-message part is the ring's latency, modelled apart.
    (1 << 16, 0.02),
    (1 << 20, 0.15),
    (1 << 23, 0.50),
    (1 << 26, 0.78),
    (1 << 29, 0.86),
    (1 << 33, 0.88),
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Target:
    """One kind of device, as published (not measured here)."""

    name: str
    """The short name --target takes."""
    device: Literal["cuda", "cpu"]
    """Where the parameters live: the memory forecast's device."""
    peak_bf16_flops: float
    """Dense bf16 tensor-core peak, FLOP/s (no sparsity)."""
    peak_fp32_flops: float
    """Dense fp32 (non-tensor-core) peak, FLOP/s."""
    memory_bytes: int
    """Device memory a process can have (the data sheet's figure)."""
    hbm_bytes_per_s: float
    """Memory bandwidth (the optimizer step and element-wise kernels are bound by it)."""
    nvlink_bytes_per_s: float
    """Per-GPU unidirectional bandwidth inside a node."""
    ib_bytes_per_s: float
    """Per-GPU network bandwidth across nodes (one NIC per GPU)."""
    gpus_per_node: int
    """GPUs a node has by default (``xG`` overrides)."""
    gemm_efficiency: float
    """Fraction of the bf16 peak a large GEMM reaches in practice."""
    attention_efficiency: float
    """Fraction of the bf16 peak a fused (flash) attention reaches."""
    elementwise_efficiency: float
    """Fraction of the HBM bandwidth a memory-bound kernel reaches."""
    latency_intra_s: float
    """An NCCL collective's fixed cost inside a node, per ring step."""
    latency_inter_s: float
    """The same across nodes."""
    op_host_s: float
    """Host time to issue one eager operator (the CPU side of a kernel launch)."""
    op_device_s: float
    """A kernel's smallest time on the device."""
    compute_capability: tuple[int, int] = (0, 0)
    """CUDA's (major, minor) of the GPU: what sizes cuBLAS's workspace
    (:func:`isp_comm.memory_forecast.weights.cublas_workspace_bytes`)."""


_H100 = Target(
    name="h100",
    device="cuda",
    peak_bf16_flops=989.4e12,  # NVIDIA H100 SXM data sheet: 1,979 TFLOPS bf16 with sparsity, half dense
    peak_fp32_flops=66.9e12,  # same data sheet: FP32 67 TFLOPS
    memory_bytes=81559 * MIB,  # 80 GB HBM3: 81,559 MiB as nvidia-smi reports an H100 SXM
    hbm_bytes_per_s=3.35e12,  # 3.35 TB/s
    nvlink_bytes_per_s=450 * GB,  # NVLink 4: 900 GB/s bidirectional per GPU
    ib_bytes_per_s=50 * GB,  # DGX H100: 8x ConnectX-7 400 Gb/s, one per GPU
    gpus_per_node=8,
    gemm_efficiency=0.70,  # cuBLAS bf16 GEMMs of LLM shapes: ~650-750 TFLOP/s measured publicly on H100 SXM
    attention_efficiency=0.50,  # FlashAttention-2 forward+backward on H100: ~35-50% (Dao 2023); FA3 higher
    elementwise_efficiency=0.80,
    # per step: above NCCL's own tuning figures on NVLink (its Simple ring 3.4 us a step
    # plus 8.4 a collective, its low-latency one about 0.5; nccl-tests' small all_reduce on 8x H100
    # takes ~10-20 us in all, low-latency protocol), so small collectives are overstated;
    # kept as the planner's GPU comparisons ran with it (docs/planner.md, "What it does not model")
    latency_intra_s=8e-6,
    latency_inter_s=15e-6,
    op_host_s=8e-6,  # eager PyTorch dispatch + cudaLaunchKernel, per operator
    op_device_s=3e-6,
    compute_capability=(9, 0),  # Hopper
)
TARGETS: dict[str, Target] = {
    "h100": _H100,
    "h200": dataclasses.replace(
        _H100,
        name="h200",
        memory_bytes=143771 * MIB,  # NVIDIA H200 SXM data sheet: 141 GB HBM3e (143,771 MiB in nvidia-smi)
        hbm_bytes_per_s=4.8e12,  # 4.8 TB/s; same compute and NVLink 4 as H100 SXM
    ),
    "a100": Target(
        name="a100",
        device="cuda",
        peak_bf16_flops=312e12,  # NVIDIA A100 data sheet: 312 TFLOPS bf16 dense
        peak_fp32_flops=19.5e12,  # 19.5 TFLOPS FP32
        memory_bytes=81920 * MIB,  # A100 SXM 80GB (81,920 MiB in nvidia-smi)
        hbm_bytes_per_s=2.039e12,  # 2,039 GB/s
        nvlink_bytes_per_s=300 * GB,  # NVLink 3: 600 GB/s bidirectional
        ib_bytes_per_s=25 * GB,  # DGX A100: 8x ConnectX-6 200 Gb/s (HDR)
        gpus_per_node=8,
        gemm_efficiency=0.75,  # cuBLAS bf16 on A100: ~230-250 TFLOP/s for large GEMMs
        attention_efficiency=0.55,  # FlashAttention-2 on A100: 50-73% forward, less backward (Dao 2023)
        elementwise_efficiency=0.80,
        latency_intra_s=10e-6,
        latency_inter_s=20e-6,
        op_host_s=8e-6,
        op_device_s=3e-6,
        compute_capability=(8, 0),  # Ampere
    ),
    "b200": Target(
        name="b200",
        device="cuda",
        peak_bf16_flops=2.25e15,  # NVIDIA HGX B200 data sheet: 4.5 PFLOPS bf16 with sparsity, half dense
        peak_fp32_flops=75e12,  # HGX B200: 600 TFLOPS FP32 over 8 GPUs
        memory_bytes=180 * GB,  # HGX B200: 1.44 TB over 8 GPUs (the data sheet's decimal GB, conservatively)
        hbm_bytes_per_s=7.7e12,  # HGX B200: 62 TB/s over 8 GPUs
        nvlink_bytes_per_s=900 * GB,  # NVLink 5: 1.8 TB/s bidirectional per GPU
        ib_bytes_per_s=50 * GB,  # DGX B200: 8x ConnectX-7 400 Gb/s
        gpus_per_node=8,
        gemm_efficiency=0.65,  # assumed: fewer public measurements than for H100
        attention_efficiency=0.45,  # assumed
        elementwise_efficiency=0.80,
        latency_intra_s=8e-6,
        latency_inter_s=15e-6,
        op_host_s=8e-6,
        op_device_s=3e-6,
        compute_capability=(10, 0),  # Blackwell
    ),
    "cpu": Target(
        # A nominal CPU host, one rank per core and one thread each (not this machine:
        # --plan without --target calibrates this one). Figures of a current server
        # core (AVX-512 FMA at ~2.5 GHz: 2 x 16 fp32 FLOP/cycle peak; bf16 through
        # the fp32 units) and a DDR5 channel's share per core.
        name="cpu",
        device="cpu",
        peak_bf16_flops=80e9,
        peak_fp32_flops=80e9,
        memory_bytes=16 * GIB,
        hbm_bytes_per_s=10 * GB,
        nvlink_bytes_per_s=5 * GB,  # shared-memory copies between ranks of a host
        ib_bytes_per_s=1.25 * GB,  # 10 Gb/s Ethernet
        gpus_per_node=1,
        gemm_efficiency=0.5,
        attention_efficiency=0.2,
        elementwise_efficiency=0.5,
        latency_intra_s=20e-6,
        latency_inter_s=50e-6,
        op_host_s=10e-6,
        op_device_s=0.0,
    ),
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Cluster:
    """A target, with how many per node and how many nodes."""

    target: Target
    per_node: int
    """Devices (GPUs, or CPU ranks) per node."""
    nodes: int
    network_bytes_per_s: float = 0.0
    """A node's bandwidth across nodes, all its NICs together (--network-gbit); 0: the
    target's, one NIC a device."""

    @property
    def world(self) -> int:
        return self.per_node * self.nodes

    @property
    def ib_bytes_per_s(self) -> float:
        """Each device's bandwidth across nodes: the target's NIC, or its share of the
        node's network when one is given.

        [Note: a node with fewer NICs than GPUs]
        NCCL gives each channel of a ring one NIC, rotating over the node's NICs, and a
        channel's ring crosses each node's boundary once, so a group with k ranks on
        each node sends (n-1)/n x B out of the node whatever the NIC count (links.py):
        c NICs carry a c-th of it each. Charging each rank 1/k of the bytes at
        1/per_node of the node's bandwidth gives that time for a group that fills its
        nodes. A group with fewer ranks on a node (a replica group: one) is charged the
        same share, as in an SPMD step every rank of the node sends its group's part at
        the same moment and the per_node groups share the node's NICs (each group's
        communicator plans as if it had them alone). An even share, so approximate:
        where a node's ranks are split between groups that cross nodes and groups that
        do not (WP 6 on nodes of 8), a crossing group is charged for traffic the others
        never send, up to 2x too much on a thin network; a GPU far from its NIC (no
        GPUDirect RDMA, no PXN for groups without the NIC's own GPU) can fall below its
        share; and NCCL's share of the link is read at the group's message size, not
        at the NIC's combined traffic.
        """
        if self.network_bytes_per_s:
            return self.network_bytes_per_s / self.per_node
        return self.target.ib_bytes_per_s

    def describe(self) -> str:
        text = f"{self.target.name}x{self.per_node}, {self.nodes} node{'s' if self.nodes > 1 else ''}"
        if self.network_bytes_per_s:
            text += f", {self.network_bytes_per_s * 8 / 1e9:g} Gbit/s a node across nodes"
        return text


def gpu_target(device_name: str) -> str:
    """The known target a GPU is, from its name as CUDA gives it (``NVIDIA H200``:
    ``h200``), or '' when none is: a run is planned with its own device's figures."""
    name = device_name.lower()
    return next((t for t in TARGETS if TARGETS[t].device == "cuda" and t in name), "")


def parse_target(text: str, nodes: int = 1, network_gbit: float = 0.0) -> Cluster:
    """``NAME`` or ``NAMExG`` (``h100x8``: 8 per node), a node count and, where given,
    a node's network bandwidth across nodes in Gbit/s, or a ``ValueError`` naming what
    --target takes."""
    m = re.fullmatch(r"([a-z0-9]+?)(?:x(\d+))?", text.strip().lower())
    known = ", ".join(TARGETS)
    if not m or m.group(1) not in TARGETS:
        raise ValueError(f"--target {text!r}: unknown; one of {known}, optionally xG for G per node (h100x8)")
    target = TARGETS[m.group(1)]
    per_node = int(m.group(2)) if m.group(2) else target.gpus_per_node
    if per_node < 1:
        raise ValueError(f"--target {text!r}: xG must be at least 1")
    if nodes < 1:
        raise ValueError(f"--nodes must be >= 1, got {nodes}")
    if not 0 <= network_gbit < float("inf"):  # 0: not given
        raise ValueError(
            f"--network-gbit must be > 0 (a node's bandwidth across nodes, all its NICs together), got {network_gbit}"
        )
    return Cluster(target=target, per_node=per_node, nodes=nodes, network_bytes_per_s=network_gbit * 1e9 / 8)
