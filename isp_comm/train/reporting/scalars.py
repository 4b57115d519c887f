"""What a tracker receives: the scalars of a metrics.jsonl row under their tags, which
rows are reported, and the run's flags as hyperparameters.

Tags group the row's keys the way TensorBoard and W&B lay out their panels (the part
before the slash): ``train/``, ``perf/``, ``comm/``, ``memory/`` and ``eval/``. Each
tag ends in the row's own key, so a curve and a metrics.jsonl column are found by the
same name; the validation keys drop their ``eval_`` prefix under ``eval/``.
"""

from __future__ import annotations

import math

TAGS = {
    "loss": "train/loss",
    "lr": "train/lr",
    "grad_norm": "train/grad_norm",
    "tokens_per_s": "perf/tokens_per_s",
    "step_s": "perf/step_s",
    "data_wait_s": "perf/data_wait_s",
    "mfu_pct": "perf/mfu_pct",
    "exposed_comm_pct": "comm/exposed_comm_pct",
    "comm_s": "comm/comm_s",
    "exposed_comm_s": "comm/exposed_comm_s",
    "comm_late_s": "comm/comm_late_s",
    "pool_bytes": "memory/pool_bytes",
    "peak_rss_mib": "memory/peak_rss_mib",
    "peak_alloc_mib": "memory/peak_alloc_mib",
    "peak_reserved_mib": "memory/peak_reserved_mib",
    "eval_loss": "eval/loss",
    "eval_perplexity": "eval/perplexity",
}
"""The tag of every key a metrics.jsonl row can hold, but ``step`` (the x axis)."""


def scalars(row: dict) -> dict[str, float]:
    """The row's numbers under their tags. A key without a tag keeps its own name, so
    a field added to the row later still reaches the trackers."""
    return {
        TAGS.get(key, key): float(value)
        for key, value in row.items()
        if key != "step" and isinstance(value, int | float) and not isinstance(value, bool)
    }


def is_reported(row: dict, *, log_every: int, last_step: int) -> bool:
    """Whether a row goes to the trackers: every ``--log-every`` steps, at the run's
    last step, and at every evaluation (its validation loss is logged where it is
    measured). Step 1's row, whose time includes compilation and warm-up, is reported
    only where these say so (``--log-every 1``), as it is printed."""
    step = row["step"]
    return step % log_every == 0 or step == last_step or "eval_loss" in row


def hparams(config: dict) -> dict[str, int | float | str | bool]:
    """The run's flags as hyperparameter values (TensorBoard takes numbers, strings and
    booleans only): ``None`` (a flag left to its automatic value) becomes ``"auto"``,
    a non-finite number its text."""
    out: dict[str, int | float | str | bool] = {}
    for key, value in config.items():
        if value is None:
            out[key] = "auto"
        elif isinstance(value, float) and not math.isfinite(value):
            out[key] = str(value)
        elif isinstance(value, bool | int | float | str):
            out[key] = value
        else:
            out[key] = str(value)
    return out
