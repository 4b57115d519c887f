"""The CUDA watchdog: where the host never waits on a collective, the deadline of a
host wait seldom fires, so a thread polls the completion events of the collectives
in flight and starts the diagnosis when the oldest has run past the deadline.

[Note: the watchdog's events]
On CUDA the flight record keeps, besides its ring, the entries whose collective has
not been seen complete on its stream: ``FlightRecord.inflight``, each with the event
its handle recorded at the collective's end (``Handle.completion_event`` on an idle
observer stream, as the tracer uses). The training thread appends; this thread alone
pops from the left, and asks only ``Event.query()``, which never synchronises. A
collective whose event has not fired within the deadline of its issue is a hang: the
diagnosis runs here (its store and heartbeats need no GPU), then ``on_hang`` ends the
process, since the training thread is blocked inside CUDA where no exception reaches
it (NCCL's own watchdog does the same with ``TORCH_NCCL_ASYNC_ERROR_HANDLING``).
A handle that cannot give an event (a host-side wait) is not watched: its host wait
has the deadline.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch

from isp_comm.flight.heartbeat import stop_thread
from isp_comm.flight.record import Entry, FlightRecord, describe

POLL_S = 1.0


def exit_after_hang(text: str | None) -> None:
    """The default ``on_hang``: the diagnosis (or a line) to stderr, then exit 1;
    nothing more when ``text`` is ``""`` (the diagnosis printed it already: once)."""
    if text != "":
        print(text or "isp-comm: a collective passed its deadline on the GPU", file=sys.stderr, flush=True)
    os._exit(1)


class Watchdog:
    """Polls ``record.inflight`` every ``poll_s``; ``diagnose(what, deadline_s)`` gives the
    text passed to ``on_hang`` (default: :func:`exit_after_hang`). ``clock``: seconds,
    comparable with the entries' ``issued`` (tests pass a fake). ``device``: the rank's
    GPU, made the thread's own before it queries an event: a thread starts on device 0,
    and the runtime would give every rank of a node a context there."""

    def __init__(
        self,
        record: FlightRecord,
        deadline_s: float,
        diagnose: Callable[[str, float], str | None],
        on_hang: Callable[[str | None], None] = exit_after_hang,
        poll_s: float = POLL_S,
        clock: Callable[[], float] = time.time,
        device: torch.device | None = None,
    ) -> None:
        self.record, self.deadline_s, self.diagnose, self.on_hang = record, deadline_s, diagnose, on_hang
        self.poll_s, self.clock, self.device = poll_s, clock, device
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"isp-watchdog-{record.rank}", daemon=True)
        self.fired: Entry | None = None

    def check(self) -> Entry | None:
        """Drop the collectives seen complete; the oldest one past the deadline, if any."""
        inflight = self.record.inflight
        while inflight:
            e = inflight[0]
            if e.event is None or e.event.query():
                inflight.popleft()
                continue
            return e if self.clock() - e.issued > self.deadline_s else None
        return None

    def poll(self) -> bool:
        """One look; on a hang, the diagnosis and ``on_hang``. Returns whether it fired."""
        e = self.check()
        if e is None:
            return False
        self.fired = e
        entry: dict[str, Any] = e.to_dict()
        text = self.diagnose(f"{describe(entry)} (on the GPU)", self.deadline_s)
        self.on_hang("" if getattr(self.diagnose, "told", False) else text)  # told: printed once already
        return True

    def _run(self) -> None:
        if self.device is not None:
            torch.cuda.set_device(self.device)
        while not self._stop.wait(self.poll_s):
            if self.poll():
                return

    def start(self) -> None:
        self._thread.start()
        # an event query is a C++ call: see [Note: the heartbeat at interpreter exit]
        self._stop_at_exit = weakref.finalize(self, stop_thread, self._thread, self.poll_s + 5.0, self._stop)

    def close(self) -> None:
        stop_thread(self._thread, self.poll_s + 5.0, self._stop)
