"""Side streams for the CUDA backends: one per (group, lane), the events that end a
collective, and the one object through which those backends reach ``torch.cuda``.

[Note: lanes]
A collective of a CUDA symmetric-memory or nvshmem backend runs on a side stream,
never on the compute stream, so that compute goes on while bytes move. One stream
for every collective would still serialise them: a prefetch gather of the next
block would queue behind the reduce-scatter of the last one. So each group has a
stream per *lane*: ``gather`` (all-gathers), ``reduce`` (reduce-scatters and
all-reduces) and ``all_to_all``. Collectives of one lane run in issue order, the
same on every rank (every rank issues the same collectives in the same order, see
[Note: one issue order on every rank]); lanes do not wait for each other, so each
lane owns its scratch buffers too: two lanes never share a byte. (The nvshmem
backend cannot: all its collectives share one team, so they share one stream, see
[Note: one stream for a team] in ``nvshmem_backend.py``.)

[Note: one runtime seam]
The backends reach CUDA only through a :class:`CudaRuntime`: the streams, events,
``record_stream`` and device synchronisation they use. On a GPU it is ``torch.cuda``.
Tests pass :class:`HostRuntime` instead, whose streams run every kernel on the
host in order, so that the backends' own code runs on CPU tensors against fakes of
the collective layers that keep the real layers' semantics (``isp_comm.testing``).
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import torch
import torch.distributed as dist

from isp_comm.backends.base import Handle
from isp_comm.errors import ISPCommTimeout

LANES = ("gather", "reduce", "all_to_all")
"""The lanes of a group (see [Note: lanes])."""


class CudaRuntime:
    """``torch.cuda``'s streams and events, as the CUDA backends use them."""

    def stream(self, device: torch.device, priority: int = 0) -> torch.cuda.Stream:
        """A new stream; ``priority`` < 0 is higher (torch maps it into the device's range)."""
        return torch.cuda.Stream(device=device, priority=priority)

    def current_stream(self, device: torch.device) -> torch.cuda.Stream:
        return torch.cuda.current_stream(device)

    def use(self, stream: torch.cuda.Stream) -> Any:
        return torch.cuda.stream(stream)

    def event(self) -> torch.cuda.Event:
        """With timing: the tracer reads ``elapsed_time`` between such events."""
        return torch.cuda.Event(enable_timing=True)

    def record_stream(self, tensor: torch.Tensor, stream: torch.cuda.Stream) -> None:
        tensor.record_stream(stream)

    def synchronize(self, device: torch.device) -> None:
        torch.cuda.synchronize(device)

    def device_context(self, device: torch.device) -> Any:
        """``device`` current within: what allocates or talks through the current
        device (a symmetric-memory pool, NCCL's ``all_gather_object``) uses it."""
        return torch.cuda.device(device)


class _HostStream:
    """A stream whose work has run by the time it is issued (the host's order)."""

    def __init__(self, handle: int, priority: int = 0) -> None:
        self.cuda_stream, self.priority = handle, priority

    def __cuda_stream__(self) -> tuple[int, int]:  # the CUDA stream protocol's (version, handle)
        return (0, self.cuda_stream)

    def wait_stream(self, _other: _HostStream) -> None:
        return None

    def wait_event(self, _event: _HostEvent) -> None:
        return None

    def synchronize(self) -> None:
        return None


class _HostEvent:
    def __init__(self) -> None:
        self.recorded = False

    def record(self, _stream: _HostStream | None = None) -> None:
        self.recorded = True

    def query(self) -> bool:
        return self.recorded

    def synchronize(self) -> None:
        return None

    def elapsed_time(self, _other: _HostEvent) -> float:
        return 0.0


class HostRuntime:
    """The runtime seam on the host, for tests of the CUDA backends' code on CPU."""

    def __init__(self) -> None:
        self.streams: list[_HostStream] = []
        self._current = _HostStream(0)
        self.device: torch.device | None = None
        """The device a :meth:`device_context` made current (tests read it)."""

    def stream(self, _device: torch.device, priority: int = 0) -> _HostStream:
        self.streams.append(_HostStream(len(self.streams) + 1, priority))
        return self.streams[-1]

    def current_stream(self, _device: torch.device) -> _HostStream:
        return self._current

    def use(self, _stream: _HostStream) -> Any:
        return contextlib.nullcontext()

    def event(self) -> _HostEvent:
        return _HostEvent()

    def record_stream(self, _tensor: torch.Tensor, _stream: _HostStream) -> None:
        return None

    def synchronize(self, _device: torch.device) -> None:
        return None

    @contextlib.contextmanager
    def device_context(self, device: torch.device):
        before, self.device = self.device, device
        try:
            yield
        finally:
            self.device = before


