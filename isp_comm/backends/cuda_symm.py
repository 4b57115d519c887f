"""CUDA symmetric memory (``torch.distributed._symmetric_memory``) collectives.

Selected with ``ISPConfig(backend="symm")`` for CUDA parameters when torch's symmetric
memory is usable. Per group, each rank owns one symmetric scratch buffer (``empty`` +
``rendezvous``); a collective copies its input into the local buffer, meets its peers
at a device-side barrier, reads (pulls) what it needs straight from the peers'
buffers through ``get_buffer``, and meets them again so no buffer is overwritten while
a peer still reads it. Everything runs on one side stream; a handle's ``wait`` makes
the caller's stream wait for it (no host synchronisation).

Not exercised by CI (no GPU there): its tests live in ``tests/gpu/``.
"""

from __future__ import annotations

import logging
import time

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from isp_comm.backends.base import Backend, CompletedHandle, Handle, cuda_with, symmetric_refusal
from isp_comm.backends.symm_cpu import host_id
from isp_comm.backends.torch_backend import TorchBackend
from isp_comm.errors import ISPCommTimeout

log = logging.getLogger("isp_comm")


def available() -> bool:
    return cuda_with("torch.distributed._symmetric_memory")


class CudaEventHandle(Handle):
    """A collective on a CUDA stream, ending at ``event``. ``wait`` orders the caller's
    stream after it without stopping the host; a collective still running
    ``deadline_s`` after its issue when it is waited raises ``ISPCommTimeout`` (the
    query does not block)."""

    __slots__ = ("_device", "_event", "_issued", "_deadline_s")

    def __init__(self, event: torch.cuda.Event, device: torch.device, deadline_s: float = float("inf")) -> None:
        self._event, self._device = event, device
        self._issued, self._deadline_s = time.monotonic(), deadline_s

    def wait(self, timeout_s: float) -> None:
        if time.monotonic() - self._issued > min(timeout_s, self._deadline_s) and not self._event.query():
            raise ISPCommTimeout(f"a CUDA collective did not complete within {timeout_s:.1f}s of its issue")
        torch.cuda.current_stream(self._device).wait_event(self._event)

    def is_completed(self) -> bool:
        return self._event.query()

    def completion_event(self, _observer: torch.cuda.Stream) -> torch.cuda.Event:
        """Recorded on the stream that ran the collective, as it ended (timelines)."""
        return self._event


