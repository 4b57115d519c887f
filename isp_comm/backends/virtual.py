"""Collectives that take their modelled time: one rank of a big job on one device.

[Note: what a virtual collective does]
Under a virtual world (``isp_comm.virtual``) this process is rank R of an N-rank job
whose peers do not exist. Every collective is issued here, as in the real job, and
completes after the time a link model gives it (:class:`LinkModel`), never sooner.
Its output is written with the memory traffic of the bytes that land on this rank,
computed from this rank's own data as if every peer held the same (a mirror world):
the run never claims another rank's bytes, and sums keep the job's scale (a mean
loss, a gradient, a norm read as in the real job):

- all-gather: this rank's input copied into every chunk of the output;
- reduce-scatter: n times this rank's own chunk of the input;
- all-reduce: the tensor times n, in place;
- all-to-all: the input copied to the output (every peer sends what this rank sends).

Values stay finite; they are not the job's (the other ranks' data is never seen).
What is real: the shards, the gathered buffers, the activations, the optimizer
state, the hooks, the order of issues and waits, and so the memory and how much of
the modelled time the schedule hides.

Where the time is spent (the rules of [Note: tiers of links] in
``isp_comm/backends/tiers.py``: a demand per tier, the tiers at once, each tier in
issue order, each group in issue order):

- CPU: a comm thread writes each collective's output as it is issued (in issue
  order), places it on a :class:`~isp_comm.backends.tiers.TierSchedule` at its issue
  time, and completes its handle at the end the schedule gives (in end order: a
  collective on another tier may end first); a handle's ``wait`` blocks on it,
  under the deadline.
- CUDA: see [Note: the virtual backend on CUDA] below. The host never sleeps, so
  the step is issued as in a real run.

[Note: the virtual backend on CUDA]
Streams give the schedule's order on the device, where the host cannot know when
each collective starts:

- one stream per group (NCCL's stream per communicator): it waits for the caller's
  stream, records the collective's start, writes the output;
- one stream per tier, shared by every group: it waits for the start event and
  spins (``torch.cuda._sleep``, calibrated against CUDA events at set-up) for the
  collective's seconds on that tier, so that a tier serves its parts in issue order.
  The streams that spin are high-priority (:data:`SPIN_PRIORITY`): a spin is one block,
  and at default priority it queued behind the blocks of whatever kernel filled the
  GPU when its start event fired (a copy, a matrix product), so a collective
  started late by that kernel's length. On an H100 (6909a49, default priority),
  4 ms on NVLink and 4 ms on InfiniBand issued together took 5.85 ms, behind the
  2 GB copy of the first; at high priority the block scheduler places the spin's
  block ahead of the waiting ones. Priorities order pending blocks and preempt no
  running one: a kernel whose blocks hold every SM until it ends (a persistent
  one) can still hold a spin back. FSDP2's own streams are at -1, the spins above;
- the group's stream then waits for each tier's end, has the group's latency spun
  (on a stream of the group's own, at the tiers' priority), and records the event
  the caller's stream waits on.

The output is written on the group's stream while the tiers spin, as NCCL's kernels
copy while the bytes cross the link: a collective takes the longer of its copy and
its modelled time. With ``record_streams`` (the default, as c10d does for an
asynchronous collective) the caller's tensors are recorded on the group's stream;
a caller that waits on the stream that allocated them, before freeing them, needs
none (FSDP2's collectives: synchronous calls on its own streams), and then the
caching allocator may reuse their memory as soon as that stream has moved on.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import queue
import threading
import time
from collections.abc import Callable
from typing import Protocol

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from isp_comm.backends.base import Backend, CompletedHandle, Handle, writing_mode
from isp_comm.backends.streams import CudaRuntime, HostRuntime, Lanes
from isp_comm.backends.tiers import Demand, TierSchedule
from isp_comm.errors import ISPCommTimeout

OPS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")
BUS = "bus"
"""The one tier of a :class:`FlatLink`."""
SPIN_PRIORITY = -64
"""The CUDA priority of the streams that spin (the tiers', each group's latency):
lower is higher, 0 the default, and torch maps a value past its range to the highest
priority it has, ahead of FSDP2's own streams (-1). See [Note: the virtual backend on
CUDA]."""


class LinkModel(Protocol):
    """What a collective asks of this rank's links: ``op`` (one of :data:`OPS`) over
    the group of ``ranks`` (global ranks, ascending) on a buffer of ``nbytes``: the
    gathered (full) size for all-gather and reduce-scatter, the tensor for
    all-reduce, the whole input for all-to-all (see [Note: tiers of links] in
    ``isp_comm/backends/tiers.py``)."""

    def demand(self, op: str, ranks: tuple[int, ...], nbytes: int) -> Demand: ...

    def describe(self) -> str: ...


def ring_traffic(op: str, n: int, nbytes: int) -> float:
    """Bytes the busiest link carries: (n-1)/n of the buffer, twice for an all-reduce
    (a reduce-scatter then an all-gather)."""
    if n <= 1:
        return 0.0
    share = (n - 1) / n * nbytes
    return 2 * share if op == "all_reduce" else share


@dataclasses.dataclass(frozen=True)
class FlatLink:
    """One bus bandwidth for every collective, one tier (every collective shares
    it), no latency (``--virtual-gbps``)."""

    bytes_per_s: float

    def __post_init__(self) -> None:
        if not self.bytes_per_s > 0:
            raise ValueError(f"a virtual link's bandwidth must be > 0 bytes/s, got {self.bytes_per_s}")

    def demand(self, op: str, ranks: tuple[int, ...], nbytes: int) -> Demand:
        return Demand(0.0, ((BUS, ring_traffic(op, len(ranks), nbytes) / self.bytes_per_s),))

    def seconds(self, op: str, ranks: tuple[int, ...], nbytes: int) -> float:
        return self.demand(op, ranks, nbytes).seconds

    def describe(self) -> str:
        return f"every collective at {self.bytes_per_s / 1e9:g} GB/s bus bandwidth on one shared link, no latency"


@torch.no_grad()  # the comm thread's own grad mode is on; the buffers are no autograd's business
def _write(op: str, out: torch.Tensor | None, inp: torch.Tensor, index: int, n: int) -> None:
    """The bytes that land on this rank (see [Note: what a virtual collective does])."""
    with writing_mode(inp if op == "all_reduce" else out):
        _write_bytes(op, out, inp, index, n)


def _write_bytes(op: str, out: torch.Tensor | None, inp: torch.Tensor, index: int, n: int) -> None:
    if op == "all_gather":
        out.view(n, -1).copy_(inp.reshape(1, -1).expand(n, -1))
    elif op == "reduce_scatter":
        torch.mul(inp.view(n, -1)[index].view_as(out), n, out=out)
    elif op == "all_reduce":
        inp.mul_(n)
    else:
        out.copy_(inp.view_as(out))


class VirtualHandle(Handle):
    """A collective on the CPU comm thread: done when the thread has set ``done``."""

    __slots__ = ("done", "error", "_what", "_ranks")

    def __init__(self, what: str, ranks: tuple[int, ...]) -> None:
        self.done, self.error = threading.Event(), None
        self._what, self._ranks = what, ranks

    def wait(self, timeout_s: float) -> None:
        if not self.done.wait(timeout_s):
            ranks = list(self._ranks)
            raise ISPCommTimeout(f"virtual {self._what} over ranks {ranks} passed its {timeout_s:.1f}s deadline")
        if self.error is not None:
            raise ISPCommTimeout(f"virtual {self._what} failed: {self.error}") from self.error

    def is_completed(self) -> bool:
        return self.done.is_set()


_DRAIN = object()
"""A job that ends when every collective issued before it has ended (a barrier)."""


class _CommThread:
    """The CPU comm thread: writes each collective's bytes in issue order, places it on
    the tiers (:class:`TierSchedule`, host time) and completes it at its end, in end
    order (see [Note: what a virtual collective does])."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.schedule = TierSchedule()
        self.late_s = 0.0
        """Time the copies ran past the modelled ends (the host could not keep up)."""
        self._order = itertools.count()
        self._thread = threading.Thread(target=self._run, name="isp-virtual-comm", daemon=True)
        self._thread.start()

    def submit(self, issued: float, group: str, demand: Demand | object, body: Callable[[], None], handle) -> None:
        """``demand``: the collective's, or ``_DRAIN``."""
        self._jobs.put((issued, group, demand, body, handle))

    def _run(self) -> None:
        pending: list = []  # heap of (end, issue order, handle)
        while True:
            now = time.perf_counter()
            while pending and pending[0][0] <= now:
                heapq.heappop(pending)[2].done.set()
            try:
                job = self._jobs.get(timeout=pending[0][0] - now) if pending else self._jobs.get()
            except queue.Empty:
                continue
            if job is None:
                for _, _, handle in pending:  # closing: nothing waits for them any more
                    handle.done.set()
                return
            issued, group, demand, body, handle = job
            try:
                body()
            except Exception as exc:  # reported by the handle's wait (without its frames: they hold the tensors)
                handle.error = exc.with_traceback(None)
            if demand is _DRAIN:
                end = max(issued, self.schedule.horizon())
            else:
                end = self.schedule.place(issued, group, demand)
            now = time.perf_counter()
            if now > end:
                self.late_s += now - end
            heapq.heappush(pending, (end, next(self._order), handle))
            # the job's closure holds the collective's tensors: drop it now, or the last
            # one issued (a step's last reduce-scatter input) lives on until the next
            job = body = None

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=60)


