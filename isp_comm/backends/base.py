"""The collective interface every backend implements, and its handle type.

Backends know bytes, groups and deadlines; they know nothing of blocks or models.
Every collective takes its group and buffers explicitly and returns a handle whose
``wait(timeout_s)`` raises :class:`~isp_comm.errors.ISPCommTimeout` past the deadline.
"""

from __future__ import annotations

import contextlib
import importlib
import time

import torch
from torch.distributed import ProcessGroup


def cuda_with(module: str) -> bool:
    """CUDA is present and ``module`` imports: whether a GPU backend can be selected."""
    if not torch.cuda.is_available():
        return False
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


def symmetric_refusal(hosts: list[str], peer_access: list[bool] | None = None) -> str | None:
    """Why a group cannot use symmetric memory, or ``None`` when it can: its ranks'
    ``hosts`` (one host only: another host's memory cannot be mapped) and, on CUDA,
    whether each rank's GPU reaches every peer's (``peer_access``; ranks sharing a GPU
    are refused or allowed before, see ``cuda_symm.shared_gpu_refusal``)."""
    if len(set(hosts)) > 1:
        return f"it spans hosts {sorted(set(hosts))}"
    if peer_access is not None and not all(peer_access):
        return "its GPUs lack peer access to each other"
    return None


def writing_mode(t: object) -> contextlib.AbstractContextManager:
    """The mode a worker thread writes ``t`` in: inference mode when ``t`` was made in
    it, as the caller's own write would be (an inference tensor is written in place
    only under inference mode, which is per thread); else the thread's own, untouched
    (``inference_mode(False)`` would turn grad mode on)."""
    inference = isinstance(t, torch.Tensor) and t.is_inference()
    return torch.inference_mode() if inference else contextlib.nullcontext()


def kept() -> contextlib.AbstractContextManager:
    """Where a buffer kept across steps is made: outside inference mode, even when it is
    first needed inside it (an evaluation before training), since later steps write
    it in place outside it (an inference tensor may be written only inside)."""
    return torch.inference_mode(False)


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the bytes ``a`` and ``b`` span (first element to last, whatever the
    strides between) intersect: an output that may be written while an input it lies
    on is still read."""
    if not a.numel() or not b.numel():
        return False

    def span(t: torch.Tensor) -> tuple[int, int]:
        last = sum((n - 1) * st for n, st in zip(t.shape, t.stride()))
        return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()

    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1


def kept_empty(numel: int, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """``torch.empty`` of a buffer kept across steps (see :func:`kept`)."""
    with kept():
        return torch.empty(numel, dtype=dtype, device=device)


class Handle:
    """An issued collective. Every backend's handle derives from this class; what a
    handle can be asked is written here, with its default."""

    __slots__ = ()

    def wait(self, timeout_s: float) -> None:
        """Order the caller after the collective, within the deadline: on the host
        (CPU backends, gloo) it returns once the collective is done; on CUDA streams
        the caller's stream waits for it and the host goes on."""
        raise NotImplementedError

    def is_completed(self) -> bool:
        """Whether the collective is done with its buffers, asked without waiting.
        Used after a failure to tell the buffers that may be reused from those a
        collective may still read or write (see [Note: buffers of a failed step])."""
        raise NotImplementedError

    def completion_event(self, observer: torch.cuda.Stream) -> torch.cuda.Event | None:
        """A CUDA event at the collective's end on the stream that ran it, for
        timelines and exposed-time accounting (``observer``: an idle stream a handle
        may record on). Default ``None``: the handle cannot say (a host-side
        collective), so its span ends where the caller waited."""
        return None


class CompletedHandle(Handle):
    """Handle of a collective that finished when it was issued (e.g. a group of one)."""

    __slots__ = ()

    def wait(self, timeout_s: float) -> None:
        return None

    def is_completed(self) -> bool:
        return True


