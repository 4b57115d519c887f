"""Which parameters no rank used since the last optimizer step
(``ISPConfig(find_unused_parameters=True)``): their ``.grad`` goes back to ``None``
before the step, as a plain model leaves it.

[Note: unused parameters]
The reductions write every trainable shard's and replicated parameter's gradient,
zeros where a rank's backward produced none: a reduce-scatter or bucket must hold
the same elements on every rank, and whether a peer used a parameter is not known
until its data arrives. A plain model, DDP and FSDP2 leave such a parameter's
``.grad`` ``None`` instead, so the optimizer skips it; with zeros, AdamW's weight
decay and momentum still move it. Telling the two apart needs every rank's use on
the host, which is what this costs (as DDP's ``find_unused_parameters``): one
all-reduce of a flag per parameter and a host read of it before the step, never
inside the forward or backward.

Each rank keeps two marks per parameter, on the host, updated when a backward's
reductions write its gradient: *used* (a backward of this rank produced a gradient
for it) and *made* (the reductions made its ``.grad``, rather than adding to one the
caller had). A write into a ``.grad`` that is ``None`` starts afresh: whatever a
``zero_grad()`` dropped since (a skipped step, the order forward, ``zero_grad()``,
backward, an exception that escaped a backward) no longer counts; a write into one
that exists adds this backward's use, as accumulation over micro-steps adds its
gradient. Before the step, the *used* marks are summed over the job; a parameter none
used whose ``.grad`` the reductions made goes back to ``None``. One whose ``.grad``
the caller made (``zero_grad(set_to_none=False)``) keeps it, as a plain model keeps
its zeros. Sharded gradients are written as their reductions complete, after the
backward began: their ``None``-ness is read when it begins. The whole ones are read
from what the reducer set aside (see [Note: bucketed whole gradients]).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from isp_comm.collectives import StepCollectives


class UnusedGradients:
    """The marks of [Note: unused parameters], and the step-time decision.
    ``params``: every parameter of the model, in one order on every rank;
    ``group``/``size``: the whole job."""

    def __init__(self, params: list[nn.Parameter], collectives: StepCollectives, group, size: int) -> None:
        self.params = params
        self.ids = {id(p) for p in params}
        self.collectives, self.group, self.size = collectives, group, size
        self._used: set[int] = set()
        self._made: set[int] = set()
        self._none: set[int] = set()  # sharded parameters whose .grad was None as this backward began
        self._produced: set[int] = set()  # what this backward produced a gradient for, here
        self._backward = False  # a backward ended since the last step

    def backward_begins(self, shards: Iterable[nn.Parameter]) -> None:
        """A backward begins: which sharded gradients the reductions will make."""
        self._none = {id(p) for p in shards if p.grad is None}
        self._produced = set()

    def produced(self, params: Iterable[nn.Parameter], grads: Iterable[torch.Tensor | None]) -> None:
        """A unit's backward produced ``grads`` for ``params`` (``None``: not used here)."""
        self._produced.update(id(p) for p, g in zip(params, grads) if g is not None)

    def backward_ends(
        self, shards: Iterable[nn.Parameter], whole: Iterable[nn.Parameter], made: set[int], arrived: set[int] | None
    ) -> None:
        """The backward's reductions wrote every gradient: ``made``, the whole ones they
        made from ``None``; ``arrived``, the whole ones this backward produced (``None``:
        nothing was reduced, autograd's ``.grad`` are this rank's own, one process)."""
        for p in shards:
            self._mark(id(p), id(p) in self._none, id(p) in self._produced)
        for p in whole:
            if arrived is None:
                self._mark(id(p), True, p.grad is not None)
            else:
                self._mark(id(p), id(p) in made, id(p) in arrived)
        self._backward = True

    def _mark(self, key: int, fresh: bool, used: bool) -> None:
        if fresh:
            self._made.add(key)
            self._used.discard(key)
        if used:
            self._used.add(key)

    def steps(self, opt: torch.optim.Optimizer) -> bool:
        """Whether a backward ended since the last step and ``opt`` steps any of the
        model's parameters. A step with no backward behind it (a second step on the
        same gradients) finds no gradient of the reductions' to take back, and skips
        the all-reduce. (The step at lr 0 that makes a fresh optimizer's states is
        left alone by the communicator itself.)"""
        return self._backward and any(id(p) in self.ids for g in opt.param_groups for p in g["params"])

    def settle(self) -> None:
        """Before the step: every rank's use, summed over the job; a parameter none
        used whose ``.grad`` the reductions made goes back to ``None``. Every rank
        steps at the same point of its loop, so all issue the all-reduce."""
        used = torch.tensor(
            [float(id(p) in self._used) for p in self.params], dtype=torch.float32, device=self.collectives.device
        )
        self.collectives.all_reduce(used, self.group, self.size, "all-reduce of the parameters' use")
        for p, n in zip(self.params, used.tolist()):
            if n == 0 and id(p) in self._made:
                p.grad = None
        self._used.clear()
        self._made.clear()
        self._backward = False
