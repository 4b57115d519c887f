"""nvshmem4py (``nvshmem.core``, 0.4.1 and later) collectives on side streams.

Selected with ``ISPConfig(backend="nvshmem")`` when ``nvshmem.core`` imports and the
parameters are on CUDA. NVSHMEM is bootstrapped from a unique id that rank 0 creates
and broadcasts over torch.distributed, bound to the parameters' GPU (not the
current one), once the memory plan has sized its heap (see [Note: the symmetric
heap]). A gather or reduce-scatter between pool buffers in the heap runs on them
directly (see [Note: collectives without copies]); any other collective copies its
input into an NVSHMEM scratch tensor, runs ``fcollect`` / ``reducescatter`` /
``reduce`` / ``alltoall`` on the backend's one side stream (see [Note: one stream
for a team]), and copies the result out. NVSHMEM
teams here cover the whole world only: a group smaller than the world uses
``TorchBackend`` (NCCL) instead, as a group across hosts does for the CPU backend.
NVSHMEM collectives have no deadline of their own: a dead peer hangs them (see
[Note: what a dead peer looks like on CUDA] in ``streams.py``).

[Note: one stream for a team]
The other CUDA backend gives each (group, lane) its own side stream ([Note: lanes]
in ``streams.py``), because each of its buffers has its own signal pad. NVSHMEM
does not allow that: every collective here runs on ``TEAM_WORLD`` (world-sized
groups of other names too), and a team's collectives share its psync slots and
counters (``fcollect_count``, ``alltoall_count``); NVSHMEM requires "one collective
at a time per team, in the same order on every PE". Two streams would let the GPU
run a prefetch gather beside a reduce-scatter, or in another order on each PE:
wrong data or a barrier that never completes. So every nvshmem collective of a
backend goes through ONE side stream: still ordered after the caller's stream
(``wait_stream``) with its tensors recorded on it (``record_stream``), as a lane is,
so compute goes on beside it; the collectives serialise in issue order, which is
the same on every rank ([Note: one issue order on every rank]). The cost: a gather
queues behind a reduce-scatter issued before it. Collectives of the groups that
fall back to NCCL are not affected.

[Note: nvshmem sizes a collective by its allocation]
nvshmem4py finds the symmetric allocation of a tensor by its ``data_ptr`` and sizes
the collective from the *whole allocation*, not from the tensor passed: a slice
``buf[:n]`` of a larger scratch moves the whole scratch (an ``fcollect`` puts PE r's
data at ``r * N_alloc``, not ``r * n``), and a slice at an offset is not found at
all. So every scratch tensor is exactly one collective's size: one per (lane,
dtype, element count), allocated at its first use. The allocation is collective
(NVSHMEM's symmetric heap), and every rank issues the same collectives in the same
order, so every rank allocates alike; the sizes of a step repeat, so after the
first step nothing is allocated.

[Note: the symmetric heap]
NVSHMEM reads its heap's size once, at init, from ``NVSHMEM_SYMMETRIC_SIZE`` (bytes,
or with a suffix k/m/g/t; unset: 1 GiB), and maps it in chunks of 512 MiB
(``NVSHMEM_CUMEM_GRANULARITY``). So when the variable is unset, NVSHMEM is
initialised only once the memory plan is known: :meth:`NvshmemBackend.plan_symmetric`
(the communicator calls it at wrap time, after the plan) adds up the pool buffers that
will live in the heap and the scratch of every planned collective that still copies
([Note: scratch per collective size]), sets the variable to that plus a margin,
rounded up to 512 MiB (and unsets it again at ``close``), and only then initialises
NVSHMEM. A value that is set is the user's (several PEs sharing a GPU must fit their
heaps together): NVSHMEM starts with it when the backend is made, and
``plan_symmetric`` raises one :class:`SymmetricHeapError` naming the bytes when the
plan needs more. Without a plan (the backend used directly, the variable unset)
NVSHMEM is initialised at the first collective or symmetric allocation. The plan is
a lower bound: collectives whose sizes depend on the batch (sequence parallelism, the
vocab-parallel loss) or that come later (full state dicts) get scratch at their
first use, and an allocation that would pass the heap raises the
same error, on every rank alike (they allocate alike), instead of a failed
``nvshmem_malloc``. The heap is device memory that ``torch.cuda.max_memory_allocated``
does not see: :attr:`NvshmemBackend.device_heap_bytes` says how much, and
``comm.stats()``, the memory forecast and the planner count it.

[Note: scratch per collective size]
A collective that copies (its buffers are not in the heap) gets exact-size scratch
([Note: nvshmem sizes a collective by its allocation]): per (lane, dtype, element
count) one source and two destinations ([Note: two destinations per size]), kept
until ``close``. Each distinct size costs its own three: the sizes of a lane add up,
never just the largest; an all-reduce's destination is as large as its source (a
reduce-scatter's is a world-th of it, a gather's world times it). See
:func:`scratch_need`.

[Note: collectives without copies]
The pool's buffers (slots, the landing buffer, the cast send buffers, the
reduce-scatter pairs) and, as :attr:`NvshmemBackend.symmetric_sources` asks, the
blocks' flat shards that are gathered uncast are asked of
:meth:`NvshmemBackend.empty` with the WP group;
when that group is the world they are allocated in the heap (``nvshmem.core.tensor``,
in the same order on every rank, so each lies at the same offset of every PE's heap:
a symmetric address). A gather or reduce-scatter whose source and destination both
lie in such buffers calls the pointer-level binding on the slices themselves
(``nvshmem.bindings.<dtype>_fcollect_on_stream`` / ``<dtype>_sum_reducescatter_on_stream``,
dtype ``float``, ``bfloat16`` or ``half``): the gather lands where the pool wants it
and the reduce-scatter reads its bucket, with no copy into or out of scratch
(:attr:`Backend.staged_bytes` stays 0 for them). What is not in the heap (full state
dicts, sequence parallelism, the vocab-parallel loss, the outer parameters' unit, a
pool whose WP group is not the world) takes the copying path above.

[Note: what orders a push into a pool buffer]
``fcollect`` pushes into the peers' ``dest`` as soon as the pushing PE runs it, with
no leading barrier, and a pool buffer is reused: the landing buffer by the next
block's gather while this PE may still copy the last one out, a slot by the next
block while this PE's compute may still read the block it held (a prefetch gather is
issued before the compute that reads the other slot, so having entered collective k
says nothing of this PE's compute). Two destinations per size cannot help here: the
pool decides the buffers. So every collective without copies begins with a team sync
on the team's one stream (``team_sync_on_stream``), which that stream reaches only
after the caller's stream's work issued before the collective (``wait_stream``): no
PE leaves the sync, and so no PE pushes, before every PE has finished everything it
issued before, the reads of the buffer's last contents included. Sources need no
more: NVSHMEM lets a PE reuse its source once the collective completed on it. The
cost is one team-wide meeting per collective (per parameter at
``comm_granularity="module"``). ``tests/test_nvshmem_zero_copy.py`` checks this on
CPU with processes as PEs whose pushes land in each other's heaps after random
delays, and shows that the same run without the sync reads a peer's next block.

[Note: close after a dead peer]
Frees (``nvshmem_free``) and ``finalize`` are collective: they wait for every PE. At
``close`` after a failed step (``abandon``: a wait failed, or the backward was cut
short) a peer may be dead or stuck in another collective, so they would hang. Then
``close`` frees nothing and does not finalize: the heap (every allocation in it) and
NVSHMEM's state stay until the process exits, which after a dead peer it must
anyway (NVSHMEM cannot be re-initialised without its peers).

[Note: two destinations per size]);
a plan that alone needs more than the heap raises :class:`SymmetricHeapError` then,
naming the bytes to set. That sum is a lower bound: scratch is exact-size per
collective size ([Note: nvshmem sizes a collective by its allocation]), made at the
size's first use in a step and kept until ``close()`` (freeing is collective too),
so a model whose units differ in size, or sequence parallelism with varying batch
shapes, needs more; an allocation that would pass the heap raises the same error,
on every rank alike (they allocate alike), instead of a failed ``nvshmem_malloc``.
NVSHMEM also keeps a little of the heap for itself: leave some margin.

[Note: two destinations per size]
``fcollect`` and ``alltoall`` push straight into the peers' ``dest`` and meet only at
their end (no leading barrier), and PEs leave a collective at different times. With
one destination scratch per size, a peer that left collective k could push
collective k+1 into this PE's scratch while this PE's stream still copies k's result
out of it. So each size has two destination scratches, used in turn: collective
k+1 writes the one that k-1 used. A peer can start k+1 only once k completed there,
and k needs every PE's data, so every PE had entered k, which on its one stream
([Note: one stream for a team]) comes after its copy-out of k-1. The turn is
counted per (lane, dtype, size) in issue order, the same on every rank; groups need
no place in the key, since every collective shares the one stream and team. The
second scratch is made at a size's second use (a size used once costs one). A
leading team barrier per collective would do as well, but adds a team-wide meeting
to every collective; the heap affords the second scratch. Sources need no second
one: on return from a collective NVSHMEM lets the PE reuse its source.

CI has no GPU: ``tests/test_cuda_contracts.py`` runs this backend on CPU tensors
against a fake of nvshmem4py that keeps the semantics above and whose every call
is bound to the installed package's signature; ``tests/gpu/`` runs it on a GPU.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from isp_comm.backends.base import Backend, CompletedHandle, Handle, cuda_with, kept, overlaps
from isp_comm.backends.streams import CudaRuntime, HostRuntime, Lanes
from isp_comm.backends.torch_backend import TorchBackend, refuse_unfit
from isp_comm.errors import SymmetricHeapError

log = logging.getLogger("isp_comm")

TEAM_STREAM = "nvshmem:TEAM_WORLD"
"""The key of the one side stream of a backend's collectives ([Note: one stream for a team])."""