class HandleGroup(Handle):
    """Several collectives waited as one, under one deadline."""

    __slots__ = ("_handles",)

    def __init__(self, handles: list[Handle]) -> None:
        self._handles = handles

    def wait(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for h in self._handles:
            h.wait(max(deadline - time.monotonic(), 0.0))

    def is_completed(self) -> bool:
        return all(h.is_completed() for h in self._handles)

    def completion_event(self, observer: torch.cuda.Stream) -> torch.cuda.Event | None:
        """The last collective's end (they run in issue order on one stream), when
        every handle can tell its own; else None."""
        last = None
        for h in self._handles:
            last = h.completion_event(observer)
            if last is None:
                return None
        return last


class Backend:
    """How bytes move between the ranks of a group. Every backend derives from this
    class: the collectives below are what each must implement; the capabilities
    after them (capacity check, reservation, fallback, counters) have defaults that
    suit a backend without symmetric memory, and are all the communicator asks."""

    name: str = "base"
    disabled: bool = False
    """Whether the backend has fallen back to plain ``torch.distributed`` for every
    collective (shared memory too small, see :meth:`check_capacity`). Default: no."""
    direct_all_gathers: int = 0
    """All-gathers written by the peers straight into the caller's symmetric buffer
    (none unless a backend serves symmetric buffers)."""
    direct_reduce_scatters: int = 0
    """Reduce-scatters read straight from the peers' symmetric buffers (likewise)."""
    staged_bytes: int = 0
    """Bytes the backend copied into or out of its own scratch around collectives,
    since it was made (``comm.stats()["staged_bytes"]``). 0 unless a backend stages:
    ``torch.distributed`` runs on the caller's tensors."""
    checks_sizes: bool = False
    """Whether a collective whose ranks bring different sizes stops with a line that
    names them (the CPU shared-memory backend's "collectives out of step"), or has no
    peers to differ (the virtual one). Default: no (gloo moves them without a word):
    where the host is the device, the WP group's token gathers compare shapes first."""
    identical_sums: bool = True
    """Whether an all-reduce leaves bitwise the same sum on every rank of its group, so
    that parameters stepped on it stay bitwise alike (NCCL and gloo: each sum is made
    once and sent; the shared-memory backends: every rank adds in rank order). The
    communicator's check that the replicas stay alike ([Note: replicas that drift
    apart]) runs only where they do. Default: yes."""
    symmetric_buffers: bool = False
    """Whether :meth:`empty` with a group serves memory that the group's ranks allocate
    together and map (CPU shared memory, NVSHMEM's heap): such a buffer cannot be
    given back and made again by one rank alone, so the reduce-scatter pairs stay
    allocated between backwards (``ISPConfig.release_reduce_buffers``). Default: no."""
    symmetric_sources: bool = False
    """Whether a gather runs without copies only when its source is a symmetric buffer
    too (NVSHMEM: source and destination must be symmetric addresses), so that the
    communicator keeps the blocks' shards in buffers from :meth:`empty` with the WP
    group. Default: no (a gather reads its source where it is)."""
    device_heap_bytes: int = 0
    """Device memory the backend reserved outside torch's caching allocator (NVSHMEM's
    symmetric heap), which ``torch.cuda.max_memory_allocated`` does not see. Default: none."""
    modelled_comm_s: float = 0.0
    """Seconds of collective time issued so far by a backend that models it (the
    virtual backend, ``isp_comm/backends/virtual.py``); 0 for a backend that moves the
    bytes for real."""
    late_s: float = 0.0
    """Seconds by which a modelling backend's own work (the virtual backend's copies on
    CPU) ran past the modelled ends of its collectives: this machine's time, not the
    model's, inside the exposed time a step reports. 0 elsewhere."""

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, group: ProcessGroup) -> Handle:
        """``out`` (numel = group size x inp.numel()) receives every rank's ``inp``, rank-major."""
        raise NotImplementedError

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, group: ProcessGroup) -> Handle:
        """``out`` receives the sum over ranks of chunk ``group rank`` of ``inp`` (rank-major)."""
        raise NotImplementedError

    def all_reduce(self, tensor: torch.Tensor, group: ProcessGroup) -> Handle:
        """In-place sum over the group."""
        raise NotImplementedError

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, group: ProcessGroup) -> Handle:
        """Chunk ``j`` of ``inp`` goes to rank ``j``; chunk ``i`` of ``out`` comes from rank ``i``."""
        raise NotImplementedError

    def barrier(self, group: ProcessGroup, timeout_s: float) -> None:
        raise NotImplementedError

    def empty(
        self, numel: int, dtype: torch.dtype, device: torch.device, group: ProcessGroup | None = None
    ) -> torch.Tensor:
        """A buffer to communicate from/into. With ``group`` the call is collective over
        it and the buffer symmetric (same size on every rank): a symmetric-memory
        backend serves it from memory the peers map, and all-gathers into it are
        written by the peers directly."""
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    # ---- capabilities: what the communicator asks at set-up, with defaults ----------
    def check_capacity(self, buffer_bytes: int, largest_collectives: list[int]) -> int:
        """Whether the host can hold ``buffer_bytes`` of symmetric buffers plus each
        group's scratch (one entry of ``largest_collectives`` per group: its largest
        payload per rank); returns the bytes of host shared memory this needs, or
        falls back (:attr:`disabled`) or raises when it cannot. Collective over the
        world when overridden. Default: 0, nothing to check (no shared memory)."""
        return 0

    def reserve(self, group: ProcessGroup, nbytes: int, device: torch.device, lane: str) -> None:
        """At set-up, collectively over ``group`` when overridden: decide how the group
        communicates and size its ``lane``'s scratch (a lane of
        :data:`~isp_comm.backends.streams.LANES`, see [Note: lanes]) for collectives of
        up to ``nbytes`` per rank (0: decide only), so that no step has to grow it.
        Called for every group of more than one rank. Default: nothing to reserve."""
        return None

    def plan_symmetric(
        self, group: ProcessGroup, buffer_bytes: int, collectives: list[tuple[ProcessGroup, str, list[int]]]
    ) -> None:
        """At set-up, once, after :meth:`reserve` and before the pool is allocated,
        collectively over the world when overridden: ``buffer_bytes`` of buffers will
        be asked of :meth:`empty` with ``group``, and ``collectives`` lists (group,
        kind, per-rank input bytes of each planned size) of the other collectives, so
        that a backend whose device memory is fixed at its start (NVSHMEM's heap) can
        size it. Default: nothing to size."""
        return None

    def abandon(self) -> None:
        """A step failed (a peer may be dead): :meth:`close` must not wait for the
        peers. Default: nothing waits for them."""
        return None
