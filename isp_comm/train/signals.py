"""How a run answers Ctrl-C and SIGTERM (a preemption): noted and answered at the step
boundary with a checkpoint (``--save-on-signal``), or a stop at once without one."""

from __future__ import annotations

import signal

from isp_comm.processes import AfterImport


class Interrupted(Exception):
    """A signal arrived and a checkpoint was saved at the step boundary."""

    def __init__(self, step: int, signum: int) -> None:
        super().__init__(f"interrupted at step {step}; checkpoint step_{step:06d}")
        self.step, self.signum = step, int(signum)


class Stopped(BaseException):
    """A signal with --no-save-on-signal: the run leaves at once, through every
    ``finally`` (the communicator, its segments), with one line and no checkpoint."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name}; no checkpoint (--no-save-on-signal)")
        self.signum = int(signum)


class Signals:
    """With ``armed``: Ctrl-C and SIGTERM are noted (``got``), not raised, so the step
    in progress finishes, a checkpoint is saved and the run leaves with one line.
    Without: they raise ``Stopped`` (never a KeyboardInterrupt traceback)."""

    def __init__(self, armed: bool) -> None:
        self.armed, self.got = armed, 0
        self._after_import = AfterImport()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._note if armed else self._stop)

    def _note(self, signum: int, _frame) -> None:
        self.got = signum

    def _stop(self, signum: int, frame) -> None:
        if self._after_import.defer(signum, frame):  # [Note: a signal inside an import]
            return
        # once: the launcher follows a Ctrl-C with a SIGTERM to every worker, which would
        # raise again in the middle of the first one's way out (a traceback)
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._note)
        raise Stopped(signum)
