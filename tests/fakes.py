"""Fakes of the collective layers the CUDA backends call, for running those backends'
own code on CPU tensors over gloo (tests/test_cuda_contracts.py).

Each fake keeps the real layer's semantics where the backends could get them wrong:
- :class:`FakeNvshmem` (nvshmem4py 0.4.1's ``nvshmem.core``): symmetric tensors are
  tracked by ``data_ptr``; a collective finds its tensors' allocations that way (a
  view at an offset is not found) and sizes itself from the *whole allocation*
  (``collective.py``: ``fcollect``/``alltoall`` from the source's bytes, the others
  from the destination's, ``alltoall`` per PE); a stream is read through
  ``__cuda_stream__``; ``TEAM_WORLD`` numbers PEs by the ``rank`` given to ``init``.
  Its collectives run on the host, one after another, so two of them can never
  overlap here as they can on a GPU; instead it refuses what lets them overlap there:
  collectives of one team issued on more than one stream (NVSHMEM allows one
  collective at a time per team, in the same order on every PE).
  Nor can a peer's next collective push into this PE's destination before this PE
  copied the last result out, as on a GPU (fcollect and alltoall push into the
  peers' ``dest`` with no leading barrier); the fake refuses what allows it: a
  collective whose destination is the previous collective's of the same team.
  Its symmetric heap holds ``heap_bytes`` (NVSHMEM: ``NVSHMEM_SYMMETRIC_SIZE``, 1 GiB
  unset); an allocation past it fails as ``nvshmem_malloc`` does, saying nothing of
  the variable.
- :class:`FakeSymm` (``torch.distributed._symmetric_memory``): ``empty`` gives a
  buffer in POSIX shared memory, ``rendezvous`` maps every peer's, ``get_buffer``
  is a view of a peer's bytes (a write through it reaches the peer), ``barrier`` is
  a barrier of the group.

:class:`Checked` wraps a fake so that every call the backend makes is first bound
to the installed real package's signature (``inspect.signature(...).bind``): a name
or keyword the real package lacks fails the test, without a GPU.
"""

from __future__ import annotations

import inspect
import os
import secrets
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from isp_comm.backends.shm import Segment, segment_name


class NvshmemInvalid(Exception):
    pass


