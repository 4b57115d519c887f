"""``isp-train --nproc-per-node N``: isp-train launches its own ranks, so one command
needs no torchrun, and its failures stay one line.

The ranks are started through torch's elastic launcher API (what torchrun runs), with
``--max-restarts`` (default 0). A rank that fails has printed its one line (rank 0 prints, see
``config.fail``); the launcher then adds nothing and exits 2. A signal (Ctrl-C, or the
SIGTERM of a preemption) reaches every rank: each saves at the next step boundary
when ``--save-on-signal`` is on and leaves with one line (rank 0), and the launcher
exits with 128 + the signal's number, quietly (see :class:`Stopping` for ranks that
take long, or never stop). Before any rank has started, the launcher says so itself,
in one line, and exits with the same code.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import uuid
from datetime import timedelta
from typing import TYPE_CHECKING

from isp_comm.backends.shm import owners_gone
from isp_comm.processes import AfterImport, children_start_with_stops_blocked
from isp_comm.train.survive import ARMED_ENV, ARMED_FILE, stopped_before_ranks, stopped_before_training

if TYPE_CHECKING:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

LAUNCH_FLAGS = ("nproc_per_node", "nnodes", "rdzv_endpoint", "max_restarts")
"""TrainConfig fields that the launcher consumes (the ranks never see them)."""


def worker_argv(argv: list[str]) -> list[str]:
    """``argv`` without the launch flags (``--flag value`` and ``--flag=value``)."""
    flags = {"--" + f.replace("_", "-") for f in LAUNCH_FLAGS}
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in flags:
            skip = "=" not in arg
            continue
        out.append(arg)
    return out


def failed_job_exit(exc: ChildFailedError) -> int:
    """The launcher's exit code for a job whose ranks failed, from the first failure:
    a rank that caught a signal (saved, then left with 128 + its number) ended the job,
    though the ranks the launcher stopped after it may die of its SIGTERM (-15); any
    other failure is 2. A rank killed by a signal before anything failed (the
    out-of-memory killer) could not say why, and the ranks stopped after it do not: one
    line names it, and says whether the rank crashed (:data:`CRASH_SIGNALS`)."""
    rank, first = first_failure(exc)
    if first.exitcode < 0:
        name = first.signal_name()
        said = (
            f"rank {rank} crashed ({name}: a fault inside the rank, in native code; its threads' Python stacks "
            "at the crash are above, from faulthandler)"
            if name in CRASH_SIGNALS
            else f"rank {rank} was killed by {name} (from outside the job: the system's out-of-memory killer, "
            "a scheduler or a user)"
        )
        print(f"isp-train: error: {said}; the other ranks were stopped", file=sys.stderr)
    return first.exitcode if first.exitcode > 128 else 2


def first_failure(exc: ChildFailedError) -> tuple[int, ProcessFailure]:
    """The failure that ended the job. torch's is the earliest stamped, but a rank that
    died of a signal left no error file, so its stamp is when the agent saw it, after
    the peer that lost it raised (in the same whole second, or the next): the peer's
    error came first and the death went unnamed. A rank dead of a signal the launcher
    does not send (not SIGTERM or SIGINT) seen within :data:`SEEN_WITHIN_S` of a first
    failure that was an error (exit 1 to 127) is taken as the cause."""
    rank, first = exc.get_first_failure()
    if not 0 < first.exitcode < 128:
        return rank, first
    dead = [
        (f.timestamp, r)
        for r, f in exc.failures.items()
        if f.exitcode < 0
        and f.signal_name() not in ("SIGTERM", "SIGINT")
        and f.timestamp - first.timestamp <= SEEN_WITHIN_S
    ]
    if not dead:
        return rank, first
    cause = min(dead)[1]
    return cause, exc.failures[cause]


SEEN_WITHIN_S = 5
"""Seconds after a rank's error within which a peer's death by a signal is taken as its
cause (the agent polls its ranks every 0.1 s; stamps are whole seconds)."""


def rendezvous_failure(exc: BaseException, endpoint: str) -> str:
    """What stopped the launch before any rank ran, with every message of the
    exception's chain (torch's outer one says only "See inner exception for details",
    which the user never sees) and, for the rendezvous store, what usually causes it."""
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError, RendezvousTimeoutError

    said, seen = [], exc
    while seen is not None and len(said) < 4:
        lines = str(seen).replace("See inner exception for details.", "").strip().splitlines()
        text = lines[0].rstrip(". ") if lines else ""
        if text and text not in said:
            said.append(text)
        seen = seen.__cause__ or seen.__context__
    found = ": ".join(said) or type(exc).__name__
    if isinstance(exc, RendezvousConnectionError | RendezvousTimeoutError) and endpoint:
        found += (
            f". The rendezvous store at --rdzv-endpoint {endpoint} could not be reached or hosted: another process "
            "may hold that port (an earlier run still going, or another server; choose a free port), or the "
            "machine hosting it is not up or not reachable from here"
        )
    return found


# [Note: a rendezvous port whose holder never answers] torch's rendezvous asks the
# store at the endpoint to answer its handshake and waits for the answer in C++ with no
# timeout that holds: a port held by a process that accepts connections and never
# answers (another program, a stuck earlier run) kept the launcher waiting for as long
# as that process lived, deaf to Ctrl-C (its main thread never came back to Python),
# and it ended in C++ stack frames. The launcher therefore asks first, with torch's own
# client, in a thread it waits for at most ANSWER_S.

CONNECT_S = 3.0
"""Seconds a plain TCP connect may take: refused or unreachable, nothing is asked
(the agent hosts the store itself, or waits for the machine that hosts it)."""

ANSWER_S = 15.0
"""Seconds a store that accepted the connection has to answer torch's handshake: a
real one answers in milliseconds, also on a loaded machine."""


def endpoint_address(endpoint: str) -> tuple[str, int]:
    """The host and port torch's c10d rendezvous meets at: its own parser and default
    port (29400), so ``[::1]:7`` and ``host`` (no port) read as torch reads them."""
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import DEFAULT_PORT
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    return parse_rendezvous_endpoint(endpoint, default_port=DEFAULT_PORT)


def store_is_silent(endpoint: str, connect_s: float = CONNECT_S, answer_s: float = ANSWER_S) -> bool:
    """Whether something at ``endpoint`` accepts TCP connections but gives torch's
    TCPStore client no answer within ``answer_s``. False for anything else (nothing
    there, a host not up, a name that does not resolve, a store that answers, or one
    that fails the handshake at once): the rendezvous then goes as torch decides and
    reports. The client runs in a daemon thread, so a Ctrl-C (``launch.Stopping``)
    still reaches the caller while it waits; one that never returns ends with the
    process."""
    import torch.distributed as dist

    try:
        host, port = endpoint_address(endpoint)
    except ValueError:  # torch's launch says so itself
        return False
    if port == 0:  # "any free port": nothing to meet there yet
        return False
    try:
        with socket.create_connection((host, port), timeout=connect_s):
            pass
    except OSError:
        return False
    done = threading.Event()

    def ask() -> None:
        try:  # its own timeout longer than the wait: the wait decides, whether or not it holds
            dist.TCPStore(host, port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=2 * answer_s))
        except Exception:  # an answer, though not a store's: torch's rendezvous reports it
            pass
        done.set()

    threading.Thread(target=ask, name="isp-train-rdzv-probe", daemon=True).start()
    return not done.wait(answer_s)


def silent_store_failure(endpoint: str, answer_s: float = ANSWER_S) -> str:
    """Why the launch stopped, for :func:`store_is_silent`'s endpoint."""
    return (
        f"the rendezvous store at --rdzv-endpoint {endpoint} did not answer within {answer_s:.0f} s: something holds "
        "that port and accepts connections but does not answer as a rendezvous store (another program, or a stuck "
        "earlier run); choose a free port"
    )