class DeviceDelay:
    """A device-side wait of a given time on the current CUDA stream: a kernel that
    spins ``cycles`` clock cycles (``torch.cuda._sleep``), with the cycles per second
    calibrated against CUDA events at set-up."""

    CALIBRATION_CYCLES = 20_000_000
    """About 10 ms a spin at 2 GHz: the clocks ramp up during the warm-up spin, and a
    launch's microseconds are well under 1% of each timed one."""

    def __init__(self, device: torch.device) -> None:
        with torch.cuda.device(device):
            n = self.CALIBRATION_CYCLES
            torch.cuda._sleep(5 * n)  # warm-up: about 50 ms at full clocks
            self.cycles_per_s = n / self._measure(lambda: torch.cuda._sleep(n))

    @staticmethod
    def _measure(fn: Callable[[], object]) -> float:
        """Seconds ``fn``'s kernels take on the device (the median of 5, after one warm-up)."""
        fn()
        times = []
        for _ in range(5):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        return sorted(times)[2]

    def spin(self, seconds: float) -> None:
        """On the current stream: a kernel that takes ``seconds``."""
        if seconds > 0:
            torch.cuda._sleep(int(seconds * self.cycles_per_s))


class VirtualBackend(Backend):
    """Collectives of rank R of a virtual world that take their modelled time (see
    [Note: what a virtual collective does]). ``link``: the time model (a
    :class:`FlatLink`, or the planner's, built by the layer above); ``runtime``: the
    CUDA seam (tests pass :class:`~isp_comm.backends.streams.HostRuntime`, or a
    runtime of their own with ``delay``: an object whose ``spin(seconds)`` stands
    for the device's spin); ``record_streams``: whether the caller's tensors are
    recorded on the collective's stream (CUDA; see [Note: the virtual backend on CUDA])."""

    name = "virtual"
    checks_sizes = True  # one rank: no peer brings another size

    def __init__(
        self,
        device: torch.device,
        link: LinkModel,
        timeout_s: float = 300.0,
        runtime: CudaRuntime | HostRuntime | None = None,
        *,
        record_streams: bool = True,
        delay: object | None = None,
    ) -> None:
        self.device, self.link, self.timeout_s = device, link, timeout_s
        self.record_streams = record_streams
        self.modelled_comm_s = 0.0
        self.tier_s: dict[str, float] = {}
        """Seconds of modelled traffic issued on each tier of links (their demands)."""
        self.issued: dict[str, int] = dict.fromkeys(OPS, 0)
        self._ranks: dict[str, tuple[int, ...]] = {}
        self._thread = self._lanes = self._delay = None
        if device.type == "cuda" or runtime is not None:
            self._lanes = Lanes(runtime if runtime is not None else CudaRuntime(), timeout_s)
            self._delay = delay if runtime is not None else DeviceDelay(device)
        else:
            self._thread = _CommThread()

    @property
    def late_s(self) -> float:
        """CPU: time the comm thread's copies ran past the modelled ends (0 on CUDA)."""
        return self._thread.late_s if self._thread is not None else 0.0

    def group_ranks(self, group: ProcessGroup) -> tuple[int, ...]:
        ranks = self._ranks.get(group.group_name)
        if ranks is None:
            ranks = self._ranks[group.group_name] = tuple(sorted(dist.get_process_group_ranks(group)))
        return ranks

    def _issue(self, op: str, out: torch.Tensor | None, inp: torch.Tensor, group: ProcessGroup) -> Handle:
        ranks = self.group_ranks(group)
        n = len(ranks)
        if n == 1:
            if out is not None:
                out.copy_(inp.view_as(out))
            return CompletedHandle()
        full = (out if op == "all_gather" else inp).numel() * inp.element_size()
        demand = self.link.demand(op, ranks, full)
        if demand.seconds > self.timeout_s:  # its wait would time out, and a diagnosis ask peers that do not exist
            raise ValueError(
                f"virtual world: the modelled {op.replace('_', '-')} of {full:,} bytes over ranks {list(ranks)} takes "
                f"{demand.seconds:.1f} s, past the {self.timeout_s:.1f} s deadline (--comm-timeout, "
                "ISPConfig.timeout_s): raise the deadline, or give the link model more bandwidth"
            )
        self.modelled_comm_s += demand.seconds
        for tier, seconds in demand.tiers:
            self.tier_s[tier] = self.tier_s.get(tier, 0.0) + seconds
        self.issued[op] += 1
        index = ranks.index(dist.get_rank())
        what = op.replace("_", "-")
        if self._lanes is None:
            handle = VirtualHandle(what, ranks)
            body = lambda: _write(op, out, inp, index, n)  # noqa: E731
            self._thread.submit(time.perf_counter(), group.group_name, demand, body, handle)
            return handle
        return self._on_streams(group, demand, lambda: _write(op, out, inp, index, n), (out, inp), f"virtual {what}")

    def _on_streams(self, group: ProcessGroup, demand: Demand, write: Callable[[], None], tensors, what: str):
        """The collective on the group's stream and the tiers' (see [Note: the virtual
        backend on CUDA])."""
        lanes, rt, delay = self._lanes, self._lanes.runtime, self._delay

        def spin_after(group_name: str, lane: str, after, seconds: float):
            """``seconds`` spun on the lane's high-priority stream once ``after`` fired; the end."""
            spin_stream = lanes.stream(group_name, lane, self.device, SPIN_PRIORITY)
            spin_stream.wait_event(after)
            with rt.use(spin_stream):
                if delay is not None:
                    delay.spin(seconds)
                end = rt.event()
                end.record(spin_stream)
            return end

        def body(stream) -> None:
            start = rt.event()
            start.record(stream)
            write()
            ends = [spin_after("virtual tiers", tier, start, s) for tier, s in demand.tiers if s > 0]
            for end in ends:
                stream.wait_event(end)
            if demand.latency_s > 0:  # the group's, after its last part (its own stream: a spin queues on none)
                parts_done = rt.event()
                parts_done.record(stream)
                stream.wait_event(spin_after(group.group_name, "virtual latency", parts_done, demand.latency_s))

        kept = tensors if self.record_streams else ()
        return lanes.run(group.group_name, "virtual", self.device, kept, body, what, group)

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, group: ProcessGroup) -> Handle:
        return self._issue("all_gather", out, inp, group)

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, group: ProcessGroup) -> Handle:
        return self._issue("reduce_scatter", out, inp, group)

    def all_reduce(self, tensor: torch.Tensor, group: ProcessGroup) -> Handle:
        return self._issue("all_reduce", None, tensor, group)

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, group: ProcessGroup) -> Handle:
        return self._issue("all_to_all", out, inp, group)

    def barrier(self, group: ProcessGroup, timeout_s: float) -> None:
        """No peer to meet: only this rank's collectives issued so far are waited for."""
        if self._thread is not None:
            handle = VirtualHandle("barrier", self.group_ranks(group))
            self._thread.submit(time.perf_counter(), group.group_name, _DRAIN, lambda: None, handle)
            handle.wait(timeout_s)
        elif self._lanes is not None:
            self._lanes.synchronize()

    def empty(
        self, numel: int, dtype: torch.dtype, device: torch.device, group: ProcessGroup | None = None
    ) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, device=device)

    def close(self) -> None:
        if self._thread is not None:
            self._thread.close()
            self._thread = None
        elif self._lanes is not None:
            self._lanes.synchronize()
