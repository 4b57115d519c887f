"""nvshmem4py (``nvshmem.core``, 0.4.1 and later) collectives on side streams.

Selected with ``ISPConfig(backend="nvshmem")`` when ``nvshmem.core`` imports and the
parameters are on CUDA. NVSHMEM is bootstrapped from a unique id that rank 0 creates
and broadcasts over torch.distributed, bound to the parameters' GPU (not the
current one). A collective copies its input into an NVSHMEM scratch tensor, runs
``fcollect`` / ``reducescatter`` / ``reduce`` / ``alltoall`` on the backend's one
side stream (see [Note: one stream for a team]), and copies the result out. NVSHMEM
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
Every scratch comes from NVSHMEM's symmetric heap, whose size NVSHMEM reads once, at
init, from ``NVSHMEM_SYMMETRIC_SIZE`` (bytes, or with a suffix k/m/g/t; unset: 1 GiB).
The backend is made, and NVSHMEM initialised, before the communicator plans its
memory, so isp-comm cannot size the heap from the plan; set the variable before the
job starts. What the backend does instead: it reads the same variable at init
(:func:`heap_bytes`) and counts what it allocates. At wrap time
:meth:`NvshmemBackend.reserve` adds up the scratch of each lane's largest
collective (a source and two destinations, see [Note: two destinations per size]);
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

import os
import re
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from isp_comm.backends.base import Backend, CompletedHandle, Handle, cuda_with
from isp_comm.backends.streams import CudaRuntime, HostRuntime, Lanes
from isp_comm.backends.torch_backend import TorchBackend
from isp_comm.errors import SymmetricHeapError

TEAM_STREAM = "nvshmem:TEAM_WORLD"
"""The key of the one side stream of a backend's collectives ([Note: one stream for a team])."""


DEFAULT_HEAP_BYTES = 1 << 30
"""NVSHMEM's symmetric heap when ``NVSHMEM_SYMMETRIC_SIZE`` is unset (1 GiB)."""


def heap_bytes(environ=None) -> int:
    """The symmetric heap NVSHMEM makes at init: ``NVSHMEM_SYMMETRIC_SIZE`` as NVSHMEM
    reads it (a number with an optional k/m/g/t suffix, powers of 1024), else 1 GiB."""
    raw = (os.environ if environ is None else environ).get("NVSHMEM_SYMMETRIC_SIZE", "").strip()
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


def load_api() -> NvshmemApi:
    import nvshmem.core
    from cuda.core import Device

    return NvshmemApi(nvshmem.core, Device)


def device_index(device: torch.device) -> int:
    """The GPU NVSHMEM binds: the parameters' (``cuda:N``), not whichever is current;
    the current one only for a bare ``cuda``; 0 for CPU tensors (tests on fakes)."""
    if device.index is not None:
        return device.index
    return torch.cuda.current_device() if device.type == "cuda" else 0


