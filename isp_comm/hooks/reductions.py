"""The gradient half of the engine: reduce-scatters of sharded gradients (bounded in
flight, drained into ``.grad``) and the averaging of gradients autograd left whole.

:class:`GradientReducer` is owned by the :class:`~isp_comm.hooks.engine.BlockEngine`
and given everything it uses: the communication context, the groups, the backend,
the reduce-scatter buffers and the parameters it averages.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from isp_comm.backends.base import Backend, CompletedHandle, Handle, HandleGroup
from isp_comm.config import ISPConfig
from isp_comm.context import CommContext
from isp_comm.groups import ParallelGroups
from isp_comm.layout import ReduceGroup
from isp_comm.memory_pool import ReduceScatterBuffers
from isp_comm.units import BlockUnit

LOW_PRECISION = (torch.float16, torch.bfloat16)


def divide_factors(world: int) -> tuple[float, float]:
    """(pre, post) with pre * post = world: an fp16 / bf16 sum over ``world`` ranks is
    divided by ``pre`` before it is reduced and by ``post`` after, so that neither the
    partial sums overflow nor small gradients underflow (FSDP2 divides the same way).
    fp32 sums are divided once, after: the order the fp32 parity tests hold bitwise."""
    if world <= 1:
        return 1.0, 1.0
    pre = 1
    while world % pre == 0 and world / pre > pre:
        pre *= 2
    return float(pre), world / pre


@dataclass
class InflightReduce:
    unit: BlockUnit
    group: ReduceGroup
    pair: tuple[torch.Tensor, torch.Tensor]
    out: torch.Tensor
    handle: Handle
    issued_at: float
    pooled: bool  # ``pair`` came from the reduce-scatter buffers (the root's are its own)


class GradientReducer:
    """Reduce-scatter issue and completion, replica all-reduce, DDP-style averaging.

    At most ``config.max_inflight_reduce_scatter`` reduce-scatters are in flight: the
    oldest is completed before another is issued, which bounds gradient buffers."""

    def __init__(
        self,
        ctx: CommContext,
        groups: ParallelGroups,
        backend: Backend,
        config: ISPConfig,
        rs_buffers: ReduceScatterBuffers,
        replicated: list[nn.Parameter],
    ) -> None:
        self.ctx, self.groups, self.backend, self.config = ctx, groups, backend, config
        self.rs_buffers = rs_buffers
        self.replicated = replicated
        self.wp_summed: list[nn.Parameter] = []
        """Shards whose own backward sums their gradients over WP (vocab-parallel head,
        hidden-split embedding): averaged over replicas only."""
        self.inflight: deque[InflightReduce] = deque()
        self._pre, self._post = divide_factors(groups.world_size)
        self._stash: dict[nn.Parameter, torch.Tensor] = {}
        self._flat: dict[tuple[str, torch.dtype], torch.Tensor] = {}

    # ---- sharded gradients ------------------------------------------------------------
    def _make_room(self) -> None:
        while len(self.inflight) >= self.config.max_inflight_reduce_scatter:
            self._complete(self.inflight.popleft())

    def reduce_block(
        self, unit: BlockUnit, grads: tuple[torch.Tensor | None, ...], module: bool, packed: Callable[[], None]
    ) -> None:
        """Pack ``unit``'s gradients into pooled buffers and reduce-scatter them, one
        collective per dtype group (one per parameter when ``module``); ``packed()``
        runs once the last group is packed (the slot may then be freed)."""
        for i, group in enumerate(unit.groups):
            self._make_room()
            pair = self.rs_buffers.acquire(group.dtype, group.gathered_numel)
            inp, out = pair[0][: group.gathered_numel], pair[1][: group.shard_numel]
            (unit.pack_grads_param_major if module else unit.pack_grads)(grads, inp, group)
            if i == len(unit.groups) - 1:
                packed()
            self._issue(unit, group, pair, inp, out, module, pooled=True)

    def reduce_root(self, root: BlockUnit, grads: tuple[torch.Tensor | None, ...]) -> None:
        """The outer parameters' gradients, in buffers of their own (not the pool's)."""
        for group in root.groups:
            self._make_room()
            inp = torch.empty(group.gathered_numel, dtype=group.dtype, device=root.device)
            out = torch.empty(group.shard_numel, dtype=group.dtype, device=root.device)
            root.pack_grads(grads, inp, group)
            self._issue(root, group, (inp, out), inp, out, module=False, pooled=False)

    def _issue(self, unit, group, pair, inp: torch.Tensor, out: torch.Tensor, module: bool, pooled: bool) -> None:
        if group.dtype in LOW_PRECISION and self._pre > 1:  # see divide_factors
            inp.div_(self._pre)
        self.ctx.delay()
        wp = self.groups.wp_group
        if self.groups.wp_size == 1:  # the packed gradients are the reduced shard already
            out, handle = inp, CompletedHandle()
            self.ctx.counters.reduce_scatters += 1
        elif module:
            slices = unit.param_major_slices(inp, group.layout)
            handle = HandleGroup([self.backend.reduce_scatter(out[s], r, wp) for r, s in slices])
            self.ctx.counters.reduce_scatters += len(slices)
        else:
            handle = self.backend.reduce_scatter(out, inp, wp)
            self.ctx.counters.reduce_scatters += 1
        self.ctx.counters.bytes_reduced += inp.numel() * inp.element_size()
        if pooled:
            self.ctx.event("reduce_scatter", unit.index, "backward")
        self.inflight.append(InflightReduce(unit, group, pair, out, handle, time.perf_counter(), pooled))
        if not self.config.overlap:
            self._complete(self.inflight.popleft())

    def _complete(self, r: InflightReduce) -> None:
        what = f"block {r.unit.index}"
        self.ctx.wait(r.handle, f"reduce-scatter of {what}", ("reduce-scatter", what, r.issued_at))
        if self.groups.replica_size > 1:
            self.ctx.delay()
            self.ctx.counters.all_reduces += 1
            self.ctx.wait(self.backend.all_reduce(r.out, self.groups.replica_group), f"replica all-reduce of {what}")
        if self.groups.world_size > 1:
            r.out.div_(self._post if r.group.dtype in LOW_PRECISION else self.groups.world_size)
        r.unit.accumulate_grad(r.out, r.group)
        if r.pooled:
            self.rs_buffers.release(r.group.dtype, r.pair)

    def drain(self) -> None:
        while self.inflight:
            self._complete(self.inflight.popleft())

    # ---- gradients autograd left whole ------------------------------------------------------
    def stash(self) -> None:
        """A forward with grad begins: keep earlier micro-steps' gradients of the
        whole-gradient parameters aside (added back once this backward's are averaged)."""
        for p in (*self.replicated, *self.wp_summed):
            if p.grad is not None and p not in self._stash:
                self._stash[p] = p.grad
                p.grad = None

    def reduce_whole(self) -> None:
        """Average the gradients autograd left whole: replicated parameters over the
        world; shards never gathered (the vocab-parallel head, the hidden-split
        embedding: already summed over WP in their own backward) over the replica
        group. Earlier micro-steps' stashed grads are added back."""
        world = self.groups.world_size
        for params, group, size, what in (
            (self.replicated, self.groups.world_group, world, "replicated gradients"),
            (self.wp_summed, self.groups.replica_group, self.groups.replica_size, "WP-summed shard gradients"),
        ):
            params = [p for p in params if p.requires_grad]
            by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
            for p in params:
                by_dtype.setdefault(p.dtype, []).append(p)
            for dt, ps in by_dtype.items():
                if world > 1:
                    self._average(ps, dt, group, size, world, what)
                for p in ps:
                    old = self._stash.pop(p, None)
                    if old is not None and p.grad is not None:
                        p.grad = old.add_(p.grad)
                    elif old is not None:
                        p.grad = old
        self._stash.clear()

    def _average(self, ps: list[nn.Parameter], dt: torch.dtype, group, size: int, world: int, what: str) -> None:
        """Sum ``ps``' grads over ``group`` (one flat all-reduce) and divide by ``world``."""
        total = sum(p.numel() for p in ps)
        flat = self._flat.get((what, dt))
        if flat is None:
            flat = self._flat[(what, dt)] = torch.empty(total, dtype=dt, device=ps[0].device)
        off = 0
        for p in ps:
            piece = flat[off : off + p.numel()].view_as(p)
            piece.copy_(p.grad) if p.grad is not None else piece.zero_()
            off += p.numel()
        if size > 1:
            self.ctx.delay()
            self.ctx.counters.all_reduces += 1
            t0 = time.perf_counter()
            self.ctx.wait(self.backend.all_reduce(flat, group), f"all-reduce of {what}", ("all-reduce", what, t0))
        flat.div_(world)
        off = 0
        for p in ps:
            piece = flat[off : off + p.numel()].view_as(p)
            off += p.numel()
            if p.grad is None:
                p.grad = piece.clone()
            else:
                p.grad.copy_(piece)

    def close(self, abandon: bool) -> None:
        """Drop the buffers; ``abandon``: forget in-flight reduce-scatters (their peers
        are gone) instead of completing them."""
        if abandon:
            self.inflight.clear()
        else:
            self.drain()
        self._flat.clear()
