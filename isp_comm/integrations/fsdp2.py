"""isp-comm's symmetric-memory collectives inside PyTorch FSDP2.

FSDP2 lets a user replace its all-gather and reduce-scatter through the public
``FSDPModule.set_custom_all_gather`` / ``set_custom_reduce_scatter`` hooks; the classes
here implement those interfaces on an isp-comm backend::

    for m in [*blocks, model]:
        fully_shard(m)
    symm = use_symm_collectives([*blocks, model])   # after fully_shard, before training
    ...
    symm.close()
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

from isp_comm.backends import Backend, make_backend


class BackendAllGather(AllGather):
    """FSDP2 all-gather on an isp-comm backend (completes before returning)."""

    def __init__(self, backend: Backend, timeout_s: float) -> None:
        self.backend, self.timeout_s = backend, timeout_s

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op: bool = False):
        self.backend.all_gather(output_tensor, input_tensor, group).wait(self.timeout_s)
        return None


class BackendReduceScatter(ReduceScatter):
    """FSDP2 reduce-scatter on an isp-comm backend: SUM, or AVG as a sum and a divide."""

    def __init__(self, backend: Backend, timeout_s: float) -> None:
        self.backend, self.timeout_s = backend, timeout_s

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
        if op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            raise ValueError(f"isp-comm's reduce-scatter supports SUM and AVG, got {op}")
        self.backend.reduce_scatter(output_tensor, input_tensor, group).wait(self.timeout_s)
        if op == dist.ReduceOp.AVG:
            output_tensor.div_(dist.get_world_size(group))
        return None


class BackendReplicaAllReduce:
    """FSDP2's all-reduce hook (``FSDPModule.set_all_reduce_hook``) that makes a 1-D
    FSDP over a shard group into hybrid sharding (HSDP) on an isp-comm backend: the
    reduce-scatter's output is averaged over ``group``, the replicas (FSDP2 divides
    it by the shard group's size only). Waits for the all-reduce on the hook's stream."""

    def __init__(self, backend: Backend, group: dist.ProcessGroup, timeout_s: float) -> None:
        self.backend, self.group, self.timeout_s = backend, group, timeout_s
        self.size = dist.get_world_size(group)

    def __call__(self, reduce_output: torch.Tensor) -> None:
        self.backend.all_reduce(reduce_output, self.group).wait(self.timeout_s)
        reduce_output.div_(self.size)


def use_symm_collectives(modules: Iterable[FSDPModule], timeout_s: float = 300.0) -> Backend:
    """Route the all-gathers and reduce-scatters of these ``fully_shard``-ed modules
    through one symmetric-memory backend, chosen by the parameters' device: shared
    memory for CPU parameters, torch's symmetric memory for CUDA ones (its handles
    make the calling stream, FSDP2's all-gather or reduce-scatter stream, wait on an
    event: no host thread touches CUDA tensors); ``close()`` it when training ends."""
    modules = list(modules)
    for m in modules:
        if not isinstance(m, FSDPModule):
            raise TypeError(f"{type(m).__name__} is not an FSDP2 module: call fully_shard on it first")
    devices = {p.device for m in modules for p in m.parameters()}
    if len(devices) != 1:
        raise ValueError(f"the modules' parameters must be on one device, found {sorted(map(str, devices))}")
    backend = make_backend("symm", devices.pop(), timeout_s)
    ag, rs = BackendAllGather(backend, timeout_s), BackendReduceScatter(backend, timeout_s)
    for m in modules:
        m.set_custom_all_gather(ag)
        m.set_custom_reduce_scatter(rs)
    return backend
