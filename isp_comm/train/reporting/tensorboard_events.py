"""TensorBoard event files under ``OUT/tensorboard/``, through ``torch.utils.tensorboard``.

[Note: a resumed run's events]
A new run (no checkpoint to start from) starts the folder anew, as it truncates
metrics.jsonl. A resumed run appends a new event file to the same folder, opened with
``purge_step`` at the checkpoint's step + 1: TensorBoard (and its event reader) then
drops every event the earlier runs wrote at that step or later, so the steps that a
killed run logged past its last checkpoint, and that this run trains again, show
once, with this run's values. The hyperparameters are written by the run that creates
the folder, at step 0, which no purge reaches.
"""

from __future__ import annotations

import os
import shutil

from isp_comm.train.reporting.names import missing_package
from isp_comm.train.reporting.scalars import hparams

FOLDER = "tensorboard"
"""The event files' folder inside ``--out``."""

METRICS = ("train/loss", "eval/loss")
"""The scalars TensorBoard's HPARAMS table shows beside the flags."""


def _has_events(folder: str) -> bool:
    return os.path.isdir(folder) and any(n.startswith("events.out.tfevents") for n in os.listdir(folder))


class TensorBoardEvents:
    """One run's event files: the flags once, then the reported rows' scalars."""

    def __init__(self, out: str, *, start: int, config: dict) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
            from torch.utils.tensorboard.summary import hparams as hparams_summaries
        except ImportError as exc:
            raise ValueError(missing_package("tensorboard", exc)) from exc
        self.folder = os.path.join(out, FOLDER)
        if not start and os.path.isdir(self.folder):  # a new run: its own curves only
            shutil.rmtree(self.folder)
        fresh = not _has_events(self.folder)
        # the queue holds a reported row's scalars; each row is flushed at once (log)
        self.writer = SummaryWriter(log_dir=self.folder, purge_step=None if fresh else start + 1, max_queue=64)
        if fresh:
            metrics = {tag: 0.0 for tag in METRICS if tag.startswith("train/") or config.get("eval_every")}
            for summary in hparams_summaries(hparams(config), metrics):
                self.writer.file_writer.add_summary(summary, 0)
            self.writer.flush()

    def log(self, step: int, values: dict[str, float]) -> None:
        """The scalars of one reported step, flushed to disk (a killed run keeps them)."""
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, step)
        self.writer.flush()

    def close(self, exit_code: int) -> None:
        self.writer.close()
