"""The two autograd Functions that tell the engine where a block's backward begins and ends."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from isp_comm.hooks.engine import BlockEngine
    from isp_comm.units import BlockUnit


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
    def forward(ctx: Any, anchor: torch.Tensor, engine: BlockEngine, unit: BlockUnit, slot: torch.Tensor):
        ctx.engine, ctx.unit = engine, unit
        ctx.set_materialize_grads(False)
        views = tuple(unit.full_views(slot))
        ctx.mark_non_differentiable(*(v for v, t in zip(views, unit.trainable) if not t))
        return views

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None):
        ctx.engine.post_backward(ctx.unit, grads)
        return None, None, None, None


class PreBackward(torch.autograd.Function):
    """Identity on a block's outputs; its backward runs just before the block's backward."""

    @staticmethod
    def forward(ctx: Any, engine: BlockEngine, unit: BlockUnit, *tensors: torch.Tensor):
        ctx.engine, ctx.unit = engine, unit
        ctx.set_materialize_grads(False)
        return tensors

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None):
        ctx.engine.pre_backward(ctx.unit)
        return (None, None, *grads)
