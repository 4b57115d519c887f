"""What isp-train --report-to costs per step, on CPU.

    python bench/reporting.py [--rows 200] [--steps 300] [--repeats 3]

Two measurements, each for ``tensorboard``, ``wandb`` (offline; when installed) and
both:
- ``log``: ``Reporters.log`` on reported rows of a real run's metrics.jsonl (a run of
  the reference llama made first, with its evaluation), ``--rows`` rows in a window,
  ``--repeats`` windows, each in a fresh folder: the median microseconds per reported
  row. At ``--log-every N`` a step pays 1/N of it on average.
- ``run``: ``isp-train`` at world 1 (the reference llama, ``--steps`` steps, ``--log-every
  10``, no trace) without and with each ``--report-to``, alternating, ``--repeats`` runs
  each: the mean time per step over the run (the step's tokens over the last row's
  tokens/s, which counts every step after the first, reporting included), median of
  the runs with the range.

Prints a markdown table; raw figures to --out (default bench/results/local/reporting.json).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench.common import add_out, markdown_table, progress, save_results  # noqa: E402
from isp_comm.train.reporting import Reporters  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SEQ, BATCH = 64, 8  # isp-train's defaults


def _trackers() -> list[str]:
    import importlib.util

    return ["tensorboard"] + (["wandb", "tensorboard,wandb"] if importlib.util.find_spec("wandb") else [])


def _env(home: str) -> dict:
    """W&B offline, its own folders in ``home`` (nothing leaves the machine)."""
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true", "PYTHONPATH": ROOT}
    return env | {k: home for k in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR")}


def isp_train(out: str, steps: int, report_to: str, env: dict, *extra: str) -> list[dict]:
    """One isp-train run at world 1; its metrics.jsonl rows."""
    cmd = [sys.executable, "-m", "isp_comm.train", "--steps", str(steps), "--log-every", "10", "--no-trace"]
    cmd += ["--no-final-save", "--report-to", report_to, "--out", out, *extra]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if res.returncode:
        raise RuntimeError(f"{' '.join(cmd)}: exit {res.returncode}\n{res.stderr[-2000:]}")
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def log_window(report_to: str, rows: list[dict], folder: str) -> float:
    """Microseconds per reported row: ``Reporters.log`` on every row, all reported."""
    os.environ.update(WANDB_MODE="offline", WANDB_SILENT="true")
    with Reporters(report_to, folder, start=0, config={"steps": len(rows)}, log_every=1, last_step=len(rows)) as rep:
        t0 = time.perf_counter()
        for row in rows:
            rep.log(row)
        return (time.perf_counter() - t0) / len(rows) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=200, help="reported rows per log() window")
    ap.add_argument("--steps", type=int, default=300, help="steps of each isp-train run")
    ap.add_argument("--repeats", type=int, default=3, help="windows and runs of each")
    add_out(ap)
    args = ap.parse_args()
    trackers = _trackers()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        env = _env(os.path.join(tmp, "wandb-home"))
        os.environ.update({k: v for k, v in env.items() if k.startswith("WANDB_")})
        progress("bench/reporting.py: a run whose rows are logged")
        made = isp_train(os.path.join(tmp, "rows"), 40, "none", env, "--eval-every", "10", "--eval-split", "0.1")
        rows = [{**made[i % len(made)], "step": i + 1} for i in range(args.rows)]
        for name in trackers:
            us = [log_window(name, rows, os.path.join(tmp, f"log-{name}-{r}")) for r in range(args.repeats)]
            results.append({"measure": "log", "report_to": name, "us_per_row": us})
        runs: dict[str, list[float]] = {name: [] for name in ["none", *trackers]}
        for r in range(args.repeats):
            for name in runs:
                progress(f"bench/reporting.py: isp-train --report-to {name}, run {r + 1}/{args.repeats}")
                last = isp_train(os.path.join(tmp, f"run-{name}-{r}"), args.steps, name, env)[-1]
                runs[name].append(BATCH * SEQ / last["tokens_per_s"] * 1e3)
        results += [{"measure": "run", "report_to": k, "ms_per_step": v} for k, v in runs.items()]
    base = statistics.median(runs["none"])
    table = []
    for name in trackers:
        per_row = statistics.median(next(r["us_per_row"] for r in results if r.get("report_to") == name))
        ms = runs[name]
        table.append(
            [f"`{name}`", f"{per_row:.0f}", f"{per_row / 10:.1f}", f"{statistics.median(ms):.3f} ({min(ms):.3f}-"
             f"{max(ms):.3f})", f"{(statistics.median(ms) / base - 1) * 100:+.1f}%"]
        )  # fmt: skip
    none = f"{base:.3f} ({min(runs['none']):.3f}-{max(runs['none']):.3f})"
    print(f"isp-train --report-to none: {none} ms per step")
    header = ["--report-to", "us per reported row", "us per step at --log-every 10", "ms per step (run)", "vs none"]
    print(markdown_table(header, table, "lrrrr"))
    path = save_results("reporting", args, results)
    print(f"\nraw JSON: {path}")


if __name__ == "__main__":
    main()
