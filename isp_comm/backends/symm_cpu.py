"""CPU symmetric-memory collectives: every rank of a group on one host maps the same
POSIX shared-memory buffers, so a collective is a few memcpys and two flag rounds.

Per group: a control segment of flags (``ready[r]``, ``done[r]``; rank r alone writes
its own) and one scratch segment per rank. A collective with epoch ``e``:

1. wait until every peer's ``done >= e - 1`` (nobody still reads my scratch: the
   slot-reuse guard uses monotonically increasing epochs, never a modular counter);
2. copy my input into my scratch, publish ``ready = e``;
3. wait until every peer's ``ready >= e``, check that every peer issued the same kind
   and size ([Note: what each rank issued]); read what I need from peers' scratch
   (reductions sum in fixed rank order, in fp32 for bf16/fp16: deterministic);
4. publish ``done = e``.

Symmetric buffers: ``empty(..., group=g)`` allocates a buffer collectively on every
rank of ``g`` (same sizes, same order) as one shared segment per rank that every peer
maps. An all-gather whose output lies in such a buffer skips the scratch: each rank
publishes where its output is and ``ready = e`` (its output may now be written), waits
for every peer's ``ready``, writes its input straight into every peer's output and
publishes ``done = e``; it completes once every peer's ``done >= e`` (its own output
is then whole). A reduce-scatter whose input lies in one reads its chunk straight from
every peer's input the same way, and completes only when no peer reads its input any
more. The memory pool allocates its slots and buffers this way.

Collectives run in FIFO order on one worker thread per backend (the copies release
the GIL), so they overlap the caller's compute. Every wait spins briefly, then yields
and sleeps with backoff, and has a deadline that names the ranks that did not arrive.
Groups whose ranks are on different hosts use ``TorchBackend`` instead.

Segments are reserved when created (see the note on reservation in ``shm.py``), and
every creation is agreed over the group: if any rank could not reserve its segment,
all of them raise :class:`~isp_comm.errors.SharedMemoryError` (``strict``, what
``backend="symm"`` asks for) or all of them go on without it (``backend="auto"``: a
buffer becomes an ordinary one, a group whose scratch cannot grow uses
``TorchBackend``), so no rank ever waits on a peer that gave up.
"""

from __future__ import annotations

import logging
import os
import queue
import secrets
import socket
import threading
import time
import weakref
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from isp_comm.backends.base import (
    Backend,
    CompletedHandle,
    Handle,
    kept_empty,
    overlaps,
    symmetric_refusal,
    writing_mode,
)
from isp_comm.backends.shm import (
    DOCKER_HINT,
    SHM_DIR,
    Flags,
    Segment,
    pid_alive,
    segment_name,
    shm_free_bytes,
    unordered_flags,
)
from isp_comm.backends.torch_backend import TorchBackend, refuse_unfit
from isp_comm.errors import ISPCommTimeout, SharedMemoryError
from isp_comm.processes import usable_cores

log = logging.getLogger("isp_comm")
HOST_ENV = "ISP_COMM_HOST_ID"  # overrides the host identity (tests simulate two hosts)
_MIN_SCRATCH = 1 << 16


def scratch_bytes(nbytes: int) -> int:
    """A group's scratch segment for collectives of up to ``nbytes`` per rank: the next
    power of two, at least 64 KiB (grown collectively when a larger one comes)."""
    return max(_MIN_SCRATCH, 1 << (max(nbytes, 1) - 1).bit_length())


def _stop_worker(q: queue.SimpleQueue, stopping: threading.Event, worker: threading.Thread) -> None:
    """See [Note: the worker at interpreter exit]."""
    stopping.set()
    q.put(None)
    worker.join(timeout=10.0)


def host_id() -> str:
    return os.environ.get(HOST_ENV) or socket.gethostname()


class SymmHandle(Handle):
    __slots__ = ("_done", "_error", "_stalled", "what")

    def __init__(self, what: str, stalled: list[str | None] | None = None) -> None:
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._stalled = stalled or [None]  # the backend's: see [Note: a deadline names who is late]
        self.what = what

    def _finish(self, error: BaseException | None = None) -> None:
        self._error = error
        self._done.set()

    def is_completed(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout_s: float) -> None:
        if not self._done.wait(timeout_s):
            late = self._stalled[0]
            raise ISPCommTimeout(
                f"{self.what} did not complete within {timeout_s:.1f}s" + (f": {late}" if late else "")
            )
        if self._error is not None:
            raise self._error


