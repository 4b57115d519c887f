"""Weights and optimizer state: what each unit shards, and what that costs on rank 0.

Read from the engine's own decisions: :func:`~isp_comm.discovery.unit_specs` says
what each unit shards and :class:`~isp_comm.layout.BlockLayout` how large its flat
shard is; what is left is replicated. Also what a rank holds outside tensors: measured
on CPU (its runtime's memory), read from torch's sources on CUDA (cuBLAS's workspaces).
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Sequence

import torch
from torch import nn

from isp_comm.config import ISPConfig
from isp_comm.discovery import unit_specs
from isp_comm.layout import BlockLayout
from isp_comm.memory_forecast.result import MIB, Optimizer
from isp_comm.units import find_sharded

UnitLayout = tuple[int, BlockLayout, list[bool]]
"""A unit's index (blocks from 0; the outer units negative), its layout on rank 0, and
which of its parameters are trainable."""


def unit_layouts(
    model: nn.Module,
    blocks: Sequence[nn.Module],
    config: ISPConfig,
    head: nn.Module | None,
    wp: int,
    replicas: int = 1,
) -> tuple[list[UnitLayout], list[nn.Parameter]]:
    """Every unit's layout on rank 0, and the parameters left replicated (each tied
    one once). ``replicas``: the replica group's size, which splits the pieces of
    ``state_sharding="world"`` (1: no pieces)."""
    pd, rd = config.param_dtype, config.reduce_dtype
    replicas = replicas if config.state_sharding == "world" else 1
    layouts: list[UnitLayout] = []
    for s in unit_specs(model, list(blocks), config, head):
        found, _ = find_sharded(s.owners, s.names, s.dim1, wp, 0)
        layout = BlockLayout(found, wp, 0, pd if s.cast else None, rd if s.cast else None, replicas, 0)
        trainable = [sp_.module._parameters[sp_.name].requires_grad for sp_ in layout.params]
        layouts.append((s.index, layout, trainable))
    in_units = {id(sp_.module._parameters[sp_.name]) for _, lay, _ in layouts for sp_ in lay.params}
    return layouts, [p for p in model.parameters() if id(p) not in in_units]


def flat_bytes(lay: BlockLayout) -> int:
    """Bytes of a unit's flat shard (its WP rows, what gathers read)."""
    return lay.store.numel * lay.dtype.itemsize


def master_bytes(lay: BlockLayout) -> int:
    """Bytes of what a unit's parameters are views of, and of its gradient buffer: the
    flat shard, or with pieces the pieces (see [Note: pieces] in ``isp_comm/layout.py``)."""
    return lay.master_store.numel * lay.master_dtype.itemsize


def trainable_bytes(layout: BlockLayout, trainable: list[bool]) -> list[int]:
    """Bytes of each trainable parameter (its valid rows, or its piece's) of a unit on rank 0."""
    return [sp.valid_rows * sp.inner * sp.dtype.itemsize for sp, t in zip(layout.pieces, trainable) if t]


@dataclasses.dataclass(frozen=True)
class Weights:
    """Bytes of the parameters, their gradients and the optimizer's state on rank 0."""

    master: int  # every unit's parameters: its flat shard, or its pieces
    wp_shards: int  # with pieces, every unit's flat shard besides (in the gather dtype)
    grad_shards: int  # the flat gradient buffers of units with a trainable parameter
    trainable_shards: list[int]  # each trainable sharded parameter's rows
    replicated: int  # every replicated parameter
    replicated_trainable: list[int]  # each trainable replicated parameter
    opt_state: int  # the optimizer's state of every trainable parameter
    casts: int  # replicated parameters cast to param_dtype for a step
    outer_gather: int  # the outer parameters' unit, gathered once per step outside the pool
    wp_summed: int  # trainable shards of the vocab head and split embedding (all-reduced whole; none with pieces)
    refresh: int  # with pieces: the replica all-gather's send and landing buffers (see hooks/refresh.py)
    largest_module: int  # the largest sharded module, made real whole at wrap
    largest_item: int  # the largest tensor DCP copies at once

    @property
    def all_trainable(self) -> list[int]:
        return self.trainable_shards + self.replicated_trainable


