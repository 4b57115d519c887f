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
"""

from __future__ import annotations

import fcntl
import os
import socket
import sys
from typing import IO

import torch.distributed as dist

from isp_comm.backends import shm

LOCK_NAME = ".isp-train.lock"
RESTART_PREFIX = "isp-train/attempt_"


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
    from torch.distributed.constants import default_pg_timeout

    agent = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=default_pg_timeout
    )
    return dist.PrefixStore(f"{RESTART_PREFIX}{attempt}", agent)
