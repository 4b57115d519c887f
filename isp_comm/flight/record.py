"""The flight record: a rank's last K collectives, always on.

[Note: what the record costs]
Every collective the communicator issues (block gathers, reduce-scatters, bucket
all-reduces, the SP all-to-all, the vocab-parallel head's, the loss's and the clip's)
adds one :class:`Entry` at issue and stamps its completion at the wait that ends it.
The hot path is a slot-class construction, two clock reads, a dict update for the
group's sequence number and a ring write; no lock (the heartbeat thread reads a
snapshot, and a torn read of a ring that moves on costs one stale entry, never a
crash: ``snapshot`` copies the deque, which is atomic under the GIL). The budget is
2 us per collective; ``bench/flight_record.py`` measures it.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

import torch
import torch.distributed as dist

DEFAULT_CAPACITY = 64
"""Entries kept per rank: a few steps of a small model, a step's tail of a large one."""


class Entry:
    """One collective as this rank issued it. ``seq`` counts the collectives of
    ``group`` on this rank from 1: at the same ``seq`` of the same group every rank
    in step issued the same kind, bytes, dtype, block and phase."""

    __slots__ = (
        *("seq", "group", "kind", "nbytes", "dtype", "block", "phase", "step"),
        *("issued", "done", "handle", "event"),
    )

    def __init__(self, seq, group, kind, nbytes, dtype, block, phase, step, issued, handle) -> None:
        self.seq, self.group, self.kind, self.nbytes, self.dtype = seq, group, kind, nbytes, dtype
        self.block, self.phase, self.step, self.issued, self.handle = block, phase, step, issued, handle
        self.done: float | None = None
        self.event: Any = None
        """CUDA: an event at the collective's end on its stream (see [Note: the watchdog's events])."""

    def signature(self) -> tuple:
        """What every rank in step agrees on at this ``(group, seq)``."""
        return (self.kind, self.nbytes, str(self.dtype), self.block, self.phase)

    def to_dict(self) -> dict[str, Any]:
        return {
            "seq": self.seq,
            "group": self.group,
            "kind": self.kind,
            "bytes": self.nbytes,
            "dtype": str(self.dtype).removeprefix("torch."),
            "block": self.block,
            "phase": self.phase,
            "step": self.step,
            "issued": self.issued,
            "done": self.done,
        }


def describe(e: dict[str, Any]) -> str:
    """``block 0 forward all-gather #57`` for an entry's dict (``outer`` for -1)."""
    where = f"block {e['block']} {e['phase']}" if e["block"] >= 0 else e["phase"]
    return f"{where} {e['kind']} #{e['seq']}"


class FlightRecord:
    """The last ``capacity`` collectives of one rank, with the ones still pending.

    ``step`` is the caller's step number, stamped on every entry (isp-train sets it
    through :meth:`~isp_comm.ISPCommunicator.set_step`; ``None`` otherwise)."""

    def __init__(self, rank: int, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.rank = rank
        self.entries: deque[Entry] = deque(maxlen=capacity)
        self.pending: dict[int, Entry] = {}
        """Issued, not yet waited, by ``id(handle)`` (the entry holds the handle, so the
        id is not reused while it is here)."""
        self.seqs: dict[str, int] = {}
        self.completed: dict[str, int] = {}
        """Per group: the highest sequence number waited for."""
        self.step: int | None = None
        self.inflight: deque[Entry] = deque()
        """CUDA: entries whose completion event has not been seen yet (the watchdog's)."""
        self.current: Entry | None = None
        """The collective the rank's main thread waits for now (``None`` between waits)."""
        self._labels: dict[Any, str] = {}
        self._max_pending = 4 * capacity

    def label(self, group: Any) -> str:
        """The group's name on every rank alike: its global ranks."""
        name = self._labels.get(group)
        if name is None:
            ranks = dist.get_process_group_ranks(group) if group is not None else [self.rank]
            name = self._labels[group] = ",".join(map(str, ranks))
        return name

    def issue(self, handle: Any, kind: str, group: Any, tensor: torch.Tensor, block: int, phase: str) -> Entry:
        """Record a collective just issued on ``group`` (``tensor``: what it sends or
        reduces, for its bytes and dtype)."""
        name = self._labels.get(group) or self.label(group)
        seqs, pending = self.seqs, self.pending
        seq = seqs[name] = seqs.get(name, 0) + 1
        e = Entry(seq, name, kind, tensor.nbytes, tensor.dtype, block, phase, self.step, time.time(), handle)
        self.entries.append(e)
        pending[id(handle)] = e
        if len(pending) > self._max_pending:  # handles never waited (a failed step): forget the oldest
            del pending[next(iter(pending))]
        return e

    def begin_wait(self, handle: Any) -> None:
        """The main thread starts waiting for ``handle``."""
        self.current = self.pending.get(id(handle))

    def watch(self, e: Entry, event: Any) -> None:
        """CUDA: the watchdog follows ``e`` until ``event`` (its collective's end) fires."""
        if event is not None:
            e.event = event
            self.inflight.append(e)

    def complete(self, handle: Any) -> None:
        """The wait on ``handle`` returned: stamp its entry's completion."""
        self.current = None
        e = self.pending.pop(id(handle), None)
        if e is not None:
            e.done = time.time()
            e.handle = None
            if e.seq > self.completed.get(e.group, 0):
                self.completed[e.group] = e.seq

    def oldest_pending(self) -> Entry | None:
        """The earliest issued collective not yet waited for."""
        pending = list(self.pending.values())
        return min(pending, key=lambda e: e.issued) if pending else None

    def waiting(self) -> Entry | None:
        """What the rank waits for: the collective its main thread waits on, else the
        oldest pending one."""
        current = self.current
        return current if current is not None else self.oldest_pending()

    def snapshot(self) -> dict[str, Any]:
        """The record as plain data (JSON), for the store and ``hang.json``."""
        entries = [e.to_dict() for e in list(self.entries)]
        waiting = self.waiting()
        return {
            "rank": self.rank,
            "time": time.time(),
            "step": self.step,
            "issued": dict(self.seqs),
            "completed": dict(self.completed),
            "waiting": waiting.to_dict() if waiting is not None else None,
            "entries": entries,
        }
