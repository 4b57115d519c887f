"""One block's runtime state and its transitions: unshard, wait, reshard, swap in and out.

The engine decides *when* (block order, prefetch, backward); a :class:`BlockState`
knows *how* one block moves between its states, and what each state holds.

[Note: what each state holds]
``SHARDED``: only the unit's flat shard (its own memory); no slot.
``GATHERING``: a pool slot is held and an all-gather is in flight into it, or into
the one shared landing buffer (``comm_granularity="block"``; copied into the slot,
param-major, when waited), or straight into the slot from the peers
(``comm_granularity="module"``).
``GATHERED``: the slot holds the block's full weights, param-major.
Swapped in (any gathered state): the block's modules point at views of the slot.

[Note: who swaps a block]
The state alone swaps a block's modules in and out of its slot: ``swap_in`` for a
compute, ``swap_out`` when a compute ends but the block stays gathered (a recompute
in backward, a forward that raised, the end of the block's backward), and on every
way back to SHARDED (``reshard``, ``abandon``), so a freed slot is never pointed at.
The engine asks for these transitions and never swaps a block's unit itself. One
block's forward thus moves engine.py -> block_state.py -> units.py and back at most
3 times (tests/test_block_path.py counts it).

[Note: direct landing]
With ``comm_granularity="module"`` peers write the slot itself, possibly from
another thread, while autograd may hold views of it saved by the last forward;
the slot's version counter is frozen from issue to wait so those views do not see
a bump. The guard is entered in :meth:`BlockState.unshard` and always left, by
:meth:`BlockState.wait_for_unshard` (also when the wait fails) or
:meth:`BlockState.abandon`.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from enum import Enum, auto
from typing import Any

import torch

from isp_comm.backends.base import Backend, CompletedHandle, Handle, HandleGroup, kept_empty
from isp_comm.config import ISPConfig
from isp_comm.context import CommContext
from isp_comm.hooks.autograd import BackwardHooks, UnshardBlock
from isp_comm.hooks.casting import cast_params_in, cast_params_out
from isp_comm.hooks.refresh import WeightRefresh
from isp_comm.memory_pool import SlotPool, gather_landing
from isp_comm.units import BlockUnit


def swap_in_views(unit: BlockUnit, region: torch.Tensor, hooks: BackwardHooks) -> list[torch.Tensor]:
    """Point ``unit``'s modules at full views of its gathered ``region``: out of an
    ``UnshardBlock`` node when grad is enabled and the unit trains (its backward marks
    the end of the unit's backward), else detached. A block's state swaps it in
    through this; the engine swaps the root unit (outside the pool) in through it too.
    Returns the views."""
    if torch.is_grad_enabled() and unit.requires_grad:
        views = list(UnshardBlock.apply(unit.anchor, hooks, unit, region))
    else:
        views = [v.detach() for v in unit.full_views(region)]
    unit.swap_in(views)
    return views


class GatherState(Enum):
    SHARDED = auto()
    GATHERING = auto()
    GATHERED = auto()


@dataclass
class GatherResources:
    """What every block's gathers share: the pool, the backend, the landing buffer's
    current owner and the cast send buffers (one per dtype)."""

    ctx: CommContext
    config: ISPConfig
    backend: Backend
    pool: SlotPool
    wp_group: Any
    refresh: WeightRefresh | None = None
    """Brings a stale WP shard up to date before its gather (see [Note: refreshing the WP shards])."""
    send: dict[torch.dtype, torch.Tensor] = field(default_factory=dict)
    staging_owner: BlockState | None = None


class BlockState:
    """The runtime state of one block (see the notes above)."""

    def __init__(self, unit: BlockUnit, res: GatherResources) -> None:
        self.unit, self.res = unit, res
        self.landing = gather_landing(unit.wp_size, res.config.comm_granularity)  # fixed at wrap
        self.state = GatherState.SHARDED
        self.slot = -1  # the slot of the last gather (reused when free)
        self.region: torch.Tensor | None = None
        self.handle: Handle | None = None
        self.issued_at: Any = None  # the last gather's issue mark (tracing, see CommContext.issued)
        self.backward_at: Any = None  # when the block's backward began (tracing)
        self.saved_views = False  # the last forward saved views of the slot for backward
        self._forwards: list[weakref.ref] = []  # the graph nodes of forwards with grad (see views_held)
        self._staging: torch.Tensor | None = None
        self._landing: Any = None
        self._cast: list | None = None  # in-block replicated params cast while swapped in
        self._versions: tuple[int, ...] | None = None  # the shards' at the last forward with grad

    @property
    def swapped_in(self) -> bool:
        return self._cast is not None

    @property
    def views_held(self) -> bool:
        """A forward with grad since the last backward took views of the slot, and its
        graph is alive: the views may be saved for a backward still to come (see
        [Note: forwards before one backward])."""
        return any(ref() is not None for ref in self._forwards)

    def end_backward(self) -> None:
        """The backward is over: the graphs it ran freed what they saved."""
        self._forwards.clear()
        self._versions = None

    # ---- SHARDED -> GATHERING -> GATHERED ------------------------------------------------
    def unshard(self, backward: bool) -> bool:
        """Take a free slot and issue the all-gather into it; ``False`` (nothing done)
        when no slot is free. In backward, a block whose forward saved views of its
        slot must get that same slot back."""
        assert self.state is GatherState.SHARDED
        unit, res = self.unit, self.res
        dt = unit.gather_dtype
        n_slots = res.config.n_slots
        preferred = self.slot if self.slot >= 0 else unit.index % n_slots
        slot = res.pool.free_slot(dt, preferred, (backward and self.saved_views) or self.views_held)
        if slot is None:
            return False
        if res.refresh is not None:
            res.refresh.ensure(unit)
        if res.staging_owner is not None:  # one landing buffer: finish the gather using it
            res.staging_owner.wait_for_unshard()
        n = unit.gathered_numel
        region = res.pool.acquire(dt, slot, unit.index, n, unit.index % n_slots)
        n_collectives = 1
        if self.landing == "slot":  # wp 1: the gather is one cast (or copy) straight into the slot
            with torch.autograd._unsafe_preserve_version_counter(region):
                unit.fill_send(region)
            handle: Handle = CompletedHandle()
        else:
            send = unit.flat_shard
            if dt != unit.dtype:  # cast to param_dtype (and, for mixed dtypes, re-laid out)
                buf = res.send.get(dt)
                if buf is None or buf.numel() < unit.shard_numel:  # the pool's (symmetric), else its own
                    buf = res.pool.send(dt, unit.shard_numel)
                    if buf is None:
                        buf = kept_empty(unit.shard_numel, dt, unit.device)
                    res.send[dt] = buf
                send = buf[: unit.shard_numel]
                unit.fill_send(send)
            res.ctx.delay()
            if self.landing == "per-parameter":
                self._landing = torch.autograd._unsafe_preserve_version_counter(region)  # [Note: direct landing]
                self._landing.__enter__()
                slices = unit.param_major_slices(region, unit.gather)
                handle = HandleGroup([res.backend.all_gather(r, send[s], res.wp_group) for r, s in slices])
                n_collectives = len(slices)
            else:
                self._staging = res.pool.staging(dt, n)
                handle = res.backend.all_gather(self._staging, send, res.wp_group)
                res.staging_owner = self
            res.ctx.record(handle, "all-gather", res.wp_group, send, unit.index, "backward" if backward else "forward")
        self.state, self.slot, self.region, self.handle = GatherState.GATHERING, slot, region, handle
        res.ctx.counters.all_gathers += n_collectives
        res.ctx.counters.bytes_gathered += n * dt.itemsize
        self.issued_at = res.ctx.issued(handle)
        return True

    def wait_for_unshard(self) -> None:
        """GATHERING -> GATHERED: wait for the gather and land it in the slot."""
        if self.state is not GatherState.GATHERING:
            return
        what = f"block {self.unit.index}"
        try:
            self.res.ctx.wait(self.handle, f"all-gather of {what}", ("all-gather", what, self.issued_at))
            if self._staging is not None:
                with torch.autograd._unsafe_preserve_version_counter(self.region):
                    self.unit.copy_out(self._staging, self.region)
        finally:
            self._leave_landing()
        self.state, self.handle = GatherState.GATHERED, None

    def _leave_landing(self) -> None:
        if self._staging is not None:
            self._staging = None
            self.res.staging_owner = None
        if self._landing is not None:
            self._landing.__exit__(None, None, None)
            self._landing = None

    # ---- back to SHARDED -------------------------------------------------------------
    def reshard(self) -> bool:
        """Free the slot (waiting for an in-flight gather first, swapping the block's
        modules out of it when they point at it); ``False`` when the block was sharded
        already."""
        if self.state is GatherState.SHARDED:
            return False
        self.wait_for_unshard()
        self.swap_out()
        unit = self.unit
        self.res.pool.release(unit.gather_dtype, self.slot, unit.index, unit.gathered_numel)
        self.state, self.region = GatherState.SHARDED, None
        return True

    def abandon(self) -> list[torch.Tensor]:
        """Back to SHARDED without waiting: a collective failed or a step was cut
        short. A gather still in flight may yet write the slot and the landing buffer:
        those are retired from the pool and returned, for the caller to keep (see
        [Note: buffers of a failed step] in ``engine.py``)."""
        self.swap_out()
        unit, staging = self.unit, self._staging
        in_flight = self.state is GatherState.GATHERING and not self.handle.is_completed()
        leaked = [t for t in (self.region, staging) if t is not None] if in_flight else []
        self._leave_landing()
        if self.state is not GatherState.SHARDED:
            free = self.res.pool.retire if in_flight else self.res.pool.release
            free(unit.gather_dtype, self.slot, unit.index, unit.gathered_numel)
            if in_flight and staging is not None:
                self.res.pool.retire_staging(unit.gather_dtype)
        self.state, self.handle, self.region = GatherState.SHARDED, None, None
        return leaked

    # ---- backward ----------------------------------------------------------------------
    def pre_backward(self, hooks: BackwardHooks) -> None:
        """The block's backward is next (it is GATHERED): swap its weights in, with
        grad, until its gradients exist, so that a recompute calling the block's
        original forward directly sees them."""
        self.backward_at = self.res.ctx.mark()
        self._check_unwritten()
        with torch.enable_grad():
            self.swap_in(hooks)

    def _check_unwritten(self) -> None:
        """[Note: weights written between a forward and its backward] A plain model's
        backward refuses weights an in-place write changed since its forward saved
        them (autograd's "modified by an inplace operation"). Here the forward saved
        views of the slot, not the shards, and the backward gathers the shards again:
        it would combine the new weights with the forward's activations, without a
        word. So the shards' version counters, taken at each forward with grad, are
        compared when the block's backward begins (also after an optimizer stepped
        from a gradient hook between two forwards' backwards of one block)."""
        if self._versions is not None and self._versions != tuple(s._version for s in self.unit.shards):
            raise RuntimeError(
                f"isp-comm: block {self.unit.index}'s weights were written in place between its forward and its "
                "backward (an optimizer step, an edit under torch.no_grad, a load): the backward would combine the "
                "new weights with the forward's activations. A plain model's backward refuses this too (autograd: "
                "a variable needed for gradient computation modified by an inplace operation); write the weights "
                "after the backward"
            )

    def post_backward(self) -> None:
        """Every weight gradient of the block's use by one forward exists: swap out
        (the engine then reduce-scatters them and frees the slot)."""
        self.swap_out()
        self.res.ctx.trace("compute", f"backward block {self.unit.index}", self.backward_at)

    # ---- the modules' view of the weights ---------------------------------------------------
    def begin_forward(self, hooks: BackwardHooks) -> None:
        """A forward of the gathered block begins (not a recompute): with grad, the
        unit follows its shards' ``requires_grad`` (the backward reduces what this
        forward saw) and the slot's views are saved for that backward; then swap in.

        [Note: forwards before one backward] Two forwards with grad may share one
        backward (DPO's chosen and rejected, summed into one loss): autograd then runs
        each block's backward once per forward, and each use's gradients are
        reduce-scattered into the shards in turn (the sum, as a plain model's
        ``.grad`` accumulates it). Each forward's saved weights are views of the
        block's slot, which the backward gathers again; so while a forward's graph is
        alive, every later gather of the block (the second forward's, the
        backward's) must land in that same slot: ``views_held`` makes the slot
        choice strict, and a block that cannot have it stops with the slot error,
        never computing on another block's bytes. It holds a weak reference to each
        forward's ``UnshardBlock`` node (the views themselves are gone: a linear
        saves a transpose of its weight), so a graph that was dropped (an accuracy
        forward's) lets the slot go, and the end of a backward forgets them all (it
        freed what they saved). A block with nothing trainable has no such node: the
        engine holds the ``PreBackward`` node of its outputs instead: every backward
        that reads its views passes through it."""
        grad = torch.is_grad_enabled()
        if grad:
            self.unit.refresh_trainable()
            self._versions = tuple(s._version for s in self.unit.shards)  # [Note: weights written between ...]
        self.saved_views = grad
        views = self.swap_in(hooks)
        node = next((v.grad_fn for v in views if v.grad_fn is not None), None)  # a frozen first one has none
        if grad and node is not None:
            self.hold_views_for(node)

    def weights_get_gradients(self) -> bool:
        """Called in the block's backward: whether the running backward reaches the
        ``UnshardBlock`` node of a forward that took views of the slot, so that the
        block's post-backward will come (see [Note: a block's backward that ends
        unseen] in ``engine.py``). A forward whose node is gone used none of the views
        (nothing in its graph holds the node). ``True`` when no forward took views:
        the slot is then kept to the backward's end, as before."""
        nodes = [node for node in (ref() for ref in self._forwards) if node is not None]
        return not self._forwards or any(torch._C._will_engine_execute_node(node) for node in nodes)

    def hold_views_for(self, node: Any) -> None:
        """``node`` lives as long as the graph of a forward that may have saved views of
        the slot for its backward (see ``views_held``)."""
        self._forwards = [ref for ref in self._forwards if ref() is not None] + [weakref.ref(node)]

    def swap_in(self, hooks: BackwardHooks) -> list[torch.Tensor]:
        """Point the block's linears at full views of its slot (and cast in-block
        replicated params to ``param_dtype``). With grad enabled the views come out of
        an ``UnshardBlock`` node, whose backward marks the end of the block's backward."""
        unit = self.unit
        assert self._cast is None, f"block {unit.index} is already swapped in"
        assert self.region is not None and self.state is GatherState.GATHERED
        views = swap_in_views(unit, self.region, hooks)
        # (replicated parameter, its master) while a cast copy stands in
        self._cast = cast_params_in(unit.replicated, self.res.config.param_dtype)
        return views

    def swap_out(self) -> None:
        if self._cast is None:
            return
        self.unit.swap_out()
        cast_params_out(self._cast)
        self._cast = None
