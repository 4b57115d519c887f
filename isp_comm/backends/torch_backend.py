"""Collectives on ``torch.distributed`` (NCCL on CUDA, gloo on CPU)."""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from isp_comm.backends.base import CompletedHandle, Handle
from isp_comm.errors import ISPCommTimeout


class TorchHandle:
    """Wraps a ``dist.Work`` so that waiting has a deadline and a useful error."""

    __slots__ = ("_work", "_what")

    def __init__(self, work: dist.Work, what: str, group: ProcessGroup) -> None:
        self._work = work
        self._what = f"{what} over ranks {dist.get_process_group_ranks(group)}"

    def wait(self, timeout_s: float) -> None:
        try:
            self._work.wait(timeout=timedelta(seconds=timeout_s))
        except RuntimeError as exc:  # gloo/NCCL report timeouts and dead peers this way
            raise ISPCommTimeout(
                f"{self._what} failed or passed its {timeout_s:.1f}s deadline (a peer died or stalled): {exc}"
            ) from exc


def _single(group: ProcessGroup) -> bool:
    return dist.get_world_size(group) == 1


class TorchBackend:
    """``torch.distributed`` collectives, always asynchronous."""

    name = "torch"

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, group: ProcessGroup) -> Handle:
        if _single(group):
            out.copy_(inp.view_as(out))
            return CompletedHandle()
        return TorchHandle(dist.all_gather_single(out, inp, group=group, async_op=True), "all-gather", group)

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, group: ProcessGroup) -> Handle:
        if _single(group):
            out.copy_(inp.view_as(out))
            return CompletedHandle()
        work = dist.reduce_scatter_single(out, inp, group=group, async_op=True)
        return TorchHandle(work, "reduce-scatter", group)

    def all_reduce(self, tensor: torch.Tensor, group: ProcessGroup) -> Handle:
        if _single(group):
            return CompletedHandle()
        return TorchHandle(dist.all_reduce(tensor, group=group, async_op=True), "all-reduce", group)

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, group: ProcessGroup) -> Handle:
        if _single(group):
            out.copy_(inp)
            return CompletedHandle()
        return TorchHandle(dist.all_to_all_single(out, inp, group=group, async_op=True), "all-to-all", group)

    def barrier(self, group: ProcessGroup, timeout_s: float) -> None:
        if not _single(group):
            self.all_reduce(torch.zeros(1), group).wait(timeout_s)

    def empty(
        self, numel: int, dtype: torch.dtype, device: torch.device, group: ProcessGroup | None = None
    ) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, device=device)

    def close(self) -> None:
        return None
