"""Spans of compute and communication on one rank, for timelines (Chrome trace), and
the clocks that time them.

[Note: two clocks] On CPU a span's ends are host times (``perf_counter``): the work
runs in the thread that records it. On CUDA the host only enqueues work, so host
times would measure kernel launches; there a mark is a CUDA event recorded on the
stream that runs the work (``torch.cuda.Event(enable_timing=True)``), and a span is
resolved to seconds only once both its events have completed (``query()``, which
never blocks): after the step, without stalling it. A collective's span runs from
its issue (an event on the issuing stream, which the collective's stream waits for)
to its completion on the stream that ran it; a wait's span, from just before the
compute stream was made to wait to just after: the time the compute stream stood
still for communication, which is what ``exposed_comm_s`` adds up.
"""

from __future__ import annotations

import time
from typing import Any

import torch

MIN_WAIT_S = 1e-5
LANES = ("compute", "all-gather", "reduce-scatter", "all-reduce", "all-to-all", "wait")


class HostClock:
    """Marks are ``perf_counter`` seconds, known at once."""

    cuda = False

    def now(self) -> float:
        return time.perf_counter()

    def elapsed(self, a: float, b: float) -> float | None:
        return b - a

    def completion(self, handle: Any) -> None:
        return None

    def settle(self) -> None:
        return None


class CudaClock:
    """Marks are timing events recorded on ``device``'s current stream; see [Note: two clocks]."""

    cuda = True

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._observer: torch.cuda.Stream | None = None

    def now(self) -> torch.cuda.Event:
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def elapsed(self, a: torch.cuda.Event, b: torch.cuda.Event) -> float | None:
        """Seconds from ``a`` to ``b``, or ``None`` while either has not completed."""
        if not (a.query() and b.query()):
            return None
        return a.elapsed_time(b) / 1e3

    def completion(self, handle: Any) -> torch.cuda.Event | None:
        """An event at the end of ``handle``'s collective on its own stream, or None
        when the handle cannot say (a host-side wait: its span ends at the wait)."""
        if self._observer is None:  # an idle stream that only waits, so its events fire as the work ends
            self._observer = torch.cuda.Stream(device=self.device)
        return handle.completion_event(self._observer)  # see Handle.completion_event

    def settle(self) -> None:
        """Outside a step (stopping a trace): let every recorded event complete."""
        torch.cuda.synchronize(self.device)


Clock = HostClock | CudaClock


def clock_for(device: torch.device) -> Clock:
    return CudaClock(device) if device.type == "cuda" else HostClock()


class Tracer:
    """Collects (lane, name, start, end) spans as marks of ``clock``; ``spans()`` gives
    them in seconds since the tracer started. A collective's span runs from its issue
    to its completion on the stream that ran it (CUDA) or to the moment the training
    thread learned it was complete (host: an upper bound of its real duration)."""

    def __init__(self, clock: Clock | None = None) -> None:
        self.clock = clock if clock is not None else HostClock()
        self.origin = self.clock.now()
        self.wall_origin = time.time()
        """The origin on the wall clock, which every rank shares (on one host exactly,
        across hosts to NTP's milliseconds): :func:`aligned` puts ranks on one time line.
        On CUDA, when the origin event was enqueued (the stream may run it later)."""
        self._marks: list[tuple[str, str, Any, Any]] = []

    def add(self, lane: str, name: str, start: Any, end: Any) -> None:
        self._marks.append((lane, name, start, end))

    def spans(self) -> list[tuple[str, str, float, float]]:
        """The spans resolved so far (all of them after ``clock.settle()``), in
        seconds since the tracer started; waits shorter than 10 us are left out."""
        out = []
        for lane, name, a, b in self._marks:
            t0, t1 = self.clock.elapsed(self.origin, a), self.clock.elapsed(self.origin, b)
            if t0 is not None and t1 is not None and (lane != "wait" or t1 - t0 >= MIN_WAIT_S):
                out.append((lane, name, t0, t1))
        return out


Spans = list[tuple[str, str, float, float]]
"""(lane, name, start_s, end_s) of one rank."""


def aligned(traces: list[tuple[float, Spans]]) -> list[Spans]:
    """Each rank's spans, given with its tracer's ``wall_origin``, in seconds since the
    earliest rank's origin: each tracer counts from its own start, and ranks start
    their traces milliseconds apart, which drew a collective ending on one rank
    before it began on another."""
    base = min((origin for origin, _ in traces), default=0.0)
    return [[(lane, name, t0 + o - base, t1 + o - base) for lane, name, t0, t1 in spans] for o, spans in traces]


def chrome_events(spans_by_rank: list[Spans]) -> list[dict]:
    """Chrome/Perfetto trace events: one process per rank, one thread per lane."""
    events: list[dict] = []
    for rank, spans in enumerate(spans_by_rank):
        events.append({"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}})
        for tid, lane in enumerate(LANES):
            events.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": tid, "args": {"name": lane}})
        for lane, name, t0, t1 in spans:
            events.append(
                {
                    "name": name,
                    "cat": lane,
                    "ph": "X",
                    "pid": rank,
                    "tid": LANES.index(lane),
                    "ts": round(t0 * 1e6, 1),
                    "dur": round(max(t1 - t0, 0.0) * 1e6, 1),
                }
            )
    return events