def weights(
    layouts: list[UnitLayout],
    replicated: list[nn.Parameter],
    optimizer: Optimizer,
    param_dtype: torch.dtype | None,
) -> Weights:
    """The weights' parts of every phase (see :class:`Weights`)."""
    trainable_shards = [b for _, lay, tr in layouts for b in trainable_bytes(lay, tr)]
    repl_trainable = [p.numel() * p.element_size() for p in replicated if p.requires_grad]
    per_param_state = {"adamw": 2, "sgd": 0, "sgd_momentum": 1}[optimizer]
    casts = 0
    if param_dtype is not None:
        casts = sum(p.numel() * param_dtype.itemsize for p in replicated if p.dtype != param_dtype)
    root = next((lay for i, lay, _ in layouts if i == -1), None)
    module_bytes: dict[int, int] = {}  # a sharded module is made real whole, then its rows are taken
    for _, lay, _ in layouts:
        for sp_ in lay.params:
            module_bytes[id(sp_.module)] = module_bytes.get(id(sp_.module), 0) + sp_.full_numel * sp_.dtype.itemsize
    pieces = [lay for _, lay, _ in layouts if lay.replicas > 1]
    refresh: dict[torch.dtype, int] = {}  # one send and one landing buffer per gather dtype, the largest unit's
    for lay in pieces:
        nbytes = (1 + lay.replicas) * lay.piece_bound * lay.gather_dtype.itemsize
        refresh[lay.gather_dtype] = max(refresh.get(lay.gather_dtype, 0), nbytes)
    return Weights(
        master=sum(master_bytes(lay) for _, lay, _ in layouts),
        wp_shards=sum(flat_bytes(lay) for lay in pieces),
        grad_shards=sum(master_bytes(lay) for _, lay, tr in layouts if any(tr)),
        trainable_shards=trainable_shards,
        replicated=sum(p.numel() * p.element_size() for p in replicated),
        replicated_trainable=repl_trainable,
        opt_state=per_param_state * (sum(trainable_shards) + sum(repl_trainable)),
        casts=casts,
        outer_gather=root.gathered_numel * root.gather_dtype.itemsize if root is not None else 0,
        wp_summed=sum(
            b for (i, lay, tr) in layouts if i in (-2, -3) and lay.replicas == 1 for b in trainable_bytes(lay, tr)
        ),
        refresh=sum(refresh.values()),
        largest_module=max(module_bytes.values(), default=0),
        largest_item=max([master_bytes(lay) for _, lay, _ in layouts] + trainable_shards + repl_trainable, default=0),
    )


GLOO_RUNTIME = int(4.5 * MIB)
"""Memory that gloo's collectives keep outside tensors once a step has run (world > 1).
Fitted on bench/forecast.py's grid: 6 MiB while the torch backend ran gloo's own
all-gather and reduce-scatter; 4.5 MiB, the grid's smallest largest error, once it
ran them as broadcasts and reduces (see [Note: gloo's gather and reduce-scatter on
CPU] in ``isp_comm/backends/torch_backend.py``)."""
CPU_LOW_PRECISION_RUNTIME = {"AVX2": 0, "default": int(7.5 * MIB)}
"""Memory the CPU kernels of bf16/fp16 compute keep outside tensors (code and buffers),
by torch's CPU capability: 7.5 MiB on the machine the forecast was first fitted on
(capability not recorded); none measurable on an AVX2-only one, where the forecast
with 7.5 MiB read 8 to 12 MiB above every measured phase of a bf16 run."""


