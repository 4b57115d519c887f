"""WHEN weights are gathered and gradients reduced: the per-block schedule.

Forward: block i waits for its gather, issues block i+1's, computes, releases its slot.
Backward (reverse): ``PreBackward`` of block i waits for block i's re-gather and issues
block i-1's; ``UnshardBlock``'s backward (all of block i's weight gradients exist)
packs them, issues one reduce-scatter and frees the slot. A callback queued on the
autograd engine drains the reduce-scatters when the whole backward has finished.
"""

from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum, auto
from typing import Any

import torch
from torch import nn
from torch.autograd import Variable

from isp_comm.backends.base import Handle, HandleGroup
from isp_comm.hooks.autograd import PreBackward, UnshardBlock
from isp_comm.hooks.casting import cast_floats, map_tensors
from isp_comm.hooks.reductions import GradientReductions, InflightReduce
from isp_comm.hooks.trace import Tracer
from isp_comm.units import BlockUnit


class Phase(Enum):
    IDLE = auto()
    FORWARD = auto()
    BACKWARD = auto()


class UnitState(Enum):
    SHARDED = auto()  # no slot
    GATHERING = auto()  # slot held, collective in flight
    GATHERED = auto()  # slot holds the full weights


@dataclass
class _UnitRuntime:
    state: UnitState = UnitState.SHARDED
    slot: int = -1
    region: torch.Tensor | None = None
    handle: Handle | None = None
    staging: torch.Tensor | None = None
    landing: Any = None  # version-counter guard while peers write the slot directly (module granularity)
    issued_at: float = 0.0  # perf_counter when the gather was issued (tracing)
    backward_at: float = 0.0  # perf_counter when the block's backward began (tracing)
    saved_views: bool = False  # the last forward saved views of the slot for backward
    swapped: list | None = None  # in-block replicated params cast for compute, while swapped in
    reduced: bool = False  # this backward already reduce-scattered the block


@dataclass
class CommCounters:
    all_gathers: int = 0
    reduce_scatters: int = 0
    all_reduces: int = 0
    bytes_gathered: int = 0
    bytes_reduced: int = 0
    exposed_comm_s: float = 0.0