class _Buffer:
    """What cuda.core's ``Buffer`` tells the collectives: its address and bytes."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.base, self.handle, self.size = tensor, tensor.data_ptr(), tensor.numel() * tensor.element_size()


class _Device:
    def __init__(self, device_id: int = 0) -> None:
        self.device_id = device_id
        self.current = False

    def set_current(self) -> None:
        self.current = True


_NBYTES = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2, torch.float64: 8, torch.int64: 8, torch.int32: 4}


class FakeNvshmem:
    """``nvshmem.core`` as the backend uses it, its collectives done over gloo."""

    Teams = SimpleNamespace(TEAM_WORLD=0)

    def __init__(self, heap_bytes: int = 1 << 30) -> None:
        self._tracked: dict[int, _Buffer] = {}
        self.heap_bytes = heap_bytes
        self.pe = self.npes = None
        self.calls: list[str] = []
        self.streams_seen: list[int] = []
        self._team_stream: dict[int, int] = {}  # team -> the one stream its collectives run on
        self._last_dst: dict[int, int] = {}  # team -> its last collective's destination allocation
        self.dsts: list[int] = []  # every collective's destination allocation, in issue order

    # ---- init_fini -------------------------------------------------------------------
    def get_unique_id(self, empty: bool = False):
        data = np.zeros(1, dtype=[("version", "<i4"), ("internal", "i1", (124,))])
        if not empty:
            data.view(np.int8)[:] = np.frombuffer(secrets.token_bytes(128), dtype=np.int8)
        return SimpleNamespace(_data=data)

    def init(self, device=None, uid=None, rank=None, nranks=None, mpi_comm=None, initializer_method: str = "") -> None:
        if initializer_method != "uid" or uid is None or rank is None or nranks is None:
            raise NvshmemInvalid("Invalid parameters for UID based init")
        if device is None or not device.current:
            raise NvshmemInvalid("init: no device bound")
        uids: list = [None] * nranks
        dist.all_gather_object(uids, uid._data.tobytes())
        if len(set(uids)) != 1:  # the real bootstrap hangs; the fake says why
            raise NvshmemInvalid("init: the PEs were given different unique ids")
        self.pe, self.npes = rank, nranks

    def finalize(self) -> None:
        if self._tracked:
            raise NvshmemInvalid(f"finalize with {len(self._tracked)} allocations not freed")
        self.pe = None

    # ---- memory ----------------------------------------------------------------------
    def tensor(self, shape, dtype=torch.float32, release=False, morder="C", except_on_del=True) -> torch.Tensor:
        if self.pe is None:
            raise NvshmemInvalid("NVSHMEM Library is not initialized")
        t = torch.empty(shape, dtype=dtype)
        if sum(b.size for b in self._tracked.values()) + t.numel() * t.element_size() > self.heap_bytes:
            raise NvshmemInvalid("nvshmem_malloc failed")  # what the real one says, nothing more
        self._tracked[t.data_ptr()] = _Buffer(t)
        return t

    def _buffer(self, t: torch.Tensor) -> _Buffer:
        buf = self._tracked.get(t.data_ptr())
        if buf is None:
            raise NvshmemInvalid("Tried to retrieve buffer from Tensor not tracked by nvshmem")
        return buf

    def free_tensor(self, tensor: torch.Tensor) -> None:
        del self._tracked[self._buffer(tensor).handle]

    # ---- direct ----------------------------------------------------------------------
    def my_pe(self) -> int:
        return self.pe

    def n_pes(self) -> int:
        return self.npes

    def team_n_pes(self, team) -> int:
        return self.npes

    # ---- collectives (collective.py's _call_collective / collective_on_buffer) --------
    def _call(self, coll: str, team, dst_array, src_array, op=None, stream=None) -> None:
        if self.pe is None:
            raise NvshmemInvalid("NVSHMEM Library is not initialized")
        if stream is None:
            raise NotImplementedError("Non-on-stream collectives are not yet implemented")
        if team != self.Teams.TEAM_WORLD:
            raise NvshmemInvalid("the fake knows TEAM_WORLD only")
        self._one_at_a_time(team, int(stream.__cuda_stream__()[1]))
        src, dst = self._buffer(src_array), self._buffer(dst_array)
        self._fresh_destination(team, dst.handle)
        if src_array.dtype != dst_array.dtype:
            raise NvshmemInvalid("Non-matching data types for src and dest arrays")
        nbytes = _NBYTES[src_array.dtype]
        size = src.size if coll in ("fcollect", "alltoall") else dst.size
        per_pe = coll == "alltoall"
        elems = max(1, size // ((self.npes if per_pe else 1) * nbytes))
        s, d = src.base.view(-1), dst.base.view(-1)  # the whole allocations
        self.calls.append(coll)
        getattr(self, "_do_" + coll)(d, s, elems)

    def _one_at_a_time(self, team, stream: int) -> None:
        """NVSHMEM: "Team-based collectives must occur in the same order across all PEs
        in a team", one at a time (they share the team's psync slots and counters).
        Collectives of a team on two streams may run concurrently, and in another
        order on each PE, on a GPU: refused here, where the host would serialise them."""
        self.streams_seen.append(stream)
        first = self._team_stream.setdefault(team, stream)
        if first != stream:
            raise NvshmemInvalid(
                f"collectives of team {team} issued on streams {first} and {stream}: "
                "on a GPU they may overlap, or run in another order on each PE"
            )

    def _fresh_destination(self, team, dst: int) -> None:
        """NVSHMEM: "Since PEs can enter and exit collectives at different times,
        accessing such memory remotely may require additional synchronization." A peer
        that left collective k may push collective k+1 into this PE's ``dest`` while
        this PE still copies k's result out of it: refused when k+1 reuses k's
        ``dest`` on the team. Collective k's completion on every PE proves each PE
        entered k, so each has copied out k-1: a ``dest`` last used before k is safe."""
        if self._last_dst.get(team) == dst:
            raise NvshmemInvalid(
                f"team {team}: a collective into the previous one's destination (a peer may push into it "
                "before this PE copied the last result out)"
            )
        self._last_dst[team] = dst
        self.dsts.append(dst)

    def _do_fcollect(self, d: torch.Tensor, s: torch.Tensor, n: int) -> None:
        parts = [torch.empty(n, dtype=s.dtype) for _ in range(self.npes)]
        dist.all_gather(parts, s[:n].clone())
        for pe, part in enumerate(parts):  # PE pe's data lands at pe * n of the allocation
            d[pe * n : (pe + 1) * n].copy_(part[: max(0, min(n, d.numel() - pe * n))])

    def _do_reducescatter(self, d: torch.Tensor, s: torch.Tensor, n: int) -> None:
        full = s.new_zeros(n * self.npes)  # past the source's allocation the real one reads garbage
        m = min(s.numel(), full.numel())
        full[:m] = s[:m]
        dist.all_reduce(full)
        d[:n].copy_(full[self.pe * n : (self.pe + 1) * n])

    def _do_reduce(self, d: torch.Tensor, s: torch.Tensor, n: int) -> None:
        acc = s[:n].clone()
        dist.all_reduce(acc)
        d[:n].copy_(acc)

    def _do_alltoall(self, d: torch.Tensor, s: torch.Tensor, n: int) -> None:
        out = torch.empty(n * self.npes, dtype=s.dtype)
        dist.all_to_all_single(out, s[: n * self.npes].clone())
        d[: n * self.npes].copy_(out)

    # ---- nvshmem.bindings: the pointer-level collectives on symmetric addresses -----------
    def _region(self, ptr: int, dtype: torch.dtype, numel: int, what: str) -> torch.Tensor:
        """The ``numel`` elements at address ``ptr``, which must lie inside one tracked
        allocation (NVSHMEM: a symmetric address), as a view of it."""
        nbytes = numel * _NBYTES[dtype]
        for buf in self._tracked.values():
            if buf.handle <= ptr and ptr + nbytes <= buf.handle + buf.size:
                start = ptr - buf.handle
                return buf.base.view(-1).view(torch.uint8)[start : start + nbytes].view(dtype)
        raise NvshmemInvalid(f"{what}: {nbytes} bytes at {ptr:#x} are not inside one symmetric allocation")

    def _pointer_call(self, coll: str, team, dest: int, src: int, n_src: int, n_dst: int, dtype, stream: int):
        if self.pe is None:
            raise NvshmemInvalid("NVSHMEM Library is not initialized")
        if team != self.Teams.TEAM_WORLD:
            raise NvshmemInvalid("the fake knows TEAM_WORLD only")
        self._one_at_a_time(team, int(stream))
        s, d = self._region(src, dtype, n_src, coll + " src"), self._region(dest, dtype, n_dst, coll + " dest")
        self._fresh_destination(team, dest)
        self.calls.append(coll + "@ptr")
        return s, d

    def binding_fcollect(self, dtype, team, dest, src, nelem, stream) -> int:
        s, d = self._pointer_call("fcollect", team, dest, src, nelem, nelem * self.npes, dtype, stream)
        self._do_fcollect(d, s, nelem)
        return 0

    def binding_sum_reducescatter(self, dtype, team, dest, src, nreduce, stream) -> int:
        s, d = self._pointer_call("reducescatter", team, dest, src, nreduce * self.npes, nreduce, dtype, stream)
        self._do_reducescatter(d, s, nreduce)
        return 0

    def team_sync_on_stream(self, team, stream) -> int:
        """A sync orders what each PE issued before it: the next collective may use
        any destination again (see ``_fresh_destination``)."""
        self._one_at_a_time(team, int(stream))
        self.calls.append("sync")
        dist.barrier()
        self._last_dst.pop(team, None)
        return 0

    def fcollect(self, team, dst_array, src_array, stream=None) -> None:
        self._call("fcollect", team, dst_array, src_array, stream=stream)

    def reducescatter(self, team, dst_array, src_array, op, stream=None) -> None:
        self._call("reducescatter", team, dst_array, src_array, op, stream)

    def reduce(self, team, dst_array, src_array, op, stream=None) -> None:
        self._call("reduce", team, dst_array, src_array, op, stream)

    def alltoall(self, team, dst_array, src_array, stream=None) -> None:
        self._call("alltoall", team, dst_array, src_array, stream=stream)


class FakeBindings:
    """``nvshmem.bindings`` as the backend uses it: ``<dtype>_fcollect_on_stream``,
    ``<dtype>_sum_reducescatter_on_stream`` (dtype ``float``, ``bfloat16``, ``half``)
    and ``team_sync_on_stream``, on addresses, served by a :class:`FakeNvshmem`."""

    _DTYPES = {"float": torch.float32, "bfloat16": torch.bfloat16, "half": torch.float16}

    def __init__(self, core: FakeNvshmem) -> None:
        self._core = core

    def __getattr__(self, name: str):
        if name == "team_sync_on_stream":
            return self._core.team_sync_on_stream
        for prefix, dtype in self._DTYPES.items():
            for op in ("fcollect", "sum_reducescatter"):
                if name == f"{prefix}_{op}_on_stream":
                    fn = getattr(self._core, "binding_" + op)
                    return lambda team, dest, src, nelem, stream, _d=dtype: fn(_d, team, dest, src, nelem, stream)
        raise AttributeError(name)


class _SymmHandle:
    def __init__(self, group, peers: list[torch.Tensor]) -> None:
        self._group, self._peers = group, peers
        self.calls = 0

    @property
    def rank(self) -> int:
        return dist.get_rank(self._group)

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self._group)

    def get_buffer(self, rank: int, sizes, dtype: torch.dtype, storage_offset: int = 0) -> torch.Tensor:
        n = int(np.prod(sizes))
        flat = self._peers[rank].view(dtype)
        if storage_offset + n > flat.numel():
            raise RuntimeError(f"get_buffer: {storage_offset}+{n} elements past a {flat.numel()}-element buffer")
        return flat[storage_offset : storage_offset + n].view(sizes)

    def barrier(self, channel: int = 0, timeout_ms: int = 0) -> None:
        self.calls += 1
        dist.barrier(group=self._group)


class FakeSymm:
    """``torch.distributed._symmetric_memory`` over POSIX shared memory. Every segment
    is unlinked as soon as its peers have mapped it: nothing outlives the test."""

    def __init__(self) -> None:
        self._token = secrets.token_hex(4)
        self._count = 0
        self._mine: dict[int, Segment] = {}
        self._maps: list[Segment] = []

    def empty(self, *size, dtype=None, device=None) -> torch.Tensor:
        n = int(np.prod(size[0] if len(size) == 1 and isinstance(size[0], tuple) else size))
        nbytes = n * torch.empty(0, dtype=dtype or torch.float32).element_size()
        self._count += 1
        seg = Segment(segment_name(os.getpid(), self._token, self._count), nbytes, create=True)
        t = seg.bytes[:nbytes].view(dtype or torch.float32)
        self._mine[t.data_ptr()] = seg
        return t

    def rendezvous(self, tensor: torch.Tensor, group) -> _SymmHandle:
        seg = self._mine[tensor.data_ptr()]
        names: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(names, (seg.name, seg.nbytes), group=group)
        peers = []
        for name, nbytes in names:
            mapped = seg if name == seg.name else Segment(name, nbytes, create=False)
            if mapped is not seg:
                self._maps.append(mapped)
            peers.append(mapped.bytes)
        dist.barrier(group=group)  # everyone has mapped everyone's
        Segment.unlink(seg.name)
        return _SymmHandle(group, peers)

    def close(self) -> None:
        """Unlink every segment this rank made (those rendezvoused already are)."""
        for seg in self._mine.values():
            Segment.unlink(seg.name)


class Checked:
    """``fake`` whose every attribute must exist in ``real`` and whose every call is
    bound to ``real``'s signature first."""

    def __init__(self, fake: Any, real: Any) -> None:
        self._fake, self._real = fake, real

    def __getattr__(self, name: str) -> Any:
        real = getattr(self._real, name)  # AttributeError: the real package has no such name
        fake = getattr(self._fake, name)
        if not callable(fake) or isinstance(fake, type):
            return fake
        try:
            sig = inspect.signature(real)
        except (TypeError, ValueError):  # builtins without a signature: the name alone is checked
            sig = None

        def call(*args, **kwargs):
            if sig is not None:
                sig.bind(*args, **kwargs)
            return fake(*args, **kwargs)

        return call
