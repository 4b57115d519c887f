"""A Weights & Biases run, when the ``wandb`` package is installed.

``wandb.init`` reads the environment as W&B documents it: ``WANDB_MODE=offline``
writes the run under ``OUT/wandb/`` only (``wandb sync`` uploads it later),
``WANDB_PROJECT`` and ``WANDB_ENTITY`` choose where it goes (the project defaults to
``isp-train``). The run is named after the ``--out`` folder, its config is the run's
flags and world, and W&B's console capture is off: the run's own lines stay as they
are, in a terminal and in a log file.

A resumed run continues the same W&B run: the id is kept in ``OUT/wandb/run_id`` and
given back with ``resume="allow"``. Steps are W&B's x axis (``step=``); W&B ignores,
with a warning, a step below the run's last, so the steps that a killed run logged past
its last checkpoint keep their first values.
"""

from __future__ import annotations

import os
import uuid

from isp_comm.train.reporting.names import missing_package

RUN_ID = os.path.join("wandb", "run_id")
"""Where in ``--out`` the W&B run's id is kept for a resume."""


class WandbRun:
    """One W&B run: the config at its start, then the reported rows' scalars."""

    def __init__(self, out: str, *, start: int, config: dict) -> None:
        try:
            import wandb
        except ImportError as exc:
            raise ValueError(missing_package("wandb", exc)) from exc
        path = os.path.join(out, RUN_ID)
        run_id = None
        if start and os.path.isfile(path):
            with open(path) as f:
                run_id = f.read().strip() or None
        if run_id is None:
            run_id = uuid.uuid4().hex[:12]  # W&B takes letters, digits, - and _
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w") as f:
                f.write(run_id + "\n")
        try:
            self.run = wandb.init(
                project=os.environ.get("WANDB_PROJECT") or "isp-train",
                name=os.path.basename(os.path.abspath(out)),
                id=run_id,
                resume="allow",
                dir=out,
                config=config,
                settings=wandb.Settings(console="off"),
            )
        except Exception as exc:  # wandb's errors (no API key, no network) as one line
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ValueError(
                f"--report-to wandb: {first} (log in with wandb login, or set WANDB_MODE=offline to write the "
                "run locally)"
            ) from exc

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def close(self, exit_code: int) -> None:
        self.run.finish(exit_code=exit_code)