class CudaSymmBackend(Backend):
    name = "symm"

    def __init__(self, timeout_s: float = 300.0) -> None:
        from torch.distributed import _symmetric_memory as symm_mem

        self._symm = symm_mem
        self._timeout_s = timeout_s
        # the device barriers' own deadline comes later than the host's, so that a
        # late collective is reported by a handle's wait, as ISPCommTimeout, rather than
        # by a trapped kernel (a sticky CUDA error)
        self._timeout_ms = int(2 * timeout_s * 1000)
        self._groups: dict[str, tuple[torch.Tensor, object]] = {}
        self._local: dict[str, bool] = {}  # group -> symmetric memory (else NCCL, see _symmetric)
        self._fallback = TorchBackend()
        self._streams: dict[torch.device, torch.cuda.Stream] = {}  # per device: made on the tensors' own
        self._streams_by_group: dict[str, torch.cuda.Stream] = {}

    def _symmetric(self, group: ProcessGroup, device: torch.device) -> bool:
        """Whether ``group`` uses symmetric memory: its ranks share a host and their
        GPUs reach each other (decided once per group, collectively, at its first
        collective; every rank issues the same collectives, so all decide alike).
        Otherwise NCCL serves it, said in one line."""
        key = group.group_name
        if key not in self._local:
            props = torch.cuda.get_device_properties
            mine = str(props(device).uuid)
            infos: list = [None] * dist.get_world_size(group)
            dist.all_gather_object(infos, (host_id(), mine), group=group)
            here = [u for h, u in infos if h == host_id()]  # the GPUs of this host's ranks
            index = {str(props(i).uuid): i for i in range(torch.cuda.device_count())}
            ok = len(set(here)) == len(here) and all(  # one GPU per rank, each reaching the others
                u == mine or (u in index and torch.cuda.can_device_access_peer(device, index[u])) for u in here
            )
            flags: list = [None] * len(infos)
            dist.all_gather_object(flags, ok, group=group)
            refusal = symmetric_refusal([h for h, _ in infos], flags)
            self._local[key] = refusal is None
            if refusal is not None and dist.get_rank(group) == 0:
                ranks = dist.get_process_group_ranks(group)
                log.warning("isp-comm: group %s: %s; using NCCL for it", ranks, refusal)
        return self._local[key]

    def reserve(self, group: ProcessGroup, nbytes: int, device: torch.device) -> None:
        """Size ``group``'s scratch for collectives of up to ``nbytes`` per rank, at
        set-up (collective over the group). The communicator reserves what its memory
        plan says each group moves, so no step has to grow a scratch: growing means
        the host waits until no collective reads the old buffer."""
        if dist.get_world_size(group) > 1 and self._symmetric(group, device):
            self._buffer(group, nbytes, device, planned=True)

    def _buffer(self, group: ProcessGroup, nbytes: int, device: torch.device, planned: bool = False):
        key = group.group_name
        have = self._groups.get(key)
        if have is None or have[0].numel() < nbytes:
            cap = max(1 << 20, 1 << (max(nbytes, 1) - 1).bit_length())
            if have is not None or not planned:
                log.warning(
                    "isp-comm: the symmetric scratch of group %s grows to %d bytes for a collective the memory "
                    "plan did not size (the host waits for the streams once)",
                    dist.get_process_group_ranks(group),
                    cap,
                )
                torch.cuda.current_stream(device).synchronize()  # the old buffer is no longer read
                if key in self._streams_by_group:
                    self._streams_by_group[key].synchronize()
            buf = self._symm.empty(cap, dtype=torch.uint8, device=device)
            have = (buf, self._symm.rendezvous(buf, group))
            self._groups[key] = have
        return have

    def _run(
        self, group: ProcessGroup, inp: torch.Tensor | None, out: torch.Tensor | None, nbytes: int, device, body
    ) -> Handle:
        if dist.get_world_size(group) == 1:
            body(None, None)
            return CompletedHandle()
        buf, hdl = self._buffer(group, nbytes, device)
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device=device)
        self._streams_by_group[group.group_name] = stream
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            if inp is not None and inp.numel():
                flat = inp.reshape(-1)
                buf[: flat.numel() * flat.element_size()].view(flat.dtype).copy_(flat)
            hdl.barrier(channel=0, timeout_ms=self._timeout_ms)
            body(hdl, buf)
            hdl.barrier(channel=0, timeout_ms=self._timeout_ms)
            event = torch.cuda.Event(enable_timing=True)
            event.record(stream)
        # both ends are used on the side stream: the caching allocator must not hand
        # their memory to another tensor before the side stream is done with them
        for t in (inp, out):
            if t is not None:
                t.record_stream(stream)
        return CudaEventHandle(event, device, self._timeout_s)

    @staticmethod
    def _peer(hdl, r: int, n: int, dtype: torch.dtype, offset: int = 0) -> torch.Tensor:
        return hdl.get_buffer(r, (n,), dtype, offset)

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, group: ProcessGroup) -> Handle:
        if not self._symmetric(group, inp.device):
            return self._fallback.all_gather(out, inp, group)
        n, w = inp.numel(), dist.get_world_size(group)

        def body(hdl, _buf):
            if hdl is None:
                out.copy_(inp.reshape(out.shape))
                return
            flat = out.view(-1)
            for r in range(w):
                flat[r * n : (r + 1) * n].copy_(self._peer(hdl, r, n, inp.dtype))

        return self._run(group, inp, out, n * inp.element_size(), inp.device, body)

    def _sum(self, hdl, w: int, n: int, dtype: torch.dtype, offset: int, out: torch.Tensor) -> None:
        acc = self._peer(hdl, 0, n, dtype, offset).float()
        for r in range(1, w):
            acc.add_(self._peer(hdl, r, n, dtype, offset))
        out.copy_(acc)

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, group: ProcessGroup) -> Handle:
        if not self._symmetric(group, inp.device):
            return self._fallback.reduce_scatter(out, inp, group)
        n, w = out.numel(), dist.get_world_size(group)

        def body(hdl, _buf):
            if hdl is None:
                out.copy_(inp.reshape(out.shape))
            elif n:
                self._sum(hdl, w, n, inp.dtype, hdl.rank * n, out.view(-1))

        return self._run(group, inp, out, inp.numel() * inp.element_size(), inp.device, body)

    def all_reduce(self, tensor: torch.Tensor, group: ProcessGroup) -> Handle:
        if not self._symmetric(group, tensor.device):
            return self._fallback.all_reduce(tensor, group)
        n, w = tensor.numel(), dist.get_world_size(group)

        def body(hdl, _buf):
            if hdl is not None and n:
                self._sum(hdl, w, n, tensor.dtype, 0, tensor.view(-1))

        return self._run(group, tensor, None, n * tensor.element_size(), tensor.device, body)

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, group: ProcessGroup) -> Handle:
        if not self._symmetric(group, inp.device):
            return self._fallback.all_to_all(out, inp, group)
        w = dist.get_world_size(group)
        n = inp.numel() // w

        def body(hdl, _buf):
            if hdl is None:
                out.copy_(inp)
                return
            flat = out.view(-1)
            for r in range(w):
                flat[r * n : (r + 1) * n].copy_(self._peer(hdl, r, n, inp.dtype, hdl.rank * n))

        return self._run(group, inp, out, inp.numel() * inp.element_size(), inp.device, body)

    def barrier(self, group: ProcessGroup, timeout_s: float) -> None:
        dist.barrier(group=group)

    def empty(
        self, numel: int, dtype: torch.dtype, device: torch.device, group: ProcessGroup | None = None
    ) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, device=device)

    def close(self) -> None:
        torch.cuda.synchronize()
        self._groups.clear()
        self._fallback.close()