DEFAULT_HEAP_BYTES = 1 << 30
"""NVSHMEM's symmetric heap when ``NVSHMEM_SYMMETRIC_SIZE`` is unset (1 GiB)."""

HEAP_VAR = "NVSHMEM_SYMMETRIC_SIZE"
HEAP_GRANULARITY = 512 << 20
"""NVSHMEM maps its heap in chunks of ``NVSHMEM_CUMEM_GRANULARITY`` (512 MiB by default)."""
HEAP_MARGIN = 64 << 20
"""Left over the plan for NVSHMEM's own use of the heap (teams, psync arrays)."""

BINDING_DTYPES = {torch.float32: "float", torch.bfloat16: "bfloat16", torch.float16: "half"}
"""The dtypes whose pointer-level collectives the backend calls, by nvshmem4py's name."""


def heap_size_for(need: int) -> int:
    """The ``NVSHMEM_SYMMETRIC_SIZE`` set when it is unset: ``need`` bytes plus
    :data:`HEAP_MARGIN`, rounded up to :data:`HEAP_GRANULARITY`."""
    return -(-(need + HEAP_MARGIN) // HEAP_GRANULARITY) * HEAP_GRANULARITY


def scratch_need(kind: str, sizes: list[int], world: int) -> int:
    """Heap bytes of the scratch that collectives of ``kind`` (``all_gather``,
    ``reduce_scatter``, ``all_reduce``, ``all_to_all``) with these per-rank input
    ``sizes`` take on the copying path: per distinct size a source and two
    destinations (see [Note: scratch per collective size])."""
    out = {
        "all_gather": lambda n: n * world,
        "reduce_scatter": lambda n: -(-n // world),
        "all_reduce": lambda n: n,
        "all_to_all": lambda n: n,
    }[kind]
    return sum(n + 2 * out(n) for n in set(sizes) if n)


def heap_bytes(environ=None) -> int:
    """The symmetric heap NVSHMEM makes at init: ``NVSHMEM_SYMMETRIC_SIZE`` as NVSHMEM
    reads it (a number with an optional k/m/g/t suffix, powers of 1024), else 1 GiB."""
    raw = (os.environ if environ is None else environ).get(HEAP_VAR, "").strip()
    if not raw:
        return DEFAULT_HEAP_BYTES
    m = re.fullmatch(r"(\d+(?:\.\d*)?)\s*([kmgtKMGT]?)[bB]?", raw)
    if m is None:
        raise ValueError(f"NVSHMEM_SYMMETRIC_SIZE={raw!r}: not a size (bytes, or e.g. 512M, 4G)")
    return int(float(m.group(1)) * 1024 ** " kmgt".index(m.group(2).lower() or " "))


def available() -> bool:
    return cuda_with("nvshmem.core")


def install_hint(cuda_version: str | None = None) -> str:
    """What to install for the CUDA major of this torch build (nvshmem4py's wheels
    come per CUDA major: ``nvshmem4py-cu12``, ``nvshmem4py-cu13``)."""
    cuda = cuda_version if cuda_version is not None else torch.version.cuda
    if not cuda:
        return f"this torch ({torch.__version__}) is built without CUDA"
    major = cuda.split(".")[0]
    if major not in ("12", "13"):
        return f"nvshmem4py has no wheel for CUDA {cuda} (cu12 and cu13 only)"
    return f"pip install 'isp-comm[nvshmem-cu{major}]' (nvshmem4py-cu{major}, for torch's CUDA {cuda})"


@dataclass(frozen=True)
class NvshmemApi:
    """What the backend uses of nvshmem4py and cuda-core, in one place: the real
    packages (:func:`load_api`), or a fake with their semantics in tests."""

    core: Any
    """``nvshmem.core``."""
    Device: Any
    """``cuda.core.Device`` (cuda-core 1.x: the top-level namespace; ``.experimental`` is gone)."""
    bindings: Any = None
    """``nvshmem.bindings``: the pointer-level collectives (see [Note: collectives
    without copies]); ``None``: every collective copies."""


def load_api() -> NvshmemApi:
    import nvshmem.bindings
    import nvshmem.core
    from cuda.core import Device

    return NvshmemApi(nvshmem.core, Device, nvshmem.bindings)


def device_index(device: torch.device) -> int:
    """The GPU NVSHMEM binds: the parameters' (``cuda:N``), not whichever is current;
    the current one only for a bare ``cuda``; 0 for CPU tensors (tests on fakes)."""
    if device.index is not None:
        return device.index
    return torch.cuda.current_device() if device.type == "cuda" else 0


class NvshmemBackend(Backend):
    name = "nvshmem"
    symmetric_sources = True  # see [Note: collectives without copies]
    symmetric_buffers = True  # the pool is symmetric heap, allocated by every PE together
    identical_sums = False  # a team reduction may add the peers from each PE's own on: last bits differ
    _PLAN = "the memory plan (pool buffers and the scratch of planned collectives)"

    def __init__(
        self,
        device: torch.device,
        timeout_s: float = 300.0,
        *,
        api: NvshmemApi | None = None,
        runtime: CudaRuntime | HostRuntime | None = None,
    ) -> None:
        self._api = api if api is not None else load_api()
        self._device = device
        self._lanes = Lanes(runtime if runtime is not None else CudaRuntime(), timeout_s)
        self._fallback = TorchBackend(device)
        self._world = dist.get_world_size()
        self._scratch: dict[tuple[str, torch.dtype, int, int], torch.Tensor] = {}
        self._turns: dict[tuple[str, torch.dtype, int], int] = {}  # see [Note: two destinations per size]
        self._allocations: list[torch.Tensor] = []  # every heap tensor, in allocation order (freed in it)
        self._symmetric: list[tuple[int, int]] = []  # (address, bytes) of the pool's buffers in the heap
        self._heap, self._heap_used = 0, 0  # see [Note: the symmetric heap]
        self._planned = 0  # heap bytes of the memory plan (plan_symmetric)
        self._set_heap_var = False  # this backend set NVSHMEM_SYMMETRIC_SIZE (and unsets it at close)
        self._initialized = self._abandoned = self._closed = False
        self.staged_bytes = 0
        self.direct_all_gathers = self.direct_reduce_scatters = 0
        if os.environ.get(HEAP_VAR, "").strip():  # the heap's size is the user's: nothing to wait for
            self._ensure_init()

    # ---- NVSHMEM's init and its heap ----------------------------------------------------
    @property
    def device_heap_bytes(self) -> int:
        """The symmetric heap NVSHMEM reserved on the device (0 before its init)."""
        return self._heap

    def plan_symmetric(
        self, group: ProcessGroup, buffer_bytes: int, collectives: list[tuple[ProcessGroup, str, list[int]]]
    ) -> None:
        """At wrap time, collectively over the world: size the heap from the plan and
        initialise NVSHMEM (see [Note: the symmetric heap]). ``buffer_bytes``: the pool
        buffers asked of :meth:`empty` with ``group``; ``collectives``: (group, kind,
        per-rank input bytes) of the collectives that copy. Groups NCCL serves count
        nothing."""
        need = buffer_bytes if self._world_group(group) and self._world > 1 else 0
        for g, kind, sizes in collectives:
            if self._world_group(g) and self._world > 1:
                need += scratch_need(kind, sizes, self._world)
        self._planned = need
        if self._initialized and need > self._heap:  # started with the variable that was set
            raise self._heap_error(self._PLAN, need)
        self._ensure_init()

    def _ensure_init(self) -> None:
        """Size the heap (set the variable or check it) and initialise NVSHMEM, once."""
        if self._initialized:
            return
        if not os.environ.get(HEAP_VAR, "").strip():
            os.environ[HEAP_VAR] = str(heap_size_for(self._planned))
            self._set_heap_var = True
        self._heap = heap_bytes()
        if self._planned > self._heap:
            raise self._heap_error(self._PLAN, self._planned)
        self._init_nvshmem()
        self._initialized = True

    def _init_nvshmem(self) -> None:
        """Bind NVSHMEM to the parameters' GPU and meet the other ranks through a
        unique id that rank 0 creates and broadcasts."""
        nv = self._api.core
        dev = self._api.Device(device_index(self._device))
        dev.set_current()
        uid = nv.get_unique_id(empty=True)
        if dist.get_rank() == 0:
            uid = nv.get_unique_id()
        raw = torch.from_numpy(uid._data.view(np.int8).copy()).to(self._device)
        dist.broadcast(raw, src=0)
        uid._data.view(np.int8)[:] = raw.cpu().numpy()
        nv.init(device=dev, uid=uid, rank=dist.get_rank(), nranks=self._world, initializer_method="uid")

    def _world_group(self, group: ProcessGroup) -> bool:
        return dist.get_world_size(group) == self._world

    def _heap_tensor(self, numel: int, dtype: torch.dtype, what: str) -> torch.Tensor:
        """A tensor in the symmetric heap (collective: every rank allocates alike).

        [Note: no allocation beside a collective]
        ``nvshmem_malloc`` is collective: it ends with a barrier over every PE, which
        NVSHMEM runs on a stream of its own. A collective of ``TEAM_WORLD`` still in
        flight on the team stream ([Note: one stream for a team]) would then run beside
        another collective of the same team, which NVSHMEM forbids (they share its psync
        slots). So the team stream is drained first: a host wait, but only when a
        buffer is made, at a scratch size's first or second use (the first steps), never
        once every size has its buffers."""
        self._ensure_init()
        nbytes = numel * dtype.itemsize
        if self._heap_used + nbytes > self._heap:
            raise self._heap_error(
                f"{what} of {nbytes} bytes (with the {self._heap_used} already allocated)", self._heap_used + nbytes
            )
        self._lanes.synchronize()
        # close() frees every buffer in order; after a dead peer it frees none (frees are
        # collective), and then nvshmem4py's "freed implicitly" at exit would only be noise
        with kept():
            t = self._api.core.tensor((numel,), dtype=dtype, except_on_del=False)
        self._heap_used += nbytes
        self._allocations.append(t)
        return t

    def _exact(self, lane: str, dtype: torch.dtype, numel: int, turn: int = 0) -> torch.Tensor:
        """A scratch tensor of exactly ``numel`` elements (see [Note: nvshmem sizes a
        collective by its allocation]), the ``turn``-th of its size (0 or 1)."""
        key = (lane, dtype, numel, turn)
        t = self._scratch.get(key)
        if t is None:
            t = self._scratch[key] = self._heap_tensor(numel, dtype, f"a {lane} scratch")
        return t

    def _heap_error(self, what: str, need: int) -> SymmetricHeapError:
        had = os.environ.get(HEAP_VAR)
        size = f"{HEAP_VAR}={had}" if had else f"{HEAP_VAR} unset (1 GiB)"
        return SymmetricHeapError(
            f"isp-comm nvshmem backend: {what} needs {need} bytes of NVSHMEM's symmetric heap, "
            f"which holds {self._heap or heap_bytes()} ({size}); set {HEAP_VAR} to at least {need} bytes "
            "plus margin before NVSHMEM starts (it reads it at init), or leave it unset for isp-comm to size, "
            "or use another backend"
        )

    def reserve(self, group: ProcessGroup, nbytes: int, device: torch.device, lane: str) -> None:
        """Nothing to decide or size: world-sized groups are NVSHMEM's, the others
        NCCL's, and the heap is sized from the whole plan by :meth:`plan_symmetric`
        (which knows each collective's kind and every distinct size, see [Note:
        scratch per collective size])."""
        return None

    # ---- the copying path -----------------------------------------------------------------
    def _destination(self, lane: str, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """The destination scratch of this size whose turn it is (see [Note: two
        destinations per size])."""
        key = (lane + ":out", dtype, numel)
        turn = self._turns.get(key, 0)
        self._turns[key] = turn ^ 1
        return self._exact(*key, turn)

    def _collective(self, lane: str, group, inp, out, n_in: int, n_out: int, call) -> Handle:
        """Copy ``inp`` into a scratch, ``call(dst, src, stream)``, copy the result to
        ``out`` (``inp`` itself for an all-reduce), all on the lane's stream."""
        if n_in == 0 and n_out == 0:
            return CompletedHandle()
        src = self._exact(lane + ":in", inp.dtype, n_in)
        dst = self._destination(lane, inp.dtype, n_out)
        self.staged_bytes += (n_in + n_out) * inp.element_size()

        def body(stream) -> None:
            src.copy_(inp.reshape(-1))
            call(dst, src, stream)
            out.view(-1).copy_(dst)

        # one stream for every collective: see [Note: one stream for a team]
        what = f"nvshmem {lane} collective"
        return self._lanes.run(TEAM_STREAM, "team", self._device, (inp, out), body, what, group)

    # ---- the path without copies ----------------------------------------------------------
    def _in_heap(self, *tensors: torch.Tensor) -> bool:
        """Every tensor lies in one of the pool's heap buffers (symmetric addresses)."""
        for t in tensors:
            if not t.is_contiguous():
                return False
            ptr, n = t.data_ptr(), t.numel() * t.element_size()
            if not any(base <= ptr and ptr + n <= base + size for base, size in self._symmetric):
                return False
        return True

    def _direct(self, lane: str, group, tensors, op: str, dest: torch.Tensor, src: torch.Tensor, nelem: int):
        """``<dtype>_<op>_on_stream(team, dest, src, nelem, stream)`` on the slices
        themselves, after a team sync (see [Note: what orders a push into a pool buffer])."""
        b, team = self._api.bindings, int(self._api.core.Teams.TEAM_WORLD)
        fn = getattr(b, f"{BINDING_DTYPES[src.dtype]}_{op}_on_stream")

        def body(stream) -> None:
            s = int(stream.__cuda_stream__()[1])
            if b.team_sync_on_stream(team, s):
                raise RuntimeError(f"nvshmem team sync before a {lane} collective failed")
            if fn(team, dest.data_ptr(), src.data_ptr(), nelem, s):
                raise RuntimeError(f"nvshmem {op} on team {team} failed")

        what = f"nvshmem {lane} collective (no copies)"
        return self._lanes.run(TEAM_STREAM, "team", self._device, tensors, body, what, group)

    def _zero_copy(self, out: torch.Tensor, inp: torch.Tensor) -> bool:
        """Whether a collective runs on ``inp`` and ``out`` themselves: both on the heap,
        in a dtype the bindings take, and apart (an in-place gather or reduce-scatter,
        whose output lies on its input, goes through the scratch: NVSHMEM's collectives
        do not say that they read a source a destination overlaps before writing it)."""
        usable = self._api.bindings is not None and inp.dtype in BINDING_DTYPES
        return usable and not overlaps(out, inp) and self._in_heap(inp, out)

    # ---- collectives ----------------------------------------------------------------------
    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, group: ProcessGroup) -> Handle:
        refuse_unfit("all-gather", dist.get_world_size(group), out, inp)  # [Note: sizes that do not fit on CUDA]
        if not self._world_group(group):
            return self._fallback.all_gather(out, inp, group)
        self._ensure_init()
        nv, n = self._api.core, inp.numel()
        if n and out.numel() == n * self._world and self._zero_copy(out, inp):
            self.direct_all_gathers += 1
            return self._direct("gather", group, (inp, out), "fcollect", out, inp, n)
        call = lambda dst, src, s: nv.fcollect(nv.Teams.TEAM_WORLD, dst, src, stream=s)
        return self._collective("gather", group, inp, out, n, n * self._world, call)

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, group: ProcessGroup) -> Handle:
        refuse_unfit("reduce-scatter", dist.get_world_size(group), out, inp)  # [Note: sizes that do not fit on CUDA]
        if not self._world_group(group):
            return self._fallback.reduce_scatter(out, inp, group)
        self._ensure_init()
        nv, n = self._api.core, out.numel()
        if n and inp.numel() == n * self._world and self._zero_copy(out, inp):
            self.direct_reduce_scatters += 1
            return self._direct("reduce", group, (inp, out), "sum_reducescatter", out, inp, n)
        call = lambda dst, src, s: nv.reducescatter(nv.Teams.TEAM_WORLD, dst, src, "sum", stream=s)
        return self._collective("reduce", group, inp, out, inp.numel(), n, call)

    def all_reduce(self, tensor: torch.Tensor, group: ProcessGroup) -> Handle:
        if not self._world_group(group):
            return self._fallback.all_reduce(tensor, group)
        self._ensure_init()
        nv, n = self._api.core, tensor.numel()
        call = lambda dst, src, s: nv.reduce(nv.Teams.TEAM_WORLD, dst, src, "sum", stream=s)
        return self._collective("reduce", group, tensor, tensor, n, n, call)

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, group: ProcessGroup) -> Handle:
        refuse_unfit("all-to-all", dist.get_world_size(group), out, inp)  # [Note: sizes that do not fit on CUDA]
        if not self._world_group(group):
            return self._fallback.all_to_all(out, inp, group)
        self._ensure_init()
        nv, n = self._api.core, inp.numel()
        call = lambda dst, src, s: nv.alltoall(nv.Teams.TEAM_WORLD, dst, src, stream=s)
        return self._collective("all_to_all", group, inp, out, n, n, call)

    def barrier(self, group: ProcessGroup, timeout_s: float) -> None:
        dist.barrier(group=group)

    def empty(
        self, numel: int, dtype: torch.dtype, device: torch.device, group: ProcessGroup | None = None
    ) -> torch.Tensor:
        """With a world-sized ``group`` (collective over the world), a buffer in the
        symmetric heap that gathers and reduce-scatters use without copies (see [Note:
        collectives without copies]); else an ordinary one."""
        if group is None or self._closed or not numel or self._world == 1 or not self._world_group(group):
            return torch.empty(numel, dtype=dtype, device=device)
        t = self._heap_tensor(numel, dtype, "a pool buffer")
        self._symmetric.append((t.data_ptr(), numel * dtype.itemsize))
        return t

    def abandon(self) -> None:
        """A step failed: ``close`` must not wait for the peers (see [Note: close after a dead peer])."""
        self._abandoned = True

    def close(self) -> None:
        """Free every heap tensor in allocation order (the same on every rank), then
        finalize; after :meth:`abandon`, neither (see [Note: close after a dead peer])."""
        if self._closed:
            return
        self._closed = True
        if self._initialized and not self._abandoned:
            self._lanes.synchronize()
            self._lanes.runtime.synchronize(self._device)  # the compute stream may still read pool buffers
            for t in self._allocations:
                self._api.core.free_tensor(t)
            self._api.core.finalize()
        elif self._initialized:
            log.warning(
                "isp-comm nvshmem backend: closed after a failed step; %d heap allocations (%d bytes) are not "
                "freed and NVSHMEM is not finalized (both wait for every peer): they last until the process exits",
                len(self._allocations),
                self._heap_used,
            )
        self._allocations.clear()
        self._scratch.clear()
        self._symmetric.clear()
        self._heap_used = 0
        if self._set_heap_var:
            os.environ.pop(HEAP_VAR, None)
            self._set_heap_var = False