@dataclass
class _Group:
    ranks: tuple[int, ...]
    me: int
    token: str
    pids: list[int]
    ctrl: Segment
    flags: Flags
    scratch: list[Segment] = field(default_factory=list)
    capacity: int = 0
    generation: int = 0
    epoch: int = 0
    acc: torch.Tensor | None = None  # fp32 accumulator for bf16/fp16 reductions
    buffers: list[tuple[int, int, list[Segment]]] = field(default_factory=list)  # (my base, bytes, per rank)
    cores: int = field(default_factory=lambda: usable_cores())  # this host's, as the container allows

    @property
    def spin_budget(self) -> int:
        """Yields before sleeping: a waiting rank must not take the core a peer copies
        on when the group's ranks outnumber the cores (the affinity capped by the
        cgroup's quota: a container given 2 CPUs on a 64-core host has 2)."""
        return 1000 if self.size <= self.cores else 200

    @property
    def size(self) -> int:
        return len(self.ranks)


class SymmCpuBackend(Backend):
    """Shared-memory collectives for CPU tensors of ranks on one host."""

    name = "symm"
    symmetric_buffers = True  # the pool's buffers are shared-memory segments the peers map
    checks_sizes = True  # each call's sizes are compared: "collectives out of step"

    def __init__(self, timeout_s: float = 300.0, strict: bool = True) -> None:
        """``strict``: a segment that cannot be reserved is an error on every rank
        (else the group goes on without shared memory there; see the module note)."""
        unordered = unordered_flags()
        if unordered:
            raise ValueError(unordered)
        self.timeout_s = timeout_s
        self.strict = strict
        self.disabled = False  # every collective through TorchBackend (see disable())
        self._fallback = TorchBackend()
        self._groups: dict[tuple[int, ...], _Group | None] = {}
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._stopping = threading.Event()
        self._worker = threading.Thread(target=self._run, name="isp-symm", daemon=True)
        self._worker.start()
        # [Note: the worker at interpreter exit] A daemon thread that is inside a torch
        # op when the interpreter finalises is ended as it takes the GIL back, from a
        # C++ destructor, and the process aborts ("terminate called without an active
        # exception"). So a backend never closed (a script that leaves on an error) stops
        # its worker at exit, before finalisation: the wait it may be in gives up, and
        # the thread is joined. weakref.finalize runs at exit and holds no ref to self.
        self._stop_at_exit = weakref.finalize(self, _stop_worker, self._queue, self._stopping, self._worker)
        self._last: SymmHandle | None = None
        self._stalled: list[str | None] = [None]  # see [Note: a deadline names who is late]
        self._closed = False
        self.direct_all_gathers = 0  # all-gathers written straight into symmetric buffers
        self.direct_reduce_scatters = 0  # reduce-scatters read straight from symmetric buffers
        self.staged_bytes = 0  # copied into and out of the scratch (0 for the direct ones)

    def check_capacity(self, buffer_bytes: int, largest_collectives: list[int]) -> int:
        """Collective over the world, at set-up: can every host's ``/dev/shm`` hold, for
        each of its ranks, ``buffer_bytes`` of symmetric buffers plus the scratch of
        each group (one per entry of ``largest_collectives``, that group's largest
        payload per rank)? Returns about what this host needs. When one cannot, every
        rank takes the same decision: ``SharedMemoryError`` when strict, else a
        warning on rank 0 and TorchBackend from now on."""
        per_rank_bytes = buffer_bytes + sum(scratch_bytes(n) for n in largest_collectives)
        infos: list = [None] * dist.get_world_size()
        dist.all_gather_object(infos, (host_id(), shm_free_bytes(), per_rank_bytes))
        hosts: dict[str, list] = {}
        for h, free, need in infos:
            agg = hosts.setdefault(h, [0, free, 0])
            agg[0], agg[1], agg[2] = agg[0] + need, min(agg[1], free), agg[2] + 1
        short = [(h, need, free, n) for h, (need, free, n) in hosts.items() if need > free]
        if short:
            h, need, free, n = short[0]
            msg = (
                f"{SHM_DIR} on host {h} has {free} bytes free ({free / 2**20:.1f} MiB), but the symmetric-memory "
                f"backend needs about {need} bytes ({need / 2**20:.1f} MiB) for its {n} ranks; {DOCKER_HINT}"
            )
            if self.strict:
                raise SharedMemoryError(msg)
            if dist.get_rank() == 0:
                log.warning("isp-comm: %s; backend 'auto' falls back to 'torch'", msg)
            self.disable()
        return hosts[host_id()][0]

    def disable(self) -> None:
        """Use TorchBackend for everything from now on (before any collective: the
        communicator calls it when shared memory cannot hold what the job needs)."""
        assert not self._groups, "disable() must come before the first collective"
        self.disabled = True

    # ---- group set-up (collective over the group, in the calling thread) ------------
    def _create_agreed(
        self, group: ProcessGroup, name: str, nbytes: int, create: bool = True
    ) -> tuple[bool, Segment | None]:
        """Create my segment of a collective allocation (``create``; the others only
        learn how it went). ``(True, segment)`` when every creator reserved its own;
        else the error on every rank (strict) or ``(False, None)`` on every rank."""
        error: SharedMemoryError | None = None
        mine = None
        if create:
            try:
                mine = Segment(name, nbytes, create=True)
            except SharedMemoryError as exc:
                error = exc
        ok = torch.tensor([0 if error else 1], dtype=torch.int32)
        try:
            dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)  # also the barrier before peers map it
        except BaseException:  # a peer died: no one will map it, so no one else unlinks it
            if mine is not None:
                Segment.unlink(name)
            raise
        if ok.item():
            return True, mine
        if mine is not None:
            Segment.unlink(name)
            mine.close()
        ranks = dist.get_process_group_ranks(group)
        if self.strict:
            raise error or SharedMemoryError(f"a peer of ranks {ranks} could not reserve its {nbytes}-byte segment")
        if dist.get_rank() == ranks[0]:
            log.warning("isp-comm: %s; going on without shared memory for it", error or "a peer's /dev/shm is full")
        return False, None

    def _group(
        self, group: ProcessGroup, nbytes: int, what: str = "", dtype: torch.dtype | None = None
    ) -> _Group | None:
        if self.disabled:
            return None
        ranks = tuple(dist.get_process_group_ranks(group))
        if ranks not in self._groups:
            self._groups[ranks] = self._setup(group, ranks)
        g = self._groups[ranks]
        if g is not None and nbytes > g.capacity:
            self._agree_to_grow(g, what, nbytes, dtype)
            self._grow(group, g, nbytes)
        return self._groups[ranks]

    def _agree_to_grow(self, g: _Group, what: str, nbytes: int, dtype: torch.dtype | None) -> None:
        """Before a group's scratch grows (``torch.distributed`` calls in this thread),
        check over the flags, within the deadline, that every rank is growing it for
        the same collective.

        [Note: a scratch grown by some ranks only] A rank grows the scratch when a
        collective's bytes exceed it, through gloo calls that wait under the process
        group's timeout (30 minutes), not this backend's. Ranks out of step by a size
        that crosses the scratch's (an SP rank fed a longer batch) left the larger one
        there, while its peers stopped at the deadline with "did not arrive" for it,
        not "collectives out of step". So the growing rank first takes an epoch of
        its own with the collective's kind and bytes as what it issued: every rank
        growing for the same collective passes it, and a peer that is not meets it
        with its own collective, both stopping with the line that names each."""
        g.epoch += 1
        h = SymmHandle(f"{what} (symm, growing its scratch) over ranks {list(g.ranks)}", self._stalled)
        self._queue.put(("agree", g, g.epoch, None, None, h, (what, nbytes, dtype)))
        self._last = h
        h.wait(self.timeout_s)

    def _setup(self, group: ProcessGroup, ranks: tuple[int, ...]) -> _Group | None:
        infos: list = [None] * len(ranks)
        dist.all_gather_object(infos, (host_id(), os.getpid(), secrets.token_hex(4)), group=group)
        refusal = symmetric_refusal([h for h, _, _ in infos])
        if refusal is not None:
            log.warning("isp-comm: group %s: %s; using torch.distributed for it", list(ranks), refusal)
            return None
        me = ranks.index(dist.get_rank())
        pids, token = [p for _, p, _ in infos], infos[0][2]
        name = segment_name(pids[0], token, "ctrl")
        nbytes = 5 * len(ranks) * Flags.STRIDE * 8  # ready, done, where my buffer is, what I issued (x2)
        ok, ctrl = self._create_agreed(group, name, nbytes, create=me == 0)  # rank 0 alone creates it
        if not ok:
            return None
        try:
            if ctrl is None:
                ctrl = Segment(name, nbytes, create=False)
            dist.barrier(group=group)
        finally:  # also when a peer died before the barrier
            if me == 0:
                Segment.unlink(name)
        return _Group(ranks, me, token, pids, ctrl, Flags(ctrl, 5 * len(ranks)))

    def _grow(self, group: ProcessGroup, g: _Group, nbytes: int) -> None:
        """Collectively replace every rank's scratch by a larger one (sizes agree on
        all ranks because every rank issues the same collectives)."""
        self._drain()
        cap = scratch_bytes(nbytes)
        g.generation += 1
        names = [segment_name(g.pids[r], g.token, "scratch", r, g.generation) for r in range(g.size)]
        ok, mine = self._create_agreed(group, names[g.me], cap)
        if not ok:  # no room: this group uses TorchBackend from now on
            self._groups[g.ranks] = None
            return
        try:
            new = [mine if r == g.me else Segment(names[r], cap, create=False) for r in range(g.size)]
            dist.barrier(group=group)
        finally:  # also when a peer died before the barrier
            Segment.unlink(names[g.me])
        for seg in g.scratch:
            seg.close()
        g.scratch, g.capacity = new, cap

    # ---- collectives ------------------------------------------------------------------
    def _submit(self, kind: str, group: ProcessGroup, out, inp, nbytes: int) -> Handle:
        if self._closed:
            raise RuntimeError("the symmetric-memory backend is closed")
        _check_sizes(kind, group, out, inp)
        dtype = next((t.dtype for t in (inp, out) if t is not None), None)  # an all-reduce's is its out
        g = self._group(group, nbytes, kind.replace("_", "-"), dtype)
        if g is None and kind == "barrier":
            self._fallback.barrier(group, self.timeout_s)
            return CompletedHandle()
        if g is None:
            return _FALLBACK_OPS[kind](self._fallback, *(t for t in (out, inp) if t is not None), group)
        if g.size == 1:
            if kind != "all_reduce":
                out.copy_(inp.reshape(out.shape))
            return CompletedHandle()
        extra: tuple = ()
        if kind == "all_gather":
            where = self._registered(g, out)
            if where is not None:
                kind, extra = "all_gather_direct", (where,)
                self.direct_all_gathers += 1
        elif kind == "reduce_scatter":
            where = self._registered(g, inp)
            if where is not None:
                kind, extra = "reduce_scatter_direct", (where,)
                self.direct_reduce_scatters += 1
        if not extra and kind != "barrier":  # through the scratch: in, then out (see Backend.staged_bytes)
            self.staged_bytes += nbytes + (out.numel() * out.element_size() if out is not None else nbytes)
        g.epoch += 1
        h = SymmHandle(f"{kind.replace('_', '-')} (symm) over ranks {list(g.ranks)}", self._stalled)
        self._queue.put((kind, g, g.epoch, out, inp, h, extra))
        self._last = h
        return h

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, group: ProcessGroup) -> Handle:
        return self._submit("all_gather", group, out, inp, inp.numel() * inp.element_size())

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, group: ProcessGroup) -> Handle:
        return self._submit("reduce_scatter", group, out, inp, inp.numel() * inp.element_size())

    def all_reduce(self, tensor: torch.Tensor, group: ProcessGroup) -> Handle:
        return self._submit("all_reduce", group, tensor, None, tensor.numel() * tensor.element_size())

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, group: ProcessGroup) -> Handle:
        return self._submit("all_to_all", group, out, inp, inp.numel() * inp.element_size())

    def barrier(self, group: ProcessGroup, timeout_s: float) -> None:
        self._submit("barrier", group, None, None, 0).wait(timeout_s)

    def empty(
        self, numel: int, dtype: torch.dtype, device: torch.device, group: ProcessGroup | None = None
    ) -> torch.Tensor:
        """With ``group`` (collective over it): a symmetric buffer peers can write into."""
        if group is None or torch.device(device).type != "cpu" or self._closed:
            return torch.empty(numel, dtype=dtype, device=device)
        g = self._group(group, 0)
        if g is None or g.size == 1:
            return torch.empty(numel, dtype=dtype, device=device)
        nbytes = numel * dtype.itemsize
        k = len(g.buffers)
        names = [segment_name(g.pids[r], g.token, "buf", k, r) for r in range(g.size)]
        ok, mine = self._create_agreed(group, names[g.me], nbytes)
        if not ok:  # no room: an ordinary buffer (its collectives take the scratch path)
            return torch.empty(numel, dtype=dtype, device=device)
        try:
            segs = [mine if r == g.me else Segment(names[r], nbytes, create=False) for r in range(g.size)]
            dist.barrier(group=group)
        finally:  # also when a peer died before the barrier
            Segment.unlink(names[g.me])
        g.buffers.append((mine.bytes.data_ptr(), mine.nbytes, segs))
        return mine.bytes[:nbytes].view(dtype)

    @staticmethod
    def _registered(g: _Group, t: torch.Tensor) -> int | None:
        """``buffer index << 40 | byte offset`` when ``t`` lies in one of the group's
        symmetric buffers, else None."""
        if not t.is_contiguous() or t.device.type != "cpu":
            return None
        ptr, n = t.data_ptr(), t.numel() * t.element_size()
        for k, (base, nbytes, _) in enumerate(g.buffers):
            if base <= ptr and ptr + n <= base + nbytes:
                return k << 40 | (ptr - base)
        return None

    # ---- worker -----------------------------------------------------------------------
    def _run(self) -> None:
        failed: BaseException | None = None
        while True:
            item = self._queue.get()
            if item is None:
                return
            kind, g, epoch, out, inp, h, extra = item
            error = failed  # peers are out of step after a failure: fail fast
            if failed is None:
                try:
                    with writing_mode(out):
                        _WORKER_OPS[kind](self, g, epoch, out, inp, *extra)
                except BaseException as exc:  # noqa: BLE001 - handed to the waiter
                    error = failed = exc
            # the caller's tensors are theirs again once it is told: none kept to the next collective
            item = out = inp = extra = None
            h._finish(error)

    def _wait_flags(self, g: _Group, base: int, target: int, what: str) -> None:
        """Wait until every rank's flag ``base + r`` reaches ``target``.

        [Note: a deadline names who is late] The waiter's deadline (the handle's,
        ``CommContext.timeout_s``) and this one are equal and start about together,
        and the waiter's usually passes first: its error said only that the
        collective did not complete. So while the worker sleeps here it keeps, in
        ``_stalled`` (a list the handles share, holding no reference to the backend),
        which ranks it waits for, and the handle's error names them. A wait that fails
        leaves its line there: the handle's deadline may pass after the worker's error
        and before the handle is told of it, and must still name them (it said only
        "did not complete" in one CI run of 2026-12-05)."""
        self._wait_flags_until(g, base, target, what)
        self._stalled[0] = None

    def _wait_flags_until(self, g: _Group, base: int, target: int, what: str) -> None:
        deadline = time.monotonic() + self.timeout_s
        pause, spins = 5e-5, 0
        next_probe = time.monotonic() + 0.1
        while True:
            missing = [r for r in range(g.size) if g.flags.load(base + r) < target]
            if not missing:
                return
            spins += 1
            if spins < g.spin_budget:
                os.sched_yield()
                continue
            now = time.monotonic()
            late = [g.ranks[r] for r in missing]
            self._stalled[0] = (
                f"the worker waits in {what} (symm, epoch {target}) for ranks {late} of group {list(g.ranks)}"
            )
            if self._stopping.is_set():
                raise ISPCommTimeout(f"{what} (symm, epoch {target}): abandoned, the backend is closing")
            if now > deadline:
                raise ISPCommTimeout(
                    f"{what} (symm, epoch {target}): ranks {late} of group {list(g.ranks)} did not arrive "
                    f"within {self.timeout_s:.1f}s"
                )
            if now > next_probe:  # a dead peer (same host: its pid is visible) fails at once
                next_probe = now + 0.1
                dead = [g.ranks[r] for r in missing if not pid_alive(g.pids[r])]
                if dead:
                    raise ISPCommTimeout(f"{what} (symm, epoch {target}): ranks {dead} of group {list(g.ranks)} died")
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)

    def _exchange(self, g: _Group, epoch: int, what: str, src: torch.Tensor | None) -> list[torch.Tensor]:
        """Steps 1-3: publish ``src`` in my scratch; return every rank's scratch bytes."""
        self._wait_flags(g, g.size, epoch - 1, what + " (peers still reading)")
        if src is not None and src.numel():
            flat = src.reshape(-1)
            g.scratch[g.me].bytes[: flat.numel() * flat.element_size()].view(flat.dtype).copy_(flat)
        nbytes, dtype = (0, None) if src is None else (src.numel() * src.element_size(), src.dtype)
        self._arrive(g, epoch, what, nbytes, dtype)
        return [s.bytes for s in g.scratch]

    def _arrive(
        self, g: _Group, epoch: int, what: str, nbytes: int, dtype: torch.dtype | None = None, direct: bool = False
    ) -> None:
        """Publish what I issued and ``ready = e``, wait for every peer's, and check that
        we all issued the same: collectives are paired by their order alone, so a rank
        out of step (another kind, another size) would otherwise mix its bytes into a
        collective it never meant, and every rank would go on with wrong values. See
        [Note: what each rank issued]. ``dtype``: the input's (``None``: no tensor);
        ``direct``: through symmetric buffers, not the scratch."""
        slots = (3 + epoch % 2) * g.size  # a peer may be one epoch ahead
        mine = _signature(_DIRECT[what] if direct else what, nbytes, dtype)
        g.flags.store(slots + g.me, mine)
        g.flags.store(g.me, epoch)
        self._wait_flags(g, 0, epoch, what)
        theirs = [g.flags.load(slots + r) for r in range(g.size)]
        if any(t != mine for t in theirs):
            said = ", ".join(f"rank {g.ranks[r]}: {_describe(t)}" for r, t in enumerate(theirs))
            raise RuntimeError(
                f"collectives out of step in group {list(g.ranks)} (symm, epoch {epoch}): {said}; every rank "
                "must issue the same collectives, of the same sizes, in the same order (ranks must run the same "
                "blocks; a block's weights or whole parameters that some ranks leave unused need "
                "ISPConfig(find_unused_parameters=True))"
            )

    def _done(self, g: _Group, epoch: int) -> None:
        g.flags.store(g.size + g.me, epoch)

    def _do_all_gather(self, g: _Group, epoch: int, out: torch.Tensor, inp: torch.Tensor) -> None:
        n = inp.numel()
        peers = self._exchange(g, epoch, "all-gather", inp)
        flat_out = out.view(-1)
        for r, buf in enumerate(peers):
            flat_out[r * n : (r + 1) * n].copy_(buf[: n * inp.element_size()].view(inp.dtype))
        self._done(g, epoch)

    def _do_all_gather_direct(self, g: _Group, epoch: int, out: torch.Tensor, inp: torch.Tensor, where: int) -> None:
        nb = inp.numel() * inp.element_size()
        g.flags.store(2 * g.size + g.me, where)  # where peers write into me (read after ready)
        self._arrive(g, epoch, "all-gather", nb, inp.dtype, direct=True)  # my output may be written
        if nb:
            src = inp.reshape(-1).view(torch.uint8)
            for r in range(g.size):
                self._peer_region(g, r, g.me * nb, nb).copy_(src)
        g.flags.store(g.size + g.me, epoch)  # my writes are complete
        self._wait_flags(g, g.size, epoch, "all-gather (peers still writing)")

    def _peer_region(self, g: _Group, r: int, start: int, nbytes: int) -> torch.Tensor:
        """Bytes ``[start, start + nbytes)`` past where rank ``r`` published its buffer."""
        code = g.flags.load(2 * g.size + r)
        k, off = code >> 40, (code & ((1 << 40) - 1)) + start
        return g.buffers[k][2][r].bytes[off : off + nbytes]

    def _do_reduce_scatter_direct(
        self, g: _Group, epoch: int, out: torch.Tensor, inp: torch.Tensor, where: int
    ) -> None:
        nb = out.numel() * inp.element_size()
        g.flags.store(2 * g.size + g.me, where)  # where peers read my input (read after ready)
        nb_in = inp.numel() * inp.element_size()
        self._arrive(g, epoch, "reduce-scatter", nb_in, inp.dtype, direct=True)  # my input may be read
        if nb:
            chunks = [self._peer_region(g, r, g.me * nb, nb).view(inp.dtype) for r in range(g.size)]
            self._sum_chunks(g, chunks, out.view(-1))
        g.flags.store(g.size + g.me, epoch)  # I no longer read peers' inputs
        self._wait_flags(g, g.size, epoch, "reduce-scatter (peers still reading)")

    def _sum_chunks(self, g: _Group, chunks: list[torch.Tensor], out: torch.Tensor) -> None:
        """Sum in rank order; bf16/fp16 accumulate in fp32.

        [Note: a reduce-scatter in place] ``out`` is summed into directly only when it
        overlaps no chunk after the first: a direct reduce-scatter whose output is the
        rank's own chunk of its symmetric input (in place, as gloo allows) reads that
        chunk as ``chunks[me]``, and summing into ``out`` first would add the partial
        sum instead of the rank's own values on every rank but the first (silently)."""
        if out.is_floating_point() and out.dtype not in (torch.float32, torch.float64):
            if g.acc is None or g.acc.numel() < out.numel():
                g.acc = kept_empty(out.numel(), torch.float32, "cpu")
            acc = g.acc[: out.numel()]
        elif any(overlaps(out, c) for c in chunks[1:]):
            acc = torch.empty_like(out)  # the same sum, in the dtype itself, then copied
        else:
            acc = out
        acc.copy_(chunks[0])
        for c in chunks[1:]:
            acc.add_(c)
        if acc is not out:
            out.copy_(acc)

    def _do_reduce_scatter(self, g: _Group, epoch: int, out: torch.Tensor, inp: torch.Tensor) -> None:
        n = out.numel()
        peers = self._exchange(g, epoch, "reduce-scatter", inp)
        isz = inp.element_size()
        chunks = [buf[g.me * n * isz : (g.me + 1) * n * isz].view(inp.dtype) for buf in peers]
        if n:
            self._sum_chunks(g, chunks, out.view(-1))
        self._done(g, epoch)

    def _do_all_reduce(self, g: _Group, epoch: int, tensor: torch.Tensor, _inp: None) -> None:
        n, isz = tensor.numel(), tensor.element_size()
        peers = self._exchange(g, epoch, "all-reduce", tensor)
        if n:
            flat = tensor.view(-1)
            self._sum_chunks(g, [buf[: n * isz].view(tensor.dtype) for buf in peers], flat)
        self._done(g, epoch)

    def _do_all_to_all(self, g: _Group, epoch: int, out: torch.Tensor, inp: torch.Tensor) -> None:
        n, isz = inp.numel() // g.size, inp.element_size()
        peers = self._exchange(g, epoch, "all-to-all", inp)
        flat_out = out.view(-1)
        for r, buf in enumerate(peers):
            flat_out[r * n : (r + 1) * n].copy_(buf[g.me * n * isz : (g.me + 1) * n * isz].view(inp.dtype))
        self._done(g, epoch)

    def _do_agree(
        self, g: _Group, epoch: int, _out: None, _inp: None, what: str, nbytes: int, dtype: torch.dtype | None
    ) -> None:
        self._arrive(g, epoch, what, nbytes, dtype)  # no scratch: see [Note: a scratch grown by some ranks only]
        self._done(g, epoch)

    def _do_barrier(self, g: _Group, epoch: int, _out: None, _inp: None) -> None:
        self._exchange(g, epoch, "barrier", None)
        self._done(g, epoch)

    # ---- teardown ---------------------------------------------------------------------
    def _drain(self) -> None:
        if self._last is not None:
            self._last.wait(self.timeout_s)
            self._last = None

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._last is not None and not self._last.is_completed():
            # closed with collectives still queued or running: a step was cut short
            # (the owner drains everything otherwise), so they are abandoned, not awaited
            self._stopping.set()
        self._queue.put(None)  # after the collectives queued before it
        self._worker.join(timeout=self.timeout_s)
        self._stop_at_exit()
        for g in self._groups.values():
            if g is not None:
                for seg in (g.ctrl, *g.scratch, *(s for _, _, segs in g.buffers for s in segs)):
                    seg.close()
        self._groups.clear()
        self._fallback.close()


