"""Bringing WP shards up to date after their pieces changed (``state_sharding="world"``).

[Note: refreshing the WP shards]
With pieces (see [Note: pieces] in ``isp_comm/layout.py``) the optimizer writes the
masters, 1/world of every parameter, while the gathers read each unit's flat shard:
its WP rows in the gather dtype. After the masters change, a unit's flat shard is
rebuilt from every replica's pieces by one all-gather over the replica group, in the
gather dtype, before the unit's next WP gather.

* **What makes a unit stale.** An optimizer step over pieces it may write, the
  trainable ones and any still holding a gradient (a step post-hook the communicator
  registers; it sees fused optimizers too, whose writes leave version counters
  alone; a frozen piece without a gradient is not stepped, and a unit of those alone
  stays fresh); an in-place write that bumps a piece's version counter (looked at
  when the model's forward begins, or a block's when it is called on its own), or
  that of a tensor of a state dict handed out (``dcp.load`` writes into
  those: they share the pieces' memory under version counters of their own, [Note:
  one storage per state-dict tensor] in ``isp_comm/state.py``; [Note: watching the
  state dicts handed out]); a parameter re-pointed (``p.data = t``), copied back at
  the next forward ([Note: re-pointed parameters] in ``isp_comm/units.py``); and the
  explicit points: ``load_state_dict``,
  ``load_full_state_dict``, the Hugging Face import and ``params_updated()``. Every
  rank must see the same ones (they decide which collectives it issues): each is a
  step, call or write every rank makes alike. A step that writes nothing (the one
  at learning rate 0 that gives a fresh optimizer its states, which one rank may
  take alone to read a state dict) is taken under :meth:`WeightRefresh.unwritten`. A mark or a write made while the
  unit's gather is in flight (after the pieces were read) keeps it stale: ``_finish``
  clears only what the gather it waits for saw, and ``ensure`` gathers again.
* **When.** Lazily, at the next forward, in an order every rank shares: the outer
  units when the root's forward begins (their gathers, or computes, come first),
  each unit's gather issued as the one before it is waited for, block 0's last,
  so that it runs behind the outer units' WP gather; then each block just before
  its WP gather is issued. Right behind a block's WP gather, the next block's
  replica all-gather is issued: while block ``i`` computes, block ``i + 1``'s WP
  gather runs on the links inside a node and block ``i + 2``'s replica gather on the
  links between nodes (with one replica group per node-local rank, a replica group
  spans nodes when WP fills a node). The outer units' gathers are waited for before
  the forward's first compute: they are exposed.
* **Buffers.** One send buffer (a rank's pieces) and one landing buffer (every
  replica's) per gather dtype, sized by the largest unit and kept (made outside
  inference mode even when the first refresh runs in it, as written after it). At most one
  replica all-gather is in flight, and a new one is issued only after the last was
  waited for and unpacked, so neither buffer is written while a collective or the
  unpack still reads it.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from isp_comm.backends.base import Backend, Handle, kept_empty
from isp_comm.context import CommContext
from isp_comm.units import BlockUnit


@dataclass(eq=False)
class _Gather:
    """The replica all-gather in flight: whose, its handle, where it lands, and what
    it saw of the pieces (their version counters, the marks made so far)."""

    unit: BlockUnit
    handle: Handle
    landing: torch.Tensor
    issued_at: Any
    versions: tuple[int, ...]
    marks: int


class WeightRefresh:
    """The stale flags of the units with pieces, and the replica all-gathers that
    clear them (see the note above). Owned by the engine; every method is called
    in the same order on every rank."""

    def __init__(self, ctx: CommContext, backend: Backend, replica_group: Any, units: list[BlockUnit]) -> None:
        self.ctx, self.backend, self.group = ctx, backend, replica_group
        self.units = [u for u in units if u.replicas > 1]
        self._stale: set[int] = set()  # ids of stale units
        self._marks = dict.fromkeys(map(id, self.units), 0)  # unit id -> the mark_stale calls that named it
        self._versions = {id(u): _versions(u) for u in self.units}
        self._inflight: _Gather | None = None
        self._buffers: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}
        self._watched: list[tuple[weakref.ref, torch.Tensor, int]] = []  # see watch()
        self._prune_at = 0  # len(_watched) at which watch() next drops the entries whose tensors are gone
        self._gone_written = False  # an entry dropped by watch() whose tensor was written: for the next look
        self.leaked: list[torch.Tensor] = []
        """Buffers an abandoned gather may still write (see [Note: buffers of a failed step])."""

    def mark_stale(self, written: set[int] | None = None) -> None:
        """The pieces of every unit, or of those holding a parameter whose id is in
        ``written``, may have changed: refresh each before its next gather."""
        for u in self.units:
            if written is None or any(id(s) in written for s in u.shards):
                self._marks[id(u)] += 1
                self._stale.add(id(u))

    def watch(self, handed: Iterable[torch.Tensor]) -> None:
        """A state dict's local tensors, each sharing a piece's memory under a version
        counter of its own: a write through one, or through any view of it, makes every
        unit stale at the next look (see the note).

        [Note: watching the state dicts handed out] Every state dict handed out is
        watched, not only the last: the ranks must agree on what was written, and one
        rank may take another state dict of its own (to read its keys) before all of
        them load into the first. Each entry holds the root of its tensor's views
        weakly, and a detached alias of it: the alias shares the root's version counter
        and memory (a piece's, alive anyway) but not the root itself. A write through
        anything the caller keeps (the DTensor, a ``to_local()``) is seen at any later
        look, and one made just before the caller dropped the whole dict
        (``dcp.load(comm.state_dict(), ...)`` drops it as soon as it has written, or a
        dict kept past a forward, written, then dropped) at the next look, through the
        alias; an entry whose root is gone is dropped once a look has read it, or by
        a later ``watch`` once the entries have doubled since they were last pruned
        (a state dict watches module by module), which keeps what it read for the next
        look (a loop taking state dicts without a forward held every one's entries
        until then)."""
        if len(self._watched) >= self._prune_at:  # a state dict watches per module: pruned at doublings
            kept = []
            for r, alias, n in self._watched:
                if r() is not None:
                    kept.append((r, alias, n))
                elif alias._version != n:
                    self._gone_written = True
            self._watched = kept
            self._prune_at = 2 * len(kept) + 64
        for t in handed:
            root = t if t._base is None else t._base
            self._watched.append((weakref.ref(root), root.detach(), root._version))

    def check(self) -> None:
        """A forward begins: a unit whose pieces' version counters moved is stale, and
        every unit when a watched tensor was written."""
        written = self._gone_written or any(alias._version != n for _, alias, n in self._watched)
        self._gone_written = False
        self._watched = [(r, alias, alias._version) for r, alias, _ in self._watched if r() is not None]
        self._prune_at = 2 * len(self._watched) + 64
        if written:
            self.mark_stale()
        for u in self.units:
            self._look(u)

    def _look(self, unit: BlockUnit) -> None:
        """``unit`` is stale when its pieces' version counters moved since its last gather read them."""
        if id(unit) not in self._stale and _versions(unit) != self._versions[id(unit)]:
            self._stale.add(id(unit))

    @contextlib.contextmanager
    def unwritten(self) -> Iterator[None]:
        """Writes made inside leave the pieces as they were (an optimizer's step at
        learning rate 0): neither the step's mark nor the version counters it moves
        make a unit stale. A write before it, not yet looked at, still does."""
        before = {id(u): _versions(u) for u in self.units}
        stale, marks = set(self._stale), dict(self._marks)
        try:
            yield
        finally:
            self._stale, self._marks = stale, marks
            for u in self.units:
                now, g = _versions(u), self._inflight
                if self._versions[id(u)] == before[id(u)]:
                    self._versions[id(u)] = now
                if g is not None and g.unit is u and g.versions == before[id(u)]:
                    g.versions = now

    def is_stale(self, unit: BlockUnit) -> bool:
        return id(unit) in self._stale

    def prefetch(self, unit: BlockUnit | None) -> None:
        """Issue ``unit``'s replica all-gather ahead of its WP gather, when it is stale
        and no other is in flight."""
        if unit is not None and id(unit) in self._stale and self._inflight is None:
            self._issue(unit)

    def ensure(self, unit: BlockUnit, then: BlockUnit | None = None) -> None:
        """``unit``'s flat shard is up to date when this returns (on CUDA: on the
        current stream); ``then``'s gather, when it is stale, is issued behind."""
        while id(unit) in self._stale:  # again when the pieces changed after its gather read them
            if self._inflight is not None and self._inflight.unit is not unit:
                self._finish()
            if self._inflight is None:
                self._issue(unit)
            self._finish()
        self.prefetch(then)

    def _issue(self, unit: BlockUnit) -> None:
        send, landing = self._buffers_for(unit)
        n = unit.piece_gather.numel
        send, landing = send[:n], landing[: unit.replicas * n]
        unit.fill_piece_send(send)
        self.ctx.delay()
        seen = _versions(unit), self._marks[id(unit)]
        handle = self.backend.all_gather(landing, send, self.group)
        self.ctx.record(handle, "all-gather", self.group, send, unit.index, "forward")
        self.ctx.counters.all_gathers += 1
        self.ctx.counters.bytes_gathered += landing.numel() * landing.element_size()
        self._inflight = _Gather(unit, handle, landing, self.ctx.issued(handle), *seen)

    def _finish(self) -> None:
        g, what = self._inflight, f"the pieces of block {self._inflight.unit.index}"
        self.ctx.wait(g.handle, f"replica all-gather of {what}", ("all-gather", what, g.issued_at))
        self._inflight = None
        with torch.no_grad():
            g.unit.unpack_shard(g.landing, g.unit.flat_shard)
        if g.marks == self._marks[id(g.unit)] and _versions(g.unit) == g.versions:  # nothing written since the read
            self._stale.discard(id(g.unit))
        self._versions[id(g.unit)] = g.versions

    def _buffers_for(self, unit: BlockUnit) -> tuple[torch.Tensor, torch.Tensor]:
        """The send and landing buffers of ``unit``'s gather dtype, made at first use."""
        dt = unit.gather_dtype
        if dt not in self._buffers:
            n = max(u.piece_bound for u in self.units if u.gather_dtype == dt)
            r = unit.replicas
            self._buffers[dt] = (kept_empty(n, dt, unit.device), kept_empty(r * n, dt, unit.device))
        return self._buffers[dt]

    def in_flight(self) -> int:
        return int(self._inflight is not None)

    def close(self, abandon: bool) -> None:
        """Finish the gather in flight, or, ``abandon``: keep its buffers if it may
        still use them (never handed back, see [Note: buffers of a failed step])."""
        if self._inflight is not None:
            if not abandon:
                self._finish()
            elif not self._inflight.handle.is_completed():
                self.leaked += list(self._buffers.pop(self._inflight.unit.gather_dtype))
            self._inflight = None
        self._buffers.clear()
        self._watched.clear()


def _versions(unit: BlockUnit) -> tuple[int, ...]:
    return tuple(s._version for s in unit.shards)
