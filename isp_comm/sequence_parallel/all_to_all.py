"""All-to-all as an autograd function, through an isp-comm backend.

``all_to_all(tensors, scatter_dim, gather_dim, ...)`` splits each tensor into ``sp``
chunks along ``scatter_dim``, sends chunk ``j`` to rank ``j`` of the group and
concatenates what arrives along ``gather_dim`` (one dim for all tensors, or one per
tensor). Its backward is the same exchange with the two dims swapped. All tensors'
exchanges are issued before the first is waited, so q, k and v travel together.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from isp_comm.backends.base import Backend, Handle
from isp_comm.context import CommContext


@torch._disable_dynamo  # torch.compiler.disable, lazily: [Note: dynamo loaded on first call] in hooks/compiled.py
def _issue(recv: torch.Tensor, send: torch.Tensor, group: ProcessGroup, backend: Backend, comm: CommContext) -> Handle:
    """Issue one all-to-all and record it. Run eagerly inside a compiled block: the
    flight record reads the bytes sent, which a traced tensor of symbolic shape cannot
    give (``nbytes`` raises there)."""
    return comm.record(backend.all_to_all(recv.view(-1), send.view(-1), group), "all-to-all", group, send)


def _exchange(
    tensors: tuple[torch.Tensor, ...],
    scatter: tuple[int, ...],
    gather: tuple[int, ...],
    group: ProcessGroup,
    backend: Backend,
    comm: CommContext,
) -> tuple[torch.Tensor, ...]:
    sp = dist.get_world_size(group)
    t0 = comm.mark()
    pending = []
    for t, dim in zip(tensors, scatter):
        if t.shape[dim] % sp:
            raise ValueError(f"dim {dim} of size {t.shape[dim]} does not split over {sp} ranks")
        send = torch.stack(t.chunk(sp, dim=dim)).contiguous()  # [sp, ...chunk]
        recv = torch.empty_like(send)
        pending.append((recv, _issue(recv, send, group, backend, comm)))
    out = []
    for (recv, handle), dim in zip(pending, gather):
        comm.wait(handle, f"all-to-all of {len(tensors)} tensors over the SP group")
        out.append(torch.cat(recv.unbind(0), dim=dim))
    comm.trace("all-to-all", f"{len(tensors)} tensors", t0)
    return tuple(out)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        scatter: tuple[int, ...],
        gather: tuple[int, ...],
        group,
        backend,
        comm: CommContext,
        *tensors: torch.Tensor,
    ):
        ctx.args = (scatter, gather, group, backend, comm)
        return _exchange(tensors, scatter, gather, group, backend, comm)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor):
        scatter, gather, group, backend, comm = ctx.args
        back = _exchange(tuple(g.contiguous() for g in grads), gather, scatter, group, backend, comm)
        return (None, None, None, None, None, *back)


def all_to_all(
    tensors: tuple[torch.Tensor, ...] | list[torch.Tensor],
    scatter_dim: int | tuple[int, ...],
    gather_dim: int | tuple[int, ...],
    group: ProcessGroup,
    backend: Backend,
    comm: CommContext | None = None,
) -> tuple[torch.Tensor, ...]:
    """Differentiable all-to-all of several tensors over ``group`` (see module doc).
    Waits go through ``comm`` (its deadline, failure flag, counters and tracer; a
    default context, 300 s, when ``None``)."""
    if dist.get_world_size(group) == 1:
        return tuple(tensors)
    n = len(tensors)
    scatter = (scatter_dim,) * n if isinstance(scatter_dim, int) else tuple(scatter_dim)
    gather = (gather_dim,) * n if isinstance(gather_dim, int) else tuple(gather_dim)
    if len(scatter) != n or len(gather) != n:
        raise ValueError(f"{n} tensors need {n} scatter and gather dims, got {scatter} and {gather}")
    comm = comm if comm is not None else CommContext(dist.get_rank(), 300.0)
    return _AllToAll.apply(scatter, gather, group, backend, comm, *tensors)
