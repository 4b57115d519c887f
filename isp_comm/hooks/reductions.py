"""The gradient half of the engine: reduce-scatters of sharded gradients (bounded in
flight, then all-reduced or reduce-scattered over replicas, drained into ``.grad``)
and the bucketed averaging of gradients autograd left whole.

:class:`GradientReducer` is owned by the :class:`~isp_comm.hooks.engine.BlockEngine`
and given everything it uses: the communication context, the groups, the backend,
the reduce-scatter buffers and the parameters it averages.

[Note: one issue order on every rank]
Every rank must issue the collectives of a group in the same order, and the CPU
shared-memory backend runs every group's collectives on one FIFO worker, so a rank
whose groups' collectives interleave differently from a peer's can deadlock with it.
So nothing here is issued on a timing-dependent condition (never "when a handle
happens to be done"): reduce-scatters are issued in autograd's order; a block's
replica collective (all-reduce, or reduce-scatter into the pieces with
``state_sharding="world"``) when the next block's reduce-scatter has been issued, or
when room is made or the backward drained; a bucket of whole gradients when it and every
bucket before it are ready, in the buckets' fixed order (or, with
``find_unused_parameters``, when the backward ends); gradients whose replica
reduction was deferred and that the last backward did not reach, when it ends, in
their first backward's order. Autograd runs the same graph in
the same order on every rank, as DDP relies on too; where ranks use different
parameters it does not, which is what that option is for.
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from isp_comm.backends.base import Backend, CompletedHandle, Handle, HandleGroup
from isp_comm.config import ISPConfig
from isp_comm.context import CommContext
from isp_comm.groups import ParallelGroups
from isp_comm.hooks.grad_hooks import UserGradHooks
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


@dataclass(eq=False)
class InflightReduce:
    """One reduce group of one block, from its reduce-scatter's issue until its part
    of the gradient is in ``.grad``: reduce-scatter over WP, then (with replicas) an
    all-reduce of the shard over the replica group, or a reduce-scatter of it into
    the pieces when the unit has them (``replica`` set once issued)."""

    unit: BlockUnit
    group: ReduceGroup
    pair: tuple[torch.Tensor, torch.Tensor]
    out: torch.Tensor
    handle: Handle
    issued_at: Any
    pooled: bool  # ``pair`` came from the reduce-scatter buffers (the root's are its own)
    replica: Handle | None = None
    replica_at: Any = None

    def in_flight(self) -> bool:
        """Whether a collective may still read or write ``pair`` (see ``abandon``)."""
        return not self.handle.is_completed() or (self.replica is not None and not self.replica.is_completed())


@dataclass(eq=False)
class Bucket:
    """Whole gradients averaged by one all-reduce: parameters of one dtype and one
    group, about ``bucket_mb`` together, in reverse registration order (the order
    their gradients appear in backward, as DDP's buckets)."""

    params: list[nn.Parameter]
    group: Any
    size: int  # ranks in ``group``
    what: str
    flat: torch.Tensor | None = None  # allocated at the first issue, kept
    waiting: int = 0  # parameters whose gradient this backward has not produced yet
    handle: Handle | None = None
    issued_at: Any = None
    done: set[int] = field(default_factory=set)  # ids of the parameters ready this backward


@dataclass(eq=False)
class Deferred:
    """One reduce group's gradients of the backwards whose replica reduction waits
    (see [Note: replica reductions deferred]): their sum after the WP stage, laid out
    as the WP shard, or replica-major (``scattered``) for the WP-summed rows."""

    unit: BlockUnit
    group: ReduceGroup
    total: torch.Tensor
    scattered: bool = False


class GradientReducer:
    """Reduce-scatter issue and completion, replica all-reduce, bucketed DDP-style
    averaging of the gradients autograd leaves whole.

    At most ``config.max_inflight_reduce_scatter`` reduce groups are in flight at once
    (reduce-scatter or its replica all-reduce): the oldest is completed before another
    is issued, which bounds gradient buffers."""

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
        self.leaked: list[Any] = []
        """Buffers a failed step left to collectives that may still use them (never reused)."""
        self._pre, self._post = divide_factors(groups.world_size)
        self.replica_sync = True  # set_requires_replica_sync's (see [Note: replica reductions deferred])
        self._syncing = True  # this backward's: replica_sync as its forward armed the reductions
        self.deferred_backwards = 0  # backwards since the last replica reduction whose gradients wait for it
        self._deferred: dict[tuple[int, ReduceGroup], Deferred] = {}  # (id(unit), group) -> their sum
        self._stash: dict[nn.Parameter, torch.Tensor] = {}
        self._buckets: list[Bucket] = []
        self._bucket_of: dict[int, Bucket] = {}
        self._trainable: tuple[int, ...] | None = None
        self._next_bucket = 0  # buckets issued this backward, in order
        self._hooks: dict[int, tuple[Any, Any]] = {}  # id(parameter) -> its two hooks (arriving, accumulated)
        self._active = False  # a forward with grad began: hooks issue buckets
        self._armed = False  # a forward with grad began: arriving gradients set earlier ones aside
        self._arrived: set[int] = set()  # ids of the parameters whose gradient arrived this backward
        self.arrived: set[int] = set()
        """The last backward's ``_arrived`` (its whole gradients produced on this rank)."""
        self.made: set[int] = set()  # the whole gradients the last backward's reduction made (.grad was None)
        self.user_hooks = UserGradHooks(config.find_unused_parameters)  # [Note: post-accumulate-grad hooks]
        self.entered: Callable[[], None] | None = None
        """Called as a whole gradient arrives in a backward the buckets are armed for: the
        engine's start of a backward, for one that reaches no block (a forward that ran
        none), which no block's hook would start."""

    # ---- sharded gradients ------------------------------------------------------------
    def _make_room(self) -> None:
        while len(self.inflight) >= self.config.max_inflight_reduce_scatter:
            self._complete_oldest()

    def _complete_oldest(self) -> None:
        """Complete the oldest reduce, then forget it: one that fails stays in
        ``inflight``, where ``close(abandon=True)`` finds its buffers."""
        self._complete(self.inflight[0])
        self.inflight.popleft()

    def reduce_block(
        self, unit: BlockUnit, grads: tuple[torch.Tensor | None, ...], module: bool, packed: Callable[[], None]
    ) -> None:
        """Pack ``unit``'s gradients into pooled buffers and reduce-scatter them, one
        collective per dtype group (one per parameter when ``module``); ``packed()``
        runs once the last group is packed (the slot may then be freed)."""
        for i, group in enumerate(unit.groups):
            self._make_room()
            pair = self.rs_buffers.acquire(group.dtype, *group.pair_numels)
            inp, out = pair[0][: group.gathered_numel], pair[1][: group.shard_numel]
            (unit.pack_grads_param_major if module else unit.pack_grads)(grads, inp, group)
            if i == len(unit.groups) - 1:
                packed()
            self._issue(unit, group, pair, inp, out, module, pooled=True)

    def reduce_root(self, root: BlockUnit, grads: tuple[torch.Tensor | None, ...]) -> None:
        """The outer parameters' gradients, in buffers of their own (not the pool's),
        each as long as a pooled pair would be (see ``_to_replicas``)."""
        for group in root.groups:
            self._make_room()
            pair = tuple(torch.empty(n, dtype=group.dtype, device=root.device) for n in group.pair_numels)
            inp, out = pair[0][: group.gathered_numel], pair[1][: group.shard_numel]
            root.pack_grads(grads, inp, group)
            self._issue(root, group, pair, inp, out, module=False, pooled=False)

    def reduce_summed(self, unit: BlockUnit, grads: tuple[torch.Tensor | None, ...]) -> None:
        """Gradients of WP rows that their own backward summed over WP already (the
        vocab-parallel head's, the hidden-split embedding's), when the unit has pieces:
        straight to the replica reduce-scatter."""
        for group in unit.groups:
            self._make_room()
            inp = torch.empty(group.scattered_numel, dtype=group.dtype, device=unit.device)
            out = torch.empty(group.piece.numel, dtype=group.dtype, device=unit.device)
            unit.pack_piece_grads(grads, group, inp)
            if group.dtype in LOW_PRECISION and self._pre > 1:  # see divide_factors
                inp.div_(self._pre)
            if not self._syncing:  # see [Note: replica reductions deferred]
                self._defer(unit, group, inp, scattered=True)  # inp is its own: kept, not copied
                continue
            self._add_deferred(unit, group, inp)
            r = InflightReduce(unit, group, (inp, out), out, CompletedHandle(), None, pooled=False)
            self._scatter_to_replicas(r, inp)
            self.inflight.append(r)
            if not self.config.overlap:
                self._complete_oldest()

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
        if self.groups.wp_size > 1:
            self.ctx.record(handle, "reduce-scatter", wp, inp, unit.index, "backward")
        self.ctx.counters.bytes_reduced += inp.numel() * inp.element_size()
        if pooled:
            self.ctx.event("reduce_scatter", unit.index, "backward")
        issued = InflightReduce(unit, group, pair, out, handle, self.ctx.issued(handle), pooled)
        for r in self.inflight:  # the earlier blocks' replica all-reduces, see [Note: one issue order on every rank]
            self._to_replicas(r)
        self.inflight.append(issued)
        if not self.config.overlap:
            self._complete_oldest()

    def _to_replicas(self, r: InflightReduce) -> None:
        """Wait for ``r``'s reduce-scatter and issue its shard's replica collective
        (asynchronous: completed by ``_complete``): an all-reduce, or, when the unit
        has pieces, a reduce-scatter into them. The pair's two buffers take turns (no
        third buffer): the one the WP stage did not leave the shard in receives the
        replica-major input, and the other, read by then, the pieces."""
        if self.groups.replica_size == 1 or r.replica is not None or not self._syncing:
            return
        what = f"block {r.unit.index}"
        self.ctx.wait(r.handle, f"reduce-scatter of {what}", ("reduce-scatter", what, r.issued_at))
        r.handle = CompletedHandle()
        self._add_deferred(r.unit, r.group, r.out)
        if r.unit.replicas == 1:
            self.ctx.delay()
            self.ctx.counters.all_reduces += 1
            r.replica = self.backend.all_reduce(r.out, self.groups.replica_group)
            self.ctx.record(r.replica, "all-reduce", self.groups.replica_group, r.out, r.unit.index, "backward")
            r.replica_at = self.ctx.issued(r.replica)
            return
        held, spare = (r.pair[0], r.pair[1]) if r.group.wp_size == 1 else (r.pair[1], r.pair[0])
        inp = spare[: r.group.scattered_numel]
        r.unit.pack_pieces(r.out, r.group, inp)
        r.out = held[: r.group.piece.numel]
        self._scatter_to_replicas(r, inp)

    def _scatter_to_replicas(self, r: InflightReduce, inp: torch.Tensor) -> None:
        """Issue the replica reduce-scatter of ``inp`` (replica-major) into ``r.out``."""
        self.ctx.delay()
        self.ctx.counters.reduce_scatters += 1
        self.ctx.counters.bytes_reduced += inp.numel() * inp.element_size()
        r.replica = self.backend.reduce_scatter(r.out, inp, self.groups.replica_group)
        self.ctx.record(r.replica, "reduce-scatter", self.groups.replica_group, inp, r.unit.index, "backward")
        r.replica_at = self.ctx.issued(r.replica)

    def _complete(self, r: InflightReduce) -> None:
        what = f"block {r.unit.index}"
        if self.groups.replica_size > 1 and self._syncing:
            self._to_replicas(r)
            kind = "all-reduce" if r.unit.replicas == 1 else "reduce-scatter"
            self.ctx.wait(r.replica, f"replica {kind} of {what}", (kind, what, r.replica_at))
        else:
            self.ctx.wait(r.handle, f"reduce-scatter of {what}", ("reduce-scatter", what, r.issued_at))
            if self.groups.replica_size > 1:  # see [Note: replica reductions deferred]
                self._defer(r.unit, r.group, r.out)
                if r.pooled:
                    self.rs_buffers.release(r.group.dtype, r.pair)
                return
        if self.groups.world_size > 1:
            r.out.div_(self._post if r.group.dtype in LOW_PRECISION else self.groups.world_size)
        r.unit.accumulate_grad(r.out, r.group)
        if r.pooled:
            self.rs_buffers.release(r.group.dtype, r.pair)
        shards = r.unit.shards
        self.user_hooks.call(shards[i] for i in r.group.members if shards[i].requires_grad)

    def drain(self) -> None:
        while self.inflight:
            self._complete_oldest()
        if self._syncing and self._deferred:
            self._reduce_deferred()
            while self.inflight:
                self._complete_oldest()

    # ---- replica reductions deferred --------------------------------------------------------
    # [Note: replica reductions deferred]
    # With replicas, each micro-step's gradient shards cross the replica group (between
    # nodes, the slow links) to be summed; over N micro-steps of one optimizer step only
    # their sum is needed. ``ISPCommunicator.set_requires_replica_sync(False)`` makes the
    # backwards of the forwards it covers stop after the WP stage: each reduce group's
    # WP-reduced shard is added into a sum of its own (``Deferred``, in the reduce dtype,
    # a WP shard of every block: FSDP2's partial reduce output), and the backward that
    # syncs again adds that sum into its own shard before the replica collective, which
    # then runs once for N micro-steps. Gradients the syncing backward does not reach (a
    # block every rank skipped in it) are reduced over the replicas alone when it ends.
    # Nothing is divided before then, so the sum divides as one micro-step's would (see
    # ``divide_factors``). The whole gradients (buckets) follow suit: a deferred
    # backward issues no bucket and leaves autograd's sum in ``.grad``; the first of
    # them sets aside what ``.grad`` held before (reduced already), the later ones and
    # the syncing one add to it, whose buckets reduce the sum; the earlier part comes
    # back after. ``.grad`` of the shards is written by the syncing backward only. An
    # optimizer step or a clip while gradients wait is refused, as is a change of
    # ``requires_grad`` (the reduce groups would change under the sums).
    def _defer(self, unit: BlockUnit, group: ReduceGroup, grad: torch.Tensor, scattered: bool = False) -> None:
        """Add a deferred backward's ``grad`` of ``group`` into its sum (the first one
        copied out of the pooled pair it is in; the replica-major input of the
        WP-summed rows, ``scattered``, is a buffer of its own: kept)."""
        key = (id(unit), group)
        waiting = self._deferred.get(key)
        if waiting is None:
            self._deferred[key] = Deferred(unit, group, grad if scattered else grad.clone(), scattered)
        else:
            waiting.total.add_(grad)

    def _add_deferred(self, unit: BlockUnit, group: ReduceGroup, grad: torch.Tensor) -> None:
        """The syncing backward's ``grad`` of ``group`` takes in the deferred ones' sum
        (nothing to look up, and no group hashed, in a step that deferred nothing)."""
        waiting = self._deferred.pop((id(unit), group), None) if self._deferred else None
        if waiting is not None:
            grad.add_(waiting.total)

    def _reduce_deferred(self) -> None:
        """The deferred sums the syncing backward did not reach, reduced over the
        replicas on their own, in the order their sums were made (the same on every
        rank: autograd's order, and the reduces completed in their issue order), each as
        if its WP stage had just ended."""
        for waiting in list(self._deferred.values()):
            unit, group = waiting.unit, waiting.group
            del self._deferred[(id(unit), group)]
            self._make_room()
            if waiting.scattered:
                out = torch.empty(group.piece.numel, dtype=group.dtype, device=unit.device)
                r = InflightReduce(unit, group, (waiting.total, out), out, CompletedHandle(), None, pooled=False)
                self._scatter_to_replicas(r, waiting.total)
            else:
                pair = tuple(torch.empty(n, dtype=group.dtype, device=unit.device) for n in group.pair_numels)
                out = pair[1 if group.wp_size > 1 else 0][: group.shard_numel]
                out.copy_(waiting.total)
                r = InflightReduce(unit, group, pair, out, CompletedHandle(), None, pooled=False)
            self.inflight.append(r)

    @property
    def syncing(self) -> bool:
        """Whether the backward armed last reduces over the replicas (writes ``.grad``)."""
        return self._syncing

    def sync_changed(self) -> bool:
        """Whether ``replica_sync`` now says otherwise than the armed backward does: a
        forward with grad whose backward never came (an accuracy forward) armed it, and
        the next forward must arm again to read the flag."""
        return self.groups.world_size > 1 and (self.replica_sync or self.groups.replica_size == 1) != self._syncing

    def drop_deferred(self) -> None:
        """Every gradient waiting for its replica reduction is dropped (a backward that
        did not go as planned drops the step's gradients; ``close()``)."""
        self._deferred.clear()
        self._stash.clear()
        self.deferred_backwards = 0

    # ---- gradients autograd left whole ------------------------------------------------------
    # [Note: bucketed whole gradients] The replicated parameters' gradients (and the
    # WP-summed shards') are averaged like DDP's: in buckets of one dtype and group,
    # each all-reduced as soon as autograd has accumulated every gradient in it (a
    # post-accumulate-grad hook counts them), so the reduction overlaps the rest of
    # the backward. Earlier micro-steps' gradients are set aside so that ``.grad``
    # holds this backward's alone when a bucket is packed: a parameter's when its
    # gradient arrives (a hook on the parameter, which runs before autograd
    # accumulates), the others' when the backward ends. Not at the forward: a
    # ``zero_grad()`` between the forward and the backward (the order of many loops)
    # must still drop them, and a gradient set aside there would have come back after
    # it. ``reduce_whole`` issues what never became ready (unused parameters count as
    # zero), waits in order, divides and adds what was set aside back.
    # With ``find_unused_parameters`` every bucket waits for the backward's end: a
    # parameter that some ranks use and others do not would make its bucket ready at
    # different points of their backwards, between other groups' collectives, and
    # a backend that runs every group on one queue (the CPU shared-memory one) needs
    # one issue order on every rank (see [Note: one issue order on every rank]).
    def _plan_buckets(self) -> None:
        """(Re)build the buckets when the set of trainable parameters changed (the same
        decision on every rank: the same model, the same ``requires_grad``)."""
        world = self.groups.world_size
        sets = (
            (self.replicated, self.groups.world_group, world, "replicated gradients"),
            (self.wp_summed, self.groups.replica_group, self.groups.replica_size, "WP-summed shard gradients"),
        )
        trainable = tuple(id(p) for params, *_ in sets for p in params if p.requires_grad)
        if trainable == self._trainable:
            return
        self._trainable = trainable
        for params, *_ in sets:  # a frozen parameter takes no hook: it gets one when it thaws
            for p in params:
                if p.requires_grad and id(p) not in self._hooks:
                    arriving = p.register_hook(functools.partial(self._grad_arriving, p))
                    self._hooks[id(p)] = (arriving, p.register_post_accumulate_grad_hook(self._grad_ready))
        cap = int(self.config.bucket_mb * 2**20)
        self._buckets, self._bucket_of = [], {}
        for params, group, size, what in sets:
            open_: dict[torch.dtype, Bucket] = {}
            for p in reversed([p for p in params if p.requires_grad]):
                b = open_.get(p.dtype)
                if b is None or (b.params and sum(q.numel() * q.element_size() for q in b.params) >= cap):
                    b = open_[p.dtype] = Bucket([], group, size, what)
                    self._buckets.append(b)
                b.params.append(p)
                self._bucket_of[id(p)] = b

    def stash(self) -> None:
        """A forward with grad begins: arm the buckets, and the hooks that set earlier
        micro-steps' gradients aside as this backward's arrive (see [Note: bucketed
        whole gradients]; one process sums them as autograd would)."""
        if self.groups.world_size > 1:
            self._syncing = self.replica_sync or self.groups.replica_size == 1
            self._plan_buckets()
            for b in self._buckets:
                b.waiting, b.done, b.handle = len(b.params), set(), None
            self._next_bucket = 0
            ours = {pid: accumulated.id for pid, (_, accumulated) in self._hooks.items()}
            self.user_hooks.hold((p for b in self._buckets for p in b.params), whole=True, ours=ours)
            # without overlap, or with find_unused_parameters (see [Note: bucketed whole
            # gradients]), reduce_whole issues every bucket
            self._active = self._syncing and self.config.overlap and not self.config.find_unused_parameters
            self._armed, self._arrived = True, set()

    def _grad_arriving(self, p: nn.Parameter, grad: torch.Tensor) -> None:
        """Autograd is about to accumulate ``p``'s gradient of this backward: the one
        ``.grad`` holds now (earlier micro-steps') goes aside first."""
        if self._armed and id(p) not in self._arrived:
            if not self._arrived and self.entered is not None:  # this backward's first: it begins
                self.entered()
            self._arrived.add(id(p))
            if not self.deferred_backwards:  # see [Note: replica reductions deferred]
                self._set_aside(p)

    def _set_aside(self, p: nn.Parameter) -> None:
        if p.grad is not None and p not in self._stash:
            self._stash[p] = p.grad
            p.grad = None

    def _grad_ready(self, p: nn.Parameter) -> None:
        """Autograd accumulated ``p``'s gradient of this backward (see [Note: bucketed whole gradients])."""
        b = self._bucket_of.get(id(p)) if self._active else None
        if b is None or id(p) in b.done:
            return
        b.done.add(id(p))
        b.waiting -= 1
        while self._next_bucket < len(self._buckets) and self._buckets[self._next_bucket].waiting == 0:
            self._issue_bucket(self._buckets[self._next_bucket])
            self._next_bucket += 1

    def _issue_bucket(self, b: Bucket) -> None:
        """Pack the bucket's gradients (zeros where none came) and all-reduce them; a
        bucket over one rank (the WP-summed shards without replicas) is left in the
        gradients themselves, divided there by ``reduce_whole``: no flat buffer."""
        if b.size == 1:
            b.handle = CompletedHandle()
            return
        dt = b.params[0].dtype
        if b.flat is None:
            b.flat = torch.empty(sum(p.numel() for p in b.params), dtype=dt, device=b.params[0].device)
        off = 0
        for p in b.params:
            piece = b.flat[off : off + p.numel()].view_as(p)
            piece.copy_(p.grad) if p.grad is not None else piece.zero_()
            off += p.numel()
        if dt in LOW_PRECISION and self._pre > 1:  # see divide_factors
            b.flat.div_(self._pre)
        self.ctx.delay()
        self.ctx.counters.all_reduces += 1
        if self.ctx.events is not None:  # the bucket's index: only when recording
            self.ctx.event("all_reduce", self._buckets.index(b), "backward")
        b.handle = self.backend.all_reduce(b.flat, b.group)
        self.ctx.record(b.handle, "all-reduce", b.group, b.flat, -1, "backward")
        b.issued_at = self.ctx.issued(b.handle)

    def unstash(self) -> None:
        """No backward followed the forward that armed the buckets: they disarm (and
        anything set aside goes back into ``.grad``)."""
        self._active = self._armed = False
        self.user_hooks.release(call=False)
        if not self.deferred_backwards:  # what is set aside waits for the syncing backward
            self._put_back()

    def _put_back(self) -> None:
        for p, old in self._stash.items():  # a frozen one's (say zeros) is kept, as autograd keeps it
            p.grad = old if p.grad is None else old.add_(p.grad)
        self._stash.clear()

    def reduce_whole(self) -> None:
        """The backward is over: issue the buckets that never became ready, wait for
        every bucket in order, divide, write ``.grad`` and add the stash back."""
        world, first = self.groups.world_size, not self.deferred_backwards
        self.arrived, self.made = set(), set()
        if world > 1 and self._buckets:
            self._active = self._armed = False
            for b in self._buckets if first else ():  # no gradient arrived this backward: earlier ones aside too
                for p in b.params:
                    if id(p) not in self._arrived:
                        self._set_aside(p)
            self.arrived = self._arrived
            if first:  # after a deferred backward, none is made afresh (see [Note: unused parameters])
                self.made = {id(p) for b in self._buckets for p in b.params if p not in self._stash}
        if not self._syncing:  # see [Note: replica reductions deferred]
            self.deferred_backwards += 1
            return
        self.deferred_backwards = 0
        if world > 1 and self._buckets:
            for b in self._buckets[self._next_bucket :]:
                self._issue_bucket(b)
            self._next_bucket = len(self._buckets)
            for b in self._buckets:
                if b.size == 1:
                    b.handle = None
                    self._divide_in_place(b)
                    continue
                self.ctx.wait(b.handle, f"all-reduce of {b.what}", ("all-reduce", b.what, b.issued_at))
                b.handle = None
                b.flat.div_(self._post if b.flat.dtype in LOW_PRECISION else world)
                off = 0
                for p in b.params:
                    piece = b.flat[off : off + p.numel()].view_as(p)
                    off += p.numel()
                    if not p.requires_grad:  # frozen since the forward: autograd made it none either
                        continue
                    if p.grad is None:
                        p.grad = piece.clone()
                    else:
                        p.grad.copy_(piece)
        self._put_back()

    def _divide_in_place(self, b: Bucket) -> None:
        """A bucket over one rank: its gradients averaged where they are, as a flat
        buffer would be (divided before and after, or once in fp32; zeros where none came)."""
        for p in b.params:
            if not p.requires_grad:  # frozen since the forward: see reduce_whole
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            elif p.dtype in LOW_PRECISION:
                p.grad.div_(self._pre).div_(self._post)
            else:
                p.grad.div_(self.groups.world_size)

    def in_flight(self) -> int:
        return len(self.inflight) + sum(b.handle is not None and not b.handle.is_completed() for b in self._buckets)

    def close(self, abandon: bool) -> None:
        """Drop the buffers. ``abandon`` (a collective failed, the peers are gone):
        complete nothing; a buffer a collective may still use is kept in ``leaked``
        rather than handed back (see [Note: buffers of a failed step])."""
        if abandon:
            for r in self.inflight:
                if r.in_flight():
                    self.leaked.append(r.pair)
                elif r.pooled:
                    self.rs_buffers.release(r.group.dtype, r.pair)
            self.leaked += [b.flat for b in self._buckets if b.handle is not None and not b.handle.is_completed()]
            self.inflight.clear()
            self._active = False
        else:
            self._deferred.clear()  # gradients left waiting are dropped, not reduced at close
            self.drain()
        self.user_hooks.release(call=False)
        for hooks in self._hooks.values():
            for h in hooks:
                h.remove()
        self._hooks.clear()
        self._buckets, self._bucket_of, self._trainable = [], {}, None
