"""The two autograd Functions that tell the engine where a block's backward begins and ends.

They call a :class:`BackwardHooks` (the engine implements it), so this module
imports nothing above it: the engine imports these Functions, never the reverse.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from isp_comm.units import BlockUnit


class BackwardHooks(Protocol):
    """What the Functions below call back into."""

    def pre_backward(self, unit: BlockUnit) -> None:
        """Block ``unit``'s backward is about to begin."""

    def post_backward(self, unit: BlockUnit, grads: tuple[torch.Tensor | None, ...]) -> None:
        """Every trainable weight gradient of ``unit`` exists: ``grads``, one per
        parameter, in the unit's order."""


class UnshardBlock(torch.autograd.Function):
    """Forward: the block's full weights as views of its gathered slot.

    Backward runs once every trainable weight gradient of the block has been
    produced: the block's backward is over, so its gradients are reduce-scattered and
    its slot freed. The trainable shard passed as ``anchor`` only connects the node to
    the graph; its gradient is ``None`` here and the real, reduced one is added to
    ``.grad`` later. Views of frozen parameters are non-differentiable, so autograd
    neither computes nor waits for their gradients.
    """

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, hooks: BackwardHooks, unit: BlockUnit, slot: torch.Tensor):
        ctx.hooks, ctx.unit = hooks, unit
        ctx.set_materialize_grads(False)
        views = tuple(unit.full_views(slot))
        ctx.mark_non_differentiable(*(v for v, t in zip(views, unit.trainable) if not t))
        return views

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None):
        ctx.hooks.post_backward(ctx.unit, grads)
        return None, None, None, None


class ShardViews(torch.autograd.Function):
    """Forward: a unit's WP rows as views of its flat shard, for a unit that computes
    on them directly (never gathered) while its parameters are pieces (see [Note:
    pieces] in ``isp_comm/layout.py``). Backward, once every trainable view's
    gradient exists, hands those gradients to the engine (as ``UnshardBlock`` does),
    which reduce-scatters them into the pieces."""

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, hooks: BackwardHooks, unit: BlockUnit):
        ctx.hooks, ctx.unit = hooks, unit
        ctx.set_materialize_grads(False)
        views = tuple(unit.shard_view(unit.flat_shard, sp) for sp in unit.params)
        ctx.mark_non_differentiable(*(v for v, t in zip(views, unit.trainable) if not t))
        return views

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None):
        ctx.hooks.post_backward(ctx.unit, grads)
        return None, None, None


class PreBackward(torch.autograd.Function):
    """Identity on a block's outputs; its backward runs just before the block's backward."""

    @staticmethod
    def forward(ctx: Any, hooks: BackwardHooks, unit: BlockUnit, *tensors: torch.Tensor):
        ctx.hooks, ctx.unit = hooks, unit
        ctx.set_materialize_grads(False)
        return tensors

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None):
        ctx.hooks.pre_backward(ctx.unit)
        return (None, None, *grads)
