"""The communication context: what every component that issues or waits on a
collective is handed explicitly (compare FSDP2's ``FSDPCommContext``).

It owns the deadline of every wait, the failure flag, the counters, the clock, the
tracer and the event log. Waiting goes through :meth:`CommContext.wait` and nowhere
else, so every timeout names the rank, sets the failure flag (after which nobody
waits on the vanished peers again) and counts as exposed communication, whoever
waits: the block engine, the vocab-parallel head, the hidden-split embedding, the
sequence-parallel all-to-all or the chunk check.
"""

from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from isp_comm.backends.base import Handle
from isp_comm.errors import ISPCommTimeout
from isp_comm.flight.record import FlightRecord
from isp_comm.trace import Clock, HostClock, Tracer


@dataclass
class CommCounters:
    """What was issued since wrapping (``comm.stats()`` reports them)."""

    all_gathers: int = 0
    reduce_scatters: int = 0
    all_reduces: int = 0
    bytes_gathered: int = 0
    bytes_reduced: int = 0
    exposed_comm_s: float = 0.0
    """Time the training thread (CPU), or the compute stream (CUDA), stood still
    waiting for collectives; see [Note: two clocks] in ``isp_comm/trace.py``."""


class CommContext:
    """Deadline, failure flag, counters, clock, tracer, event log and flight record of
    one communicator."""

    def __init__(self, rank: int, timeout_s: float, debug_delay_s: float = 0.0, clock: Clock | None = None) -> None:
        self.rank = rank
        self.timeout_s = timeout_s
        self.clock: Clock = clock if clock is not None else HostClock()
        self.counters = CommCounters()
        self.tracer: Tracer | None = None
        """Records compute and communication spans while set (``comm.start_trace()``)."""
        self.events: list[tuple[str, int, str]] | None = None
        """(kind, block, phase) of every gather, compute and reduce while set."""
        self.failed = False
        """A wait failed: peers are gone, so in-flight collectives are abandoned."""
        self._debug_delay_s = debug_delay_s
        self._delay_rng = random.Random(rank) if debug_delay_s > 0 else None
        self._unresolved: deque[tuple[Any, Any]] = deque()  # CUDA waits whose events have not completed
        self._cuda = self.clock.cuda
        self.flight = FlightRecord(rank)
        """The last collectives issued, always on (see :mod:`isp_comm.flight`)."""
        self.phase = "outer"
        """Where the training loop is: "forward" or "backward" (the engine sets it), "outer" between."""
        self.diagnose: Callable[[str, float], str | None] | None = None
        """Run at the first wait that passes its deadline: the hang's diagnosis, for the
        error's message (:class:`~isp_comm.flight.diagnosis.Diagnoser`)."""

    def record(
        self, handle: Handle, kind: str, group: Any, tensor: torch.Tensor, block: int = -1, phase: str | None = None
    ) -> Handle:
        """A collective was just issued on ``group`` (``tensor``: what it sends): into the
        flight record; returns ``handle``. ``phase`` defaults to backward inside autograd's
        backward, else :attr:`phase`. Called at every issue site, whatever the backend."""
        if phase is None:
            phase = "backward" if torch._C._current_autograd_node() is not None else self.phase
        e = self.flight.issue(handle, kind, group, tensor, block, phase)
        if self._cuda:  # see [Note: the watchdog's events]
            self.flight.watch(e, self.clock.completion(handle))
        return handle

    def wait(self, handle: Handle, what: str, span: tuple[str, str, Any] | None = None) -> None:
        """Wait for ``handle`` within the deadline.

        A failure or timeout re-raises with ``what`` and this rank named, and sets
        ``failed``. ``span`` = (lane, name, issued) with ``issued`` from
        :meth:`issued` records the collective's span in the tracer; the wait itself
        is recorded too."""
        t0 = self.clock.now()
        self.flight.begin_wait(handle)
        try:
            handle.wait(self.timeout_s)
        except Exception as exc:
            first, self.failed = not self.failed, True
            found = None
            if first and isinstance(exc, ISPCommTimeout) and self.diagnose is not None:
                found = self.diagnose(what, self.timeout_s)  # see [Note: the diagnosis without the stuck collective]
            err = type(exc)(f"{what} (rank {self.rank}): {exc}" + (f"\n{found}" if found else ""))
            if found:
                err.diagnosis, err.told = found, bool(getattr(self.diagnose, "told", False))
            raise err from exc
        self.flight.complete(handle)
        t1 = self.clock.now()
        if self.clock.cuda:  # events resolve later (see settle_waits)
            self._unresolved.append((t0, t1))
            if len(self._unresolved) > 256:
                self.settle_waits()
        else:  # host times: known now
            self.counters.exposed_comm_s += t1 - t0
        if self.tracer is not None:
            self.tracer.add("wait", what, t0, t1)
            if span is not None and span[2] is not None:
                start, done = span[2] if isinstance(span[2], tuple) else (span[2], None)
                self.tracer.add(span[0], span[1], start, t1 if done is None else done)

    def settle_waits(self) -> None:
        """Add the waits whose length is known by now to ``exposed_comm_s`` (on CUDA,
        those whose events have completed; never blocks)."""
        while self._unresolved:
            dt = self.clock.elapsed(*self._unresolved[0])
            if dt is None:
                return
            self._unresolved.popleft()
            self.counters.exposed_comm_s += dt

    def issued(self, handle: Handle) -> Any:
        """A collective was just issued: the mark its span starts at, with its
        completion on its own stream when the clock can tell (CUDA), while tracing;
        ``None`` otherwise."""
        if self.tracer is None:
            return None
        start = self.clock.now()
        recorded = self.flight.pending.get(id(handle))  # on CUDA, :meth:`record` made its event
        done = recorded.event if recorded is not None and recorded.event is not None else self.clock.completion(handle)
        return start if done is None else (start, done)

    def mark(self) -> Any:
        """Now, as the clock marks it, while tracing (else ``None``)."""
        return self.clock.now() if self.tracer is not None else None

    def trace(self, lane: str, name: str, start: Any) -> None:
        """Record a span from ``start`` (a :meth:`mark`) to now, when tracing."""
        if self.tracer is not None and start is not None:
            self.tracer.add(lane, name, start, self.clock.now())

    def record_events(self, enabled: bool = True) -> list[tuple[str, int, str]] | None:
        """Start (or stop) the (kind, block, phase) event log; returns the new log."""
        self.events = [] if enabled else None
        return self.events

    def start_trace(self) -> None:
        """Record compute and communication spans from now on."""
        self.tracer = Tracer(self.clock)

    def stop_trace(self) -> list[tuple[str, str, float, float]]:
        """Stop recording; the (lane, name, start_s, end_s) spans since :meth:`start_trace`."""
        tracer, self.tracer = self.tracer, None
        if tracer is None:
            return []
        tracer.clock.settle()  # outside a step: every CUDA event may complete
        return tracer.spans()

    def delay(self) -> None:
        """Test-only: a random sleep before issuing a collective (``debug_delay_s``)."""
        if self._delay_rng is not None:
            time.sleep(self._delay_rng.random() * self._debug_delay_s)

    def event(self, kind: str, index: int, phase: str) -> None:
        if self.events is not None:
            self.events.append((kind, index, phase))
