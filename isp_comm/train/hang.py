"""isp-train's side of a hang (see :mod:`isp_comm.flight`): how a run that timed out
ends, and the test-only fault that makes one.

[Note: ending a hung job]
The waiting ranks leave at their deadline plus the diagnosis's few seconds, with one
line (the rank that printed the diagnosis) and exit code 1, without a traceback. The
launcher (torchrun, or isp-train's own) then sends SIGTERM to the ranks still there
and SIGKILL 30 s later: a stopped rank ignores SIGTERM but not SIGKILL, so the job
ends within the deadline plus about a minute. A rank that would survive its launcher
dies with it (``isp_comm.processes.die_with_parent``).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from collections.abc import Callable
from typing import NoReturn

import torch

from isp_comm.errors import ISPCommTimeout
from isp_comm.flight.diagnosis import HANG_TXT

FAULT_ENV = "ISP_TEST_HANG"
"""Test-only: ``stop:RANK:STEP`` makes rank RANK stop itself (SIGSTOP) before step STEP;
``extra:RANK:STEP`` makes it run one extra forward at that step (its collectives then
differ from the others'); ``oom:RANK:STEP`` makes it ask the allocator for a petabyte
at the step's first forward (a real refusal, CUDA's or the CPU's). Used by
tests/test_flight.py and tests/test_survive.py; never set it in a real run."""


def inject_fault(rank: int, step: int, forward: Callable[[], object], device: torch.device) -> None:
    """Test-only (:data:`FAULT_ENV`): the fault it asks for, at its rank and step."""
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    kind, at_rank, at_step = spec.split(":")
    if rank != int(at_rank) or step != int(at_step):
        return
    if kind == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif kind == "extra":
        with torch.no_grad():
            forward()
    elif kind == "oom":
        torch.empty(2**50, dtype=torch.uint8, device=device)
    else:
        raise ValueError(f"{FAULT_ENV}: unknown fault {kind!r} (stop, extra or oom)")


def raise_if_peer_lost(exc: RuntimeError, rank: int, where: str, comm_timeout: float) -> None:
    """A wait outside the communicator (the set-up's groups and checks, a checkpoint's
    commit) that passed the process group's timeout or lost its peer, as an
    ``ISPCommTimeout`` with one line naming ``where``: it ended in torch's 30- to 80-line
    traceback on every waiting rank (a peer stopped while the model was wrapped, or
    killed while a save was committed; seen by an outside review). No flight record
    covers such a wait, so the peer is not named here (the launcher names a dead one)."""
    said = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
    if not isinstance(exc, torch.distributed.DistError) and "/gloo/" not in said:
        return
    quiet_after_hang()
    raise ISPCommTimeout(
        f"rank {rank}: {where} waited past {comm_timeout + 60:.0f} s (--comm-timeout + 60 s) or lost a peer: a "
        f"peer rank stopped, stuck or died there (its own line, if any, is above); torch: {said}"
    ) from exc


def quiet_after_hang() -> None:
    """After a hang, the communicator's close would warn that buffers a collective may
    still use are kept (a note for a program that goes on); the run ends instead, so
    isp-train's output stays one line plus the diagnosis."""
    logging.getLogger("isp_comm").setLevel(logging.ERROR)


def hang_exit(exc: ISPCommTimeout, out: str) -> NoReturn:
    """One line on the rank that printed the diagnosis (every rank when none could be
    made), then exit 1: see [Note: ending a hung job]."""
    first = str(exc).splitlines()[0]
    if exc.told:
        print(f"isp-train: stopped: {first}; the diagnosis above is in {os.path.join(out, HANG_TXT)}", file=sys.stderr)
    elif exc.diagnosis is None:
        print(f"isp-train: stopped: {first}", file=sys.stderr)
    sys.stderr.flush()
    sys.stdout.flush()
    os._exit(1)  # not sys.exit: the process group's teardown would wait on the stuck collective
