"""Processes that never outlive the one that started them.

A launched rank, a calibration and the isp-train runs a calibration measures all ask
the kernel for SIGKILL when their parent dies (``prctl(PR_SET_PDEATHSIG)``), with a
thread checking the parent as a fallback. Without it, a launcher or a ``--plan``
that is killed leaves them running: ranks that keep training, a calibration that
keeps loading the cores the next one times. SIGKILL, not SIGTERM: a job that is
killed stops, and writes no checkpoint after the kill.

A child opts in where it starts (:func:`die_with_parent`), or when its parent set
:data:`DIE_WITH_PARENT_ENV` in its environment (:func:`die_with_parent_if_asked`):
``preexec_fn`` would do it before ``exec``, but is unsafe in a process with threads.

A process that has no handlers of its own yet, or is leaving after a failure it has
reported, answers Ctrl-C and SIGTERM with a quiet exit (:func:`leave_on_signals`).

The cores a process may run on (:func:`usable_cores`: its affinity, capped by its
container's CPU quota) size what shares them: a plan's ranks, and how long the
shared-memory backend's waiting ranks yield before they sleep.

[Note: a signal while a child starts]
A SIGINT or SIGTERM that reaches a rank while its interpreter starts (the launcher
forwards its Ctrl-C; ranks run in sessions of their own), before any line of ours
runs, is a ``KeyboardInterrupt`` inside the ``site`` import: "Fatal Python error:
init_import_site" and a traceback from each such rank (CI, at 2 s after a launch
whose ranks were just starting, 2026-12-03). Nothing a child runs can be early
enough; what it inherits is. A signal mask is kept across ``fork`` and ``exec``, so
the launcher starts its ranks with SIGINT and SIGTERM blocked
(:func:`children_start_with_stops_blocked`): a signal in that window waits, pending,
and :func:`leave_on_signals`, the rank's first code, unblocks them once its handler
is set, when the handler takes it. The launcher itself keeps taking them: they are
blocked in its main thread (the one that starts the ranks) and the threads it starts
meanwhile, and one thread of its own leaves them open; the kernel hands the signal to
that thread, and Python runs the handler in the main thread as ever, once that thread
next takes the GIL: after a sleep it is in (the agent's 0.1 s monitor loop, the
rendezvous's waits of up to a second), not during it. Under a bare torchrun the ranks
start unblocked, and the window is open.

[Note: a signal inside an import]
A handler that raises runs between two bytecodes of whatever the main thread is doing,
and for the seconds of torch's import that is a module's body. There the exception
may be caught (torch wraps numpy's import, Python wraps ``__set_name__``) and leave a
half-built module behind: the next import of it fails with a traceback of its own
(``cannot load module more than once``, a ``RecursionError`` in numpy's
``__getattr__``). So a handler looks first at where it landed (:func:`importing`): a
process still starting leaves at once, there being nothing yet to release; a run
that has something to release raises a moment later, once the import is done.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from types import FrameType

PR_SET_PDEATHSIG = 1
DIE_WITH_PARENT_ENV = "ISP_COMM_DIE_WITH_PARENT"
"""Set to ``1`` by a parent for a child that must die with it."""


def die_with_parent(poll_s: float = 0.5) -> None:
    """SIGKILL this process when its parent dies (Linux prctl), with a polling thread
    as the fallback where prctl is missing or the parent died before it was set."""
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass  # not Linux: the thread below still does it
    if os.getppid() != parent or parent == 1:  # it died before prctl took effect
        os.kill(os.getpid(), signal.SIGKILL)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="isp-parent-watch", daemon=True).start()


def die_with_parent_if_asked() -> None:
    """:func:`die_with_parent` when the parent asked for it (:data:`DIE_WITH_PARENT_ENV`)."""
    if os.environ.get(DIE_WITH_PARENT_ENV) == "1":
        die_with_parent()


def shutting_down(frame: FrameType | None) -> bool:
    """Whether ``frame`` is the interpreter's shutdown, joining the threads left
    (``threading._shutdown``): an exception raised there is printed with a traceback
    ("Exception ignored in ... threading"), not propagated."""
    while frame is not None:
        if frame.f_code.co_name == "_shutdown" and frame.f_code.co_filename.endswith("threading.py"):
            return True
        frame = frame.f_back
    return sys.is_finalizing()


def in_exit_callback(frame: FrameType | None) -> bool:
    """Whether ``frame`` runs in an exit callback (``atexit``, a ``weakref.finalize``
    at exit): the interpreter calls those on its way out, with no frame of the program
    beneath them (the main thread's stack otherwise starts at the program's module, or
    at ``runpy`` for ``python -m``, or at threading's shutdown)."""
    bottom = None
    while frame is not None:
        bottom, frame = frame, frame.f_back
    return bottom is not None and bottom.f_code.co_name not in ("<module>", "_run_module_as_main", "_shutdown")


def importing(frame: FrameType | None) -> bool:
    """Whether ``frame``, where a signal handler interrupted the main thread, runs
    inside an import (see [Note: a signal inside an import])."""
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


class AfterImport:
    """For a handler about to raise: a signal that lands inside an import is sent again
    50 ms later, so that the handler raises outside it; for ``limit_s`` at most, after
    which it raises where it is (a program run from inside an import, ``python -c
    "import job"``, stays inside one)."""

    def __init__(self, limit_s: float = 2.0) -> None:
        self.limit_s = limit_s
        self._since: float | None = None  # when the signal being put off first came

    def defer(self, signum: int, frame: FrameType | None) -> bool:
        """True when ``signum`` is put off (sent again in 50 ms): the handler returns."""
        if not importing(frame):
            self._since = None
            return False
        now = time.monotonic()
        self._since = now if self._since is None else self._since
        if now - self._since >= self.limit_s:
            return False
        again = threading.Timer(0.05, os.kill, args=(os.getpid(), signum))
        again.daemon = True
        again.start()
        return True


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
"""The signals that stop a run: Ctrl-C, and a scheduler's or a launcher's SIGTERM."""


def leave_on_signals(code: int | None = None, said: Callable[[int], str] | None = None) -> None:
    """Ctrl-C and SIGTERM end this process quietly (``SystemExit``, through every
    ``finally``) with ``code``, or 128 + the signal: for a process between its start
    and its own handlers, or on its way out after a failure it has reported, where a
    handler that raises something else (a ``KeyboardInterrupt``) prints a traceback.
    ``said``: the signal's number to the one line printed first (to stderr), once (a
    second Ctrl-C while the first unwinds says nothing more), for a process that must
    say why it stops (a launcher before its ranks start, a process alone).
    Inside an import it leaves at once (``os._exit``): a process still starting has
    nothing to release; so does one already shutting down (the launcher's SIGTERM to a
    rank joining its last threads after it reported its failure), which has released it.
    In an exit callback the signal is let go: the process is leaving with its own
    status, and the callbacks after it still release what they hold (raised there, the
    ``SystemExit`` was printed as "Exception ignored in atexit callback", a traceback)."""

    to_say = [] if said is None else [said]

    def leave(signum: int, frame: FrameType | None) -> None:
        status = 128 + signum if code is None else code
        if in_exit_callback(frame):
            return
        while to_say:  # taken before it is printed: a signal during the print says nothing more
            with contextlib.suppress(Exception):  # a closed pipe; a print this interrupted
                print(to_say.pop()(signum), file=sys.stderr, flush=True)
        if importing(frame) or shutting_down(frame):
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):  # a closed pipe; a print this interrupted
                    stream.flush()
            os._exit(status)
        raise SystemExit(status)

    for sig in STOP_SIGNALS:
        signal.signal(sig, leave)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)  # [Note: a signal while a child starts]


