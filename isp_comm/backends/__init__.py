"""HOW bytes move: collective backends behind one interface."""

from __future__ import annotations

import torch

from isp_comm.backends import cuda_symm, nvshmem_backend
from isp_comm.backends.base import Backend, CompletedHandle, Handle
from isp_comm.backends.shm import unordered_flags
from isp_comm.backends.symm_cpu import SymmCpuBackend
from isp_comm.backends.torch_backend import TorchBackend


def backend_class(name: str, device_type: str) -> type[Backend]:
    """The class :func:`make_backend` builds for ``name`` on a ``device_type`` device,
    without building it (what a forecast reads, e.g. ``symmetric_buffers``).

    ``"symm"``: POSIX shared memory on CPU, torch symmetric memory on CUDA;
    ``"nvshmem"``: nvshmem4py (CUDA); ``"auto"``: symm on CPU where shared memory
    allows and the host publishes its flags in order (:func:`~isp_comm.backends.shm.
    unordered_flags`), torch (gloo) otherwise, torch (NCCL) on CUDA."""
    from isp_comm.config import BACKENDS

    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r} (one of {BACKENDS})")
    if name == "torch":
        return TorchBackend
    if device_type == "cpu":
        if name == "nvshmem":
            raise ValueError("backend 'nvshmem' needs CUDA parameters")
        unordered = unordered_flags()
        if unordered and name == "symm":
            raise ValueError(unordered)
        if unordered:  # auto: gloo, where this host's flags could be read out of order
            return TorchBackend
        return SymmCpuBackend  # auto: falls back when /dev/shm is short, with the same buffers
    if name == "nvshmem":
        return nvshmem_backend.NvshmemBackend
    if name == "auto":  # NCCL: the CUDA symmetric-memory backend has not run across GPUs yet (README)
        return TorchBackend
    return cuda_symm.CudaSymmBackend


def make_backend(name: str, device: torch.device, timeout_s: float) -> Backend:
    """The backend named in ``ISPConfig.backend`` for parameters on ``device`` (which
    class: :func:`backend_class`)."""
    cls = backend_class(name, device.type)
    if cls is TorchBackend:
        return TorchBackend(device)
    if cls is SymmCpuBackend:
        return SymmCpuBackend(timeout_s, strict=name == "symm")
    if cls is nvshmem_backend.NvshmemBackend:
        if not nvshmem_backend.available():
            raise ValueError(f"backend 'nvshmem' needs CUDA and nvshmem4py: {nvshmem_backend.install_hint()}")
        return nvshmem_backend.NvshmemBackend(device, timeout_s)
    if cuda_symm.available():
        return cuda_symm.CudaSymmBackend(timeout_s)
    raise ValueError(f"no symmetric-memory backend for device {device}")


__all__ = ["Backend", "CompletedHandle", "Handle", "SymmCpuBackend", "TorchBackend", "backend_class", "make_backend"]
