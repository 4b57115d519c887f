"""The communication context's clocks: on CUDA, spans and exposed communication come
from events on the streams and are resolved only once the events have completed."""

from __future__ import annotations

import torch

from isp_comm.context import CommContext
from isp_comm.trace import CudaClock, HostClock, Tracer


class FakeEvent:
    """What CudaClock reads of a ``torch.cuda.Event``: ``query`` and ``elapsed_time``.
    ``t`` (ms) is set when "the GPU" reaches the event."""

    def __init__(self) -> None:
        self.t: float | None = None

    def query(self) -> bool:
        return self.t is not None

    def elapsed_time(self, later: FakeEvent) -> float:
        return later.t - self.t


class FakeCudaClock(CudaClock):
    """CudaClock with its events made here instead of on a GPU (its ``elapsed`` and
    ``completion`` are the real ones)."""

    def __init__(self) -> None:
        self.events: list[FakeEvent] = []
        self._observer = object()

    def now(self) -> FakeEvent:
        self.events.append(FakeEvent())
        return self.events[-1]


class Collective:
    """A handle on a stream: ``wait`` never blocks, its end is an event of its own."""

    def __init__(self, done: FakeEvent) -> None:
        self.done = done

    def wait(self, timeout_s: float) -> None:
        return None

    def is_completed(self) -> bool:
        return self.done.query()

    def completion_event(self, _stream: object) -> FakeEvent:
        return self.done


def test_cuda_spans_and_exposed_time_come_from_completed_events() -> None:
    clock = FakeCudaClock()
    ctx = CommContext(0, 10.0, clock=clock)
    ctx.tracer = Tracer(clock)
    done = FakeEvent()
    handle = Collective(done)
    issued = ctx.issued(handle)  # the gather is issued ...
    ctx.wait(handle, "all-gather of block 1", ("all-gather", "block 1", issued))  # ... and waited at once
    origin, start, before, after = clock.events
    # nothing has run on "the GPU" yet: nothing is known, and asking does not block
    ctx.settle_waits()
    assert ctx.counters.exposed_comm_s == 0.0 and ctx.tracer.spans() == []
    # the compute stream reached the issue at 1 ms and the wait at 3 ms; the gather
    # ended at 8 ms on its own stream, so the compute stream stood still from 3 to 8
    origin.t, start.t, before.t, done.t, after.t = 0.0, 1.0, 3.0, 8.0, 8.0
    ctx.settle_waits()
    assert abs(ctx.counters.exposed_comm_s - 0.005) < 1e-12
    spans = {lane: (t0, t1) for lane, _, t0, t1 in ctx.tracer.spans()}
    assert spans == {"all-gather": (0.001, 0.008), "wait": (0.003, 0.008)}


def test_host_clock_counts_waits_at_once() -> None:
    ctx = CommContext(0, 10.0, clock=HostClock())
    ctx.tracer = Tracer(ctx.clock)
    handle = Collective(FakeEvent())
    issued = ctx.issued(handle)
    assert isinstance(issued, float)  # the host clock cannot see a stream's end: the span ends at the wait
    ctx.wait(handle, "reduce-scatter of block 0", ("reduce-scatter", "block 0", issued))
    # the wait's own span is there too when it lasted 10 us or more (a busy machine)
    spans = {lane: (t0, t1) for lane, _, t0, t1 in ctx.tracer.spans()}
    t0, t1 = spans["reduce-scatter"]
    assert 0.0 <= t0 <= t1 and set(spans) <= {"reduce-scatter", "wait"}
    assert ctx.counters.exposed_comm_s >= 0.0 and not ctx._unresolved


def test_a_recorded_collective_gives_its_span_the_flight_records_event() -> None:
    """On CUDA the flight record takes an event at every collective's end; a trace of
    the same collective uses that event, not a second one on the observer stream."""
    clock = FakeCudaClock()
    asked = []
    real = clock.completion
    clock.completion = lambda handle: asked.append(handle) or real(handle)
    ctx = CommContext(0, 10.0, clock=clock)
    ctx.tracer = Tracer(clock)
    handle = Collective(FakeEvent())
    ctx.record(handle, "all-gather", None, torch.empty(4), 1, "forward")
    _, done = ctx.issued(handle)
    assert asked == [handle] and done is handle.done  # one event, shared
