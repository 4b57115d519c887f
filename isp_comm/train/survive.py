"""What keeps a run from outliving its launcher, or sharing its folder with another.

* (:func:`isp_comm.processes.die_with_parent`) a rank launched by torchrun or
  ``isp-train --nproc-per-node`` dies with its launcher. torch >= 2.13 starts each
  worker in a session of its own, so a signal to the launcher's process group no
  longer reaches the ranks; without this a killed launcher leaves them training.
* ``lock_folder``: one live run per ``--out`` (``fcntl.flock``, released by the kernel
  when the holder dies, so a killed run never leaves a stale lock).
* ``remove_stale_segments``: shared-memory segments of isp-comm jobs whose creator is gone.
* ``restart_store``: a restarted rank's process groups meet under keys of their own
  attempt. torch's elastic agent (torchrun, ``isp-train --nproc-per-node``) hands its
  workers one TCPStore for the whole job (``TORCHELASTIC_USE_AGENT_STORE``), and
  nothing prefixes the workers' keys per attempt: attempt 1's gloo rendezvous finds
  the addresses that attempt 0's ranks published, connects to a dead rank's port and
  fails ("Connection refused"), or not, depending on which rank writes first.
* ``no_restart`` / ``restart_refused``: a rank that failed before its first step on
  a mistake is not restarted (see [Note: no restart for a mistake]).
* ``stopped_before_ranks``: the one line of isp-train's launcher stopped by a signal
  before any rank started (the ranks say why a run stops once they run; before them,
  nobody did), and ``launcher_asked``: whether the command line asks for that launcher.
* ``stopped_before_training``: its line when its ranks had started but not yet set
  the run's own handlers (torch's import, the rendezvous), and ``say_armed``: a
  rank's word to it that they are set (:data:`ARMED_ENV`); a process alone says it too.
* ``said_before_handlers``: which of those lines a process says when a signal stops
  it before its own handlers, from its command line (none for a launcher's rank).

Imports nothing heavy: a restarted rank asks :func:`restart_refused` before torch loads.
"""

from __future__ import annotations

import fcntl
import os
import signal
import socket
import sys
from typing import IO, TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch.distributed as dist

LOCK_NAME = ".isp-train.lock"
RESTART_PREFIX = "isp-train/attempt_"
NO_RESTART = "isp-train-no-restart"
"""The file, in the elastic agent's folder of the run, that says an attempt failed on a
mistake: its number."""


def lock_folder(out: str) -> IO[str]:
    """Take ``out``'s lock for this process (kept while the returned file is open);
    a ``ValueError`` naming the holder's pid and host when another run has it."""
    try:
        os.makedirs(out, exist_ok=True)
        f = open(os.path.join(out, LOCK_NAME), "a+")
    except OSError as exc:
        raise ValueError(f"--out {out}: cannot create it ({exc.strerror or exc})") from exc
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "an unknown process"
        f.close()
        raise ValueError(f"--out {out} is in use by another isp-train run ({holder}); wait for it or stop it") from None
    f.seek(0)
    f.truncate()
    f.write(f"pid {os.getpid()} on host {socket.gethostname()}\n")
    f.flush()
    return f


def remove_stale_segments() -> None:
    """Unlink the segments of isp-comm jobs whose creating process is gone, saying so
    in one line (what ``isp-comm cleanup`` does by hand)."""
    from isp_comm.backends import shm

    stale = shm.stale_segments()
    for name in stale:
        shm.Segment.unlink(name)
    if stale:
        print(
            f"isp-train: removed {len(stale)} shared-memory segment(s) left by dead jobs from /dev/shm",
            file=sys.stderr,
            flush=True,
        )


