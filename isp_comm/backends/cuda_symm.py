"""CUDA symmetric memory (``torch.distributed._symmetric_memory``) collectives.

Selected with ``ISPConfig(backend="symm")`` for CUDA parameters when torch's symmetric
memory is usable. Each (group, lane) owns one symmetric scratch buffer (``empty`` +
``rendezvous``) and one side stream (see [Note: lanes] in ``streams.py``): a
collective copies its input into the local buffer, meets its peers at a device-side
barrier, reads (pulls) what it needs straight from the peers' buffers through
``get_buffer``, and meets them again so that no buffer is overwritten while a peer
still reads it. A handle's ``wait`` makes the caller's stream wait for it (no host
synchronisation). A dead peer is therefore seldom an ``ISPCommTimeout`` here: the
device barrier waits out twice the timeout and traps the kernel, which ends the
process's CUDA context (see [Note: what a dead peer looks like on CUDA] in
``streams.py``).

[Note: scratch that grows without a host wait]
The communicator reserves each group's scratch at wrap time from its memory plan
(:meth:`CudaSymmBackend.reserve`), and decides there, once per group, whether the
group uses symmetric memory at all, so that no step meets the peers on the host.
What the plan cannot size (a sequence-parallel all-to-all, whose size is the
batch's) grows at its first use: a new buffer is made and rendezvoused (a host
meeting of the group's ranks, once per growth), and the old one is kept, not
freed, until ``close()``: collectives already issued on the lane may still read
it, and keeping it asks nothing of the host. Growth doubles, so a run makes a few.

Ranks sharing one GPU (tests on a one-GPU machine) use symmetric memory when
``TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1`` is set, as torch's rendezvous asks;
without it wrapping refuses them in one line (:func:`shared_gpu_refusal`).

CI has no GPU: ``tests/test_cuda_contracts.py`` runs this backend on CPU tensors
against a fake of ``_symmetric_memory`` over shared memory whose every call is
bound to the installed torch's signature; ``tests/gpu/`` runs it on a GPU.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from isp_comm.backends.base import Backend, CompletedHandle, Handle, cuda_with, kept, symmetric_refusal
from isp_comm.backends.streams import CudaEventHandle, CudaRuntime, HostRuntime, Lanes
from isp_comm.backends.symm_cpu import host_id
from isp_comm.backends.torch_backend import TorchBackend, refuse_unfit

log = logging.getLogger("isp_comm")

__all__ = ["CudaEventHandle", "CudaSymmBackend", "accumulator", "available", "sum_into"]


def available() -> bool:
    return cuda_with("torch.distributed._symmetric_memory")


def accumulator(dtype: torch.dtype) -> torch.dtype:
    """The dtype :func:`sum_into` adds ``dtype`` in: fp32 for the narrower floats, the
    dtype itself for fp32, fp64 and integers, as NCCL sums them (in fp32 an fp64 sum
    kept 24 bits of mantissa and an int64 one lost its low bits past 2**24)."""
    return torch.promote_types(dtype, torch.float32) if dtype.is_floating_point else dtype


def sum_into(peers: list[torch.Tensor], out: torch.Tensor) -> None:
    """``out`` = the sum of ``peers``, in rank order, in :func:`accumulator`'s dtype.
    Never writes a peer's buffer: they are other ranks' scratch, which those ranks
    may still read."""
    if accumulator(out.dtype) == out.dtype:
        torch.add(peers[0], peers[1], out=out)
        for p in peers[2:]:
            out.add_(p)
        return
    acc = peers[0].to(torch.float32, copy=True)
    for p in peers[1:]:
        acc.add_(p)
    out.copy_(acc)


OVERLAP_VARIABLE = "TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES"
"""Set to 1, torch's symmetric memory lets ranks on one GPU map each other's buffers
(its rendezvous refuses them otherwise). For tests on a shared GPU: a real job
never shares a GPU silently."""


def overlapping_allowed(environ=None) -> bool:
    """Whether :data:`OVERLAP_VARIABLE` is set to 1 (read at each decision: a test
    sets it in its ranks' environment)."""
    return (os.environ if environ is None else environ).get(OVERLAP_VARIABLE, "").strip() == "1"


def shared_gpu_refusal(infos: list[tuple[str, str]], allowed: bool) -> str | None:
    """The one line that refuses a group whose ranks share a GPU, or ``None``.
    ``infos``: each rank's (host, GPU UUID) in group order; ranks sharing a GPU are
    those with the same pair. ``allowed``: :func:`overlapping_allowed`."""
    ranks: dict[tuple[str, str], list[int]] = {}
    for r, info in enumerate(infos):
        ranks.setdefault(tuple(info), []).append(r)
    shared = [rs for rs in ranks.values() if len(rs) > 1]
    if not shared or allowed:
        return None
    return (
        f"backend 'symm': group ranks {shared} share a GPU; torch symmetric memory maps ranks on one GPU only "
        f"with {OVERLAP_VARIABLE}=1 (for tests), and NCCL refuses them: give each rank its own GPU"
    )


def _gpu_uuid(device: torch.device) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


def _peer_ok(device: torch.device, uuids: list[str]) -> bool:
    """This rank's GPU reaches every GPU of ``uuids`` (the GPUs of this host's ranks):
    its own (ranks sharing it, with :data:`OVERLAP_VARIABLE`), or another with
    peer access."""
    mine = _gpu_uuid(device)
    index = {_gpu_uuid(torch.device("cuda", i)): i for i in range(torch.cuda.device_count())}
    return all(u == mine or (u in index and torch.cuda.can_device_access_peer(device, index[u])) for u in uuids)


class CudaSymmBackend(Backend):
    name = "symm"

    def __init__(
        self,
        timeout_s: float = 300.0,
        *,
        symm: Any = None,
        runtime: CudaRuntime | HostRuntime | None = None,
        peer_check=None,
    ) -> None:
        if symm is None:
            from torch.distributed import _symmetric_memory as symm
        self._symm = symm
        self._rt = runtime if runtime is not None else CudaRuntime()
        self._lanes = Lanes(self._rt, timeout_s)
        # the device barriers' own deadline, twice the host's: past it the kernel traps
        # (a sticky CUDA error). A handle's wait reports ISPCommTimeout first only if the
        # host reaches it late; see [Note: what a dead peer looks like on CUDA]
        self._timeout_ms = int(2 * timeout_s * 1000)
        self._peer_check = peer_check if peer_check is not None else (_gpu_uuid, _peer_ok)
        self._buffers: dict[tuple[str, str], tuple[torch.Tensor, Any]] = {}  # (group, lane) -> (buffer, handle)
        self._retired: list[tuple[torch.Tensor, Any]] = []  # see [Note: scratch that grows without a host wait]
        self._local: dict[str, bool] = {}  # group -> symmetric memory (else NCCL, see _symmetric)
        self._fallback = TorchBackend()

    def _symmetric(self, group: ProcessGroup, device: torch.device) -> bool:
        """Whether ``group`` uses symmetric memory: its ranks share a host and their
        GPUs reach each other. Decided once per group, collectively, by
        :meth:`reserve` at wrap time (or at the group's first collective if it was
        never reserved). Otherwise NCCL serves it, said in one line; but ranks that
        share a GPU are refused with a ValueError (NCCL would fail on them too)
        unless :data:`OVERLAP_VARIABLE` is 1, and then use symmetric memory."""
        key = group.group_name
        if key not in self._local:
            uuid_of, peer_ok = self._peer_check
            infos: list = [None] * dist.get_world_size(group)
            flags: list = [None] * len(infos)
            with self._rt.device_context(device):  # NCCL's all_gather_object uses the current device
                dist.all_gather_object(infos, (host_id(), uuid_of(device)), group=group)
                shared = shared_gpu_refusal(infos, overlapping_allowed())
                if shared is not None:  # every rank saw the same infos: every rank raises
                    raise ValueError(shared)
                here = sorted({u for h, u in infos if h == host_id()})  # the GPUs of this host's ranks
                dist.all_gather_object(flags, peer_ok(device, here), group=group)
            refusal = symmetric_refusal([h for h, _ in infos], flags)
            self._local[key] = refusal is None
            if refusal is not None and dist.get_rank(group) == 0:
                ranks = dist.get_process_group_ranks(group)
                log.warning("isp-comm: group %s: %s; using NCCL for it", ranks, refusal)
        return self._local[key]

    def reserve(self, group: ProcessGroup, nbytes: int, device: torch.device, lane: str = "reduce") -> None:
        """At set-up (collective over ``group``): decide whether the group uses
        symmetric memory, and size its ``lane``'s scratch for collectives of up to
        ``nbytes`` per rank (0: decide only). See [Note: scratch that grows without a
        host wait]."""
        if dist.get_world_size(group) > 1 and self._symmetric(group, device) and nbytes:
            self._buffer(group, lane, nbytes, device)

    def _buffer(self, group: ProcessGroup, lane: str, nbytes: int, device: torch.device):
        key = (group.group_name, lane)
        have = self._buffers.get(key)
        if have is None or have[0].numel() < nbytes:
            cap = max(1 << 20, 1 << (max(nbytes, 1) - 1).bit_length())
            if have is not None:
                self._retired.append(have)
                log.info("isp-comm: the %s scratch of group %s grows to %d bytes", lane, group.group_name, cap)
            with self._rt.device_context(device), kept():  # the symmetric pool is the current device's
                buf = self._symm.empty(cap, dtype=torch.uint8, device=device)
                have = self._buffers[key] = (buf, self._symm.rendezvous(buf, group))
        return have

    def _run(self, group: ProcessGroup, lane: str, inp: torch.Tensor, out: torch.Tensor | None, body) -> Handle:
        """``inp`` into the lane's buffer, a barrier, ``body(handle)`` reading the
        peers' buffers, a barrier: on the lane's side stream."""
        device = inp.device
        buf, hdl = self._buffer(group, lane, inp.numel() * inp.element_size(), device)
        self.staged_bytes += inp.nbytes + (inp if out is None else out).nbytes  # into its buffer, out of the peers'

        def on_stream(_stream) -> None:
            if inp.numel():
                flat = inp.reshape(-1)
                buf[: flat.numel() * flat.element_size()].view(flat.dtype).copy_(flat)
            hdl.barrier(channel=0, timeout_ms=self._timeout_ms)
            body(hdl)
            hdl.barrier(channel=0, timeout_ms=self._timeout_ms)

        what = f"symmetric-memory {lane} collective"
        return self._lanes.run(group.group_name, lane, device, (inp, out), on_stream, what, group)

    @staticmethod
    def _peers(hdl, n: int, dtype: torch.dtype, offset: int = 0) -> list[torch.Tensor]:
        return [hdl.get_buffer(r, (n,), dtype, offset) for r in range(hdl.world_size)]

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, group: ProcessGroup) -> Handle:
        # [Note: sizes that do not fit on CUDA]
        # Each collective here takes its count from one side: a reduce-scatter reads
        # ``out.numel()`` elements at ``rank x out.numel()`` of every peer's scratch, so
        # an input shorter than the group's share summed stale bytes of an earlier
        # collective; a longer gather output kept its tail, a shorter one raised between
        # the two device barriers (the peers then wait in the second until it traps);
        # an all-to-all dropped an input's last ``numel % size`` elements; an output of
        # another dtype was converted. NVSHMEM's copying path alike (nvshmem4py sizes a
        # reduce-scatter by its destination and reads the source past its allocation,
        # an all-to-all by the source's numel // npes). NCCL, the fallback, refuses
        # each: so does every CUDA backend, at issue, before anything is sent.
        refuse_unfit("all-gather", dist.get_world_size(group), out, inp)
        if dist.get_world_size(group) == 1:
            out.copy_(inp.reshape(out.shape))
            return CompletedHandle()
        if not self._symmetric(group, inp.device):
            return self._fallback.all_gather(out, inp, group)
        n = inp.numel()

        def body(hdl) -> None:
            flat = out.view(-1)
            for r, peer in enumerate(self._peers(hdl, n, inp.dtype)):
                flat[r * n : (r + 1) * n].copy_(peer)

        return self._run(group, "gather", inp, out, body)

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, group: ProcessGroup) -> Handle:
        refuse_unfit("reduce-scatter", dist.get_world_size(group), out, inp)  # [Note: sizes that do not fit on CUDA]
        if dist.get_world_size(group) == 1:
            out.copy_(inp.reshape(out.shape))
            return CompletedHandle()
        if not self._symmetric(group, inp.device):
            return self._fallback.reduce_scatter(out, inp, group)
        n = out.numel()

        def body(hdl) -> None:
            if n:
                sum_into(self._peers(hdl, n, inp.dtype, hdl.rank * n), out.view(-1))

        return self._run(group, "reduce", inp, out, body)

    def all_reduce(self, tensor: torch.Tensor, group: ProcessGroup) -> Handle:
        if dist.get_world_size(group) == 1:
            return CompletedHandle()
        if not self._symmetric(group, tensor.device):
            return self._fallback.all_reduce(tensor, group)
        n = tensor.numel()

        def body(hdl) -> None:
            if n:
                sum_into(self._peers(hdl, n, tensor.dtype), tensor.view(-1))

        return self._run(group, "reduce", tensor, None, body)

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, group: ProcessGroup) -> Handle:
        refuse_unfit("all-to-all", dist.get_world_size(group), out, inp)  # [Note: sizes that do not fit on CUDA]
        if dist.get_world_size(group) == 1:
            out.copy_(inp)
            return CompletedHandle()
        if not self._symmetric(group, inp.device):
            return self._fallback.all_to_all(out, inp, group)
        n = inp.numel() // dist.get_world_size(group)

        def body(hdl) -> None:
            flat = out.view(-1)
            for r, peer in enumerate(self._peers(hdl, n, inp.dtype, hdl.rank * n)):
                flat[r * n : (r + 1) * n].copy_(peer)

        return self._run(group, "all_to_all", inp, out, body)

    def barrier(self, group: ProcessGroup, timeout_s: float) -> None:
        dist.barrier(group=group)

    def empty(
        self, numel: int, dtype: torch.dtype, device: torch.device, group: ProcessGroup | None = None
    ) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, device=device)

    def close(self) -> None:
        self._lanes.synchronize()
        self._buffers.clear()
        self._retired.clear()
        self._fallback.close()
