"""The collective interface every backend implements, and its handle type.

Backends know bytes, groups and deadlines; they know nothing of blocks or models.
Every collective takes its group and buffers explicitly and returns a handle whose
``wait(timeout_s)`` raises :class:`~isp_comm.errors.ISPCommTimeout` past the deadline.
"""

from __future__ import annotations

import importlib
import time
from typing import Protocol

import torch
from torch.distributed import ProcessGroup


def cuda_with(module: str) -> bool:
    """CUDA is present and ``module`` imports: whether a GPU backend can be selected."""
    if not torch.cuda.is_available():
        return False
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


def symmetric_refusal(hosts: list[str], peer_access: list[bool] | None = None) -> str | None:
    """Why a group cannot use symmetric memory, or ``None`` when it can: its ranks'
    ``hosts`` (one host only: another host's memory cannot be mapped) and, on CUDA,
    whether each rank's GPU is its own and can access every peer's (``peer_access``)."""
    if len(set(hosts)) > 1:
        return f"it spans hosts {sorted(set(hosts))}"
    if peer_access is not None and not all(peer_access):
        return "its GPUs lack peer access to each other (or two ranks share one)"
    return None


class Handle(Protocol):
    """An issued collective."""

    def wait(self, timeout_s: float) -> None:
        """Order the caller after the collective, within the deadline: on the host
        (CPU backends, gloo) it returns once the collective is done; on CUDA streams
        the caller's stream waits for it and the host goes on."""
        ...

    def is_completed(self) -> bool:
        """Whether the collective is done with its buffers, asked without waiting.
        Used after a failure to tell the buffers that may be reused from those a
        collective may still read or write (see [Note: buffers of a failed step])."""
        ...


class CompletedHandle:
    """Handle of a collective that finished when it was issued (e.g. a group of one)."""

    def wait(self, timeout_s: float) -> None:
        return None

    def is_completed(self) -> bool:
        return True


class HandleGroup:
    """Several collectives waited as one, under one deadline."""

    __slots__ = ("_handles",)

    def __init__(self, handles: list[Handle]) -> None:
        self._handles = handles

    def wait(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for h in self._handles:
            h.wait(max(deadline - time.monotonic(), 0.0))

    def is_completed(self) -> bool:
        return all(h.is_completed() for h in self._handles)

    def completion_event(self, observer):
        """The last collective's end (they run in issue order on one stream), when
        every handle can tell its own; else None."""
        last = None
        for h in self._handles:
            fn = getattr(h, "completion_event", None)
            last = fn(observer) if fn is not None else None
            if last is None:
                return None
        return last


class Backend(Protocol):
    """How bytes move between the ranks of a group."""

    name: str

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, group: ProcessGroup) -> Handle:
        """``out`` (numel = group size x inp.numel()) receives every rank's ``inp``, rank-major."""
        ...

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, group: ProcessGroup) -> Handle:
        """``out`` receives the sum over ranks of chunk ``group rank`` of ``inp`` (rank-major)."""
        ...

    def all_reduce(self, tensor: torch.Tensor, group: ProcessGroup) -> Handle:
        """In-place sum over the group."""
        ...

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, group: ProcessGroup) -> Handle:
        """Chunk ``j`` of ``inp`` goes to rank ``j``; chunk ``i`` of ``out`` comes from rank ``i``."""
        ...

    def barrier(self, group: ProcessGroup, timeout_s: float) -> None: ...

    def empty(
        self, numel: int, dtype: torch.dtype, device: torch.device, group: ProcessGroup | None = None
    ) -> torch.Tensor:
        """A buffer to communicate from/into. With ``group`` the call is collective over
        it and the buffer symmetric (same size on every rank): a symmetric-memory
        backend serves it from memory the peers map, and all-gathers into it are
        written by the peers directly."""
        ...

    def close(self) -> None: ...