class CudaEventHandle(Handle):
    """A collective on a side stream, ending at ``event``. ``wait`` orders the caller's
    stream after it without stopping the host.

    [Note: what a dead peer looks like on CUDA]
    ``wait`` raises ``ISPCommTimeout``, naming the collective and its ranks, only when
    the host reaches it more than ``deadline_s`` after the issue while the event is
    still pending (``query`` does not block). The host usually waits right after
    issuing, long before any deadline, and checking later would need a host
    synchronisation or a watchdog thread in every step, which this handle does not
    add. So a peer that dies or stalls mid-step is mostly *not* reported here: the
    host blocks at the step's next synchronisation instead, until, on the
    symmetric-memory backend, the device barrier's own deadline (twice the timeout)
    traps the kernel — a sticky CUDA error that ends the process's CUDA context, so
    the job must restart — and, on the nvshmem backend, which has no device
    deadline, until the launcher's or NCCL's watchdog ends the job."""

    __slots__ = ("_device", "_event", "_issued", "_deadline_s", "_runtime", "_what", "_group")

    def __init__(
        self, event, device: torch.device, deadline_s: float = float("inf"), runtime=None, what: str = "", group=None
    ) -> None:
        self._event, self._device = event, device
        self._issued, self._deadline_s = time.monotonic(), deadline_s
        self._runtime = runtime if runtime is not None else CudaRuntime()
        self._what, self._group = what or "a CUDA collective", group

    def wait(self, timeout_s: float) -> None:
        late = time.monotonic() - self._issued
        if late > min(timeout_s, self._deadline_s) and not self._event.query():
            ranks = f" over ranks {dist.get_process_group_ranks(self._group)}" if self._group is not None else ""
            raise ISPCommTimeout(
                f"{self._what}{ranks} did not complete within {min(timeout_s, self._deadline_s):.1f}s "
                f"of its issue ({late:.1f}s ago; a peer died or stalled)"
            )
        self._runtime.current_stream(self._device).wait_event(self._event)

    def is_completed(self) -> bool:
        return self._event.query()

    def completion_event(self, _observer) -> Any:
        """Recorded (with timing) on the stream that ran the collective, as it ended."""
        return self._event


class Lanes:
    """The side streams of one backend, one per (group, lane), made on the tensors'
    own device (not the current one), and the issue of a collective on one of them."""

    def __init__(self, runtime: CudaRuntime | HostRuntime, deadline_s: float) -> None:
        self.runtime, self._deadline_s = runtime, deadline_s
        self._streams: dict[tuple[str, str, torch.device], Any] = {}

    def stream(self, group_name: str, lane: str, device: torch.device, priority: int = 0):
        """The lane's stream, made with ``priority`` the first time it is asked for."""
        key = (group_name, lane, device)
        s = self._streams.get(key)
        if s is None:
            s = self._streams[key] = self.runtime.stream(device, priority)
        return s

    def run(self, group_name: str, lane: str, device: torch.device, tensors, body, what: str = "", group=None):
        """Run ``body(stream)`` on the lane's stream after the caller's stream's work so
        far; ``tensors`` (the collective's inputs and outputs) are recorded on the lane,
        so the caching allocator never hands their memory to another tensor while the
        lane may still use it. ``what`` and ``group`` name the collective in a timeout."""
        rt = self.runtime
        stream = self.stream(group_name, lane, device)
        stream.wait_stream(rt.current_stream(device))
        with rt.use(stream):
            body(stream)
            event = rt.event()
            event.record(stream)
        for t in tensors:
            if t is not None:
                rt.record_stream(t, stream)
        return CudaEventHandle(event, device, self._deadline_s, rt, what, group)

    def synchronize(self) -> None:
        for s in self._streams.values():
            s.synchronize()
