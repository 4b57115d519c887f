"""HOW bytes move: collective backends behind one interface."""

from __future__ import annotations

import torch

from isp_comm.backends.base import Backend, CompletedHandle, Handle
from isp_comm.backends.symm_cpu import SymmCpuBackend
from isp_comm.backends.torch_backend import TorchBackend


def make_backend(name: str, device: torch.device, timeout_s: float) -> Backend:
    """The backend named in ``ISPConfig.backend`` for parameters on ``device``."""
    if name == "torch" or (name == "auto" and device.type != "cpu"):
        return TorchBackend()
    if name in ("symm", "auto"):
        if device.type != "cpu":
            raise ValueError(f"backend 'symm' supports CPU tensors in this build, got device {device}")
        return SymmCpuBackend(timeout_s)
    raise ValueError(f"unknown backend {name!r}")


__all__ = ["Backend", "CompletedHandle", "Handle", "SymmCpuBackend", "TorchBackend", "make_backend"]
