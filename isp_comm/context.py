"""The communication context: what every component that issues or waits on a
collective is handed explicitly (compare FSDP2's ``FSDPCommContext``).

It owns the deadline of every wait, the failure flag, the counters, the tracer and
the event log. Waiting goes through :meth:`CommContext.wait` and nowhere else, so
every timeout names the rank, sets the failure flag (after which nobody waits on
the vanished peers again) and counts as exposed communication, whoever waits: the
block engine, the vocab-parallel head, the hidden-split embedding, the
sequence-parallel all-to-all or the chunk check.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

from isp_comm.backends.base import Handle
from isp_comm.trace import Tracer


@dataclass
class CommCounters:
    """What was issued since wrapping (``comm.stats()`` reports them)."""

    all_gathers: int = 0
    reduce_scatters: int = 0
    all_reduces: int = 0
    bytes_gathered: int = 0
    bytes_reduced: int = 0
    exposed_comm_s: float = 0.0
    """Time the training thread spent waiting for collectives."""


class CommContext:
    """Deadline, failure flag, counters, tracer and event log of one communicator."""

    def __init__(self, rank: int, timeout_s: float, debug_delay_s: float = 0.0) -> None:
        self.rank = rank
        self.timeout_s = timeout_s
        self.counters = CommCounters()
        self.tracer: Tracer | None = None
        """Records compute and communication spans while set (``comm.start_trace()``)."""
        self.events: list[tuple[str, int, str]] | None = None
        """(kind, block, phase) of every gather, compute and reduce while set."""
        self.failed = False
        """A wait failed: peers are gone, so in-flight collectives are abandoned."""
        self._debug_delay_s = debug_delay_s
        self._delay_rng = random.Random(rank) if debug_delay_s > 0 else None

    def wait(self, handle: Handle, what: str, span: tuple[str, str, float] | None = None) -> float:
        """Wait for ``handle`` within the deadline; returns when it completed.

        A failure or timeout re-raises with ``what`` and this rank named, and sets
        ``failed``. ``span`` = (lane, name, issued_at) records the collective's span
        from its issue to now in the tracer; the wait itself is recorded too."""
        t0 = time.perf_counter()
        try:
            handle.wait(self.timeout_s)
        except Exception as exc:
            self.failed = True
            raise type(exc)(f"{what} (rank {self.rank}): {exc}") from exc
        t1 = time.perf_counter()
        self.counters.exposed_comm_s += t1 - t0
        if self.tracer is not None:
            if t1 - t0 > 1e-5:
                self.tracer.add("wait", what, t0, t1)
            if span is not None:
                self.tracer.add(span[0], span[1], span[2], t1)
        return t1

    def trace(self, lane: str, name: str, start: float) -> None:
        """Record a span from ``start`` to now, when tracing."""
        if self.tracer is not None:
            self.tracer.add(lane, name, start, time.perf_counter())

    def delay(self) -> None:
        """Test-only: a random sleep before issuing a collective (``debug_delay_s``)."""
        if self._delay_rng is not None:
            time.sleep(self._delay_rng.random() * self._debug_delay_s)

    def event(self, kind: str, index: int, phase: str) -> None:
        if self.events is not None:
            self.events.append((kind, index, phase))
