"""What sequence parallelism buys: the longest sequence that trains on 4 ranks within a
per-rank memory budget, with sp = 4 (one sequence split over the four ranks) against
sp = 1 (each rank trains whole sequences), weights sharded over all four (wp = 4).

    python bench/sequence.py [--budget-mib 1024] [--start 1024] [--max-seq 65536]

Each (sp, sequence length) runs in fresh processes: one SGD step on one sequence per
SP group, then the peak RSS of each rank (VmHWM, whole process: interpreter, torch,
model shards, activations, communication buffers). Lengths double from --start until
a rank's peak exceeds the budget. Prints a markdown table and writes
OUT/sequence.json (--out, default bench/results/local).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import MIB, add_out, markdown_table, proc_status_bytes, save_results  # noqa: E402
from isp_comm import ISPCommunicator, ISPConfig, ParallelGroups  # noqa: E402
from isp_comm.models.llama import LlamaConfig, build  # noqa: E402
from isp_comm.testing import run_ranks  # noqa: E402

WORLD = 4
CFG = dict(vocab_size=256, hidden=256, ffn_hidden=688, n_layers=4, n_heads=8, n_kv_heads=4)


def _worker(rank: int, world: int, sp: int, seq: int) -> dict:
    cfg = LlamaConfig(**CFG, max_seq_len=seq)
    with torch.device("meta"):
        model = build(cfg)
    comm = ISPCommunicator(model, ParallelGroups.create(wp_size=world, sp_size=sp), ISPConfig())
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    sp_rank, dp_rank = rank % sp, rank // sp
    x = torch.randint(0, cfg.vocab_size, (1, seq + 1), generator=torch.Generator().manual_seed(dp_rank))
    lo, hi = sp_rank * seq // sp, (sp_rank + 1) * seq // sp
    t0 = time.perf_counter()
    logits = model(x[:, lo:hi], position_ids=torch.arange(lo, hi))
    F.cross_entropy(logits.flatten(0, 1), x[0, lo + 1 : hi + 1]).backward()
    opt.step()
    step_s = time.perf_counter() - t0
    comm.close()
    return {"sp": sp, "seq": seq, "rank": rank, "peak_rss": proc_status_bytes("VmHWM"), "step_s": step_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget-mib", type=float, default=1024)
    ap.add_argument("--start", type=int, default=1024)
    ap.add_argument("--max-seq", type=int, default=65536)
    add_out(ap)
    args = ap.parse_args()
    rows, longest = [], {}
    for sp in (1, WORLD):
        seq = args.start
        while seq <= args.max_seq:
            res = run_ranks(_worker, WORLD, sp, seq, timeout_s=1800, start="spawn")
            row = {**max(res, key=lambda r: r["peak_rss"]), "step_s": max(r["step_s"] for r in res)}
            row["fits"] = row["peak_rss"] <= args.budget_mib * MIB
            rows.append(row)
            print(f"sp {sp} seq {seq}: peak {row['peak_rss'] / MIB:.0f} MiB, step {row['step_s']:.1f} s", flush=True)
            if not row["fits"]:
                break
            longest[sp] = seq
            seq *= 2
    print(
        f"\n{WORLD} ranks, wp = 4, llama hidden {CFG['hidden']} x {CFG['n_layers']} layers, one sequence per SP "
        f"group, budget {args.budget_mib:.0f} MiB per rank\n"
    )
    table = [
        [r["sp"], r["seq"], f"{r['peak_rss'] / MIB:.0f}", f"{r['step_s']:.1f}", "yes" if r["fits"] else "no"]
        for r in rows
    ]
    print(markdown_table(["sp", "sequence", "peak RSS / rank (MiB)", "step (s)", "within budget"], table))
    print("\n" + ", ".join(f"sp = {sp}: longest {n} tokens" for sp, n in longest.items()))
    save_results("sequence", args, rows)


if __name__ == "__main__":
    main()
