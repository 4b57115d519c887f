"""A private CUDA MPS daemon for the shared-GPU NVSHMEM tests.

NVSHMEM runs several PEs on one GPU in full mode only under MPS (without it, in
"limited" mode, its on-stream collectives abort the process). A test can start MPS
itself without changing any GPU setting: the control daemon's pipe and log folders
are a temporary folder of its own (``CUDA_MPS_PIPE_DIRECTORY``,
``CUDA_MPS_LOG_DIRECTORY``), ``nvidia-cuda-mps-control -d`` starts it, and
``echo quit | nvidia-cuda-mps-control`` with the same folders stops it. The ranks
inherit the folders through their environment and so become its clients; NVSHMEM
runs the same binary to find the server, so it must be on ``PATH``.

    with PrivateMps() as mps:
        if mps.reason:              # no binary, or the daemon did not start
            pytest.skip(mps.reason)
        for name, value in mps.env.items():
            monkeypatch.setenv(name, value)
        ...                         # ranks spawned now are MPS clients

The daemon is stopped on every way out of the ``with`` (an exception, a failed
assertion, a skip); if ``quit`` does not end it within its deadline, the pid it
wrote is killed: it is this test's daemon, no other.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time

BINARY = "nvidia-cuda-mps-control"
PID_FILE = "nvidia-cuda-mps-control.pid"
"""Where the control daemon writes its pid, in its pipe folder."""


def pe_share(world: int) -> int:
    """Each PE's ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``: the PEs of one GPU must sum to
    at most 100 for NVSHMEM to run them in full mode."""
    return 100 // world


class PrivateMps:
    """An MPS control daemon in a temporary folder of its own, for one ``with``.

    ``reason``: why MPS is not running (``None`` when it is); ``env``: the variables
    that make a process its client (give them to the ranks' environment: the test's
    ``monkeypatch.setenv``, which undoes them after)."""

    def __init__(self, binary: str = BINARY, timeout_s: float = 20.0) -> None:
        self.binary = binary
        self.timeout_s = timeout_s
        self.reason: str | None = None
        self.env: dict[str, str] = {}
        self._root: str | None = None
        self._started = False

    def __enter__(self) -> PrivateMps:
        path = shutil.which(self.binary)
        if path is None:
            self.reason = f"{self.binary} is not on PATH: no CUDA MPS, so NVSHMEM would run several PEs per GPU limited"
            return self
        self._root = tempfile.mkdtemp(prefix="isp_mps_")
        self.env = {
            "CUDA_MPS_PIPE_DIRECTORY": os.path.join(self._root, "pipe"),
            "CUDA_MPS_LOG_DIRECTORY": os.path.join(self._root, "log"),
        }
        for folder in self.env.values():
            os.makedirs(folder)
        said = os.path.join(self._root, "start.txt")  # a file, not a pipe: the daemon may keep it open
        try:
            with open(said, "w") as out:
                res = subprocess.run(
                    [path, "-d"], env={**os.environ, **self.env}, stdin=subprocess.DEVNULL, stdout=out,
                    stderr=subprocess.STDOUT, timeout=self.timeout_s,
                )  # fmt: skip
        except (OSError, subprocess.TimeoutExpired) as exc:
            self._started = True
            self.reason = f"{self.binary} -d failed: {exc}"
        else:
            self._started = True  # it may have forked a daemon even when it says it failed: stop it anyway
            if res.returncode:
                with open(said) as f:
                    self.reason = f"{self.binary} -d exited {res.returncode}: {f.read().strip()[-300:]}"
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        """``quit`` to the daemon (it ends its server too), then its folders go."""
        if self._started:
            self._started = False
            self._quit()
        if self._root is not None:
            shutil.rmtree(self._root, ignore_errors=True)
            self._root = None

    def _pid(self) -> int | None:
        try:
            with open(os.path.join(self.env["CUDA_MPS_PIPE_DIRECTORY"], PID_FILE)) as f:
                return int(f.read().strip())
        except (OSError, ValueError):
            return None

    def _quit(self) -> None:
        pid = self._pid()
        try:
            subprocess.run(
                [self.binary], input="quit\n", env={**os.environ, **self.env}, stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL, text=True, timeout=self.timeout_s,
            )  # fmt: skip
        except (OSError, subprocess.TimeoutExpired):
            pass
        if pid is None:
            return
        deadline = time.monotonic() + self.timeout_s
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if _alive(pid):  # our own daemon, by the pid it wrote in our folder
            os.kill(pid, signal.SIGKILL)


def stop_left_behind(tmp: str) -> list[int]:
    """Stop the daemons that :class:`PrivateMps` folders under ``tmp`` still hold (a
    test killed before its ``with`` ended): ``quit``, then a kill of the pid each
    wrote. Returns those pids. bench/gpu_check.py runs it after every step."""
    import glob

    stopped = []
    for pid_file in glob.glob(os.path.join(tmp, "isp_mps_*", "pipe", PID_FILE)):
        mps = PrivateMps()
        mps._root, mps._started = os.path.dirname(os.path.dirname(pid_file)), True
        mps.env = {
            "CUDA_MPS_PIPE_DIRECTORY": os.path.dirname(pid_file),
            "CUDA_MPS_LOG_DIRECTORY": os.path.join(mps._root, "log"),
        }
        pid = mps._pid()
        mps.stop()
        stopped += [pid] if pid is not None else []
    return stopped


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, exited but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def nvshmem_status() -> str:
    """NVSHMEM's init status in this process by name (``STATUS_NOT_INITIALIZED`` before
    init, ``STATUS_FULL_MPG`` or ``STATUS_LIMITED_MPG`` for several PEs on one GPU).
    ``nvshmem.core.init_status()`` returns the binding's plain int (``cpdef int`` in
    nvshmem4py 0.4.1), so the name comes from its ``InitStatus`` enum."""
    import nvshmem.core

    return nvshmem.core.InitStatus(nvshmem.core.init_status()).name
