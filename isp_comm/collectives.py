"""Collectives outside the block schedule: a step's loss, the clip's norm, a validation
total, an object gather at the end of a run.

[Note: one road for every collective]
The engine's gathers and reductions go through the backend and wait under the
communicator's deadline (:meth:`~isp_comm.context.CommContext.wait`). The few
collectives a training loop issues around them used to call ``torch.distributed``
directly: they waited under the process group's own timeout (30 minutes on gloo),
and a backend that emulates or records collectives never saw them. They take the
same road here: issued through the communicator's backend, waited through its
context, so that a stalled peer ends them at the same deadline and names the rank.
"""

from __future__ import annotations

import pickle
from typing import Any

import torch
from torch.distributed import ProcessGroup

from isp_comm.backends.base import Backend
from isp_comm.context import CommContext


class StepCollectives:
    """The out-of-schedule collectives of one communicator, on its backend and context."""

    def __init__(self, backend: Backend, ctx: CommContext, device: torch.device) -> None:
        self.backend, self.ctx, self.device = backend, ctx, device

    def _record(self, handle, group: ProcessGroup, sent: torch.Tensor):
        return self.ctx.record(handle, "all-gather", group, sent, -1, "outer")

    def all_reduce(self, tensor: torch.Tensor, group: ProcessGroup, size: int, what: str) -> torch.Tensor:
        """Sum ``tensor`` in place over ``group`` (``size`` ranks); returns it."""
        if size > 1:
            self.ctx.wait(self.ctx.record(self.backend.all_reduce(tensor, group), "all-reduce", group, tensor), what)
        return tensor

    def all_max(self, tensor: torch.Tensor, group: ProcessGroup, size: int, what: str) -> torch.Tensor:
        """The element-wise maximum of ``tensor`` over ``group``, in place (an
        all-gather and a local max: backends reduce by sum only); returns it."""
        if size > 1:
            tensor.copy_(self.all_gather(tensor, group, size, what).amax(dim=0))
        return tensor

    def all_gather(self, tensor: torch.Tensor, group: ProcessGroup, size: int, what: str) -> torch.Tensor:
        """Every rank's ``tensor`` over ``group`` (``size`` ranks), stacked rank-major."""
        if size == 1:
            return tensor.unsqueeze(0)
        every = torch.empty(size * tensor.numel(), dtype=tensor.dtype, device=tensor.device)
        mine = tensor.contiguous().view(-1)
        self.ctx.wait(self.ctx.record(self.backend.all_gather(every, mine, group), "all-gather", group, mine), what)
        return every.view(size, *tensor.shape)

    def all_gather_object(self, obj: Any, group: ProcessGroup, size: int, what: str) -> list[Any]:
        """Every rank's picklable ``obj``, rank-major (a host meeting: never in a step).
        Two all-gathers on the backend's device: the pickled lengths, then the bytes
        padded to the longest."""
        if size == 1:
            return [obj]
        payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        lengths = torch.empty(size, dtype=torch.int64, device=self.device)
        mine = torch.tensor([payload.numel()], dtype=torch.int64, device=self.device)
        self.ctx.wait(self._record(self.backend.all_gather(lengths, mine, group), group, mine), f"{what} (lengths)")
        sizes = lengths.tolist()
        longest = max(sizes)
        padded = torch.zeros(longest, dtype=torch.uint8, device=self.device)
        padded[: payload.numel()] = payload.to(self.device)
        every = torch.empty(size * longest, dtype=torch.uint8, device=self.device)
        self.ctx.wait(self._record(self.backend.all_gather(every, padded, group), group, padded), what)
        rows = every.view(size, longest).cpu()
        return [pickle.loads(rows[r, : sizes[r]].numpy().tobytes()) for r in range(size)]
