"""HOW bytes move: collective backends behind one interface."""

from __future__ import annotations

from isp_comm.backends.base import Backend, CompletedHandle, Handle
from isp_comm.backends.torch_backend import TorchBackend


def make_backend(name: str) -> Backend:
    """The backend named in ``ISPConfig.backend``."""
    if name in ("torch", "auto"):
        return TorchBackend()
    raise ValueError(f"unknown backend {name!r}")


__all__ = ["Backend", "CompletedHandle", "Handle", "TorchBackend", "make_backend"]