class NvshmemBackend(Backend):
    name = "nvshmem"

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
        self._heap, self._heap_used = heap_bytes(), 0  # see [Note: the symmetric heap]
        self._planned: dict[str, int] = {}  # lane -> heap bytes of its largest planned collective
        self._init_nvshmem()

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

    def _exact(self, lane: str, dtype: torch.dtype, numel: int, turn: int = 0) -> torch.Tensor:
        """A scratch tensor of exactly ``numel`` elements (see [Note: nvshmem sizes a
        collective by its allocation]), the ``turn``-th of its size (0 or 1)."""
        key = (lane, dtype, numel, turn)
        t = self._scratch.get(key)
        if t is None:
            nbytes = numel * torch.empty(0, dtype=dtype).element_size()
            if self._heap_used + nbytes > self._heap:
                raise self._heap_error(
                    f"a {lane} scratch of {nbytes} bytes (with the {self._heap_used} already allocated)",
                    self._heap_used + nbytes,
                )
            t = self._scratch[key] = self._api.core.tensor((numel,), dtype=dtype)
            self._heap_used += nbytes
        return t

    def _heap_error(self, what: str, need: int) -> SymmetricHeapError:
        had = os.environ.get("NVSHMEM_SYMMETRIC_SIZE")
        size = f"NVSHMEM_SYMMETRIC_SIZE={had}" if had else "NVSHMEM_SYMMETRIC_SIZE unset (1 GiB)"
        return SymmetricHeapError(
            f"isp-comm nvshmem backend: {what} needs {need} bytes of NVSHMEM's symmetric heap, "
            f"which holds {self._heap} ({size}); set NVSHMEM_SYMMETRIC_SIZE to at least {need} bytes "
            "plus margin before the job starts (NVSHMEM reads it at init), or use another backend"
        )

    def reserve(self, group: ProcessGroup, nbytes: int, device: torch.device, lane: str) -> None:
        """At wrap time: check that the heap holds the scratch of each lane's largest
        planned collective, ``nbytes`` of input per rank (see [Note: the symmetric
        heap]); nothing is allocated (a scratch is exact-size per collective, and the
        plan gives bytes, not dtypes and element counts). Groups NCCL serves: nothing."""
        if not self._world_group(group) or not nbytes:
            return
        # a source and two destinations: gathers put world x the input, reduce-scatters
        # world-th of it (an all-reduce, in = out, needs more: this is a lower bound)
        out = nbytes * self._world if lane == "gather" else -(-nbytes // self._world)
        self._planned[lane] = max(self._planned.get(lane, 0), nbytes + 2 * out)
        need = sum(self._planned.values())
        if need > self._heap:
            lanes = ", ".join(f"{k} {v}" for k, v in sorted(self._planned.items()))
            raise self._heap_error(f"the memory plan (per lane, bytes: {lanes})", need)

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

        def body(stream) -> None:
            src.copy_(inp.reshape(-1))
            call(dst, src, stream)
            out.view(-1).copy_(dst)

        # one stream for every collective: see [Note: one stream for a team]
        what = f"nvshmem {lane} collective"
        return self._lanes.run(TEAM_STREAM, "team", self._device, (inp, out), body, what, group)

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, group: ProcessGroup) -> Handle:
        if not self._world_group(group):
            return self._fallback.all_gather(out, inp, group)
        nv, n = self._api.core, inp.numel()
        call = lambda dst, src, s: nv.fcollect(nv.Teams.TEAM_WORLD, dst, src, stream=s)
        return self._collective("gather", group, inp, out, n, n * self._world, call)

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, group: ProcessGroup) -> Handle:
        if not self._world_group(group):
            return self._fallback.reduce_scatter(out, inp, group)
        nv = self._api.core
        call = lambda dst, src, s: nv.reducescatter(nv.Teams.TEAM_WORLD, dst, src, "sum", stream=s)
        return self._collective("reduce", group, inp, out, inp.numel(), out.numel(), call)

    def all_reduce(self, tensor: torch.Tensor, group: ProcessGroup) -> Handle:
        if not self._world_group(group):
            return self._fallback.all_reduce(tensor, group)
        nv, n = self._api.core, tensor.numel()
        call = lambda dst, src, s: nv.reduce(nv.Teams.TEAM_WORLD, dst, src, "sum", stream=s)
        return self._collective("reduce", group, tensor, tensor, n, n, call)

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, group: ProcessGroup) -> Handle:
        if not self._world_group(group):
            return self._fallback.all_to_all(out, inp, group)
        nv, n = self._api.core, inp.numel()
        call = lambda dst, src, s: nv.alltoall(nv.Teams.TEAM_WORLD, dst, src, stream=s)
        return self._collective("all_to_all", group, inp, out, n, n, call)

    def barrier(self, group: ProcessGroup, timeout_s: float) -> None:
        dist.barrier(group=group)

    def empty(
        self, numel: int, dtype: torch.dtype, device: torch.device, group: ProcessGroup | None = None
    ) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, device=device)

    def close(self) -> None:
        self._lanes.synchronize()
        for t in self._scratch.values():
            self._api.core.free_tensor(t)
        self._scratch.clear()
        self._heap_used = 0
        self._api.core.finalize()
