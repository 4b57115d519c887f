"""``isp-train --report-to``: the metrics where users watch a run, TensorBoard and
Weights & Biases, beside metrics.jsonl.

``names`` checks the flag (before any rank starts), ``scalars`` says what a tracker
receives (tags, which rows, the flags as hyperparameters), ``tensorboard_events`` and
``wandb_run`` write them. :class:`Reporters` is what the run holds: only the process
that writes metrics.jsonl opens one, and with ``--report-to none`` (the default) it
holds no tracker and nothing is written. This package imports nothing else of
isp-train: the run hands it plain values.
"""

from __future__ import annotations

from types import TracebackType

from isp_comm.train.reporting.names import parse_report_to
from isp_comm.train.reporting.scalars import is_reported, scalars
from isp_comm.train.reporting.tensorboard_events import TensorBoardEvents
from isp_comm.train.reporting.wandb_run import WandbRun

__all__ = ["Reporters", "parse_report_to"]

_KINDS = {"tensorboard": TensorBoardEvents, "wandb": WandbRun}


class Reporters:
    """The trackers of one run, fed each reported row of metrics.jsonl; a context
    manager that closes them with the run's exit code (W&B records it)."""

    def __init__(self, report_to: str, out: str, *, start: int, config: dict, log_every: int, last_step: int) -> None:
        """Open every tracker ``report_to`` names for the run folder ``out``, at step
        ``start`` (0 for a new run, else the checkpoint's step); ``config`` (the
        flags) is recorded once per run. A ``ValueError`` of one line when a tracker
        cannot start; those opened before it are closed."""
        self.log_every, self.last_step = log_every, last_step
        self.trackers: list = []
        try:
            for name in parse_report_to(report_to):
                self.trackers.append(_KINDS[name](out, start=start, config=config))
        except BaseException:
            self.close(exit_code=1)
            raise

    def log(self, row: dict) -> None:
        """Send ``row`` (a metrics.jsonl row) to every tracker, when it is a reported
        step (``scalars.is_reported``)."""
        if not self.trackers or not is_reported(row, log_every=self.log_every, last_step=self.last_step):
            return
        values = scalars(row)
        for tracker in self.trackers:
            tracker.log(row["step"], values)

    def close(self, exit_code: int = 0) -> None:
        """Flush and close every tracker, the run ending with ``exit_code`` (closing
        again does nothing)."""
        trackers, self.trackers = self.trackers, []
        for tracker in trackers:
            tracker.close(exit_code)

    def __enter__(self) -> Reporters:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        # a signal's stop (isp-train's Interrupted and Stopped carry signum) ends as 128 + signum
        signum = getattr(exc, "signum", None)
        self.close(exit_code=0 if exc is None else 128 + signum if isinstance(signum, int) else 1)