CRASH_SIGNALS = frozenset({"SIGSEGV", "SIGBUS", "SIGFPE", "SIGILL", "SIGABRT"})
"""Signals a rank raises on itself when it crashes (a bad memory access, an abort in C++
code), not ones sent from outside; a rank prints its Python stacks on them (its
faulthandler, enabled in ``rank_main``)."""


NOTICE_S = 5.0
"""Seconds after a signal before the launcher says what it waits for: a healthy run's
ranks have saved and left by then, with their one line."""


class Stopping:
    """The launcher's answer to Ctrl-C and SIGTERM, in place of the elastic agent's own.

    The first signal goes the agent's way (its ``SignalException``): the agent forwards
    it to the ranks, which finish their step (and save, with ``--save-on-signal``), and
    waits for them up to its shutdown timeout (``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``, 30 s)
    before it kills them. Ranks still running ``NOTICE_S`` later get one line saying
    so, and ranks killed at the timeout another: a rank stuck in a collective or a
    save was otherwise 30 s of silence and an exit without a word. A second signal
    leaves at once: the ranks die with the launcher (:mod:`isp_comm.processes`).
    A signal before any rank started (the rendezvous, waiting for the other machines)
    has no rank to say why the run stopped: the launcher says it, in one line; so it
    does when its ranks had started but not set the run's handlers (torch's import),
    where they leave quietly (:data:`survive.ARMED_ENV`).
    """

    def __init__(self, grace_s: float) -> None:
        self.grace_s, self.signum, self.at = grace_s, 0, 0.0
        self.logs = ""
        """The agent's folder (:func:`agent_folder`), once made: it holds something
        once the agent has started ranks (their attempt's folder)."""
        self.ranks_started = True
        self._notice: threading.Timer | None = None
        self._after_import = AfterImport()

    def arm(self) -> None:
        """Take SIGINT and SIGTERM from here on: called first thing inside the ``try``
        that answers its ``SignalException``, so that no signal finds it armed outside
        (one in the agent's folder or its config escaped as a traceback). Until then,
        the process's earlier handler answers (``leave_on_signals``: one line, exit 128
        + the signal)."""
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame) -> None:
        from torch.distributed.elastic.multiprocessing.api import SignalException

        name = signal.Signals(signum).name
        if not self.signum and self._after_import.defer(signum, frame):  # [Note: a signal inside an import]
            return
        if self.signum:  # the second: not one more wait
            said = f"isp-train: {name} again: stopped at once, the ranks killed; no checkpoint"
            print(said, file=sys.stderr, flush=True)
            os._exit(128 + self.signum)
        self.signum, self.at = signum, time.monotonic()
        self.ranks_started = self._any_rank_started()
        if self.ranks_started:  # else no rank to wait for: the agent returns at once
            self._notice = threading.Timer(NOTICE_S, self._waiting, args=(name,))
            self._notice.daemon = True
            self._notice.start()
        raise SignalException(f"isp-train got {name}", sigval=signal.Signals(signum))

    def _any_rank_started(self) -> bool:
        """Whether the agent has started ranks in this launch (this attempt or an
        earlier one of ``--max-restarts``): it makes their attempt's folder in
        :attr:`logs` as it starts them. Unreadable: taken as started (no line)."""
        if not self.logs:
            return False
        try:
            return bool(os.listdir(self.logs))
        except OSError:
            return True

    def _ranks_armed(self) -> bool:
        """Whether this machine's ranks set the run's own handlers in this launch (the
        file :func:`survive.say_armed` makes): from then on rank 0 says why a run
        stops. A restart's ranks find it made by the attempt before them."""
        return os.path.exists(os.path.join(self.logs, ARMED_FILE))

    def _waiting(self, name: str) -> None:
        print(
            f"isp-train: {name}: waiting up to {self.grace_s:.0f} s for the ranks to finish their step (and save, "
            "with --save-on-signal); a second Ctrl-C or SIGTERM stops them at once",
            file=sys.stderr,
            flush=True,
        )

    def exit_code(self, signum: int) -> int:
        """128 + the signal, after one line when the ranks were killed at the timeout,
        none had started, or none had set the run's handlers.
        ``signum``: the agent's, for a signal it handled itself (SIGHUP, SIGQUIT: a
        closed terminal), which ends the ranks and the launcher without a wait."""
        if self._notice is not None:
            self._notice.cancel()
        if not self.signum:
            return 128 + int(signum)
        name = signal.Signals(self.signum).name
        if not self.ranks_started:
            print(stopped_before_ranks(self.signum), file=sys.stderr, flush=True)
        elif not self._ranks_armed():  # they left quietly, still importing torch or meeting
            print(stopped_before_training(self.signum), file=sys.stderr, flush=True)
        elif time.monotonic() - self.at >= self.grace_s:
            print(
                f"isp-train: error: ranks had not stopped {self.grace_s:.0f} s after {name} and were killed, without "
                "a checkpoint of this step: a rank stuck in a collective (on a peer that hangs, or one that left "
                "before the signal was armed), or a save longer than the wait (TORCH_ELASTIC_SHUTDOWN_TIMEOUT sets it)",
                file=sys.stderr,
                flush=True,
            )
        return 128 + self.signum


