"""The run folder's lifecycle: a new run never silently mixes with an old one, a resume
says where it starts and cuts the metrics back to it, and run.json keeps the history.

Every check is made by rank 0 and agreed collectively (``first_error``), so every
rank stops with the same one line.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shutil

import torch.distributed as dist

from isp_comm.flight.heartbeat import LIVE_DIR, LIVE_TRIGGER
from isp_comm.groups import first_error
from isp_comm.train import checkpoint, survive
from isp_comm.train.config import TrainConfig, absolute, as_dict, read_config_file, saved_flags, shown
from isp_comm.virtual import is_virtual

OWN = (
    "metrics.jsonl",
    "trace.json",
    "timeline.png",
    "run.json",
    "config.json",
    "checkpoints",
    "hf_model",
    "tensorboard",
    "wandb",
    "hang.json",
    "hang.txt",
    "hang.previous.json",
    "hang.previous.txt",
    "memory_breakdown.json",
)
"""What isp-train writes into ``--out``: what ``--overwrite`` removes, with the live
state of ``isp-comm doctor --live`` (:func:`clear_live`)."""


def checkpoint_step(path: str) -> int:
    """The step of a checkpoint folder ``.../step_000020``."""
    return int(os.path.basename(path).removeprefix("step_"))


def _saved(out: str) -> list[str]:
    root = os.path.join(out, "checkpoints")
    if not os.path.isdir(root):
        return []
    return sorted(d for d in os.listdir(root) if d.startswith("step_") and not d.endswith(checkpoint.PARTIAL))


def prepare(cfg: TrainConfig, closing: contextlib.ExitStack) -> str | None:
    """Collective, before anything is written: take the folder's lock (rank 0 holds
    it until ``closing`` closes, or its death), refuse a new run into a folder with
    checkpoints (unless ``--overwrite``, which clears isp-train's files first), and
    for ``--resume`` find the checkpoint and refuse a ``--steps`` it already reached
    (``--resume auto`` without a checkpoint: a new run; with one at ``--steps``:
    :class:`Finished`).
    Returns the checkpoint to resume from (``None`` for a new run)."""
    error, path = None, None
    if dist.get_rank() == 0 or is_virtual():  # a virtual run's one process, whatever its rank
        try:
            if cfg.resume and cfg.resume != "auto" and not os.path.isdir(cfg.out):  # not made for a refusal
                raise ValueError(
                    f"--resume: no run folder {cfg.out}: check --out, or give --resume auto, which starts a new "
                    "run when there is nothing to resume"
                )
            closing.callback(survive.lock_folder(cfg.out).close)
            error, path = _check(cfg)
        except ValueError as exc:
            error = str(exc)
    first = first_error(error)
    if first:
        raise ValueError(first)
    if dist.get_rank() == 0 or is_virtual():
        _set_aside_hang(cfg.out)
    if not is_virtual():  # one process: no rank 0 to hear from (the fake group's broadcast would be garbage)
        box = [path]
        dist.broadcast_object_list(box, src=0)
        path = box[0]
    if path is not None and checkpoint_step(path) >= cfg.steps:  # --resume auto: every rank alike
        raise Finished(checkpoint_step(path), cfg.steps)
    return path


class Finished(Exception):
    """``--resume auto`` on a run whose checkpoint has reached ``--steps``: nothing to
    train, exit 0 (a requeued job, or one restarted after its final save)."""

    def __init__(self, step: int, steps: int) -> None:
        super().__init__(
            f"the run is already finished: its checkpoint step_{step:06d} has reached --steps {steps} (nothing to "
            "train; a larger --steps trains on)"
        )


def _check(cfg: TrainConfig) -> tuple[str | None, str | None]:
    saved = _saved(cfg.out)
    path = checkpoint.latest(cfg.out) if cfg.resume else None
    if cfg.resume and (path is not None or cfg.resume != "auto"):
        if path is None:
            root = checkpoint.checkpoints_folder(cfg.out)
            if os.path.exists(root) and not os.path.isdir(root):
                return f"--resume: {root} is a file, not a folder of checkpoints: nothing to resume from", None
            return f"--resume: no complete checkpoint in {root}", None
        step = checkpoint_step(path)
        if cfg.steps <= step and cfg.resume != "auto":  # auto: a finished run (Finished, on every rank)
            return f"--resume: {path} is at step {step}; --steps {cfg.steps} must be larger to train on", None
        return None, path
    if saved and not cfg.overwrite:
        shown = ", ".join(saved[:3]) + (f" and {len(saved) - 3} more" if len(saved) > 3 else "")
        return (
            f"--out {cfg.out} holds checkpoints ({shown}): add --resume to continue from the latest, "
            "or --overwrite to clear the folder and start again"
        ), None
    if cfg.overwrite:
        for name in OWN:
            target = os.path.join(cfg.out, name)
            if os.path.isdir(target):
                shutil.rmtree(target)
            elif os.path.exists(target):
                os.remove(target)
        clear_live(cfg.out)
    return None, None


_LIVE_ANSWER = re.compile(r"rank\d+\.json(\.tmp)?")
"""A rank's answer to ``isp-comm doctor --live`` in ``live/`` (``.tmp``: one being written)."""


def clear_live(out: str) -> None:
    """For ``--overwrite``: remove the old run's live state, the ranks' answers in
    ``live/`` and a ``doctor --live`` trigger no job answered, so that a run started
    again from scratch shows none of the old run's positions (ranks it may not have,
    read as its own) and inherits no pending request. Only those files go: ``live/``
    itself is removed when nothing else is in it, and anything else stays."""
    trigger = os.path.join(out, LIVE_TRIGGER)
    if os.path.isfile(trigger):
        os.remove(trigger)
    live = os.path.join(out, LIVE_DIR)
    if not os.path.isdir(live) or os.path.islink(live):
        return
    for name in os.listdir(live):
        path = os.path.join(live, name)
        if _LIVE_ANSWER.fullmatch(name) and os.path.isfile(path) and not os.path.islink(path):
            os.remove(path)
    if not os.listdir(live):
        os.rmdir(live)


def _set_aside_hang(out: str) -> None:
    """An earlier run's hang diagnosis becomes ``hang.previous.*``: ``hang.json`` is
    this run's only, so ``isp-comm doctor`` never shows an old hang as the folder's."""
    for ext in ("json", "txt"):
        old = os.path.join(out, f"hang.{ext}")
        if os.path.exists(old):
            os.replace(old, os.path.join(out, f"hang.previous.{ext}"))


def previous_run(out: str) -> dict:
    """The run.json of the run that wrote ``out`` (empty when there is none)."""
    try:
        with open(os.path.join(out, "run.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def writer_of(previous: dict, step: int) -> dict:
    """The run (of run.json: the last one, or one of its ``history``) that saved the
    checkpoint of ``step``: the latest to start before it. A later run that saved
    nothing (``--no-final-save``, or stopped first) is passed over."""
    runs = [*previous.get("history", []), previous]
    return next((r for r in reversed(runs) if r.get("started_at", 0) < step), previous)


def resume_line(path: str, previous: dict) -> str:
    """Where a resume starts: step, checkpoint, and the saving run's world and wp."""
    saver = writer_of(previous, checkpoint_step(path))
    cfg = saver.get("config", {})
    world = saver.get("world", "?")
    wp = cfg.get("wp") or (world if isinstance(world, int) else "?")
    return f"isp-train: resuming from {path} (step {checkpoint_step(path)}; saved by a run at world {world}, wp {wp})"


MODEL_FLAGS = ("model", "layers", "hidden", "heads", "kv_heads", "lora_rank", "lora_targets")
"""The flags that decide the model's parameters: a checkpoint loads only into the model
they built (the layout flags reshard, these do not)."""


def model_flags_changed(path: str, cfg: TrainConfig) -> str | None:
    """For a checkpoint that failed to load: the model flags its run had (its
    ``flags.json``) that this run does not, as one clause, or ``None``."""
    try:
        saved = read_config_file(os.path.join(path, checkpoint.FLAGS))
    except (OSError, ValueError):
        return None
    ours = as_dict(cfg)
    differ = [k for k in MODEL_FLAGS if k in saved and absolute(k, saved[k]) != absolute(k, ours[k])]
    if not differ:
        return None
    had = ", ".join(f"{shown(k, saved[k])} (this run: {shown(k, ours[k])})" for k in differ)
    return f"its run had {had}: give its model flags (a plain --resume takes them from {checkpoint.FLAGS})"


def cut_metrics(out: str, step: int) -> None:
    """Keep the metrics of steps up to ``step`` only: a resume from an earlier
    checkpoint retrains the steps after it, and each step appears once, in order. A
    last line cut short (a kill or a full disk during its write) is dropped; a line
    that is not JSON before it is a ``ValueError`` naming it."""
    path = os.path.join(out, "metrics.jsonl")
    if not os.path.isfile(path):
        return
    with open(path) as f:
        lines = [line for line in f if line.strip()]
    keep = []
    for n, line in enumerate(lines, 1):
        try:
            row = json.loads(line)
        except ValueError as exc:
            if n == len(lines):  # torn: its step is retrained
                break
            raise ValueError(f"{path}: line {n} is not JSON ({exc}): mend or remove it to resume") from None
        if row.get("step", 0) <= step:
            keep.append(line if line.endswith("\n") else line + "\n")
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.writelines(keep)
    os.replace(tmp, path)


def write_run(
    out: str, cfg: TrainConfig, world: int, shapes: dict, previous: dict, resumed_at: int, model_config: dict
) -> None:
    """run.json: this run's flags, world, its working folder, the reference model's config (what
    ``isp-export`` writes beside the weights), rank 0's shard shapes, and under
    ``history`` every earlier run of this folder (flags, world, the step it started at)."""
    history = list(previous.get("history", []))
    if previous and resumed_at:
        earlier = {k: previous[k] for k in ("config", "world", "started_at") if k in previous}
        history.append(earlier)
    run = {"config": as_dict(cfg), "world": world, "started_at": resumed_at, "rank0_shapes": shapes}
    run["working_dir"] = os.getcwd()  # what relative paths among the flags (--model) are relative to
    if model_config:
        run["model_config"] = model_config
    if history:
        run["history"] = history
    with open(os.path.join(out, "run.json"), "w") as f:
        json.dump(run, f, indent=1)


def write_config(out: str, cfg: TrainConfig) -> None:
    """config.json, written as the run starts: its flags without ``resume``, so that
    ``--config OUT/config.json --out NEW`` starts the same run anew (also after an
    interrupted or resumed run)."""
    values = saved_flags(cfg)
    tmp = os.path.join(out, "config.json.tmp")
    with open(tmp, "w") as f:
        json.dump(values, f, indent=1)
    os.replace(tmp, os.path.join(out, "config.json"))


def stretch_line(previous: dict, cfg: TrainConfig, start: int, lr_at) -> str | None:
    """One line when a resume changes ``--steps``: the cosine schedule is stretched,
    and the learning rate moves from the saved run's at ``start`` to this one's at
    ``start + 1``."""
    old_steps = writer_of(previous, start).get("config", {}).get("steps")
    if not isinstance(old_steps, int) or old_steps == cfg.steps:
        return None
    before, after = lr_at(dataclasses.replace(cfg, steps=old_steps), start), lr_at(cfg, start + 1)
    return (
        f"isp-train: --steps {old_steps} -> {cfg.steps} stretches the learning-rate schedule: "
        f"{before:.3g} at step {start}, {after:.3g} at step {start + 1}"
    )
