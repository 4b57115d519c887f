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

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from isp_comm.backends.base import CompletedHandle, Handle, cuda_with


def available() -> bool:
    return cuda_with("torch.distributed._symmetric_memory")


class CudaEventHandle:
    __slots__ = ("_event",)

    def __init__(self, event: torch.cuda.Event) -> None:
        self._event = event

    def wait(self, timeout_s: float) -> None:
        # The device-side barriers carry the deadline (timeout_ms); here the
        # caller's stream simply orders itself after the collective.
        torch.cuda.current_stream().wait_event(self._event)


class CudaSymmBackend:
    name = "symm"

    def __init__(self, timeout_s: float = 300.0) -> None:
        from torch.distributed import _symmetric_memory as symm_mem

        self._symm = symm_mem
        self._timeout_ms = int(timeout_s * 1000)
        self._groups: dict[str, tuple[torch.Tensor, object]] = {}
        self._stream = torch.cuda.Stream()

    def _buffer(self, group: ProcessGroup, nbytes: int, device: torch.device):
        key = group.group_name
        have = self._groups.get(key)
        if have is None or have[0].numel() < nbytes:
            cap = max(1 << 20, 1 << (max(nbytes, 1) - 1).bit_length())
            torch.cuda.current_stream().synchronize()  # the old buffer is no longer read
            buf = self._symm.empty(cap, dtype=torch.uint8, device=device)
            have = (buf, self._symm.rendezvous(buf, group))
            self._groups[key] = have
        return have

    def _run(self, group: ProcessGroup, inp: torch.Tensor | None, nbytes: int, device, body) -> Handle:
        if dist.get_world_size(group) == 1:
            body(None, None)
            return CompletedHandle()
        buf, hdl = self._buffer(group, nbytes, device)
        self._stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._stream):
            if inp is not None and inp.numel():
                flat = inp.reshape(-1)
                buf[: flat.numel() * flat.element_size()].view(flat.dtype).copy_(flat)
            hdl.barrier(channel=0, timeout_ms=self._timeout_ms)
            body(hdl, buf)
            hdl.barrier(channel=0, timeout_ms=self._timeout_ms)
            event = torch.cuda.Event()
            event.record(self._stream)
        for t in (inp,):
            if t is not None:
                t.record_stream(self._stream)
        return CudaEventHandle(event)

    @staticmethod
    def _peer(hdl, r: int, n: int, dtype: torch.dtype, offset: int = 0) -> torch.Tensor:
        return hdl.get_buffer(r, (n,), dtype, offset)

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, group: ProcessGroup) -> Handle:
        n, w = inp.numel(), dist.get_world_size(group)

        def body(hdl, _buf):
            if hdl is None:
                out.copy_(inp.reshape(out.shape))
                return
            flat = out.view(-1)
            for r in range(w):
                flat[r * n : (r + 1) * n].copy_(self._peer(hdl, r, n, inp.dtype))

        return self._run(group, inp, n * inp.element_size(), inp.device, body)

    def _sum(self, hdl, w: int, n: int, dtype: torch.dtype, offset: int, out: torch.Tensor) -> None:
        acc = self._peer(hdl, 0, n, dtype, offset).float()
        for r in range(1, w):
            acc.add_(self._peer(hdl, r, n, dtype, offset))
        out.copy_(acc)

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, group: ProcessGroup) -> Handle:
        n, w = out.numel(), dist.get_world_size(group)

        def body(hdl, _buf):
            if hdl is None:
                out.copy_(inp.reshape(out.shape))
            elif n:
                self._sum(hdl, w, n, inp.dtype, hdl.rank * n, out.view(-1))

        return self._run(group, inp, inp.numel() * inp.element_size(), inp.device, body)

    def all_reduce(self, tensor: torch.Tensor, group: ProcessGroup) -> Handle:
        n, w = tensor.numel(), dist.get_world_size(group)

        def body(hdl, _buf):
            if hdl is not None and n:
                self._sum(hdl, w, n, tensor.dtype, 0, tensor.view(-1))

        return self._run(group, tensor, n * tensor.element_size(), tensor.device, body)

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, group: ProcessGroup) -> Handle:
        w = dist.get_world_size(group)
        n = inp.numel() // w

        def body(hdl, _buf):
            if hdl is None:
                out.copy_(inp)
                return
            flat = out.view(-1)
            for r in range(w):
                flat[r * n : (r + 1) * n].copy_(self._peer(hdl, r, n, inp.dtype, hdl.rank * n))

        return self._run(group, inp, inp.numel() * inp.element_size(), inp.device, body)

    def barrier(self, group: ProcessGroup, timeout_s: float) -> None:
        dist.barrier(group=group)

    def empty(
        self, numel: int, dtype: torch.dtype, device: torch.device, group: ProcessGroup | None = None
    ) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, device=device)

    def close(self) -> None:
        torch.cuda.synchronize()
        self._groups.clear()
