"""What a rank holds under each state sharding, measured and forecast, side by side.

    python bench/sharding.py [--world 8] [--wp 2] [--repeat 3]

One run of the same model for each ``ISPConfig.state_sharding`` ("wp": gradients and
optimizer state over the WP group; "world": over the whole job), at ``--world`` ranks
with WP ``--wp``, AdamW, fp32. Per sharding, from rank 0:

- the optimizer state's tensors (AdamW's two moments of every sharded parameter) and
  the parameters' (masters) bytes, counted from the tensors themselves, and as a
  fraction of the sharded parameters' full size;
- each phase's peak RSS above the baseline (tests/memory_probe.py, as bench/forecast.py
  measures) against the memory forecast of the same point.

The model is wide and short (hidden 512, 4 blocks, sequences of 64): the weights and
their optimizer state, not the activations, are most of a rank's memory, so what the
sharding moves shows in RSS. Prints a markdown table; writes OUT/sharding.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import MIB, add_out, markdown_table, progress, save_results  # noqa: E402
from isp_comm.memory_forecast import PHASES  # noqa: E402
from isp_comm.testing import run_ranks  # noqa: E402
from tests.memory_probe import Point, build_model, forecast_point, isp_config, measure  # noqa: E402


def point(world: int, wp: int, sharding: str) -> Point:
    return Point(world=world, wp=wp, hidden=512, layers=4, vocab=1024, batch=world, seq=64, state_sharding=sharding)


def _tensors(rank: int, world: int, pt: Point) -> dict:
    """Bytes of the sharded parameters, their AdamW state and their full size, after a step."""
    import torch

    from isp_comm import ISPCommunicator, ParallelGroups

    torch.set_num_threads(1)
    model = build_model(pt)
    comm = ISPCommunicator(model, ParallelGroups.create(wp_size=pt.wp), isp_config(pt))
    full = sum(sp.full_numel * sp.dtype.itemsize for u in comm.units for sp in u.params)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, pt.vocab, (pt.batch // world, pt.seq))
    comm.cross_entropy(model(ids), ids).backward()
    opt.step()
    shards = {id(s): s for u in comm.units for s in u.shards}
    state = sum(t.nbytes for p, st in opt.state.items() if id(p) in shards for t in st.values() if t.dim() > 0)
    params = sum(s.nbytes for s in shards.values())
    comm.close()
    return {"full": full, "params": params, "state": state}


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--wp", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3, help="runs of the RSS measurement per sharding (median)")
    add_out(ap)
    args = ap.parse_args()
    rows = []
    for sharding in ("wp", "world"):
        pt = point(args.world, args.wp, sharding)
        held = run_ranks(_tensors, args.world, pt, timeout_s=300, start="spawn")[0]
        fc = forecast_point(pt)
        runs = []
        for i in range(args.repeat):
            progress(f"[{sharding} {i + 1}/{args.repeat}] {pt.label()}")
            runs.append(measure(pt)[0]["measured"])
        for ph in PHASES:
            got = [r[ph] for r in runs]
            rows.append(
                {
                    "sharding": sharding,
                    "phase": ph,
                    "measured_mib": [g / MIB for g in got],
                    "forecast_mib": fc.peak(ph) / MIB,
                    "error_pct": 100 * (fc.peak(ph) - statistics.median(got)) / statistics.median(got),
                    **{f"{k}_bytes": v for k, v in held.items()},
                }
            )
    print(f"world {args.world}, wp {args.wp}, AdamW, fp32; rank 0; {args.repeat} runs (median, range)\n")
    firsts = [r for r in rows if r["phase"] == PHASES[0]]
    print(
        markdown_table(
            ["state sharding", "params MiB", "optimizer state MiB", "state / full sharded params"],
            [
                (
                    r["sharding"],
                    f"{r['params_bytes'] / MIB:.2f}",
                    f"{r['state_bytes'] / MIB:.2f}",
                    f"1/{r['full_bytes'] * 2 / r['state_bytes']:.2f}",
                )
                for r in firsts
            ],  # fmt: skip
            "lrrr",
        )
    )
    print()
    print(
        markdown_table(
            ["state sharding", "phase", "measured peak MiB", "forecast MiB", "error %"],
            [
                (
                    r["sharding"],
                    r["phase"],
                    _spread(r["measured_mib"]),
                    f"{r['forecast_mib']:.1f}",
                    f"{r['error_pct']:+.1f}",
                )
                for r in rows
            ],  # fmt: skip
            "llrrr",
        )
    )
    print(f"\nraw: {save_results('sharding', args, rows)}")


if __name__ == "__main__":
    main()