_WORKER_OPS = {
    "all_gather": SymmCpuBackend._do_all_gather,
    "all_gather_direct": SymmCpuBackend._do_all_gather_direct,
    "reduce_scatter": SymmCpuBackend._do_reduce_scatter,
    "reduce_scatter_direct": SymmCpuBackend._do_reduce_scatter_direct,
    "all_reduce": SymmCpuBackend._do_all_reduce,
    "all_to_all": SymmCpuBackend._do_all_to_all,
    "barrier": SymmCpuBackend._do_barrier,
    "agree": SymmCpuBackend._do_agree,
}
"""What the worker runs for each kind of queued collective (a table, not a name lookup)."""

_FALLBACK_OPS = {
    "all_gather": TorchBackend.all_gather,
    "reduce_scatter": TorchBackend.reduce_scatter,
    "all_reduce": TorchBackend.all_reduce,
    "all_to_all": TorchBackend.all_to_all,
}
"""What a group that cannot use shared memory calls on TorchBackend, per kind."""


_DIRECT = {
    "all-gather": "all-gather into a symmetric buffer",
    "reduce-scatter": "reduce-scatter from a symmetric buffer",
}
_DTYPES = (None, torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.int8)
_DTYPES += (torch.uint8, torch.int16, torch.bool, torch.complex64, torch.complex128)
"""The dtypes a signature names by code (0: no tensor); any other is one code beyond."""
_DTYPE_CODES = {dtype: code for code, dtype in enumerate(_DTYPES)}
_KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "barrier", *_DIRECT.values())


