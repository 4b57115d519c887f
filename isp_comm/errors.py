"""Exceptions a user of isp-comm may want to catch, and the check of a folder argument
the command-line tools share."""

import os


class ISPCommTimeout(RuntimeError):
    """A wait on communication outlived its deadline (a peer died or stalled).

    The first one a communicator raises carries the hang's diagnosis (which rank is
    not responding, behind or out of step; see :mod:`isp_comm.flight`) after its first
    line, and in :attr:`diagnosis`."""

    diagnosis: str | None = None
    """The diagnosis, when one was made (a store to meet in, more than one rank)."""
    told: bool = False
    """Whether this rank printed the diagnosis (the first rank whose deadline passed does)."""


class HookOrderError(RuntimeError, ValueError):
    """Scheduler hooks were called out of order (e.g. after_backward before backward)."""


class SharedMemoryError(ValueError):
    """Shared memory (``/dev/shm``) cannot hold what the symmetric-memory backend needs.

    Raised when a segment cannot be reserved, on every rank of the group alike; the
    message names the directory, the bytes needed and the bytes free. A ``ValueError``
    because the fix is the deployment's: a larger ``/dev/shm`` (Docker: ``--shm-size``)
    or ``ISPConfig(backend="torch")``."""


class SymmetricHeapError(ValueError):
    """NVSHMEM's symmetric heap (``NVSHMEM_SYMMETRIC_SIZE``, read once at NVSHMEM's
    init) cannot hold the nvshmem backend's scratch. Raised on every rank alike, at
    wrap time when the memory plan already needs more, else at the allocation that
    would not fit; the message names the bytes needed. A ``ValueError`` because the
    fix is the deployment's: a larger ``NVSHMEM_SYMMETRIC_SIZE`` set before the job
    starts, or another backend."""


def need_folder(path: str, expected: str) -> None:
    """A ``ValueError`` unless ``path`` is a folder: a file given where a folder is
    wanted says so, and what to give (``expected``), rather than "no such folder"."""
    if os.path.isdir(path):
        return
    if os.path.exists(path):
        raise ValueError(f"{path} is a file, not a folder: give {expected}")
    raise ValueError(f"{path}: no such folder")


def few_names(names: list[str], shown: int = 3) -> str:
    """The first ``shown`` of ``names``, comma-separated, and `` ...`` when there are more:
    a refusal names what it refuses without a line per parameter."""
    return ", ".join(names[:shown]) + (" ..." if len(names) > shown else "")
