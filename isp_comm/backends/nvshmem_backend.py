"""nvshmem4py (``nvshmem.core``) collectives on the current CUDA stream.

Selected with ``ISPConfig(backend="nvshmem")`` when ``nvshmem.core`` imports and the
parameters are on CUDA. NVSHMEM is bootstrapped from a unique id that rank 0 creates
and broadcasts over torch.distributed; symmetric scratch tensors come from
``nvshmem.core.interop.torch``; ``fcollect`` and ``reducescatter`` run on the caller's
stream. NVSHMEM teams here cover the whole world only: a group smaller than the world
uses ``TorchBackend`` (NCCL) instead, as a group across hosts does for the CPU backend.

Not exercised by CI (no GPU there): its tests live in ``tests/gpu/``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from isp_comm.backends.base import Backend, Handle, cuda_with
from isp_comm.backends.cuda_symm import CudaEventHandle
from isp_comm.backends.torch_backend import TorchBackend


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


class _StreamRef:
    """What ``nvshmem.core``'s collectives read from a stream: its raw handle."""

    def __init__(self, stream: torch.cuda.Stream) -> None:
        self.handle = stream.cuda_stream


class NvshmemBackend(Backend):
    name = "nvshmem"

    def __init__(self, timeout_s: float = 300.0) -> None:
        import numpy as np
        import nvshmem.core as nvshmem
        from cuda.core.experimental import Device

        self._nv = nvshmem
        self._fallback = TorchBackend()
        self._world = dist.get_world_size()
        dev = Device(torch.cuda.current_device())
        dev.set_current()
        uid = nvshmem.get_unique_id(empty=True)
        if dist.get_rank() == 0:
            uid = nvshmem.get_unique_id()
        raw = torch.from_numpy(uid._data.view(np.int8).copy()).cuda()
        dist.broadcast(raw, src=0)
        uid._data.view(np.int8)[:] = raw.cpu().numpy()
        nvshmem.init(device=dev, uid=uid, rank=dist.get_rank(), nranks=self._world, initializer_method="uid")
        self._scratch: dict[tuple[str, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}

    def _world_group(self, group: ProcessGroup) -> bool:
        return dist.get_world_size(group) == self._world

    def _buffers(self, kind: str, dtype: torch.dtype, n_in: int, n_out: int):
        key = (kind, dtype)
        have = self._scratch.get(key)
        if have is None or have[0].numel() < n_in or have[1].numel() < n_out:
            torch.cuda.current_stream().synchronize()
            for t in have or ():
                self._nv.interop.torch.free_tensor(t)
            src = self._nv.interop.torch.empty((max(n_in, 1),), dtype=dtype)
            dst = self._nv.interop.torch.empty((max(n_out, 1),), dtype=dtype)
            have = self._scratch[key] = (src, dst)
        return have

    def _finish(self) -> Handle:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream())
        return CudaEventHandle(event, torch.device("cuda", torch.cuda.current_device()))

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, group: ProcessGroup) -> Handle:
        if not self._world_group(group):
            return self._fallback.all_gather(out, inp, group)
        n = inp.numel()
        src, dst = self._buffers("ag", inp.dtype, n, n * self._world)
        src[:n].copy_(inp.reshape(-1))
        self._nv.fcollect(
            self._nv.Teams.TEAM_WORLD, dst[: n * self._world], src[:n], stream=_StreamRef(torch.cuda.current_stream())
        )
        out.view(-1).copy_(dst[: n * self._world])
        return self._finish()

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, group: ProcessGroup) -> Handle:
        if not self._world_group(group):
            return self._fallback.reduce_scatter(out, inp, group)
        n = out.numel()
        src, dst = self._buffers("rs", inp.dtype, inp.numel(), n)
        src[: inp.numel()].copy_(inp.reshape(-1))
        stream = _StreamRef(torch.cuda.current_stream())
        self._nv.reducescatter(self._nv.Teams.TEAM_WORLD, dst[:n], src[: inp.numel()], "sum", stream=stream)
        out.view(-1).copy_(dst[:n])
        return self._finish()

    def all_reduce(self, tensor: torch.Tensor, group: ProcessGroup) -> Handle:
        if not self._world_group(group):
            return self._fallback.all_reduce(tensor, group)
        n = tensor.numel()
        src, dst = self._buffers("ar", tensor.dtype, n, n)
        src[:n].copy_(tensor.reshape(-1))
        self._nv.reduce(
            self._nv.Teams.TEAM_WORLD, dst[:n], src[:n], "sum", stream=_StreamRef(torch.cuda.current_stream())
        )
        tensor.view(-1).copy_(dst[:n])
        return self._finish()

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, group: ProcessGroup) -> Handle:
        if not self._world_group(group):
            return self._fallback.all_to_all(out, inp, group)
        n = inp.numel()
        src, dst = self._buffers("a2a", inp.dtype, n, n)
        src[:n].copy_(inp.reshape(-1))
        self._nv.alltoall(self._nv.Teams.TEAM_WORLD, dst[:n], src[:n], stream=_StreamRef(torch.cuda.current_stream()))
        out.view(-1).copy_(dst[:n])
        return self._finish()

    def barrier(self, group: ProcessGroup, timeout_s: float) -> None:
        dist.barrier(group=group)

    def empty(
        self, numel: int, dtype: torch.dtype, device: torch.device, group: ProcessGroup | None = None
    ) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, device=device)

    def close(self) -> None:
        torch.cuda.synchronize()
        for pair in self._scratch.values():
            for t in pair:
                self._nv.interop.torch.free_tensor(t)
        self._scratch.clear()
        self._nv.finalize()