def _check_sizes(kind: str, group: ProcessGroup, out: torch.Tensor, inp: torch.Tensor) -> None:
    """Refuse, at issue, a collective whose output and input do not fit
    (:func:`~isp_comm.backends.torch_backend.refuse_unfit`: sizes and dtypes).

    [Note: sizes checked at issue] The worker never compares them: a gather into a
    symmetric buffer lets every peer write ``size x input`` bytes from where the
    output starts, past a shorter output into whatever follows it in the buffer (and
    in the input's dtype, whatever the output's); a reduce-scatter takes its chunks'
    length from the output, a gather leaves a longer output's tail as it was, an
    all-to-all drops an input's last ``numel % size`` elements. TorchBackend refuses
    each (gloo itself does not: see [Note: what gloo does not check]); so does this
    backend, before the epoch is taken (the peers then stop at their deadline naming
    this rank)."""
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):
        refuse_unfit(kind.replace("_", "-"), group.size(), out, inp)


def _signature(what: str, nbytes: int, dtype: torch.dtype | None) -> int:
    """A collective's kind, its input's dtype and this rank's input bytes in one flag word.

    [Note: what each rank issued]
    The flags pair collectives by epoch, that is by their order alone. Beside its
    ``ready`` flag each rank publishes its collective's kind, dtype and input size
    (kind in the top 8 bits, the dtype's code in the next 8, bytes in the low 48),
    written before ``ready`` and read after
    every peer's ``ready``, in one of two slots by the epoch's parity: a peer may be
    one epoch ahead (a direct all-gather publishes without waiting for the last
    epoch's readers), never two (each collective ends waiting for every peer's
    ``done`` of the one before, which comes after its reads). In a correct program
    every rank of a group issues the same kind with the same input size and dtype
    (the same bytes in another dtype, summed, would be summed as this rank's dtype,
    silently wrong); anything else
    (an extra forward on one rank, an SP rank fed a different batch) fails on every
    rank of the group with one message naming each rank's collective, where the torch
    backend's gloo aborts the process and this backend went on with wrong values.
    The kind tells a collective through symmetric buffers from one through the
    scratch (``_DIRECT``): a rank gathering into a symmetric buffer writes where each
    peer published its buffer, and a peer on the scratch path published nothing this
    epoch, so its stale address was written into (another live buffer of its) while
    it read the scratch its peer never filled: both went on without a word."""
    code = _DTYPE_CODES.get(dtype, len(_DTYPES))  # one lookup: every collective's signature
    return (_KINDS.index(what) << 56) | (code << 48) | nbytes


def _describe(signature: int) -> str:
    code = (signature >> 48) & 0xFF
    dtype = "" if code == 0 else f" ({_DTYPES[code]})" if code < len(_DTYPES) else " (another dtype)"
    return f"{_KINDS[signature >> 56]} of {signature & ((1 << 48) - 1)} bytes{dtype}"
