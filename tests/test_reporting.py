"""isp-train --report-to: TensorBoard event files and a W&B run hold what metrics.jsonl
holds, read back with each tool's own reader; a resume continues the same curves
without a duplicated step; nothing is written without the flag; a missing package or
a wrong name is one line."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from isp_comm.testing import run_main
from isp_comm.train.reporting import parse_report_to
from isp_comm.train.reporting.scalars import TAGS, is_reported, scalars
from tests.test_train import SMALL, _train1, isp_train

pytest.importorskip("tensorboard", reason="the test extra installs tensorboard")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402
from tensorboard.backend.event_processing.event_file_loader import EventFileLoader  # noqa: E402
from tensorboard.plugins.hparams import plugin_data_pb2  # noqa: E402


def _rows(out: str) -> dict[int, dict]:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return {r["step"]: r for r in map(json.loads, f)}


def _accumulator(out: str) -> EventAccumulator:
    """What TensorBoard shows of the run folder's events (every scalar kept)."""
    acc = EventAccumulator(os.path.join(out, "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    return acc


def _curve(acc: EventAccumulator, tag: str) -> dict[int, float]:
    events = acc.Scalars(tag)
    steps = [e.step for e in events]
    assert len(steps) == len(set(steps)), f"{tag}: a step twice: {steps}"
    return {e.step: e.value for e in events}


def _f32(x: float) -> float:
    """An event file's scalar is a float32 (TensorBoard's simple_value)."""
    return float(np.float32(x))


def _hparams(acc: EventAccumulator) -> dict:
    content = acc.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    info = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info
    return {k: v.string_value or v.number_value or v.bool_value for k, v in info.hparams.items()}


@pytest.mark.timeout(240)
def test_tensorboard_at_two_ranks_holds_metrics_and_a_resume_continues(tmp_path) -> None:
    """The acceptance run: 2 ranks, 20 steps, --log-every 5, a validation every 10; then
    a resume to 30 in the same folder adds steps 25 and 30."""
    out = str(tmp_path / "run")
    common = [*SMALL, "--no-trace", "--log-every", "5", "--eval-every", "10", "--eval-split", "0.1"]
    res = isp_train(2, *common, "--report-to", "tensorboard", "--steps", "20", "--out", out)
    assert res.returncode == 0, res.stderr[-3000:]
    assert len(os.listdir(os.path.join(out, "tensorboard"))) == 1  # one writer: rank 0's
    acc = _accumulator(out)
    rows = _rows(out)
    assert _curve(acc, "train/loss") == {s: _f32(rows[s]["loss"]) for s in (5, 10, 15, 20)}
    assert _curve(acc, "eval/loss") == {s: _f32(rows[s]["eval_loss"]) for s in (10, 20)}
    assert _curve(acc, "eval/perplexity") == {s: _f32(rows[s]["eval_perplexity"]) for s in (10, 20)}
    # every number of a reported row is there under its tag (a key without a tag would keep its name)
    numeric = {k for k, v in rows[20].items() if k != "step" and isinstance(v, int | float)}
    assert set(acc.Tags()["scalars"]) == {TAGS[k] for k in numeric}
    for key in numeric:
        assert _curve(acc, TAGS[key])[20] == _f32(rows[20][key]), key
    flags = _hparams(acc)
    assert flags["steps"] == 20 and flags["world"] == 2 and flags["report_to"] == "tensorboard"

    res = isp_train(2, *common, "--report-to", "tensorboard", "--steps", "30", "--out", out, "--resume")
    assert res.returncode == 0, res.stderr[-3000:]
    assert len(os.listdir(os.path.join(out, "tensorboard"))) == 2  # one event file per run
    acc, rows = _accumulator(out), _rows(out)
    assert _curve(acc, "train/loss") == {s: _f32(rows[s]["loss"]) for s in (5, 10, 15, 20, 25, 30)}
    assert _curve(acc, "eval/loss") == {s: _f32(rows[s]["eval_loss"]) for s in (10, 20, 30)}
    assert _hparams(acc)["steps"] == 20  # the flags are recorded once, by the run that made the folder


def _raw_steps(out: str, tag: str) -> list[int]:
    """The steps of ``tag`` in every event file, as written (no purge applied)."""
    steps = []
    for path in sorted(glob.glob(os.path.join(out, "tensorboard", "events.out.tfevents.*"))):
        for event in EventFileLoader(path).Load():
            steps += [event.step for v in event.summary.value if v.tag == tag]
    return steps


@pytest.mark.timeout(200)
def test_a_resume_past_the_last_checkpoint_shows_each_step_once_and_overwrite_clears(tmp_path) -> None:
    """A run that logged steps 15 and 20 after its last checkpoint (step 10), as a
    killed one does, is resumed from 10: the event files hold 15 and 20 twice, and
    TensorBoard's reader shows each once, with the resumed run's values. --overwrite
    then removes the events, and a run without --report-to writes none."""
    out = str(tmp_path / "run")
    flags = ["--log-every", "5", "--report-to", "tensorboard"]
    assert _train1(*flags, "--steps", "20", "--save-every", "10", "--no-final-save", "--out", out).returncode == 0
    res = _train1(*flags, "--steps", "30", "--resume", "--out", out)
    assert res.returncode == 0, res.stderr[-2000:]
    assert _raw_steps(out, "train/loss") == [5, 10, 15, 20, 15, 20, 25, 30]
    rows = _rows(out)
    assert sorted(rows) == list(range(1, 31))
    assert _curve(_accumulator(out), "train/loss") == {s: _f32(rows[s]["loss"]) for s in range(5, 31, 5)}

    res = _train1("--steps", "3", "--overwrite", "--out", out)
    assert res.returncode == 0, res.stderr[-2000:]
    assert not {"tensorboard", "wandb"} & set(os.listdir(out)), os.listdir(out)


def _wandb_records(path: str):
    """The records of a W&B run file (``run-ID.wandb``): W&B's LevelDB-style log of
    32 KiB blocks, each record a 7-byte header (CRC, length, type: 1 full, 2 first,
    3 middle, 4 last) and a piece of a ``wandb_internal_pb2.Record``."""
    from wandb.proto import wandb_internal_pb2

    with open(path, "rb") as f:
        data = f.read()
    assert data[:4] == b":W&B", data[:8]
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        size, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        if size == 0 and kind == 0:
            break
        pending += data[pos + 7 : pos + 7 + size]
        pos += 7 + size
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


@pytest.mark.timeout(200)
def test_wandb_offline_and_tensorboard_in_a_virtual_run(tmp_path) -> None:
    """--report-to tensorboard,wandb with WANDB_MODE=offline, in a virtual run (its
    comm_s reaches both): the W&B run file holds the config and, at each reported step,
    the scalars of metrics.jsonl exactly; a second run in the folder gets a W&B run of
    its own."""
    pytest.importorskip("wandb", reason="the test extra installs wandb")
    out = str(tmp_path / "run")
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    env |= {name: str(tmp_path / "wandb-home") for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR")}
    flags = ["--virtual-world", "4", "--virtual-gbps", "10", "--eval-every", "4", "--eval-split", "0.1", "--out", out]
    res = _train1(*flags, "--steps", "10", "--log-every", "5", "--report-to", "tensorboard,wandb", env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = _rows(out)
    with open(os.path.join(out, "wandb", "run_id")) as f:
        run_id = f.read().strip()
    (path,) = glob.glob(os.path.join(out, "wandb", f"offline-run-*-{run_id}", f"run-{run_id}.wandb"))
    history, config = {}, {}
    for record in _wandb_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            values = {
                item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item
            }
            history[values.pop("_step")] = values
        elif kind == "run":
            config = {u.key or "/".join(u.nested_key): json.loads(u.value_json) for u in record.run.config.update}
    assert sorted(history) == [4, 5, 8, 10]  # --log-every 5, the evaluations at 4 and 8, the last step
    for step, values in history.items():
        expected = {TAGS[k]: v for k, v in rows[step].items() if k != "step"}
        assert {k: v for k, v in values.items() if not k.startswith("_")} == expected, step
    assert "comm/comm_s" in history[10] and "eval/loss" in history[8] and "eval/loss" not in history[5]
    assert config["steps"] == 10 and config["virtual_world"] == 4 and config["world"] == 4
    acc = _accumulator(out)
    assert _curve(acc, "comm/comm_s") == {s: _f32(rows[s]["comm_s"]) for s in (4, 5, 8, 10)}

    res = _train1(*flags, "--steps", "5", "--report-to", "wandb", env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    with open(os.path.join(out, "wandb", "run_id")) as f:
        assert f.read().strip() != run_id  # a new run, not a resume: a W&B run of its own
    assert len(glob.glob(os.path.join(out, "wandb", "offline-run-*"))) == 2


def _main_without(argv: list[str]) -> None:
    """isp-train's main, ``argv[0]`` a package it then cannot import."""
    sys.modules[argv[0]] = None  # type: ignore[assignment]
    from isp_comm.train.__main__ import main

    main(argv[1:])


def _without(package: str, *args: str) -> subprocess.CompletedProcess:
    """isp-train in a Python where ``package`` cannot be imported (forked, as
    tests/test_train.py's isp_train)."""
    return run_main(_main_without, [package, *SMALL, "--steps", "2", *args], timeout_s=60)


@pytest.mark.parametrize("package", ["wandb", "tensorboard"])
def test_a_missing_package_is_one_line_naming_it(tmp_path, package: str) -> None:
    res = _without(package, "--report-to", package, "--out", str(tmp_path / "run"))
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert res.returncode == 2 and len(lines) == 1 and "Traceback" not in res.stderr, res.stderr
    assert f"the {package} package is not installed (pip install {package}" in lines[0], lines[0]
    assert not os.path.exists(tmp_path / "run")  # stopped before anything was written


def test_a_package_that_fails_to_import_is_quoted_before_the_ranks_start(tmp_path) -> None:
    """An installed wandb whose import fails (a broken dependency) was called "not
    installed", after the ranks had started: one line quoting its error, before."""
    site = tmp_path / "site" / "wandb"
    site.mkdir(parents=True)
    (site / "__init__.py").write_text("raise ImportError('libbroken.so: cannot open shared object file')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), os.getcwd()])}
    cmd = [sys.executable, "-m", "isp_comm.train", "--nproc-per-node", "2", *SMALL, "--steps", "2"]
    res = subprocess.run(
        [*cmd, "--report-to", "wandb", "--out", str(tmp_path / "run")],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert res.returncode == 2 and len(lines) == 1 and not res.stdout.strip(), res.stdout + res.stderr
    assert lines[0] == (
        "isp-train: error: --report-to wandb: the wandb package is installed but fails to import: "
        "ImportError: libbroken.so: cannot open shared object file"
    )


def test_a_package_that_fails_to_import_stops_a_single_process_run_before_it_starts(tmp_path) -> None:
    """Without --nproc-per-node (one process, no launcher) a tracker that fails to
    import stopped the run at its first report: after the run's first line, with the
    folder, its lock and its config already written. It is one line before anything
    now, as under isp-train's launcher."""
    site = tmp_path / "site" / "tensorboard"
    site.mkdir(parents=True)
    (site / "__init__.py").write_text("raise ImportError('No module named broken_dependency')\n")
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE")}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path / "site"), os.getcwd()])
    cmd = [sys.executable, "-m", "isp_comm.train", *SMALL, "--steps", "2", "--report-to", "tensorboard"]
    res = subprocess.run([*cmd, "--out", str(tmp_path / "run")], capture_output=True, text=True, env=env, timeout=60)
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert res.returncode == 2 and len(lines) == 1 and not res.stdout.strip(), res.stdout + res.stderr
    assert lines[0] == (
        "isp-train: error: --report-to tensorboard: the tensorboard package is installed but fails to import: "
        "ImportError: No module named broken_dependency"
    )
    assert not os.path.exists(tmp_path / "run")  # stopped before anything was written


def test_report_to_names() -> None:
    assert parse_report_to("none") == ()
    assert parse_report_to("tensorboard") == ("tensorboard",)
    assert parse_report_to("TensorBoard, tensorboard") == ("tensorboard",)
    for value, words in [
        ("", "give none, tensorboard, wandb"),
        ("tensorboard,", "give none, tensorboard, wandb"),
        ("mlflow", "unknown 'mlflow'"),
        ("none,tensorboard", "none reports nowhere"),
    ]:
        with pytest.raises(ValueError, match=words):
            parse_report_to(value)


def test_which_rows_and_which_numbers() -> None:
    row = {"step": 7, "loss": 2.5, "pool_bytes": 1024, "flag": True, "note": "x", "new_key": 1.5}
    assert scalars(row) == {"train/loss": 2.5, "memory/pool_bytes": 1024.0, "new_key": 1.5}
    assert not is_reported(row, log_every=5, last_step=10)
    assert is_reported({**row, "eval_loss": 1.0}, log_every=5, last_step=10)
    assert is_reported({"step": 10}, log_every=5, last_step=12) and is_reported({"step": 12}, log_every=5, last_step=12)
