"""POSIX shared-memory segments and cross-process flags, for the CPU symmetric backend.

[Note: segment lifetime] Segments are created with mode 0600 under a name that carries
the creating job's pid and a random token (``isp_<pid>_<token>_...``), mapped by every
peer and unlinked as soon as all have mapped them: the mappings stay valid, and
nothing is left in /dev/shm even if a rank is killed later. ``multiprocessing.
shared_memory`` is not used because before Python 3.13 its resource tracker may unlink
segments it does not own.

[Note: reservation] A segment's pages are reserved when it is created
(``posix_fallocate``), after a ``statvfs`` check of the free space: a tmpfs that is
too small (Docker's default ``/dev/shm`` is 64 MiB) then fails at set-up with
:class:`~isp_comm.errors.SharedMemoryError`, never with SIGBUS when a page is first
touched, also when another process fills ``/dev/shm`` later.

[Note: publication order] A flag is published with a sequentially consistent atomic
store and read with an acquire load (libatomic's ``__atomic_store_8`` /
``__atomic_load_8``), so data copied before a flag store (large copies may use
non-temporal stores) is visible to a peer that has read the flag, on x86 and on weak
memory models alike. Without libatomic, a lock round trip (a locked RMW, a full fence
on x86) precedes a plain store, and a load is plain: enough on x86, whose stores are
seen in order and whose loads are not reordered with each other, and not on a weakly
ordered CPU (Arm, POWER), where a peer could read the flag and then older data. There
the backend is not used (:func:`unordered_flags`).
"""

from __future__ import annotations

import _posixshmem
import ctypes
import ctypes.util
import functools
import mmap
import os
import platform
import threading

import numpy as np
import torch

from isp_comm.errors import SharedMemoryError

_SEQ_CST, _ACQUIRE = 5, 2
_STRONGLY_ORDERED = ("x86_64", "amd64", "i386", "i686", "x86")
PREFIX = "isp_"
SHM_DIR = "/dev/shm"
DOCKER_HINT = "give the job more (Docker: --shm-size, e.g. --shm-size=8g) or use backend='torch'"


def shm_free_bytes(shm_dir: str = SHM_DIR) -> int:
    """Bytes an unprivileged process may still allocate in ``shm_dir``."""
    st = os.statvfs(shm_dir)
    return st.f_bavail * st.f_frsize


def segment_name(pid: int, token: str, *parts: object) -> str:
    return "_".join([f"{PREFIX}{pid}", token, *map(str, parts)])


class Segment:
    """One mapped shared-memory segment."""

    def __init__(self, name: str, nbytes: int, create: bool) -> None:
        self.name = name
        self.nbytes = max(nbytes, 8)
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        try:  # every failure a SharedMemoryError, which the creation's agreement over the group carries
            fd = _posixshmem.shm_open("/" + name, flags, mode=0o600)
        except OSError as exc:
            raise SharedMemoryError(_cannot(name, create, exc)) from exc
        try:
            if create:
                self._reserve(fd, name, self.nbytes)
            self._map = mmap.mmap(fd, self.nbytes)
        except OSError as exc:
            if create:
                Segment.unlink(name)
            raise SharedMemoryError(_cannot(name, create, exc)) from exc
        finally:
            os.close(fd)
        self.array = np.frombuffer(self._map, dtype=np.uint8)
        self.bytes = torch.from_numpy(self.array)

    @staticmethod
    def _reserve(fd: int, name: str, nbytes: int) -> None:
        """Size the new segment and reserve its pages (see the note on reservation)."""
        free = shm_free_bytes()
        try:
            if free < nbytes:
                raise OSError(28, "not enough free space")
            os.ftruncate(fd, nbytes)
            os.posix_fallocate(fd, 0, nbytes)
        except OSError as exc:
            Segment.unlink(name)
            raise SharedMemoryError(
                f"{SHM_DIR} cannot hold a {nbytes}-byte shared-memory segment: {free} bytes free "
                f"({exc.strerror}); {DOCKER_HINT}"
            ) from exc

    @staticmethod
    def unlink(name: str) -> None:
        try:
            _posixshmem.shm_unlink("/" + name)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        self.bytes = None  # type: ignore[assignment]
        self.array = None  # type: ignore[assignment]
        try:
            self._map.close()
        except BufferError:  # a tensor view still exports the buffer; the GC unmaps it
            pass


class Flags:
    """``n`` int64 flags, one per 64-byte line, over a shared segment."""

    STRIDE = 8  # int64s per cache line

    def __init__(self, seg: Segment, n: int) -> None:
        assert seg.nbytes >= n * self.STRIDE * 8
        self._words = seg.array.view(np.int64)
        self._base = seg.array.ctypes.data
        atomic = _libatomic()
        self._store = self._load = None
        if atomic is not None:
            self._store = getattr(atomic, "__atomic_store_8")
            self._store.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int]
            self._load = getattr(atomic, "__atomic_load_8")
            self._load.argtypes = [ctypes.c_void_p, ctypes.c_int]
            self._load.restype = ctypes.c_uint64
        self._fence = threading.Lock()

    def _addr(self, i: int) -> int:
        return self._base + i * self.STRIDE * 8

    def store(self, i: int, value: int) -> None:
        if self._store is not None:
            self._store(self._addr(i), value, _SEQ_CST)
        else:
            with self._fence:
                pass
            self._words[i * self.STRIDE] = value

    def load(self, i: int) -> int:
        if self._load is not None:
            return int(self._load(self._addr(i), _ACQUIRE))
        return int(self._words[i * self.STRIDE])


def _cannot(name: str, create: bool, exc: OSError) -> str:
    return (
        f"cannot {'create' if create else 'map'} the shared-memory segment {name} in {SHM_DIR} ({exc.strerror}); "
        "check that it is writable and mounted, or use backend='torch'"
    )


@functools.cache
def _libatomic() -> ctypes.CDLL | None:
    lib = ctypes.util.find_library("atomic")
    return ctypes.CDLL(lib) if lib else None


def unordered_flags() -> str | None:
    """Why this host cannot publish the flags in order, or ``None`` when it can: no
    libatomic on a weakly ordered CPU ([Note: publication order])."""
    machine = platform.machine()
    if _libatomic() is not None or machine.lower() in _STRONGLY_ORDERED:
        return None
    return (
        f"the CPU shared-memory backend needs libatomic on this {machine} CPU (its loads and stores may be seen "
        "out of order, and a peer could read a flag before the data it publishes): install it (Debian and "
        "Ubuntu: the libatomic1 package) or use backend='torch'"
    )


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` (of this host) runs: not gone, and not a zombie (exited,
    not yet reaped: a launcher reaping its workers one by one leaves the others'
    peers so while they wait for it)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]  # the field after the command's name
    except (OSError, IndexError):
        return True  # no /proc (or it went meanwhile): kill(0) said it exists
    return state not in (b"Z", b"X")


def owners_gone(folder: str, prefix: str, sep: str) -> list[str]:
    """Names in ``folder`` of the form ``PREFIX PID SEP ...`` whose process ``PID`` no
    longer exists (what a run named after itself and could not remove)."""
    out = []
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return out
    for name in names:
        if not name.startswith(prefix):
            continue
        pid = name[len(prefix) :].split(sep, 1)[0]
        if pid.isdigit() and not pid_alive(int(pid)):
            out.append(name)
    return out


def stale_segments(shm_dir: str = "/dev/shm") -> list[str]:
    """isp-comm segments in ``shm_dir`` whose creating process no longer exists."""
    return owners_gone(shm_dir, PREFIX, "_")
