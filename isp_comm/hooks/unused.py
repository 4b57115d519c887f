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

A window runs from the first forward with grad after a step to the next step, so a
parameter that one micro-step of an accumulation used keeps its gradient. Each rank
notes, on the host, what its backwards produced a gradient for: the ``grads`` a
unit's backward hands the reductions, and the whole gradients ``.grad`` holds when
the backward ends. A parameter whose ``.grad`` was not ``None`` when the window
began (``zero_grad(set_to_none=False)``) is left as it is, as a plain model leaves
its zeros.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from isp_comm.collectives import StepCollectives


class UnusedGradients:
    """The window's record of used parameters, and the step-time decision (see
    [Note: unused parameters]). ``params``: every parameter of the model, in one
    order on every rank; ``group``/``size``: the whole job."""

    def __init__(self, params: list[nn.Parameter], collectives: StepCollectives, group, size: int) -> None:
        self.params = params
        self.ids = {id(p) for p in params}
        self.collectives, self.group, self.size = collectives, group, size
        self._used: set[int] = set()
        self._none_at_start: set[int] | None = None  # None: no window open
        self._backward = False  # a backward of the window ended: the reductions wrote gradients

    def forward_begins(self) -> None:
        """A forward with grad begins; the first of a window notes which gradients are ``None``."""
        if self._none_at_start is None:
            self._none_at_start = {id(p) for p in self.params if p.grad is None}

    def produced(self, params: Iterable[nn.Parameter], grads: Iterable[torch.Tensor | None]) -> None:
        """A unit's backward produced ``grads`` for ``params`` (``None``: not used here)."""
        self._used.update(id(p) for p, g in zip(params, grads) if g is not None)

    def holding(self, params: Iterable[nn.Parameter]) -> None:
        """The backward ended: ``params`` (gradients autograd left whole, before their
        reduction) were used here if they hold one."""
        self._used.update(id(p) for p in params if p.grad is not None)
        self._backward = True

    def steps(self, opt: torch.optim.Optimizer) -> bool:
        """Whether a window in which a backward ended is open and ``opt`` steps any of
        the model's parameters. A step with no backward behind it (the step at lr 0 that
        makes a fresh optimizer's states for a checkpoint, after an evaluation forward
        with grad) finds no gradient of the reductions' to take back."""
        return (
            self._backward
            and self._none_at_start is not None
            and any(id(p) in self.ids for g in opt.param_groups for p in g["params"])
        )

    def settle(self) -> None:
        """Before the step: every rank's use, summed over the job; a parameter none
        used whose gradient the window began without goes back to ``None``. Closes
        the window (every rank steps at the same point of the loop, so all issue it)."""
        used = torch.tensor(
            [float(id(p) in self._used) for p in self.params], dtype=torch.float32, device=self.collectives.device
        )
        self.collectives.all_reduce(used, self.group, self.size, "all-reduce of the parameters' use")
        start = self._none_at_start or set()
        for p, n in zip(self.params, used.tolist()):
            if n == 0 and id(p) in start:
                p.grad = None
        self._used.clear()
        self._none_at_start, self._backward = None, False
