"""Where every byte of a measured peak goes, beside the memory forecast's lines.

    python bench/memory_breakdown.py [--only I ...] [--repeat N]   # the forecast grid's points, CPU ranks
    python bench/memory_breakdown.py --review [--repeat N]          # Llama-3-8B's layout, 8x narrower, virtual

Each point trains two steps under ``isp_comm.memory_breakdown.MemoryBreakdown`` (the
second step's peaks: the steady state) and prints, for rank 0's forward, backward (and
its two moments: the loss's backward, the model's), and optimizer phases, every part
measured beside the forecast's line of the same name, the tracked peak, and what the
process held beyond it (CPU: allocator slack and runtime).

``--review``: issue 55's outside review read isp-comm's memory on Llama-3-8B at 8
GPUs (wp 8, the outer parameters sharded, every block checkpointed, bf16 compute,
sequences of 8192) from the code. The same layout runs here as rank 0 of a virtual
world of 8 (torch's fake process group, collectives that take no time) at 1/8 of the
width (hidden 512, MLP 1792, 4 heads of 128, one KV head), 1/8 of the vocabulary
(16,032) and 1/8 of the sequence (1,024), 4 blocks: every per-block buffer, the
embedding and head, and the logits are 1/64 of the 8B's; the number of blocks is 1/8.
It prints the review's items as measured, and each scaled back by 64.

Writes OUT/memory_breakdown.json (--out, default bench/results/local).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import MIB, add_out, markdown_table, progress, save_results  # noqa: E402
from bench.forecast import grid  # noqa: E402
from tests.memory_probe import Point, breakdown_steps, build_model, forecast_point, isp_config, measure_breakdown  # noqa: E402

REVIEW = Point(
    world=8, wp=8, ckpt=1.0, shard_outer=True, bf16=True, hidden=512, ffn=1792, heads=4, kv_heads=1, vocab=16032,
    seq=1024, batch=8, layers=4,
)  # fmt: skip
SCALE = 64
"""The review point's per-block buffers, embedding, head and logits are 1/64 of Llama-3-8B's."""
PHASES = ("forward", "backward", "backward/loss", "backward/model", "optimizer")


def _virtual_rank(rank: int, world: int, pt: Point) -> dict:
    import torch

    from isp_comm import ISPCommunicator, ParallelGroups
    from isp_comm.virtual import FlatLink, virtual_backend

    model = build_model(pt)
    backend = virtual_backend(torch.device("cpu"), FlatLink(1e12))
    comm = ISPCommunicator(model, ParallelGroups.create(wp_size=pt.wp), isp_config(pt), backend=backend)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    try:
        return breakdown_steps(model, comm, opt, pt, rank).as_dict()
    finally:
        comm.close()


def measure(pt: Point, virtual: bool) -> dict:
    """Rank 0's breakdown of ``pt`` (as plain data)."""
    if virtual:
        from isp_comm.testing import run_virtual

        return run_virtual(_virtual_rank, pt.world, 0, pt, timeout_s=900)
    return measure_breakdown(pt)[0].as_dict()


def review_items(b: dict, pt: Point) -> list[list[str]]:
    """The outside review's items (issue 55), as measured at the backward's peak."""
    loss = b["phases"]["backward/loss"]
    tokens = pt.batch // pt.world * pt.seq
    held = tokens * pt.vocab * (2 if pt.bf16 else 4)
    items = [
        ("two slots, landing and cast buffers", loss.get("pool slots and landing", 0), "about 1.3 GiB"),
        ("two reduce-scatter pairs (allocated at wrap)", loss.get("reduce-scatter buffers", 0), "about 1.8 GiB"),
        ("the gathered head and final norm", loss.get("outer gather", 0), "about 1.0 GiB"),
        ("the embedding-gradient bucket (one replica)", loss.get("all-reduce buffers", 0), "about 0.25 GiB"),
        ("the loss backward's fp32 logits-sized tensors", loss.get("logits and loss", 0) - held, "about 11.7 GiB (3)"),
    ]
    return [[name, f"{got / MIB:.2f}", f"{got * SCALE / 2**30:.2f}", said] for name, got, said in items]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", type=int, nargs="*", help="grid indices (bench/forecast.py's small grid)")
    ap.add_argument("--review", action="store_true", help="the review's layout in a virtual world of 8")
    ap.add_argument("--repeat", type=int, default=1, help="runs of each point (median and range)")
    add_out(ap)
    args = ap.parse_args()
    points = [REVIEW] if args.review else [p for i, p in enumerate(grid("small")) if not args.only or i in args.only]
    rows = []
    for pt in points:
        runs = []
        for rep in range(args.repeat):
            progress(f"[{rep + 1}/{args.repeat}] {pt.label()}")
            runs.append(measure(pt, virtual=args.review))
        fc = forecast_point(pt)
        print(f"\n### {pt.label()}" + (f" (median of {args.repeat})" if args.repeat > 1 else ""))
        for ph in PHASES:
            med = _median(runs, ph)
            tracked = sorted(r["tracked"][ph] for r in runs)
            spread = f" ({tracked[0] / MIB:.2f}-{tracked[-1] / MIB:.2f})" if len(runs) > 1 else ""
            print(f"\n{ph}: tracked peak {med['tracked'] / MIB:.2f} MiB{spread}\n")
            print(_table(med, fc.phases[ph.split("/")[0]]))
            for line in med["device"]:
                got = sorted(r["device"][ph].get(line, 0) / MIB for r in runs)
                print(f"\n{line}: {statistics.median(got):.2f} MiB ({got[0]:.2f}-{got[-1]:.2f}) over {len(got)} runs")
        if args.review:
            print("\nThe review's items at the loss backward's peak (rank 0; x64: Llama-3-8B's scale):\n")
            header = ["item", "measured MiB", "x64 GiB", "review"]
            print(markdown_table(header, review_items(runs[0], pt), "lrrl"))
        rows.append({"point": pt.label(), "runs": runs})
    print(f"raw: {save_results('memory_breakdown', args, rows)}")


def _median(runs: list[dict], phase: str) -> dict:
    """The phase's parts and device lines, each the median over the runs."""
    parts = list(dict.fromkeys(p for r in runs for p in r["phases"][phase]))
    lines = list(dict.fromkeys(k for r in runs for k in r["device"][phase]))
    return {
        "parts": {p: statistics.median(r["phases"][phase].get(p, 0) for r in runs) for p in parts},
        "device": {k: statistics.median(r["device"][phase].get(k, 0) for r in runs) for k in lines},
        "tracked": statistics.median(r["tracked"][phase] for r in runs),
    }


def _table(med: dict, forecast_parts: dict[str, int]) -> str:
    from isp_comm.memory_breakdown import Breakdown

    b = Breakdown({"p": med["parts"]}, {"p": med["tracked"]}, {"p": med["device"]}, 0)
    return b.table("p", forecast_parts)


if __name__ == "__main__":
    main()