_receiver: list[threading.Thread] = []  # this process's thread that takes STOP_SIGNALS, once made


def _take_stops() -> None:
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    threading.Event().wait()  # forever: the kernel hands the signals here, Python's handler runs in the main thread


@contextlib.contextmanager
def children_start_with_stops_blocked() -> Iterator[None]:
    """Inside, processes this thread starts begin with :data:`STOP_SIGNALS` blocked, and
    this process still takes them (see [Note: a signal while a child starts])."""
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("children_start_with_stops_blocked: from the main thread, where handlers run")
    before = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        if not _receiver:  # made while they are blocked here, it opens them for itself
            receiver = threading.Thread(target=_take_stops, name="isp-comm-stop-signals", daemon=True)
            receiver.start()
            _receiver.append(receiver)
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


def usable_cores(cgroup_root: str = "/sys/fs/cgroup") -> int:
    """The cores this process may run on: its CPU affinity, capped by the CPU quota of
    its cgroup (a container's ``--cpus``, a Kubernetes limit), which the affinity does
    not show: a container limited to 2 CPUs on a 64-core host sees 64 in its affinity,
    and a plan would give each of its ranks a core of its own. Reads cgroup v2's
    ``cpu.max`` (of the process's own cgroup, else the root's) or v1's CFS quota."""
    n = len(os.sched_getaffinity(0))
    own = ""
    try:
        with open("/proc/self/cgroup") as f:
            own = next((line.strip()[3:] for line in f if line.startswith("0::")), "")
    except OSError:
        pass
    candidates = [os.path.join(cgroup_root, own.lstrip("/"), "cpu.max"), os.path.join(cgroup_root, "cpu.max")]
    candidates += [os.path.join(cgroup_root, v1, "cpu.cfs_quota_us") for v1 in ("cpu", "cpu,cpuacct")]
    for path in candidates:
        try:
            with open(path) as f:
                fields = f.read().split()
            if path.endswith("cpu.max"):
                quota, period = fields[0], int(fields[1])
            else:
                with open(os.path.join(os.path.dirname(path), "cpu.cfs_period_us")) as f:
                    quota, period = fields[0], int(f.read().strip())
            if quota in ("max", "-1"):
                return n
            if period > 0 and int(quota) > 0:
                return max(1, min(n, math.ceil(int(quota) / period)))
        except (OSError, IndexError, ValueError):  # absent, or not what the kernel writes: the affinity
            continue
    return n
