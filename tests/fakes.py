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
import queue
import random
import secrets
import threading
import time
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from isp_comm.backends.shm import Flags, Segment, segment_name


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


class PushingNvshmem(FakeNvshmem):
    """``nvshmem.core`` and the bindings the backend calls, with PEs as processes whose
    symmetric heaps are POSIX shared memory every PE maps, and whose pointer-level
    collectives move bytes as a GPU's do, not in lock step:

    - allocations lie at the same offset of every PE's heap (every PE allocates alike),
      so an address translates to a peer's by its offset, as NVSHMEM's symmetric ones;
    - ``fcollect`` puts this PE's source into every PE's ``dest`` from a pusher thread,
      each put after a random delay of up to ``max_delay_s``, with no leading barrier:
      a PE ahead of its peers writes into their ``dest`` while they may still read it.
      The PE's collective completes once every PE's put for it has reached it (a flag
      each pusher sets after its bytes); its own puts may still be on their way;
    - ``sum_reducescatter`` waits until every PE entered, sums its chunk of every PE's
      source (in fp32, in PE order), and leaves once every PE has read (so a source may
      be reused on return, as NVSHMEM allows);
    - ``team_sync_on_stream`` returns once every PE has called it as often.

    The core API's collectives (the copying path) stay :class:`FakeNvshmem`'s, over gloo.
    Every segment is unlinked once every PE mapped it; ``finalize`` stops the pusher."""

    def __init__(self, heap_bytes: int = 1 << 20, max_delay_s: float = 0.003, seed: int = 0) -> None:
        super().__init__(heap_bytes)
        self._rng, self._max_delay = random.Random(seed), max_delay_s
        self._used = 0
        self._counts = {"fcollect": 0, "reduce": 0, "sync": 0}
        self._heaps: list[Segment] = []
        self._flags: list[Flags] = []
        self._segments: list[Segment] = []
        self._pushes: queue.SimpleQueue = queue.SimpleQueue()
        self._pusher: threading.Thread | None = None

    def init(self, device=None, uid=None, rank=None, nranks=None, mpi_comm=None, initializer_method: str = "") -> None:
        super().init(device, uid, rank, nranks, mpi_comm, initializer_method)
        token = secrets.token_hex(4)
        names: list = [None] * nranks
        dist.all_gather_object(names, (os.getpid(), token))
        nflags = nranks + 3  # puts from each PE, syncs, reduce-scatters entered, left
        mine = [Segment(segment_name(os.getpid(), token, k), n, create=True) for k, n in self._sizes(nflags)]
        dist.barrier()
        for pe, (pid, tok) in enumerate(names):
            segs = (
                mine
                if pe == rank
                else [Segment(segment_name(pid, tok, k), n, create=False) for k, n in self._sizes(nflags)]
            )
            self._segments += segs if pe != rank else []
            self._heaps.append(segs[0])
            self._flags.append(Flags(segs[1], nflags))
        dist.barrier()  # every PE mapped every segment
        for seg in mine:
            Segment.unlink(seg.name)
        self._segments += mine
        self._pusher = threading.Thread(target=self._push_loop, daemon=True)
        self._pusher.start()

    def _sizes(self, nflags: int) -> list[tuple[str, int]]:
        return [("heap", self.heap_bytes), ("flags", nflags * Flags.STRIDE * 8)]

    def tensor(self, shape, dtype=torch.float32, release=False, morder="C", except_on_del=True) -> torch.Tensor:
        if self.pe is None:
            raise NvshmemInvalid("NVSHMEM Library is not initialized")
        numel = int(np.prod(shape))
        start = -(-self._used // 256) * 256
        if start + numel * _NBYTES[dtype] > self.heap_bytes:
            raise NvshmemInvalid("nvshmem_malloc failed")
        self._used = start + numel * _NBYTES[dtype]
        t = self._heaps[self.pe].bytes[start : self._used].view(dtype).view(shape)
        self._tracked[t.data_ptr()] = _Buffer(t)
        return t

    def finalize(self) -> None:
        self._pushes.put(None)  # after this PE's last puts: they land first
        self._pusher.join(timeout=30)
        super().finalize()
        for seg in self._segments:
            seg.close()

    def _offset(self, ptr: int) -> int:
        return ptr - self._heaps[self.pe].bytes.data_ptr()

    def _peer(self, pe: int, offset: int, nbytes: int) -> torch.Tensor:
        return self._heaps[pe].bytes[offset : offset + nbytes]

    def _push_loop(self) -> None:
        me = self.pe
        while (item := self._pushes.get()) is not None:
            pe, offset, data, count = item
            time.sleep(self._rng.uniform(0, self._max_delay))
            self._peer(pe, offset, data.numel()).copy_(data)
            self._flags[pe].store(me, count)

    def _wait(self, index: int, count: int, what: str) -> None:
        deadline = time.monotonic() + 30
        while any(f.load(index) < count for f in self._flags):
            if time.monotonic() > deadline:
                raise TimeoutError(f"PE {self.pe}: {what} {count} did not complete")
            time.sleep(1e-4)

    def binding_fcollect(self, dtype, team, dest, src, nelem, stream) -> int:
        self._one_at_a_time(team, int(stream))
        nbytes = nelem * _NBYTES[dtype]
        data = self._region(src, dtype, nelem, "fcollect src").view(torch.uint8).clone()
        self._region(dest, dtype, nelem * self.npes, "fcollect dest")
        self._counts["fcollect"] += 1
        count, at = self._counts["fcollect"], self._offset(dest) + self.pe * nbytes
        self.calls.append("fcollect@ptr")
        for pe in self._rng.sample(range(self.npes), self.npes):
            self._pushes.put((pe, at, data, count))
        mine = self._flags[self.pe]
        deadline = time.monotonic() + 30
        while any(mine.load(pe) < count for pe in range(self.npes)):  # every PE's put reached me
            if time.monotonic() > deadline:
                raise TimeoutError(f"PE {self.pe}: fcollect {count} did not complete")
            time.sleep(1e-4)
        return 0

    def binding_sum_reducescatter(self, dtype, team, dest, src, nreduce, stream) -> int:
        self._one_at_a_time(team, int(stream))
        self._region(src, dtype, nreduce * self.npes, "reducescatter src")
        out = self._region(dest, dtype, nreduce, "reducescatter dest")
        self._counts["reduce"] += 1
        count, n = self._counts["reduce"], self.npes
        self.calls.append("reducescatter@ptr")
        self._flags[self.pe].store(n + 1, count)
        self._wait(n + 1, count, "reducescatter (entered)")
        nbytes = nreduce * _NBYTES[dtype]
        at = self._offset(src) + self.pe * nbytes
        acc = torch.zeros(nreduce, dtype=torch.float32)
        for pe in range(n):
            acc += self._peer(pe, at, nbytes).view(dtype).float()
        out.copy_(acc)
        self._flags[self.pe].store(n + 2, count)
        self._wait(n + 2, count, "reducescatter (read)")
        return 0

    def team_sync_on_stream(self, team, stream) -> int:
        self._one_at_a_time(team, int(stream))
        self._counts["sync"] += 1
        self.calls.append("sync")
        self._flags[self.pe].store(self.npes, self._counts["sync"])
        self._wait(self.npes, self._counts["sync"], "sync")
        return 0


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
