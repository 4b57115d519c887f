"""Which part of the forecast each tensor that an ``ISPCommunicator``, its model and its
optimizer own belongs to: read from the objects themselves, not guessed from sizes.

[Note: what the breakdown reads of the engine]
The engine's buffers are found where the engine keeps them: every unit's
``master`` and its shards' ``.grad`` (one flat buffer per unit, [Note: grad
aliasing]), and with pieces its ``flat_shard`` apart (the WP shard in the gather
dtype) and the replica all-gather's send and landing buffers
(``WeightRefresh._buffers``); the pool's slots, landing and cast send buffers (``SlotPool._slots``,
``_staging``, ``_send``; without the pool, the cast send buffers the gathers keep,
``GatherResources.send``) and the reduce-scatter pairs, free or in flight
(``ReduceScatterBuffers._made``, without the pool ``_lent``; with ``release_reduce_buffers`` they are made in a
backward and dropped when it ends, so the tracker reads the owners once more before
the engine's end of backward: [Note: how a storage gets its part] in
``tracker.py``); the outer unit's gathered region (``BlockEngine._root_region``) and
the outer parameters' casts (``BlockEngine._outer_cast``); the whole-gradient buckets
(``GradientReducer._buckets``) and the gradients stashed between micro-steps
(``GradientReducer._stash``); the CPU shared-memory backend's segments
(``SymmCpuBackend._groups``: control, scratch, the peers' buffers). These are private
names of other modules: a rename there leaves a buffer to a part named by when it was
made, or to ``other``, which the breakdown's tests bound (2% of the peak) beside
lines the forecast counts to the byte, so it cannot go unseen.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from isp_comm.memory_breakdown.fsdp2 import fsdp2_parts


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


def communicator_parts(comm: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """(part, tensor) of every buffer ``comm`` (an ``ISPCommunicator``) holds now (see
    [Note: what the breakdown reads of the engine])."""
    for unit in comm.sharded_units:
        yield "master shards", unit.master
        if unit.flat_shard is not unit.master:  # pieces: the WP shard the gathers read, apart
            yield "WP shards (gather dtype)", unit.flat_shard
        for shard in unit.shards:
            if shard.grad is not None:
                yield "gradient shards", shard.grad
    pool = comm.pool
    for part, buffers in (
        ("pool slots and landing", getattr(pool, "_slots", {})),
        ("pool slots and landing", getattr(pool, "_staging", {})),
        ("pool slots and landing", getattr(pool, "_send", {})),
        ("reduce-scatter buffers", getattr(comm.rs_buffers, "_made", {})),
        ("reduce-scatter buffers", getattr(comm.rs_buffers, "_lent", [])),
    ):
        for t in _tensors(buffers):
            yield part, t
    engine = comm.engine
    for t in getattr(getattr(engine, "_res", None), "send", {}).values():  # the cast send buffers kept without the pool
        yield "pool slots and landing", t
    region = getattr(engine, "_root_region", None)
    if region is not None:
        yield "outer gather", region
    for rp, _master in getattr(engine, "_outer_cast", None) or []:
        cast = rp.module._parameters.get(rp.name)
        if cast is not None:
            yield "cast copies", cast
    refresh = getattr(engine, "refresh", None)
    for t in _tensors(list(getattr(refresh, "_buffers", {}).values())):
        yield "replica gather buffers", t
    reducer = engine.reducer
    for bucket in getattr(reducer, "_buckets", []):
        if bucket.flat is not None:
            yield "all-reduce buffers", bucket.flat
    for t in getattr(reducer, "_stash", {}).values():
        yield "replicated grads", t
    for waiting in getattr(reducer, "_deferred", {}).values():  # [Note: replica reductions deferred]
        yield "deferred gradient sums", waiting.total
    yield from shared_memory_parts(comm.backend)


SHARED = "shared memory"
"""The parts of mapped shared-memory segments (each a byte tensor over its whole
mapping): the tracker counts the pages of each that this process has touched, as its
RSS does ([Note: shared segments count their resident pages] in ``tracker.py``)."""


def shared_memory_parts(backend: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """The CPU shared-memory backend's segments (``SymmCpuBackend._groups``): every
    group's control and scratch segments, and the peers' segments of its symmetric
    buffers (this rank's own are the pool's), as the forecast names them."""
    for g in getattr(backend, "_groups", {}).values():
        if g is None:
            continue
        for seg in [g.ctrl, *g.scratch]:
            yield f"{SHARED}: collective scratch", seg.bytes
        if g.acc is not None:
            yield f"{SHARED}: collective scratch", g.acc
        for _base, _nbytes, segments in g.buffers:
            for r, seg in enumerate(segments):
                if r != g.me:
                    yield f"{SHARED}: peers' pool pages", seg.bytes


def model_parts(model: nn.Module, sharded: set[int]) -> Iterator[tuple[str, torch.Tensor]]:
    """(part, tensor) of the model's parameters that are not shards (``sharded``: the
    ids of the units' shard parameters) and of their gradients, and of its buffers;
    what stands in a parameter's place during a forward (a cast, a gathered view) is
    the communicator's."""
    for p in model.parameters():
        if id(p) in sharded or not p.is_leaf:  # not a leaf: a cast or a gathered view, standing in for a forward
            continue
        yield "replicated params", p
        if p.grad is not None:
            yield "replicated grads", p.grad
    for b in model.buffers():
        yield "replicated params", b


def optimizer_parts(optimizer: torch.optim.Optimizer) -> Iterator[tuple[str, torch.Tensor]]:
    """(part, tensor) of the optimizer's state (AdamW's moments and steps, momenta)."""
    for state in optimizer.state.values():
        for t in _tensors(state):
            yield "optimizer state", t


def owned_parts(
    comm: Any, optimizers: list[torch.optim.Optimizer], model: nn.Module | None, fsdp: Sequence[nn.Module] = ()
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every owned tensor's part: the communicator's buffers first (a shard's storage is
    a master shard, not a replicated parameter), then those of FSDP2's units
    (``fsdp``: the model's ``fully_shard``-ed modules), then the model's, then the
    optimizers'."""
    sharded: set[int] = set()
    if comm is not None:
        sharded = {id(s) for unit in comm.sharded_units for s in unit.shards}
        yield from communicator_parts(comm)
    yield from fsdp2_parts(list(fsdp))
    if model is not None:
        yield from model_parts(model, sharded)
    for opt in optimizers:
        yield from optimizer_parts(opt)
