"""All-gather and reduce-scatter: gloo against the CPU symmetric-memory backend.

    python bench/collectives.py [--sizes-mib 1 8 64] [--worlds 2 4] [--reps 7]

Size = the all-gather output and the reduce-scatter input per rank. The memcpy bound
is every rank copying that many bytes at the same time, measured in the same run.
"symm" uses ordinary tensors (through the ranks' scratch segments); "symm buf" a
symmetric buffer from ``backend.empty(..., group=...)`` as the all-gather output /
reduce-scatter input, which peers write into / read from directly (what the memory
pool's slots and buffers are).
Each time is the median over repetitions of the slowest rank. Prints a markdown
table and writes OUT/collectives.json (--out, default bench/results/local).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import MIB, add_out, markdown_table, save_results  # noqa: E402
from isp_comm.backends import SymmCpuBackend, TorchBackend  # noqa: E402
from isp_comm.testing import run_ranks  # noqa: E402


def _time(fn, reps: int) -> float:
    times = []
    for _ in range(reps + 1):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        times.append(dt.item())
    return statistics.median(times[1:])  # the first is warm-up


def _worker(rank: int, world: int, sizes: list[int], reps: int) -> list[dict]:
    group = dist.new_group(list(range(world)))
    backends = {"gloo": TorchBackend(), "symm": SymmCpuBackend(timeout_s=120)}
    rows = []
    for size in sizes:
        n = size // 4 // world
        full, shard = torch.randn(world * n), torch.randn(n)
        out_full, out_shard = torch.empty(world * n), torch.empty(n)
        src = torch.randn(world * n)
        row = {"world": world, "mib": size / MIB, "memcpy": _time(lambda o=out_full, s=src: o.copy_(s), reps)}
        for name, b in backends.items():
            ag = lambda b=b, o=out_full, i=shard: b.all_gather(o, i, group).wait(120)  # noqa: E731
            rs = lambda b=b, o=out_shard, i=full: b.reduce_scatter(o, i, group).wait(120)  # noqa: E731
            row[f"ag_{name}"] = _time(ag, reps)
            row[f"rs_{name}"] = _time(rs, reps)
        symm = backends["symm"]
        sym_out = symm.empty(world * n, torch.float32, torch.device("cpu"), group=group)
        ag = lambda b=symm, o=sym_out, i=shard: b.all_gather(o, i, group).wait(120)  # noqa: E731
        row["ag_symm_buf"] = _time(ag, reps)
        sym_out.copy_(full)  # now the reduce-scatter input
        rs = lambda b=symm, o=out_shard, i=sym_out: b.reduce_scatter(o, i, group).wait(120)  # noqa: E731
        row["rs_symm_buf"] = _time(rs, reps)
        rows.append(row)
    for b in backends.values():
        b.close()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes-mib", type=float, nargs="+", default=[1, 8, 64])
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--reps", type=int, default=7)
    add_out(ap)
    args = ap.parse_args()
    sizes = [int(s * MIB) for s in args.sizes_mib]
    rows = []
    for world in args.worlds:
        rows += run_ranks(_worker, world, sizes, args.reps, timeout_s=1800, start="spawn")[0]
    ms = 1e3
    header = [
        "world", "MiB", "AG gloo ms", "AG symm ms", "AG symm buf ms", "AG gloo/symm buf",
        "RS gloo ms", "RS symm ms", "RS symm buf ms", "RS gloo/symm buf",
        "memcpy ms", "AG symm buf/memcpy", "RS symm buf/memcpy",
    ]  # fmt: skip
    table = [
        [
            r["world"],
            f"{r['mib']:g}",
            f"{r['ag_gloo'] * ms:.2f}",
            f"{r['ag_symm'] * ms:.2f}",
            f"{r['ag_symm_buf'] * ms:.2f}",
            f"{r['ag_gloo'] / r['ag_symm_buf']:.1f}x",
            f"{r['rs_gloo'] * ms:.2f}",
            f"{r['rs_symm'] * ms:.2f}",
            f"{r['rs_symm_buf'] * ms:.2f}",
            f"{r['rs_gloo'] / r['rs_symm_buf']:.1f}x",
            f"{r['memcpy'] * ms:.2f}",
            f"{r['ag_symm_buf'] / r['memcpy']:.2f}",
            f"{r['rs_symm_buf'] / r['memcpy']:.2f}",
        ]  # fmt: skip
        for r in rows
    ]
    print(markdown_table(header, table))
    save_results("collectives", args, rows)


if __name__ == "__main__":
    main()