class BlockEngine(GradientReductions):
    """Drives the units through the slot pool and the backend; owned by the communicator."""

    def __init__(self, units, groups, backend, config, pool, rs_buffers, replicated, root=None) -> None:
        self.units: list[BlockUnit] = units
        self.root: BlockUnit | None = root  # parameters outside the blocks, when sharded
        self._root_region: torch.Tensor | None = None
        self.groups = groups
        self.backend = backend
        self.config = config
        self.pool = pool
        self.rs_buffers = rs_buffers
        self.replicated: list[nn.Parameter] = replicated
        self.wp_summed: list[nn.Parameter] = []  # shards whose own backward sums grads over WP (vocab head, embedding)
        self.counters = CommCounters()
        self.phase = Phase.IDLE
        self.events: list[tuple[str, int, str]] | None = None
        self.tracer: Tracer | None = None
        self._rt = [_UnitRuntime() for _ in units]
        self._pending: set[int] = set()
        self._reduces: deque[InflightReduce] = deque()
        self._callback_queued = False
        self._stash: dict[nn.Parameter, torch.Tensor] = {}
        self._send: dict[torch.dtype, torch.Tensor] = {}
        self._rep_flat: dict[tuple[str, torch.dtype], torch.Tensor] = {}
        self._staging_owner: int | None = None
        self._outer_dtype: torch.dtype | None = None  # activations' dtype outside the blocks
        self._failed = False  # a collective failed: peers are gone, never wait again
        self._delay_rng = random.Random(groups.rank) if config.debug_delay_s > 0 else None

    # ---- waiting ------------------------------------------------------------------
    def _wait(self, handle: Handle, what: str) -> float:
        t0 = time.perf_counter()
        try:
            handle.wait(self.config.timeout_s)
        except Exception as exc:
            self._failed = True
            raise type(exc)(f"{what} (rank {self.groups.rank}): {exc}") from exc
        t1 = time.perf_counter()
        self.counters.exposed_comm_s += t1 - t0
        if self.tracer is not None and t1 - t0 > 1e-5:
            self.tracer.add("wait", what, t0, t1)
        return t1

    def _delay(self) -> None:
        if self._delay_rng is not None:
            time.sleep(self._delay_rng.random() * self.config.debug_delay_s)

    def _event(self, kind: str, index: int) -> None:
        if self.events is not None:
            self.events.append((kind, index, self.phase.name.lower()))

    # ---- gathers ------------------------------------------------------------------
    def _start_gather(self, unit: BlockUnit) -> bool:
        """Issue ``unit``'s all-gather into a free slot; False when no slot is free."""
        rt = self._rt[unit.index]
        assert rt.state is UnitState.SHARDED
        dt = unit.gather_dtype
        preferred = rt.slot if rt.slot >= 0 else unit.index % self.config.n_slots
        strict = self.phase is Phase.BACKWARD and rt.saved_views
        slot = self.pool.free_slot(dt, preferred, strict)
        if slot is None:
            return False
        if self._staging_owner is not None:  # one landing buffer: finish the gather using it
            self._finish_gather(self.units[self._staging_owner])
        n = unit.gathered_numel
        region = self.pool.acquire(dt, slot, unit.index, n, unit.index % self.config.n_slots)
        send = unit.flat_shard
        if dt != unit.dtype:  # cast to param_dtype (and, for mixed dtypes, re-laid out)
            buf = self._send.get(dt)
            if buf is None or buf.numel() < unit.shard_numel:
                buf = self._send[dt] = torch.empty(unit.shard_numel, dtype=dt, device=unit.device)
            send = buf[: unit.shard_numel]
            unit.fill_send(send)
        self._delay()
        wp_group = self.groups.wp_group
        n_collectives = 1
        if unit.wp_size == 1:
            with torch.autograd._unsafe_preserve_version_counter(region):
                handle = self.backend.all_gather(region, send, wp_group)
            rt.staging = None
        elif self.config.comm_granularity == "module":
            # [Note: direct landing] peers write the slot itself, possibly from another
            # thread; the views autograd saved from it must not see a version bump
            rt.landing = torch.autograd._unsafe_preserve_version_counter(region)
            rt.landing.__enter__()
            slices = unit.param_major_slices(region, unit.gather)
            handle = HandleGroup([self.backend.all_gather(r, send[s], wp_group) for r, s in slices])
            n_collectives, rt.staging = len(slices), None
        else:
            rt.staging = self.pool.staging(dt, n)
            handle = self.backend.all_gather(rt.staging, send, wp_group)
            self._staging_owner = unit.index
        rt.state, rt.slot, rt.region, rt.handle = UnitState.GATHERING, slot, region, handle
        self.counters.all_gathers += n_collectives
        self.counters.bytes_gathered += n * dt.itemsize
        rt.issued_at = time.perf_counter()
        self._event("all_gather", unit.index)
        if not self.config.overlap:
            self._finish_gather(unit)
        return True

    def _finish_gather(self, unit: BlockUnit) -> None:
        rt = self._rt[unit.index]
        if rt.state is not UnitState.GATHERING:
            return
        done = self._wait(rt.handle, f"all-gather of block {unit.index}")
        if self.tracer is not None:
            self.tracer.add("all-gather", f"block {unit.index}", rt.issued_at, done)
        if rt.staging is not None:
            with torch.autograd._unsafe_preserve_version_counter(rt.region):
                unit.copy_out(rt.staging, rt.region)
            rt.staging = None
            self._staging_owner = None
        if rt.landing is not None:
            rt.landing.__exit__(None, None, None)
            rt.landing = None
        rt.state, rt.handle = UnitState.GATHERED, None

    def ensure_gathered(self, unit: BlockUnit) -> torch.Tensor:
        rt = self._rt[unit.index]
        if rt.state is UnitState.SHARDED and not self._start_gather(unit):
            dt = unit.gather_dtype
            owners = [self.pool.owner(dt, i) for i in range(self.config.n_slots)]
            raise RuntimeError(
                f"isp-comm: block {unit.index} needs slot {rt.slot} but the slots are held by "
                f"blocks {owners}; blocks must run in the order of the block list"
            )
        self._finish_gather(unit)
        assert rt.region is not None
        return rt.region

    def prefetch(self, index: int) -> None:
        if not self.config.overlap or not 0 <= index < len(self.units):
            return
        if self._rt[index].state is UnitState.SHARDED and not self._start_gather(self.units[index]):
            self._pending.add(index)

    def release(self, unit: BlockUnit) -> None:
        rt = self._rt[unit.index]
        if rt.state is UnitState.SHARDED:
            return
        self._finish_gather(unit)
        self.pool.release(unit.gather_dtype, rt.slot, unit.index, unit.gathered_numel)
        rt.state, rt.region = UnitState.SHARDED, None
        for i in sorted(self._pending):
            if self._rt[i].state is not UnitState.SHARDED or self._start_gather(self.units[i]):
                self._pending.discard(i)

    # ---- forward ------------------------------------------------------------------
    def root_pre_forward(self) -> None:
        """Forward begins: stash replicated grads of earlier micro-steps, fetch block 0."""
        if torch.is_grad_enabled() and self.phase is Phase.IDLE:
            for p in (*self.replicated, *self.wp_summed):
                if p.grad is not None and p not in self._stash:
                    self._stash[p] = p.grad
                    p.grad = None
            self.phase = Phase.FORWARD
        if self.units:
            self.prefetch(0)
        if self.root is not None:
            self._root_forward()

    def _root_forward(self) -> None:
        """Gather the outer parameters (embedding, head, ...) for this forward, outside
        the slot pool; they stay gathered until their gradients exist."""
        root = self.root
        if self._root_region is None:
            rank_major = torch.empty(root.gathered_numel, dtype=root.dtype, device=root.device)
            self._delay()
            handle = self.backend.all_gather(rank_major, root.flat_shard, self.groups.wp_group)
            self.counters.all_gathers += 1
            self.counters.bytes_gathered += rank_major.numel() * rank_major.element_size()
            t0 = time.perf_counter()
            done = self._wait(handle, "all-gather of the parameters outside the blocks")
            if self.tracer is not None:
                self.tracer.add("all-gather", "outer parameters", t0, done)
            region = torch.empty_like(rank_major)
            root.copy_out(rank_major, region)
            self._root_region = region
        if torch.is_grad_enabled():
            root.refresh_trainable()
        if torch.is_grad_enabled() and root.requires_grad:
            views = list(UnshardBlock.apply(root.anchor, self, root, self._root_region))
        else:
            views = [v.detach() for v in root.full_views(self._root_region)]
        root.swap_in(views)

    def root_post_forward(self) -> None:
        """Forward done: the model's outer parameters are shards again (autograd keeps
        the gathered views it saved); without a backward to come, free them now."""
        if self.root is None:
            return
        self.root.swap_out()
        if not torch.is_grad_enabled():
            self._root_region = None

    def _swap_in(self, unit: BlockUnit, region: torch.Tensor) -> None:
        """Point the block's linears at full views of its slot (and cast in-block
        replicated params to ``param_dtype``). With grad enabled the views come out of
        an ``UnshardBlock`` node, whose backward marks the end of the block's backward."""
        rt = self._rt[unit.index]
        assert rt.swapped is None, f"block {unit.index} is already swapped in"
        if torch.is_grad_enabled() and unit.requires_grad:
            views = list(UnshardBlock.apply(unit.anchor, self, unit, region))
        else:
            views = [v.detach() for v in unit.full_views(region)]
        unit.swap_in(views)
        dtype = self.config.param_dtype
        rt.swapped = [rp for rp in unit.replicated if dtype is not None and rp.param.dtype != dtype]
        for rp in rt.swapped:
            rp.module._parameters[rp.name] = rp.param.to(dtype)

    def _swap_out(self, unit: BlockUnit) -> None:
        rt = self._rt[unit.index]
        if rt.swapped is None:
            return
        unit.swap_out()
        for rp in rt.swapped:
            rp.module._parameters[rp.name] = rp.param
        rt.swapped = None

    def block_forward(self, unit: BlockUnit, orig: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """The block's forward, wrapped. Also runs for a recompute in backward when the
        checkpoint sits outside this wrapper (ours, or one around ``Module.__call__``)."""
        rt = self._rt[unit.index]
        out_dtype = None
        if self.config.param_dtype is not None:
            if unit.index == 0:  # the dtype the rest of the model works in
                floats: list[torch.dtype] = []
                map_tensors((args, kwargs), lambda t: floats.append(t.dtype) if t.is_floating_point() else None)
                self._outer_dtype = floats[0] if floats else None
            if unit.index == len(self.units) - 1:
                out_dtype = self._outer_dtype
            args, kwargs = cast_floats((args, kwargs), self.config.param_dtype)
        if torch._C._current_autograd_node() is not None:  # recompute inside backward
            self._enter_backward()
            if rt.swapped is not None:  # swapped in for this block's backward already
                return orig(*args, **kwargs)
            region = self.ensure_gathered(unit)
            self.prefetch(unit.index - 1)
            self._swap_in(unit, region)
            try:
                return orig(*args, **kwargs)
            finally:
                self._swap_out(unit)
        if torch.is_grad_enabled():
            unit.refresh_trainable()  # before this forward: its backward reduces what it saw
        region = self.ensure_gathered(unit)
        self.prefetch(unit.index + 1)
        rt.saved_views = torch.is_grad_enabled()
        rt.reduced = False
        self._event("compute", unit.index)
        self._swap_in(unit, region)
        t0 = time.perf_counter()
        try:
            out = orig(*args, **kwargs)
        finally:
            self._swap_out(unit)
        if self.tracer is not None:
            self.tracer.add("compute", f"forward block {unit.index}", t0, time.perf_counter())
        if out_dtype is not None:
            out = cast_floats(out, out_dtype)
        self.release(unit)
        if torch.is_grad_enabled():
            out = self._mark_pre_backward(unit, out)
        return out

    def _mark_pre_backward(self, unit: BlockUnit, out: Any) -> Any:
        tensors: list[torch.Tensor] = []
        map_tensors(out, lambda t: tensors.append(t) if t.requires_grad else None)
        if not tensors:
            return out
        marked = iter(PreBackward.apply(self, unit, *tensors))
        return map_tensors(out, lambda t: next(marked) if t.requires_grad else t)

    # ---- backward -----------------------------------------------------------------
    def _enter_backward(self) -> None:
        self.phase = Phase.BACKWARD
        if not self._callback_queued:
            self._callback_queued = True
            Variable._execution_engine.queue_callback(self.end_backward)

    def pre_backward(self, unit: BlockUnit) -> None:
        """Block ``unit``'s backward is next: its weights stay swapped in until its
        gradients exist, so a recompute that calls the block's original forward
        directly (a checkpoint inside the wrapper, as transformers does) sees them."""
        self._enter_backward()
        later = unit.index + 1
        if later < len(self.units) and not self.units[later].requires_grad:
            # a block with nothing trainable has no post-backward: its backward (input
            # gradients only) is over once the block before it begins, so free its slot
            self._swap_out(self.units[later])
            self.release(self.units[later])
        region = self.ensure_gathered(unit)
        self.prefetch(unit.index - 1)
        self._event("compute", unit.index)
        self._rt[unit.index].backward_at = time.perf_counter()
        with torch.enable_grad():
            self._swap_in(unit, region)

    def post_backward(self, unit: BlockUnit, grads: tuple[torch.Tensor | None, ...]) -> None:
        self._enter_backward()
        if unit is self.root:
            self._post_backward_root(grads)
            return
        rt = self._rt[unit.index]
        assert not rt.reduced, f"block {unit.index}'s gradients were produced twice in one backward"
        rt.reduced = True
        self._swap_out(unit)
        if self.tracer is not None and rt.backward_at:
            self.tracer.add("compute", f"backward block {unit.index}", rt.backward_at, time.perf_counter())
        module = self.config.comm_granularity == "module" and unit.wp_size > 1
        for i, group in enumerate(unit.groups):  # one reduce-scatter per dtype group
            while len(self._reduces) >= self.config.max_inflight_reduce_scatter:
                self._complete_reduce(self._reduces.popleft())
            pair = self.rs_buffers.acquire(group.dtype, group.gathered_numel)
            inp, out = pair[0][: group.gathered_numel], pair[1][: group.shard_numel]
            (unit.pack_grads_param_major if module else unit.pack_grads)(grads, inp, group)
            if i == len(unit.groups) - 1:
                self.release(unit)
            self._issue_reduce(unit, group, pair, inp, out, module)

    def end_backward(self) -> None:
        """Drain reduce-scatters, average replicated grads, return to IDLE. Idempotent."""
        if self.phase is not Phase.BACKWARD:
            return
        while self._reduces:
            self._complete_reduce(self._reduces.popleft())
        self._pending.clear()
        for unit in self.units:  # blocks whose weights got no gradient still hold slots
            self._swap_out(unit)
            self.release(unit)
            self._rt[unit.index].reduced = False
        self._root_region = None
        self._reduce_replicated()
        self.phase = Phase.IDLE
        self._callback_queued = False

    # ---- introspection ---------------------------------------------------------------
    def outstanding(self) -> int:
        gathers = sum(rt.state is UnitState.GATHERING for rt in self._rt)
        return gathers + len(self._reduces)

    def close(self) -> None:
        if self._failed:  # abandon in-flight collectives: their peers are gone
            for unit, rt in zip(self.units, self._rt):
                self._swap_out(unit)
                if rt.state is not UnitState.SHARDED:
                    self.pool.release(unit.gather_dtype, rt.slot, unit.index, unit.gathered_numel)
                rt.state, rt.handle, rt.region, rt.landing = UnitState.SHARDED, None, None, None
            self._reduces.clear()
            self._staging_owner = None
        else:
            if self.phase is Phase.BACKWARD:
                self.end_backward()
            for unit in self.units:
                self.release(unit)
        self._send.clear()
        self._rep_flat.clear()
        self._root_region = None
        if self.root is not None:
            self.root.swap_out()
