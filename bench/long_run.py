"""A long run of a tiny model: memory and buffers must not grow.

    python bench/long_run.py [--steps 300] [--world 2] [--backend auto]

Per rank: RSS after warm-up (step 20) and at the end, pool bytes, slots held,
reduce-scatter buffers in use and outstanding handles at every step end, and the
isp-comm segments in /dev/shm. Prints a markdown table; writes bench/results/long_run.json.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import proc_status_bytes, save_results  # noqa: E402
from isp_comm.testing import run_ranks  # noqa: E402
from tests.parity import Case, train_isp  # noqa: E402

WARMUP = 20


def _rss() -> int:
    return proc_status_bytes("VmRSS")


def _shm() -> int:
    return sum(n.startswith("isp_") for n in os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else 0


def long_run_worker(rank: int, world: int, steps: int, backend: str) -> dict:
    case = Case(optim="adamw", steps=steps, ckpt=0.5, seq=16, batch_per_rank=2)
    trace: list[dict] = []

    def on_step(comm) -> None:
        s = comm.stats()
        trace.append({"rss": _rss(), "shm": _shm(), **{k: s[k] for k in KEYS}})

    train_isp(case, rank, world, world, on_step=on_step, backend=backend)
    after = trace[WARMUP - 1]
    return {
        "rank": rank,
        "rss_warm": after["rss"],
        "rss_end": trace[-1]["rss"],
        "growth_pct": 100 * (trace[-1]["rss"] - after["rss"]) / after["rss"],
        "constant": all({k: t[k] for k in KEYS} == {k: after[k] for k in KEYS} for t in trace[WARMUP - 1 :]),
        "max_outstanding": max(t["outstanding_handles"] for t in trace),
        "shm_max": max(t["shm"] for t in trace),
        "pool_bytes": after["pool_bytes"],
    }


KEYS = ("pool_bytes", "slots_held", "rs_buffers_in_use", "outstanding_handles", "live_gathered_bytes")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--backend", default="auto")
    args = ap.parse_args()
    rows = run_ranks(long_run_worker, args.world, args.steps, args.backend, timeout_s=3600)
    print(f"{args.steps} steps, world {args.world}, backend {args.backend}; RSS growth from step {WARMUP} to the end\n")
    print(
        "| rank | RSS at warm-up MiB | RSS at end MiB | growth | counters constant | max outstanding at step end "
        "| isp segments in /dev/shm |"
    )
    print("|---:|---:|---:|---:|---|---:|---:|")
    for r in rows:
        print(
            f"| {r['rank']} | {r['rss_warm'] / 2**20:.1f} | {r['rss_end'] / 2**20:.1f} | {r['growth_pct']:+.2f}% | "
            f"{'yes' if r['constant'] else 'NO'} | {r['max_outstanding']} | {r['shm_max']} |"
        )
    save_results("long_run", args, rows)


if __name__ == "__main__":
    main()
