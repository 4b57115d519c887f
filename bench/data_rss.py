"""Per-rank peak RSS and loading stalls of isp-train against the size of its token store.

    python bench/data_rss.py [--mib 10 2048] [--repeats 3] [--world 2] [--steps 30]

For each size, a store of random uint16 tokens is written (into --tmp, removed after),
then isp-train runs its default model and batch on it (packed rows, the batches read
ahead by the data thread) at --world ranks. From rank 0's metrics.jsonl it takes:

* ``peak_rss_mib`` of the last row (VmHWM: mapped pages a rank touched count too);
* the loading stall: ``data_wait_s`` (the time the loop waited for its batch) summed
  over the steps after the first, as a share of their ``step_s``, and its largest value.
  The first step is left out: the thread starts with the loop, so it always waits once.

Prints a markdown table (median and range over --repeats runs) and writes
OUT/data_rss.json (--out, default bench/results/local).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import add_out, markdown_table, progress, save_results  # noqa: E402
from isp_comm.train.store import write_store  # noqa: E402


def _store(folder: str, mib: int) -> None:
    n = mib * 2**20 // 2
    rng = np.random.default_rng(0)
    chunk = 1 << 23
    docs = (rng.integers(0, 4096, size=min(chunk, n - i), dtype=np.uint16) for i in range(0, n, chunk))
    write_store(folder, docs, 4096)


def _run(store: str, out: str, world: int, steps: int) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world)]
    cmd += ["-m", "isp_comm.train", "--data", store, "--steps", str(steps), "--no-trace", "--out", out]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    if res.returncode:
        raise RuntimeError(res.stderr[-2000:])
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()][1:]
    return {
        "peak_rss_mib": rows[-1]["peak_rss_mib"],
        "stall_pct": 100 * sum(r["data_wait_s"] for r in rows) / sum(r["step_s"] for r in rows),
        "max_wait_ms": 1e3 * max(r["data_wait_s"] for r in rows),
    }


def _median_range(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, nargs="+", default=[10, 2048])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--tmp", default=tempfile.gettempdir())
    add_out(ap)
    args = ap.parse_args()
    rows = []
    for mib in args.mib:
        folder = tempfile.mkdtemp(dir=args.tmp)
        try:
            progress(f"writing a {mib} MiB store")
            _store(os.path.join(folder, "store"), mib)
            runs, store = [], os.path.join(folder, "store")
            for r in range(args.repeats):
                runs.append(_run(store, os.path.join(folder, f"run{r}"), args.world, args.steps))
                progress(f"{mib} MiB store, run {r + 1}: {runs[-1]}")
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        rows.append({"store_mib": mib, **{k: [run[k] for run in runs] for k in runs[0]}})
    columns = ("peak_rss_mib", "stall_pct", "max_wait_ms")
    print(
        markdown_table(
            ["store MiB", "rank 0 peak RSS MiB", "loading stall, % of step time", "largest wait, ms"],
            [[r["store_mib"], *(_median_range(r[k]) for k in columns)] for r in rows],
        )
    )
    print(save_results("data_rss", args, rows))


if __name__ == "__main__":
    main()
