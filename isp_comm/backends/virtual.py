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

Where the time is spent:

- CPU: a comm thread runs the collectives in issue order. Each starts when the
  previous one has ended (one queue, as the planner's one communication stream and
  NCCL's one stream per communicator), writes its output and returns at its start
  plus its modelled time; a handle's ``wait`` blocks on it, under the deadline.
- CUDA: one side stream. The collective's stream waits for the caller's, writes the
  output, then spins on the device (``torch.cuda._sleep``) for the modelled time less
  the copy's, calibrated against CUDA events once at set-up; the caller's stream
  waits on its event. The host never sleeps, so the step is issued as in a real run.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from collections.abc import Callable
from typing import Protocol

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from isp_comm.backends.base import Backend, CompletedHandle, Handle
from isp_comm.backends.streams import CudaRuntime, HostRuntime, Lanes
from isp_comm.errors import ISPCommTimeout

OPS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")


class LinkModel(Protocol):
    """Seconds a collective takes: ``op`` (one of :data:`OPS`) over the group of
    ``ranks`` (global ranks, ascending) on a buffer of ``nbytes``: the gathered (full)
    size for all-gather and reduce-scatter, the tensor for all-reduce, the whole
    input for all-to-all."""

    def seconds(self, op: str, ranks: tuple[int, ...], nbytes: int) -> float: ...

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
    """One bus bandwidth for every collective and no latency (``--virtual-gbps``)."""

    bytes_per_s: float

    def __post_init__(self) -> None:
        if not self.bytes_per_s > 0:
            raise ValueError(f"a virtual link's bandwidth must be > 0 bytes/s, got {self.bytes_per_s}")

    def seconds(self, op: str, ranks: tuple[int, ...], nbytes: int) -> float:
        return ring_traffic(op, len(ranks), nbytes) / self.bytes_per_s

    def describe(self) -> str:
        return f"every collective at {self.bytes_per_s / 1e9:g} GB/s bus bandwidth, no latency"


@torch.no_grad()  # the comm thread's own grad mode is on; the buffers are no autograd's business
def _write(op: str, out: torch.Tensor | None, inp: torch.Tensor, index: int, n: int) -> None:
    """The bytes that land on this rank (see [Note: what a virtual collective does])."""
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


class _CommThread:
    """The CPU comm queue: collectives run in issue order, each ending no sooner than
    its start (the later of its issue and the previous one's end) plus its time."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.late_s = 0.0
        """Time the copies ran past the modelled ends (the host could not keep up)."""
        self._thread = threading.Thread(target=self._run, name="isp-virtual-comm", daemon=True)
        self._thread.start()

    def submit(self, issued: float, seconds: float, body: Callable[[], None], handle: VirtualHandle) -> None:
        self._jobs.put((issued, seconds, body, handle))

    def _run(self) -> None:
        free_at = 0.0
        while True:
            job = self._jobs.get()
            if job is None:
                return
            issued, seconds, body, handle = job
            start = max(issued, free_at)
            try:
                body()
            except Exception as exc:  # reported by the handle's wait
                handle.error = exc
            end = start + seconds
            now = time.perf_counter()
            if now < end:
                time.sleep(end - now)
            else:
                self.late_s += now - end
            free_at = max(end, now)
            handle.done.set()

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=60)


class DeviceDelay:
    """A device-side wait of a given time on the current CUDA stream: a kernel that
    spins ``cycles`` clock cycles (``torch.cuda._sleep``), with the cycles per second
    and the copy rate calibrated against CUDA events at set-up."""

    CALIBRATION_CYCLES = 20_000_000
    """About 10 ms a spin at 2 GHz: the clocks ramp up during the warm-up spin, and a
    launch's microseconds are well under 1% of each timed one."""

    def __init__(self, device: torch.device) -> None:
        with torch.cuda.device(device):
            n = self.CALIBRATION_CYCLES
            torch.cuda._sleep(5 * n)  # warm-up: about 50 ms at full clocks
            self.cycles_per_s = n / self._measure(lambda: torch.cuda._sleep(n))
            a = torch.empty(64 * 2**20, dtype=torch.uint8, device=device)
            b = torch.empty_like(a)
            self.copy_bytes_per_s = a.numel() / self._measure(lambda: b.copy_(a))

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

    def spin(self, seconds: float, copied_bytes: int) -> None:
        """On the current stream: the rest of ``seconds`` after writing ``copied_bytes``
        (at the calibrated rate of a device-to-device copy: bytes written per second)."""
        rest = seconds - copied_bytes / self.copy_bytes_per_s
        if rest > 0:
            torch.cuda._sleep(int(rest * self.cycles_per_s))


class VirtualBackend(Backend):
    """Collectives of rank R of a virtual world that take their modelled time (see
    [Note: what a virtual collective does]). ``link``: the time model (a
    :class:`FlatLink`, or the planner's, built by the layer above); ``runtime``: the
    CUDA seam (tests pass :class:`~isp_comm.backends.streams.HostRuntime`)."""

    name = "virtual"

    def __init__(
        self,
        device: torch.device,
        link: LinkModel,
        timeout_s: float = 300.0,
        runtime: CudaRuntime | HostRuntime | None = None,
    ) -> None:
        self.device, self.link, self.timeout_s = device, link, timeout_s
        self.modelled_comm_s = 0.0
        self.issued: dict[str, int] = dict.fromkeys(OPS, 0)
        self._ranks: dict[str, tuple[int, ...]] = {}
        self._thread = self._lanes = self._delay = None
        if device.type == "cuda" or runtime is not None:
            self._lanes = Lanes(runtime if runtime is not None else CudaRuntime(), timeout_s)
            self._delay = DeviceDelay(device) if runtime is None else None
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
        seconds = self.link.seconds(op, ranks, full)
        self.modelled_comm_s += seconds
        self.issued[op] += 1
        index = ranks.index(dist.get_rank())
        what = op.replace("_", "-")
        landed = (out if out is not None else inp).numel() * inp.element_size()
        if self._lanes is None:
            handle = VirtualHandle(what, ranks)
            self._thread.submit(time.perf_counter(), seconds, lambda: _write(op, out, inp, index, n), handle)
            return handle

        def body(_stream) -> None:
            _write(op, out, inp, index, n)
            if self._delay is not None:
                self._delay.spin(seconds, landed)  # a copy of that many bytes, as calibrated

        return self._lanes.run("virtual", "virtual", inp.device, (out, inp), body, f"virtual {what}", group)

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
            self._thread.submit(time.perf_counter(), 0.0, lambda: None, handle)
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
