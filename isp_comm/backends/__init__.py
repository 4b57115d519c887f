"""HOW bytes move: collective backends behind one interface."""

from __future__ import annotations

import torch

from isp_comm.backends import cuda_symm, nvshmem_backend
from isp_comm.backends.base import Backend, CompletedHandle, Handle
from isp_comm.backends.symm_cpu import SymmCpuBackend
from isp_comm.backends.torch_backend import TorchBackend


def make_backend(name: str, device: torch.device, timeout_s: float) -> Backend:
    """The backend named in ``ISPConfig.backend`` for parameters on ``device``.

    ``"symm"``: POSIX shared memory on CPU, torch symmetric memory on CUDA;
    ``"nvshmem"``: nvshmem4py (CUDA); ``"auto"``: symm on CPU where shared memory
    allows, torch (NCCL) on CUDA."""
    from isp_comm.config import BACKENDS

    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r} (one of {BACKENDS})")
    if name == "torch":
        return TorchBackend(device)
    if device.type == "cpu":
        if name == "nvshmem":
            raise ValueError("backend 'nvshmem' needs CUDA parameters")
        return SymmCpuBackend(timeout_s, strict=name == "symm")  # auto: falls back when /dev/shm is short
    if name == "nvshmem":
        if not nvshmem_backend.available():
            raise ValueError(f"backend 'nvshmem' needs CUDA and nvshmem4py: {nvshmem_backend.install_hint()}")
        return nvshmem_backend.NvshmemBackend(device, timeout_s)
    if name == "auto":  # NCCL: the CUDA symmetric-memory backend has not run across GPUs yet (README)
        return TorchBackend(device)
    if cuda_symm.available():
        return cuda_symm.CudaSymmBackend(timeout_s)
    raise ValueError(f"no symmetric-memory backend for device {device}")


__all__ = ["Backend", "CompletedHandle", "Handle", "SymmCpuBackend", "TorchBackend", "make_backend"]
