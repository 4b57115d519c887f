"""WHEN weights are gathered and gradients reduced: the per-block schedule.

Forward: block i waits for its gather, issues block i+1's, computes, releases its slot.
Backward (reverse): ``PreBackward`` of block i waits for block i's re-gather and issues
block i-1's; ``UnshardBlock``'s backward (all of block i's weight gradients exist)
packs them, issues one reduce-scatter and frees the slot. A callback queued on the
autograd engine drains the reduce-scatters when the whole backward has finished.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from enum import Enum, auto
from typing import Any

import torch
from torch.autograd import Variable

from isp_comm.context import CommContext
from isp_comm.hooks.autograd import PreBackward, ShardViews
from isp_comm.hooks.block_state import BlockState, GatherResources, GatherState, swap_in_views
from isp_comm.hooks.casting import cast_floats, cast_params_in, cast_params_out, map_tensors
from isp_comm.hooks.grad_hooks import refuse_gradient_hooks
from isp_comm.hooks.reductions import GradientReducer
from isp_comm.hooks.refresh import WeightRefresh
from isp_comm.hooks.unused import UnusedGradients
from isp_comm.units import BlockUnit, ReplicatedParam

log = logging.getLogger("isp_comm")


class Phase(Enum):
    IDLE = auto()
    FORWARD = auto()
    BACKWARD = auto()


class BlockEngine:
    """Drives the blocks through the slot pool and the backend; owned by the communicator.

    Each block's state and transitions are a :class:`BlockState`; every wait,
    counter and trace span goes through ``ctx``; the gradients' side is
    ``self.reducer``. The engine is the :class:`BackwardHooks` the autograd
    Functions call."""

    def __init__(
        self, ctx: CommContext, units, groups, backend, config, pool, rs_buffers, replicated, root=None, refresh=None
    ):
        self.ctx = ctx
        self.units: list[BlockUnit] = units
        self.root: BlockUnit | None = root  # parameters outside the blocks, when sharded
        self._root_region: torch.Tensor | None = None
        self.groups = groups
        self.backend = backend
        self.config = config
        self.pool = pool
        self.reducer = GradientReducer(ctx, groups, backend, config, rs_buffers, replicated)
        self.reducer.entered = self._enter_backward
        self.phase = Phase.IDLE
        self.refresh: WeightRefresh | None = refresh
        """The replica all-gathers that bring WP shards up to date after their pieces
        changed (``state_sharding="world"``; see [Note: refreshing the WP shards])."""
        self.summed: list[BlockUnit] = []
        """Units computed on their WP rows directly whose parameters are pieces (the
        vocab-parallel head, the hidden-split embedding, under ``"world"``)."""
        self._res = GatherResources(ctx, config, backend, pool, groups.wp_group, refresh)
        self.states = [BlockState(u, self._res) for u in units]
        self._pending: set[int] = set()
        self._ending_unseen: set[int] = set()
        """Blocks whose backward began and whose post-backward will not come in it (see
        [Note: a block's backward that ends unseen])."""
        self._trainable_at: tuple[bool, ...] = ()  # requires_grad at the last forward with grad
        self._hook_called = False  # the scheduler hook's root_pre_forward ran; the root's follows
        self._in_root = False  # inside the model's forward (root pre- to post-forward)
        self._callback_queued = False
        self._outer_dtype: torch.dtype | None = None  # activations' dtype outside the blocks
        self.outer: list[ReplicatedParam] = []
        """Replicated parameters outside the blocks, cast to ``param_dtype`` for a forward."""
        self._outer_cast: list | None = None
        self.leaked: list = []
        """Buffers a step cut short left to collectives in flight (see [Note: buffers of a failed step])."""
        self.unused: UnusedGradients | None = None
        """With ``find_unused_parameters``: what this rank's backwards produced (see [Note: unused parameters])."""
        self.after_backward: Callable[[int], None] | None = None  # told each backward's end, with their count
        self._ended = 0

    def _event(self, kind: str, index: int) -> None:
        if self.ctx.events is not None:  # every block, every step: nothing to do unless recording
            self.ctx.event(kind, index, self.phase.name.lower())

    # ---- gathers ------------------------------------------------------------------
    def _unshard(self, st: BlockState) -> bool:
        if not st.unshard(backward=self.phase is Phase.BACKWARD):
            return False
        self._event("all_gather", st.unit.index)
        if not self.config.overlap:
            st.wait_for_unshard()
        elif self.refresh is not None and self.phase is not Phase.BACKWARD and st.unit.index + 1 < len(self.units):
            self.refresh.prefetch(self.units[st.unit.index + 1])  # see [Note: refreshing the WP shards]
        return True

    def ensure_gathered(self, unit: BlockUnit, recompute: bool = False) -> BlockState:
        """Gather ``unit`` into a free slot now, if it is not gathered or gathering
        (``recompute``: for a checkpoint's recompute inside the backward)."""
        st = self.states[unit.index]
        if st.state is GatherState.SHARDED and not self._unshard(st):
            dt = unit.gather_dtype
            owners = [self.pool.owner(dt, i) for i in range(self.config.n_slots)]
            if recompute:  # each recomputed block keeps its slot until its own backward
                raise RuntimeError(
                    f"isp-comm: the backward recomputes block {unit.index} while the slots hold blocks {owners}: "
                    "a torch.utils.checkpoint region may hold at most n_slots blocks. Checkpoint fewer blocks a "
                    "region (ISPConfig.activation_checkpointing checkpoints each block on its own) or raise "
                    "ISPConfig.n_slots"
                )
            raise RuntimeError(
                f"isp-comm: block {unit.index} needs slot {st.slot} but the slots are held by "
                f"blocks {owners}; blocks must run in the order of the block list"
            )
        st.wait_for_unshard()
        return st

    def prefetch(self, index: int) -> None:
        if not self.config.overlap or not 0 <= index < len(self.units):
            return
        st = self.states[index]
        if st.state is GatherState.SHARDED and not self._unshard(st):
            self._pending.add(index)

    def release(self, unit: BlockUnit) -> None:
        """Reshard ``unit`` (swapped out, its slot freed), then issue the prefetches
        that waited for a slot."""
        if not self.states[unit.index].reshard():
            return
        for i in sorted(self._pending):
            if self.states[i].state is not GatherState.SHARDED or self._unshard(self.states[i]):
                self._pending.discard(i)

    # ---- forward ------------------------------------------------------------------
    # [Note: whole-model mixed precision] With ``param_dtype`` every parameter computes
    # in it, as under FSDP2's policy on the root: blocks gather in it (their in-block
    # replicated norms are cast while swapped in), the sharded outer unit gathers in
    # it, the hidden-split embedding and the vocab-parallel head cast their shards, and
    # the replicated outer parameters (``outer``: embedding, final norm, head) are cast
    # from root pre-forward to root post-forward. Casts are differentiable, so each
    # gradient reaches its master in the master's dtype. The logits come out in
    # ``param_dtype``; the loss upcasts them.
    def root_pre_forward(self, from_hook: bool = False) -> None:
        """Forward begins: arm the reductions of whole gradients, bring the
        outer units up to date, fetch block 0. ``from_hook``: the scheduler hook's
        call, which the root's own call of the same forward follows."""
        second, self._hook_called = self._hook_called, from_hook
        if not second:
            self.settle(forward=True)
            if self._in_root:  # the last forward was interrupted: undo what it left (see [Note: a forward that raised])
                self.root_post_forward()
        if torch.is_grad_enabled() and not second and any(st.views_held for st in self.states):
            self.reducer.user_hooks.defer_shards()  # a second forward before one backward: [Note: post-accumulate-...]
        if torch.is_grad_enabled() and self._arms_reductions(second):
            named = self._named_shards()
            refuse_gradient_hooks(named, wrapping=False)  # [Note: gradient hooks on a shard]
            self.reducer.stash()
            self.reducer.user_hooks.hold((s for _, s in named), whole=False)  # [Note: post-accumulate-grad hooks]
            self.phase = Phase.FORWARD
            self.ctx.phase = "forward"
        if not second:
            self._release_leftovers()
            self._reclaim()
        self._in_root = True
        if self.refresh is not None:  # see [Note: refreshing the WP shards]
            self.refresh.check()
            order = [u for u in (self.root, *self.summed) if u is not None] + self.units[:1]
            for unit, then in zip(order[:-1], order[1:]):  # each issued as the one before it is waited for
                self.refresh.ensure(unit, then if self.config.overlap else None)
        for unit in self.summed:
            self._swap_in_summed(unit)
        if self.units:
            self.prefetch(0)
        if self.root is not None:
            self._root_forward()
        if self._outer_cast is None:  # see [Note: whole-model mixed precision]
            self._outer_cast = cast_params_in(self.outer, self.config.param_dtype)

    def _arms_reductions(self, second: bool) -> bool:
        """Whether this forward with grad arms the reductions of the next backward: the
        first forward since a backward, or one after ``requires_grad`` changed.

        [Note: requires_grad between forwards] The reductions of a backward are armed
        by its first forward: each block's reduce groups, and the buckets of the
        replicated gradients, for what was trainable then. After a forward whose graph
        is gone (an accuracy forward with grad) the next forward arms them again, so
        a parameter unfrozen in between is averaged (before, its gradient stayed this
        rank's own, and the ranks drifted apart). While an earlier forward's graph is
        alive, one backward may run through both, whose gradients would be reduced as
        the later one says: that is refused. ``second``: the root's call after the
        scheduler hook's, which looked already."""
        if self.phase is Phase.BACKWARD:  # the model's forward recomputed inside a backward
            return False
        units = [u for u in (self.root, *self.summed, *self.units) if u is not None]
        whole = (*self.reducer.replicated, *self.reducer.wp_summed)
        now = tuple(p.requires_grad for p in (*(s for u in units for s in u.shards), *whole))
        changed = self.phase is Phase.FORWARD and now != self._trainable_at
        if self.reducer.deferred_backwards and now != self._trainable_at:
            raise RuntimeError(
                "isp-comm: requires_grad changed while the gradients of "
                f"{self.reducer.deferred_backwards} backward(s) wait for their replica reduction "
                "(set_requires_replica_sync(False)); change it after the optimizer step"
            )
        if changed and not second and any(st.views_held for st in self.states):
            raise RuntimeError(
                "isp-comm: requires_grad changed between two forwards with grad whose graphs are both alive; one "
                "backward through both is not supported. Change it after the backward, or first drop the earlier "
                "forward's outputs (or run that forward under torch.no_grad())"
            )
        resync = self.phase is Phase.FORWARD and self.reducer.sync_changed()  # [Note: replica reductions deferred]
        arm, self._trainable_at = self.phase is Phase.IDLE or changed or resync, now
        return arm

    def _reclaim(self) -> None:
        """Parameters re-pointed since the last forward go home ([Note: re-pointed
        parameters] in ``isp_comm/units.py``); with pieces, their units are stale."""
        for unit in (u for u in (self.root, *self.summed, *self.units) if u is not None):
            moved = unit.reclaim()
            if moved and self.refresh is not None:
                self.refresh.mark_stale({id(p) for p in moved})

    def _root_forward(self) -> None:
        """Gather the outer parameters (embedding, head, ...) for this forward, outside
        the slot pool; they stay gathered until their gradients exist."""
        root = self.root
        if self._root_region is None:
            dt = root.gather_dtype
            region = torch.empty(root.gathered_numel, dtype=dt, device=root.device)
            if root.wp_size == 1:  # rank-major is param-major: cast or copy straight in
                root.fill_send(region)
            else:
                send = root.flat_shard
                if dt != root.dtype:
                    send = torch.empty(root.shard_numel, dtype=dt, device=root.device)
                    root.fill_send(send)
                rank_major = torch.empty_like(region)
                self.ctx.delay()
                handle = self.backend.all_gather(rank_major, send, self.groups.wp_group)
                self.ctx.record(handle, "all-gather", self.groups.wp_group, send)
                what = "the parameters outside the blocks"
                span = ("all-gather", "outer parameters", self.ctx.issued(handle))
                self.ctx.wait(handle, f"all-gather of {what}", span)
                root.copy_out(rank_major, region)
            self.ctx.counters.all_gathers += 1
            self.ctx.counters.bytes_gathered += region.numel() * region.element_size()
            self._root_region = region
        if torch.is_grad_enabled():
            root.refresh_trainable()
        swap_in_views(root, self._root_region, self)

    def _release_leftovers(self) -> None:
        """A forward begins or ends: a block still gathered, or gathering, was
        prefetched by a forward that stopped before it (an early exit). Released at
        the forward's end, it leaves its slot to the backward of the block before it,
        which must gather into that slot again (before, that backward stopped with the
        slot error); at a forward's beginning, its slot may hold weights written
        since, so it is gathered again when its turn comes (a whole forward and
        backward leave no block gathered)."""
        if self.phase is Phase.BACKWARD:
            return
        self._pending.clear()
        for unit, st in zip(self.units, self.states):
            if st.state is not GatherState.SHARDED:
                self.release(unit)

    def _swap_in_summed(self, unit: BlockUnit) -> None:
        """Point a unit computed on its WP rows at views of its flat shard: out of a
        ``ShardViews`` node when it trains (whose backward hands the gradients of
        those rows to ``post_backward``), else detached."""
        grad = torch.is_grad_enabled()
        if grad:
            unit.refresh_trainable()
        if grad and unit.requires_grad:
            unit.swap_in(list(ShardViews.apply(unit.anchor, self, unit)))
        else:
            unit.swap_in([unit.shard_view(unit.flat_shard, sp).detach() for sp in unit.params])

    def root_post_forward(self, raised: bool = False) -> None:
        """Forward done: the model's outer parameters are shards again, and the engine
        lets go of their gathered region (see [Note: the outer region's lifetime]),
        and of a block prefetched for a part of the model the forward skipped.

        [Note: a forward that raised] Called by a forward hook that torch runs even when
        the forward raised (``always_call``; ``raised``: it did, and left no output;
        torch hands such a hook ``None``, and a forward that returns ``None`` is told
        apart by the exception torch is handling as it calls the hook):
        the outer parameters are then put back at once, not at the next forward, since
        until then ``model.parameters()``, a state dict or an in-place edit would see
        (and write) the forward's casts or gathered copies. Only that, which waits on
        nothing: the blocks it left gathered or in flight wait for the next forward (or
        the close), since a wait here could fail again (a collective that passed its
        deadline) and torch would print that beside the forward's own error. Nothing to
        do when no forward of ours began (a pre-hook refused it). torch runs the hook
        for an ``Exception`` only: after a ``KeyboardInterrupt`` the next forward does it."""
        if not self._in_root:
            return
        self._in_root = False
        if not raised:
            self._release_leftovers()
        if self._outer_cast is not None:
            cast_params_out(self._outer_cast)
            self._outer_cast = None
        for unit in self.summed:
            unit.swap_out()
        if self.root is None:
            return
        self.root.swap_out()
        # [Note: the outer region's lifetime] What the backward needs of the gathered
        # outer parameters is what autograd saved: in a llama-class model the head's and
        # the final norm's weights, views of the region, released when their backward
        # has run, at the start of the backward (an embedding saves only its indices).
        # Kept by the engine until the outer unit's gradients are reduced, at the end of
        # the backward, the region (the gathered head: 1 GiB at Llama-3-8B's scale over 8
        # ranks) would stay through every block's backward, where the backward peaks. An
        # outer parameter used before the blocks whose weight is saved (a norm on the
        # embeddings) keeps the whole region to its own backward, at the end, which the
        # memory forecast does not count. A second forward before the backward gathers anew.
        self._root_region = None

    def block_forward(self, unit: BlockUnit, orig: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """The block's forward, wrapped. Also runs for a recompute in backward when the
        checkpoint sits outside this wrapper (ours, or one around ``Module.__call__``).

        [Note: blocks called on their own] Outside the model's forward (an early-exit
        evaluation calling blocks in turn), nothing has looked at the writes since the
        last step: each such call looks as the model's forward does (re-pointed
        parameters, and with pieces their version counters and the state dicts handed
        out), gathers its block anew and prefetches none, since the caller may write
        the weights between two calls, after a prefetch would have read them."""
        st = self.states[unit.index]
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
            if st.swapped_in:  # swapped in for this block's backward already
                return orig(*args, **kwargs)
            self.ensure_gathered(unit, recompute=True)
            self.prefetch(unit.index - 1)
            st.swap_in(self)
            try:
                return orig(*args, **kwargs)
            finally:
                st.swap_out()
        if not self._in_root:  # a block called on its own (an early exit): see [Note: blocks called on their own]
            self._release_leftovers()
            self._reclaim()
            if self.refresh is not None:
                self.refresh.check()
        self.ensure_gathered(unit)
        if self._in_root:
            self.prefetch(unit.index + 1)
        self._event("compute", unit.index)
        st.begin_forward(self)
        t0 = self.ctx.mark()
        try:
            out = orig(*args, **kwargs)
        except BaseException:
            st.swap_out()  # the slot stays held: a failed step is abandoned (close)
            raise
        self.ctx.trace("compute", f"forward block {unit.index}", t0)
        if out_dtype is not None:
            out = cast_floats(out, out_dtype)
        self.release(unit)  # swaps the block out, then frees its slot
        if torch.is_grad_enabled():
            out = self._mark_pre_backward(unit, out)
        return out

    def _mark_pre_backward(self, unit: BlockUnit, out: Any) -> Any:
        tensors: list[torch.Tensor] = []
        map_tensors(out, lambda t: tensors.append(t) if t.requires_grad else None)
        if not tensors:
            return out
        marked = PreBackward.apply(self, unit, *tensors)
        if not unit.requires_grad:  # its views come out of no node: this one lives as long as they may
            self.states[unit.index].hold_views_for(marked[0].grad_fn)
        left = iter(marked)
        return map_tensors(out, lambda t: next(left) if t.requires_grad else t)

    # ---- backward -----------------------------------------------------------------
    def _enter_backward(self) -> None:
        if self.phase is Phase.IDLE:  # no forward with grad armed this backward's reductions
            raise RuntimeError(
                "isp-comm: a backward through the wrapped model's blocks that no forward of the model with grad "
                "began: a second backward over one forward (retain_graph=True), or one through blocks called "
                "outside the model's forward, is not supported (several losses of one forward: one backward of their "
                "sum, (loss1 + loss2).backward(); else run the model's forward again for each backward)"
            )
        if self.unused is not None and self.phase is not Phase.BACKWARD:
            # after a deferred backward, no sharded gradient is made afresh (see [Note: replica reductions deferred])
            self.unused.backward_begins([] if self.reducer.deferred_backwards else self._shards())
        self.phase = Phase.BACKWARD
        self.ctx.phase = "backward"
        if not self._callback_queued:
            self._callback_queued = True
            Variable._execution_engine.queue_callback(self.end_backward)

    def pre_backward(self, unit: BlockUnit) -> None:
        """Block ``unit``'s backward is next: its weights stay swapped in until its
        gradients exist, so a recompute that calls the block's original forward
        directly (a checkpoint inside the wrapper, as transformers does) sees them."""
        self._enter_backward()
        self._end_unseen(unit)
        st = self.ensure_gathered(unit)
        if not unit.requires_grad or not st.weights_get_gradients():
            self._ending_unseen.add(unit.index)
        self.prefetch(unit.index - 1)
        self._event("compute", unit.index)
        st.pre_backward(self)

    def _end_unseen(self, now: BlockUnit | None = None) -> None:
        """[Note: a block's backward that ends unseen] A block's post-backward comes from
        its ``UnshardBlock`` node, which autograd runs once every trainable weight's
        gradient exists. A block with nothing trainable has no such node, and one whose
        forward used none of its trainable weights (the identity for a step: a
        LayerDrop that still calls it) has one the backward never reaches; the
        ``PreBackward`` of either asks. Its backward (input gradients, if any) is over
        once another unit's begins or ends: the block before it, the outer unit or a
        summed one, or, under [Note: forwards before one backward], the next forward's
        last block (or itself again); autograd runs one forward's backward through
        before the earlier forward's. So its slot is freed then (only swapped out when
        ``now`` is the block itself, to be reused), not at the backward's end, where
        the strict slot of an earlier block's backward would find it held. With
        ``find_unused_parameters`` a trainable one is reduce-scattered then too, with
        zero gradients, at the point where a rank that used its weights does the same:
        the ranks stay in step, and each gradient is the global batch's, the rows this
        rank made the identity adding nothing. Without the option no rank issues it,
        which is right when every rank skipped the block (the gradients stay ``None``,
        as a plain model's) and, as for any block a rank skips, stops the step when
        only some did."""
        for index in sorted(self._ending_unseen):
            block, st = self.units[index], self.states[index]
            st.swap_out()
            done = (lambda: None) if block is now else (lambda b=block: self.release(b))
            if block.requires_grad and self.unused is not None:
                grads = (None,) * len(block.params)
                self.reducer.reduce_block(block, grads, st.landing == "per-parameter", packed=done)
            else:
                done()
        self._ending_unseen.clear()

    def post_backward(self, unit: BlockUnit, grads: tuple[torch.Tensor | None, ...]) -> None:
        self._enter_backward()
        if unit is self.root or unit.index < 0:  # the outer unit's or a summed one's: after the blocks'
            self._end_unseen()
        if self.unused is not None:
            self.unused.produced(unit.shards, grads)
        if unit is self.root:
            self._root_region = None
            self.reducer.reduce_root(unit, grads)
            return
        if unit.index < 0:  # one of ``summed``: its rows' gradients, summed over WP already
            self.reducer.reduce_summed(unit, grads)
            return
        st = self.states[unit.index]
        st.post_backward()
        module = st.landing == "per-parameter"  # gradients go back the way weights came
        self.reducer.reduce_block(unit, grads, module, packed=lambda: self.release(unit))

    def _shards(self) -> list[torch.nn.Parameter]:
        """Every unit's trainable shards (pieces), the outer unit's included."""
        return [s for _, s in self._named_shards()]

    def _named_shards(self) -> list[tuple[str, torch.nn.Parameter]]:
        """:meth:`_shards` with their FQNs."""
        units = (u for u in (self.root, *self.summed, *self.units) if u is not None)
        return [(pc.fqn, s) for u in units for pc, s in zip(u.pieces, u.shards) if s.requires_grad]

    def settle(self, forward: bool = False) -> None:
        """Bring the engine back to IDLE after a step that did not go as planned, when it
        is looked at outside a backward: before a forward (``forward``), an optimizer
        step, a clip or a state dict.

        [Note: steps that did not go as planned] An exception that escaped a backward
        (an interrupt, a check that raised) leaves the phase BACKWARD, the callback that
        ends it dropped by autograd: the next look ends it, finishing what every rank
        issued, and drops every gradient the engine reduces (set to ``None``, as
        ``zero_grad()`` does: that backward's are partial, and they would land after a
        ``zero_grad()`` the caller made since), so the next step reduces its own
        (before, none were averaged any more, and the ranks drifted apart, silently).
        A forward with grad that no backward followed (an accuracy forward after the
        backward) left the reductions of whole gradients armed: a step of their
        optimizer, or a clip, disarms them. A second forward before a backward, or a
        state dict, keeps them armed."""
        if torch._C._current_autograd_node() is not None:
            return
        if self.phase is Phase.BACKWARD:
            self.reducer.user_hooks.quiet = True  # its gradients are dropped: no hook sees them
            try:
                self.end_backward()
            finally:
                self.reducer.user_hooks.quiet = False
            for unit in (u for u in (self.root, *self.summed, *self.units) if u is not None):
                for shard in unit.shards:
                    shard.grad = None
            for p in (*self.reducer.replicated, *self.reducer.wp_summed):
                p.grad = None
            self.reducer.drop_deferred()
        elif self.phase is Phase.FORWARD and not forward:
            self.reducer.unstash()
            self.phase = Phase.IDLE
            self.ctx.phase = "outer"

    def end_backward(self) -> None:
        """Drain reduce-scatters, average replicated grads, return to IDLE. Idempotent."""
        if self.phase is not Phase.BACKWARD:
            return
        self._end_unseen()
        self.reducer.drain()
        self.reducer.rs_buffers.release_idle()  # see [Note: reduce-scatter pairs between backwards]
        self._pending.clear()
        for unit, st in zip(self.units, self.states):  # blocks whose weights got no gradient still hold slots
            self.release(unit)
            st.end_backward()
        self._root_region = None
        self.reducer.reduce_whole()
        if self.unused is not None:
            r = self.reducer
            arrived = r.arrived if self.groups.world_size > 1 else None
            whole = [p for p in (*r.replicated, *r.wp_summed) if p.requires_grad]
            self.unused.backward_ends(self._shards(), whole, r.made, arrived)
        hooks, synced = self.reducer.user_hooks, self.reducer.syncing
        if self.unused is not None and synced and hooks.pending() and not hooks.quiet:
            self.unused.settle()  # the hooks step: the unused gradients go back to None first
        hooks.release(call=synced)  # [Note: post-accumulate-grad hooks]
        self.phase = Phase.IDLE
        self.ctx.phase = "outer"
        self._callback_queued = False
        self._check_own_shards()
        self._ended += 1
        if self.after_backward is not None:
            self.after_backward(self._ended)

    def _check_own_shards(self) -> None:
        """[Note: parameters replaced behind the engine] Every block is swapped out
        once a backward ends, so block 0's first parameter is its shard again, the
        object this engine gathers from and reduces into. Anything else means that
        something keeps replacing the module's parameters behind the engine:
        ``fully_shard`` of a module that holds the model did, silently (its optimizer
        then stepped its own copies of the shards, which this engine never reads). Said
        here, at the first backward's end, where the forward cannot tell: FSDP swaps its
        own unsharded tensors in there. (``load_state_dict(assign=True)``, which would
        replace them once, is refused when it is called: ``discovery.refuse_assign``.)"""
        unit = self.units[0]
        sp = unit.params[0]
        if sp.module._parameters.get(sp.name) is not unit.shards[0]:
            raise RuntimeError(
                "isp-comm: the wrapped model's parameters are no longer the shards its ISPCommunicator installed: "
                "something replaces them behind it (fully_shard of a module that holds the model does); the "
                "communicator shards and reduces the model itself: do not also shard a module around it"
            )

    # ---- introspection ---------------------------------------------------------------
    def outstanding(self) -> int:
        gathers = sum(st.state is GatherState.GATHERING for st in self.states)
        refreshing = self.refresh.in_flight() if self.refresh is not None else 0
        return gathers + refreshing + self.reducer.in_flight()

    # [Note: buffers of a failed step]
    # A step cut short (a wait failed, or an error left the backward unfinished) can
    # leave collectives in flight that still read or write their buffers: a slot, the
    # landing buffer, a cast send buffer, a reduce-scatter pair, a bucket. Handing
    # such a buffer back (to the pool, or to CUDA's caching allocator by dropping the
    # last reference) would let new work use memory a collective still writes. So
    # ``close`` completes nothing then: it asks each handle whether it is done
    # (``is_completed``, which never waits), returns what is done to the pool, and
    # keeps the rest in ``leaked``, never reused, for as long as the communicator
    # lives, saying so in one warning.
    def close(self, abandon: bool = False) -> None:
        """``abandon``: the caller knows the step was cut short (a signal): its buffers
        are kept as a failed step's, said at info level rather than as a warning."""
        if self._outer_cast is not None:
            cast_params_out(self._outer_cast)
            self._outer_cast = None
        cut_short = abandon or self.ctx.failed or self.phase is Phase.BACKWARD  # the backward's callback never ran
        if cut_short:
            for st in self.states:
                self.leaked += st.abandon()
            if self.leaked:  # an abandoned gather may still read its cast send buffer
                self.leaked += self._res.send.values()
        else:
            for unit in self.units:
                self.release(unit)
        self.reducer.close(abandon=cut_short)
        self.leaked += self.reducer.leaked
        if self.refresh is not None:
            self.refresh.close(abandon=cut_short)
            self.leaked += self.refresh.leaked
        if self.leaked:
            n = sum(t.numel() * t.element_size() for t in self.leaked if isinstance(t, torch.Tensor))
            n += sum(t.numel() * t.element_size() for pair in self.leaked if isinstance(pair, tuple) for t in pair)
            (log.info if abandon else log.warning)(
                "isp-comm (rank %d): the step was cut short with collectives in flight; %d buffers (%d bytes) they "
                "may still use are kept, never reused, until the communicator is dropped",
                self.ctx.rank,
                len(self.leaked),
                n,
            )
        self._res.send.clear()
        self._root_region = None
        for unit in (self.root, *self.summed):
            if unit is not None:
                unit.swap_out()