def cpu_runtime(device: str, world: int, param_dtype: torch.dtype | None) -> dict[str, int]:
    """Memory outside tensors that a CPU rank holds from its first step on: measured, not
    derived (bench/forecast.py: the difference between a run's anonymous memory and its
    live tensors on the 2-core CPU machine, torch 2.13). On CUDA no such part counts in
    the allocator's figure."""
    if device != "cpu":
        return {}
    parts = {"runtime: gloo": GLOO_RUNTIME if world > 1 else 0}
    if param_dtype in (torch.bfloat16, torch.float16):
        table, isa = CPU_LOW_PRECISION_RUNTIME, torch.backends.cpu.get_cpu_capability()
        parts["runtime: low-precision CPU kernels"] = table.get(isa, table["default"])
    return parts


def _trainable_bytes(layout: BlockLayout, trainable: list[bool]) -> list[int]:
    """Bytes of each trainable shard parameter (its valid rows) of a unit on rank 0."""
    return [sp.valid_rows * sp.inner * sp.dtype.itemsize for sp, t in zip(layout.params, trainable) if t]


CUBLAS_HANDLES = 2
"""cuBLAS workspaces a training process holds: see [Note: cuBLAS's workspaces]."""


def cublas_workspace_bytes(capability: tuple[int, int] | None = None) -> int:
    """Bytes of one cuBLAS workspace as torch sizes it: ``$CUBLAS_WORKSPACE_CONFIG``
    (``:SIZE_KIB:COUNT`` pairs, summed) when set, else by the GPU's compute
    capability: 32 MiB from Hopper (9.x) on, 8 MiB + 128 KiB before
    (``parseChosenWorkspaceSize`` in ATen's ``CublasHandlePool.cpp``). ``capability``:
    the GPU's (major, minor); ``None``: this machine's first GPU (Hopper's when none
    is visible: the project's GPUs). A torch that reports its own size
    (``torch.backends.cuda.cublas_workspace_size``) on a visible GPU is believed.

    [Note: cuBLAS's workspaces]
    torch gives every (cuBLAS handle, stream) pair a workspace of its own, allocated
    through the caching allocator on the pair's first GEMM and kept for the process's
    life (``setWorkspaceForHandle``: a map from (handle, stream) to a ``DataPtr``), so it
    counts in ``max_memory_allocated`` but is no tensor. Handles are reserved per thread
    (a thread-local pool window), and autograd runs a CUDA backward on a device thread
    of its own: a training step's forward (the main thread, the current stream) and its
    backward (autograd's thread, the same stream) hold two workspaces, 64 MiB on a
    Hopper GPU, from the first backward on. The engine's side streams run copies and
    collectives, no GEMM, and take none. On one H200 (torch 2.11, issue 55) the measured
    peak stood 64.0-64.5 MiB above a forecast without them in every phase from the
    optimizer's on, and 60-68 MiB in the forward and backward of the second step, at
    three layouts (bench/results/gpu_h200_c960ce6/forecast_3.json); none in the wrap
    phase, before any GEMM. Not counted: cuBLASLt's own workspace (1 MiB per pair,
    where a GEMM goes through cuBLASLt and torch does not share cuBLAS's with it)."""
    config = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    if config and re.findall(r":(\d+):(\d+)", config):
        return sum(int(size) * 1024 * int(count) for size, count in re.findall(r":(\d+):(\d+)", config))
    if capability is None and torch.cuda.is_available():
        reported = getattr(torch.backends.cuda, "cublas_workspace_size", None)
        if reported is not None:
            return int(reported())
        capability = torch.cuda.get_device_capability()
    major = (capability or (9, 0))[0]
    return 4096 * 8 * 1024 if major >= 9 else 4096 * 1024 * 2 + 16 * 1024 * 8


def cuda_runtime(device: str, workspace: int | None) -> dict[str, int]:
    """What a CUDA rank's allocator holds outside tensors from its first backward on:
    :data:`CUBLAS_HANDLES` cuBLAS workspaces of ``workspace`` bytes (``None``: as torch
    sizes them on this machine's GPU), see [Note: cuBLAS's workspaces]. Nothing on CPU."""
    if device != "cuda":
        return {}
    return {"workspace: cuBLAS": CUBLAS_HANDLES * (cublas_workspace_bytes() if workspace is None else workspace)}