AGENT_PREFIX = "isp-train-agent-"
"""The agent's folder in the temp dir: ``isp-train-agent-PID-XXXX``, PID the launcher's."""


def agent_folder() -> str:
    """A new folder for the agent's error files (it reads a failed rank's there; left
    to itself it makes one in the temp dir per run and never removes it), after
    removing those of launchers that are gone: :func:`launch` removes its own at the
    end, but a launcher killed with SIGKILL (a scheduler, or a calibration's run whose
    ``--plan`` was killed: see ``isp_comm.processes``) cannot."""
    temp = tempfile.gettempdir()
    for name in owners_gone(temp, AGENT_PREFIX, "-"):
        shutil.rmtree(os.path.join(temp, name), ignore_errors=True)
    return tempfile.mkdtemp(prefix=f"{AGENT_PREFIX}{os.getpid()}-", dir=temp)


def launch(nproc: int, nnodes: int, rdzv_endpoint: str, argv: list[str], max_restarts: int = 0) -> int:
    """Run ``python -m isp_comm.train ARGV`` on ``nproc`` local ranks (of ``nnodes``
    machines meeting at ``rdzv_endpoint``), restarted up to ``max_restarts`` times
    after a failure (each restart resumes: ``TORCHELASTIC_RESTART_COUNT`` > 0 makes the
    ranks ``--resume auto``); returns the exit code for this process."""
    from torch.distributed.elastic.multiprocessing.api import DefaultLogsSpecs, SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    for name in list(logging.root.manager.loggerDict):  # the launcher's own warnings and tracebacks
        if name.startswith(("torch.distributed.elastic", "torch.distributed.launcher")):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if nnodes > 1 and max_restarts > 0:
        # A fresh store for each attempt, hosted by rank 0, rather than the agent's shared
        # one: across machines the restart counts that survive.restart_store prefixes
        # keys with can differ (an agent restarting for a peer machine does not count it).
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    grace_s = float(os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", 30))  # what the agent waits (its default)
    stopping, logs = Stopping(grace_s), ""
    try:  # armed inside: a signal while the folder and the config are made is answered too
        stopping.arm()
        logs = stopping.logs = agent_folder()
        os.environ[ARMED_ENV] = os.path.join(logs, ARMED_FILE)  # the ranks' word that their handlers are set
        config = LaunchConfig(
            logs_specs=DefaultLogsSpecs(log_dir=logs),
            signals_to_handle="SIGHUP,SIGQUIT",  # SIGINT and SIGTERM: Stopping's
            min_nodes=nnodes,
            max_nodes=nnodes,
            nproc_per_node=nproc,
            run_id="isp-train" if nnodes > 1 else str(uuid.uuid4()),  # every machine names the same run
            rdzv_backend="c10d",
            rdzv_endpoint=rdzv_endpoint or "localhost:0",
            max_restarts=max_restarts,
            monitor_interval=0.1,
        )
        if rdzv_endpoint and store_is_silent(rdzv_endpoint):  # torch would wait on it, deaf to Ctrl-C
            print(
                f"isp-train: error: launching {nproc} ranks failed: {silent_store_failure(rdzv_endpoint)}",
                file=sys.stderr,
            )
            return 2
        with children_start_with_stops_blocked():  # [Note: a signal while a child starts]
            elastic_launch(config, entrypoint=sys.executable)("-m", "isp_comm.train", *argv)
    except ChildFailedError as exc:
        return failed_job_exit(exc)
    except SignalException as exc:
        return stopping.exit_code(exc.sigval)
    except Exception as exc:  # the rendezvous: an endpoint that cannot be reached, a port in use
        print(
            f"isp-train: error: launching {nproc} ranks failed: {rendezvous_failure(exc, rdzv_endpoint)}",
            file=sys.stderr,
        )
        return 2
    finally:
        if logs:
            shutil.rmtree(logs, ignore_errors=True)
    return 0
