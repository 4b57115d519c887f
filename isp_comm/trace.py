"""Spans of compute and communication on one rank, for timelines (Chrome trace)."""

from __future__ import annotations

import time

LANES = ("compute", "all-gather", "reduce-scatter", "all-reduce", "all-to-all", "wait")


class Tracer:
    """Collects (lane, name, start_s, end_s) spans; times are ``perf_counter`` seconds
    since the tracer started. A collective's span runs from its issue to the moment the
    training thread learned it was complete (an upper bound of its real duration)."""

    def __init__(self) -> None:
        self.origin = time.perf_counter()
        self.spans: list[tuple[str, str, float, float]] = []

    def add(self, lane: str, name: str, start: float, end: float) -> None:
        self.spans.append((lane, name, start - self.origin, end - self.origin))


def chrome_events(spans_by_rank: list[list[tuple[str, str, float, float]]]) -> list[dict]:
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
