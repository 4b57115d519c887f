"""The gradient half of the engine: reduce-scatters of sharded gradients (bounded in
flight, drained into ``.grad``) and the averaging of gradients autograd left whole.

A mixin of :class:`~isp_comm.hooks.engine.BlockEngine`: it uses the engine's config,
groups, backend, counters, tracer, buffers and waits, and owns no state of its own.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import nn

from isp_comm.backends.base import Handle, HandleGroup
from isp_comm.units import BlockUnit, ReduceGroup


@dataclass
class InflightReduce:
    unit: BlockUnit
    group: ReduceGroup
    pair: tuple[torch.Tensor, torch.Tensor]
    out: torch.Tensor
    handle: Handle
    issued_at: float


class GradientReductions:
    """Reduce-scatter issue and completion, replica all-reduce, DDP-style averaging."""

    def _issue_reduce(
        self, unit: BlockUnit, group: ReduceGroup, pair, inp: torch.Tensor, out: torch.Tensor, module: bool
    ) -> None:
        self._delay()
        wp = self.groups.wp_group
        if module:
            slices = unit.param_major_slices(inp, group.layout)
            handle = HandleGroup([self.backend.reduce_scatter(out[s], r, wp) for r, s in slices])
            self.counters.reduce_scatters += len(slices)
        else:
            handle = self.backend.reduce_scatter(out, inp, wp)
            self.counters.reduce_scatters += 1
        self.counters.bytes_reduced += inp.numel() * inp.element_size()
        if unit is not self.root:
            self._event("reduce_scatter", unit.index)
        self._reduces.append(InflightReduce(unit, group, pair, out, handle, time.perf_counter()))
        if not self.config.overlap:
            self._complete_reduce(self._reduces.popleft())

    def _post_backward_root(self, grads: tuple[torch.Tensor | None, ...]) -> None:
        root = self.root
        self._root_region = None
        for group in root.groups:  # the root's buffers are its own, not the pool's
            while len(self._reduces) >= self.config.max_inflight_reduce_scatter:
                self._complete_reduce(self._reduces.popleft())
            inp = torch.empty(group.gathered_numel, dtype=group.dtype, device=root.device)
            out = torch.empty(group.shard_numel, dtype=group.dtype, device=root.device)
            root.pack_grads(grads, inp, group)
            self._issue_reduce(root, group, (inp, out), inp, out, module=False)

    def _complete_reduce(self, r: InflightReduce) -> None:
        done = self._wait(r.handle, f"reduce-scatter of block {r.unit.index}")
        if self.tracer is not None:
            self.tracer.add("reduce-scatter", f"block {r.unit.index}", r.issued_at, done)
        if self.groups.replica_size > 1:
            self._delay()
            self.counters.all_reduces += 1
            h = self.backend.all_reduce(r.out, self.groups.replica_group)
            self._wait(h, f"replica all-reduce of block {r.unit.index}")
        r.out.div_(self.groups.world_size)
        r.unit.accumulate_grad(r.out, r.group)
        if r.unit is not self.root:
            self.rs_buffers.release(r.group.dtype, r.pair)

    def _reduce_replicated(self) -> None:
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
        flat = self._rep_flat.get((what, dt))
        if flat is None:
            flat = self._rep_flat[(what, dt)] = torch.empty(total, dtype=dt, device=ps[0].device)
        off = 0
        for p in ps:
            piece = flat[off : off + p.numel()].view_as(p)
            piece.copy_(p.grad) if p.grad is not None else piece.zero_()
            off += p.numel()
        if size > 1:
            self._delay()
            self.counters.all_reduces += 1
            t0 = time.perf_counter()
            done = self._wait(self.backend.all_reduce(flat, group), f"all-reduce of {what}")
            if self.tracer is not None:
                self.tracer.add("all-reduce", what, t0, done)
        flat.div_(world)
        off = 0
        for p in ps:
            piece = flat[off : off + p.numel()].view_as(p)
            off += p.numel()
            if p.grad is None:
                p.grad = piece.clone()
            else:
                p.grad.copy_(piece)