def free_port() -> int:
    """A TCP port free on this host now (for a single-process run's store)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def restart_store() -> dist.Store | None:
    """The store a restarted rank gives ``init_process_group``: the elastic agent's
    shared store under ``isp-train/attempt_K`` (K = ``TORCHELASTIC_RESTART_COUNT``), so
    that no key written by an earlier attempt is read by this one. ``None`` (torch's
    own ``env://`` rendezvous, unchanged) for a first attempt, outside the elastic
    agent, or where the agent gives each attempt a fresh store
    (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``).

    K is the same on every rank of one agent. Across machines it is not: an agent
    restarts its healthy workers when a peer machine's failed, without counting a
    restart; so ``isp-train --nnodes N --max-restarts R`` turns the shared store off
    (``launch``), and a torchrun job over several machines needs that variable too."""
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if attempt == 0 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    import torch.distributed as dist
    from torch.distributed.constants import default_pg_timeout

    agent = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=default_pg_timeout
    )
    return dist.PrefixStore(f"{RESTART_PREFIX}{attempt}", agent)


# [Note: no restart for a mistake]
# torch's elastic agent (``--max-restarts K``, torchrun's or isp-train's launcher)
# restarts every rank after any failure: a crash, a lost peer, a hang, and also a
# mistake in the flags or the files (``--resume`` of a folder without a checkpoint, a
# model folder that does not load). A restart meets the mistake again, after loading
# everything again: on a large model, K times minutes, and K copies of its line. So a
# rank that fails with its one line before the run's first step (the flags, the
# model, the data, the checkpoint to resume) writes the attempt's number into
# :data:`NO_RESTART` in the agent's folder of this run, found from the error file it
# gives each rank (``TORCHELASTIC_ERROR_FILE``, ``RUN/attempt_N/LOCAL_RANK/error.json``);
# the agent cannot be told not to restart, so a restarted rank reads the file first,
# before torch loads, and leaves with exit 2 (0.1 s, not the attempt). One line, from
# the first attempt after it, says so. A failure later in the run restarts as before:
# a save that could not write, or anything that may not happen again. On several
# machines each agent has a folder of its own: the machine whose rank failed ends
# its attempts at once, the others meet no peer and restart with it.


def _agent_file() -> str | None:
    """:data:`NO_RESTART`'s path in this run's agent folder, or ``None`` outside an
    elastic agent (or one that keeps no error files)."""
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE", "")
    attempt_dir = os.path.dirname(os.path.dirname(error_file))
    if not error_file or not os.path.basename(attempt_dir).startswith("attempt_"):
        return None
    return os.path.join(os.path.dirname(attempt_dir), NO_RESTART)


def no_restart() -> None:
    """This rank failed on a mistake before the first step: no later attempt of the
    run starts ([Note: no restart for a mistake]). A no-op outside an elastic agent."""
    path = _agent_file()
    if path is None:
        return
    tmp = f"{path}.{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            f.write(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        os.replace(tmp, path)  # whole, as each failing rank writes it
    except OSError:
        pass  # the agent restarts as it would have


def restart_refused() -> None:
    """A restarted rank's first call: exit 2 if an earlier attempt failed on a mistake
    ([Note: no restart for a mistake]); the first local rank says so, once."""
    path = _agent_file()
    if path is None or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        return
    try:
        with open(path) as f:
            failed = int(f.read() or 0)
    except (OSError, ValueError):
        return
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    if attempt == failed + 1 and os.environ.get("LOCAL_RANK", "0") == "0":
        print(
            f"isp-train: no restart: attempt {failed} failed before its first step on a mistake that a restart "
            "would meet again (its line is above)",
            file=sys.stderr,
            flush=True,
        )
    raise SystemExit(2)


def stopped_before_ranks(signum: int) -> str:
    """What a launcher stopped by ``signum`` before any rank started says, as a rank 0
    says it once they run (``isp-train: stopped by SIGTERM; ...``): the exit code
    alone, 143 or 130, said nothing of why or how far the run got."""
    name = signal.Signals(signum).name
    return f"isp-train: stopped by {name} before any rank had started; nothing trained, no checkpoint"


def launcher_asked(argv: list[str] | None = None) -> bool:
    """Whether this process is isp-train's own launcher, as its command line says
    before torch's import and the flags' parsing: ``--nproc-per-node`` given, not a
    rank a launcher started (``LOCAL_RANK``) and not ``--plan`` (which starts none).
    A count only in a ``--config`` file is seen once the flags are parsed."""
    args = sys.argv[1:] if argv is None else argv
    names = {a.split("=", 1)[0] for a in args}
    return "--nproc-per-node" in names and "--plan" not in names and "LOCAL_RANK" not in os.environ


ARMED_ENV = "ISP_TRAIN_ARMED_FILE"
"""Set by isp-train's launcher for its ranks: the file, in its agent's folder, that its
local rank 0 makes as it sets the run's own signal handlers (:func:`say_armed`)."""

ARMED_FILE = "ranks-armed"
"""That file's name in the launcher's agent folder."""


def stopped_before_training(signum: int) -> str:
    """What a launcher whose ranks started but had not set the run's handlers says
    when ``signum`` stops it: its ranks, still importing torch or meeting, leave
    quietly (``leave_on_signals``), so the exit code, 130 or 143, said nothing."""
    name = signal.Signals(signum).name
    return f"isp-train: stopped by {name} before training started; nothing trained, no checkpoint"


def say_armed() -> None:
    """Tell isp-train's launcher (:data:`ARMED_ENV`; a bare torchrun sets none) that
    this machine's ranks have their run's own handlers, set just after this: from here
    rank 0 says why a run stops, and the launcher stays quiet. Before the handlers, not
    after: a signal in between leaves the run quiet rather than said twice."""
    path = os.environ.get(ARMED_ENV)
    if path and os.environ.get("LOCAL_RANK") == "0":
        try:
            open(path, "a").close()
        except OSError:  # the launcher's folder gone: it is past listening
            pass


def said_before_handlers(argv: list[str] | None = None) -> Callable[[int], str] | None:
    """The line isp-train says when a signal stops it before its own handlers (torch's
    import, the flags), for ``leave_on_signals``, from its command line: a launcher's
    :func:`stopped_before_ranks`; a process alone, or a launcher told its count only
    by ``--config`` (unread yet), :func:`stopped_before_training` (true of both); none
    for a launcher's rank (``LOCAL_RANK``: its launcher says it, once) or a ``--plan``
    (nothing to train). The exit code alone, 130 or 143, said nothing."""
    args = sys.argv[1:] if argv is None else argv
    if "LOCAL_RANK" in os.environ or "--plan" in {a.split("=", 1)[0] for a in args}:
        return None
    return stopped_before_ranks if launcher_asked(args) else stopped_before_training
