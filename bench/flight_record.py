"""What the flight record costs per collective (issue 49's budget: 2 us).

    python bench/flight_record.py [--calls 200000] [--runs 3]

One process, no group: the calls the communicator adds around every collective,
``CommContext.record`` at issue (slot-class entry, clock read, the group's sequence
number, ring write, pending map) and, at the wait, ``begin_wait`` and ``complete``
(the completion's clock read), timed over ``--calls`` collectives against the same
loop without them. The label of the group is cached (the first call per group asks
torch.distributed for its ranks, once). Prints a markdown table (median of
``--runs`` runs, with the range); raw figures to --out (default bench/results/local).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench.common import add_out, markdown_table, save_results  # noqa: E402
from isp_comm.backends.base import CompletedHandle  # noqa: E402
from isp_comm.context import CommContext  # noqa: E402

BUDGET_US = 2.0


def one_run(calls: int) -> dict[str, float]:
    """Seconds per collective with and without the record's calls (fresh context)."""
    ctx = CommContext(0, timeout_s=60.0)
    group = object()
    ctx.flight._labels[group] = "0,1,2,3"
    sent = torch.empty(1024, dtype=torch.bfloat16)
    handles = [CompletedHandle() for _ in range(256)]  # distinct objects, as issued collectives are

    def bare() -> float:
        t0 = time.perf_counter()
        for i in range(calls):
            h = handles[i & 255]
            h.wait(60.0)
        return time.perf_counter() - t0

    def recorded() -> float:
        record, flight = ctx.record, ctx.flight
        t0 = time.perf_counter()
        for i in range(calls):
            h = handles[i & 255]
            record(h, "all-gather", group, sent, i & 31, "forward")
            flight.begin_wait(h)
            h.wait(60.0)
            flight.complete(h)
        return time.perf_counter() - t0

    bare(), recorded()  # warm-up
    base, rec = bare(), recorded()
    return {"bare_us": 1e6 * base / calls, "recorded_us": 1e6 * rec / calls, "cost_us": 1e6 * (rec - base) / calls}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=200_000)
    ap.add_argument("--runs", type=int, default=3)
    add_out(ap)
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = [one_run(args.calls) for _ in range(args.runs)]

    def cell(key: str) -> str:
        v = [r[key] for r in rows]
        return f"{statistics.median(v):.2f} ({min(v):.2f}-{max(v):.2f})"

    med = statistics.median(r["cost_us"] for r in rows)
    header = ["calls per run", "loop without, us", "loop with the record, us", "record's cost per collective, us"]
    print(f"median of {args.runs} runs (range); budget {BUDGET_US:.1f} us; load average {os.getloadavg()[0]:.1f}")
    print(markdown_table(header, [[args.calls, cell("bare_us"), cell("recorded_us"), cell("cost_us")]]))
    print(f"raw figures: {save_results('flight_record', args, rows)}")
    if med > BUDGET_US:
        print(f"over the budget of {BUDGET_US} us per collective", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
