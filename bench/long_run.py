"""A long run of a tiny model: memory and buffers must not grow.

    python bench/long_run.py [--steps 300] [--world 2] [--backend auto]

Per rank: RSS after warm-up (step 20) and at the end, pool bytes, slots held,
reduce-scatter buffers in use and outstanding handles at every step end, and the
isp-comm segments in /dev/shm. Prints a markdown table; writes OUT/long_run.json (--out, default bench/results/local).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import add_out, save_results  # noqa: E402
from isp_comm.testing import run_ranks  # noqa: E402
from tests.parity import WARMUP, long_run_worker  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--backend", default="auto")
    add_out(ap)
    args = ap.parse_args()
    rows = run_ranks(long_run_worker, args.world, args.steps, args.backend, timeout_s=3600, start="spawn")
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
