"""Which part each tensor a PyTorch FSDP2 model holds belongs to, read from FSDP2's
own state, so that FSDP2's peak can be broken down beside isp-comm's.

[Note: what the breakdown reads of FSDP2]
Each ``fully_shard``-ed module's state (``FSDPModule._get_fsdp_state()``) holds its
parameter groups: ``_fsdp_param_groups`` from torch 2.13, ``_fsdp_param_group``
before. A group's ``FSDPParam`` objects hold

- ``_sharded_param_data``: the padded local shard of the parameter, in its own dtype
  (the fp32 master under a bf16 mixed-precision policy): a master shard;
- ``sharded_param.grad``: a DTensor whose local tensor is the gradient shard (a view
  of the reduce-scatter's output, or of its cast to the parameter's dtype, when
  nothing was accumulated into it);
- ``all_gather_outputs`` (and ``_unsharded_inner_tensors`` for tensor subclasses):
  the unsharded parameters, in the gather dtype. FSDP2 frees and re-allocates them
  by resizing their storages in place (``free_storage``, ``alloc_storage``), which no
  operator does: the tracker reads their size at every moment it takes a total
  ([Note: storages FSDP2 resizes] in ``tracker.py``);
- ``_unsharded_param``: the parameter the module computes with, whose ``.grad`` is
  the unsharded gradient, alive from its accumulation to the group's reduce-scatter.

A group holds its pending all-gather's flat output (``_all_gather_result``), and the
state shared by all groups (``comm_ctx``) holds the last one until the next group's
copy-out is ordered after it (``all_gather_state``), the reduce-scatter inputs still
in flight (``reduce_scatter_states``, or ``reduce_scatter_state`` before 2.13), and
a group its replicas' all-reduce input (``_all_reduce_state``) and the partial
output of an accumulation without reduce (``_partial_reduce_output``). Not read:
the partly gathered copies ``reshard_after_forward=N`` keeps
(``_sharded_post_forward_param_data``) and the unsharded gradients accumulated
without a reduce (``unsharded_accumulated_grad``), left to parts named by when
they were made. These are
FSDP2's private names, checked against torch 2.11 (``_fsdp_param_group``,
``reduce_scatter_state``) and 2.13; a rename leaves those
tensors to a part named by when they were made, or to ``other``, which the
breakdown's FSDP2 test bounds.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

UNSHARDED = "unsharded params"
"""FSDP2's gathered parameters (``all_gather_outputs``): the part isp-comm's pool
slots and outer gather play."""


OPERATOR_PARTS = {"fsdp::all_gather_copy_in": "all-gather buffers", "fsdp::chunk_cat": "reduce-scatter buffers"}
"""FSDP2's own operators (``torch.ops.fsdp``) -> the part of the tensors they make or
write: the flat all-gather buffer its inputs are copied into, and the flat
reduce-scatter input the gradients are copied into. They name a buffer the moment it
is filled, also one that dies before any owner is read (the last unit's
reduce-scatter input, dropped in FSDP2's final callback of a backward). Not
``split_with_sizes_copy``, the copy out to the gathered parameters: for a parameter
sharded on another dimension than the first it writes temporaries, which FSDP2 then
copies in; the gathered parameters are named by their owners."""


def fsdp_modules(model: nn.Module | None) -> list[nn.Module]:
    """The ``fully_shard``-ed modules of ``model`` (none without FSDP2)."""
    if model is None:
        return []
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a build of torch without distributed
        return []
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def param_groups(module: nn.Module) -> list[Any]:
    """The module's FSDP parameter groups (see [Note: what the breakdown reads of FSDP2])."""
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        group = getattr(state, "_fsdp_param_group", None)
        groups = [group] if group is not None else []
    return list(groups)


def _local(t: Any) -> torch.Tensor | None:
    """A DTensor's local tensor, a plain tensor itself (None otherwise)."""
    t = getattr(t, "_local_tensor", t)
    return t if isinstance(t, torch.Tensor) else None


def _groups(modules: list[nn.Module]) -> Iterator[Any]:
    """The modules' parameter groups, each once (a unit of several modules, the final
    norm with the head, has one state)."""
    seen: set[int] = set()
    for module in modules:
        for group in param_groups(module):
            if id(group) not in seen:
                seen.add(id(group))
                yield group


def unsharded_params(modules: list[nn.Module]) -> Iterator[torch.Tensor]:
    """The parameters the modules compute with (made at their first all-gather)."""
    for group in _groups(modules):
        for fp in group.fsdp_params:
            p = getattr(fp, "_unsharded_param", None)
            if p is not None and p.requires_grad:
                yield p


def _group_buffers(group: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """A group's own flat buffers alive now: its pending all-gather's output, its
    replicas' all-reduce input, its partial reduce output."""
    result = getattr(group, "_all_gather_result", None)
    if result is not None:
        yield "all-gather buffers", result.all_gather_output
    all_reduce = getattr(group, "_all_reduce_state", None)
    if all_reduce is not None:
        yield "all-reduce buffers", all_reduce.all_reduce_input
    partial = getattr(group, "_partial_reduce_output", None)
    if partial is not None:
        yield "reduce-scatter buffers", partial


def _context_buffers(ctx: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """The flat buffers the groups' shared state keeps alive now: the last all-gather's
    output, the reduce-scatter inputs in flight."""
    if getattr(ctx, "all_gather_state", None) is not None:
        yield "all-gather buffers", ctx.all_gather_state.all_gather_result.all_gather_output
    states = list(getattr(ctx, "reduce_scatter_states", None) or [])
    if getattr(ctx, "reduce_scatter_state", None) is not None:
        states.append(ctx.reduce_scatter_state)
    for state in states:
        yield "reduce-scatter buffers", state.reduce_scatter_input


def fsdp2_parts(modules: list[nn.Module]) -> Iterator[tuple[str, torch.Tensor]]:
    """(part, tensor) of every buffer the ``fully_shard``-ed ``modules`` hold now (see
    [Note: what the breakdown reads of FSDP2]), in the forecast's parts where isp-comm
    has the same thing (master and gradient shards, reduce-scatter buffers, unsharded
    gradients) and in parts of FSDP2's own where it has not."""
    contexts: dict[int, Any] = {}
    for group in _groups(modules):
        for fp in group.fsdp_params:
            yield "master shards", fp._sharded_param_data
            grad = _local(fp.sharded_param.grad)
            if grad is not None:
                yield "gradient shards", grad
            for t in [
                *(getattr(fp, "all_gather_outputs", None) or []),
                *(getattr(fp, "_unsharded_inner_tensors", None) or []),
            ]:
                yield UNSHARDED, t
            p = getattr(fp, "_unsharded_param", None)
            if p is not None and p.grad is not None:
                yield "block gradients (unsharded)", p.grad
        yield from _group_buffers(group)
        contexts[id(group.comm_ctx)] = group.comm_ctx
    for ctx in contexts.values():  # shared by the groups of one model: read once
        yield from _context_buffers(ctx)
