"""The memory forecast against measured peaks, phase by phase, over a grid of runs.

    python bench/forecast.py [--grid small|full] [--only I ...] [--repeat N] [--big SEQ]

Each grid point trains a small model for real on CPU ranks and measures each phase's
peak above the rank's baseline, as tests/memory_probe.py says (RSS less file pages,
glibc returning freed memory; ``torch.cuda.max_memory_allocated`` with ``--device
cuda``). Rank 0's figures are compared (the forecast is rank 0's: its shards are the
largest). ``--big SEQ`` prints the forecast alone for 7B, 13B and 70B llamas on 80 GB
GPUs.

Prints forecast, measured and error per phase and grid point, and writes
OUT/forecast.json (--out, default bench/results/local).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from dataclasses import asdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import MIB, add_out, markdown_table, progress, save_results  # noqa: E402
from tests.memory_probe import Point, forecast_point, measure  # noqa: E402


def compare(pt: Point, device: str = "cpu") -> list[dict]:
    """Rows of (phase, forecast, measured, error) for ``pt`` (rank 0)."""
    fc = forecast_point(pt, device)
    measured = measure(pt, device)[0]
    rows = []
    for phase, got in measured["measured"].items():
        want = fc.peak(phase)
        rows.append(
            {
                "point": pt.label(),
                "phase": phase,
                "forecast_mib": want / MIB,
                "measured_mib": got / MIB,
                "error_pct": 100.0 * (want - got) / got if got > 0 else float("inf"),
                "biggest": fc.biggest(phase)[0],
                "baseline_mib": measured["baseline"] / MIB,
            }
        )
    return rows


def grid(which: str) -> list[Point]:
    """The issue's grid: world 1/2/4, wp and sp splits, ckpt 0/0.5/1, shard-outer and
    vocab-parallel, fp32 and bf16, SGD and AdamW, the reference llama and a Qwen2."""
    pts = [
        Point(world=1, wp=1),
        Point(world=2, wp=2),
        Point(world=4, wp=4),
        Point(world=4, wp=2),
        Point(world=4, wp=2, sp=2),
        Point(world=2, wp=2, ckpt=0.5),
        Point(world=2, wp=2, ckpt=1.0),
        Point(world=2, wp=2, shard_outer=True),
        Point(world=2, wp=2, vocab_parallel=True),
        Point(world=2, wp=2, bf16=True),
        Point(world=2, wp=2, optimizer="sgd"),
        Point(world=2, wp=2, model="qwen2"),
    ]
    if which == "full":
        pts += [
            Point(world=4, wp=4, ckpt=1.0, shard_outer=True, bf16=True),
            Point(world=4, wp=2, sp=2, model="qwen2", optimizer="sgd_momentum"),
        ]
    return pts


LLAMAS = {  # (hidden, ffn, layers, heads, kv heads, vocab): Llama-2 7B and 13B, Llama-3 70B
    "7B": (4096, 11008, 32, 32, 32, 32000),
    "13B": (5120, 13824, 40, 40, 40, 32000),
    "70B": (8192, 28672, 80, 64, 8, 128256),
}
USABLE_GIB = 76.0
"""Of an 80 GB GPU's 79.1 GiB (H100 SXM), what tensors may take: the CUDA context,
NCCL's buffers and the caching allocator's fragmentation need the rest."""


def big_models(seq: int) -> list[dict]:
    """The forecast (no run) for 7B, 13B and 70B llamas on 80 GB GPUs: bf16 compute,
    fp32 master weights and AdamW, one sequence of ``seq`` tokens per rank."""
    import torch

    from isp_comm import ISPConfig
    from isp_comm.memory_forecast import forecast
    from isp_comm.models.llama import LlamaConfig, build

    rows = []
    for name, (h, f, n, a, kv, v) in LLAMAS.items():
        with torch.device("meta"):
            model = build(LlamaConfig(vocab_size=v, hidden=h, ffn_hidden=f, n_layers=n, n_heads=a, n_kv_heads=kv))
        for world in (8, 16, 64):
            for ckpt, outer in ((0.0, False), (1.0, False), (1.0, True)):
                cfg = ISPConfig(
                    param_dtype=torch.bfloat16, reduce_dtype=torch.float32, activation_checkpointing=ckpt,
                    shard_outer_params=outer,
                )  # fmt: skip
                fc = forecast(model, cfg, world, world, 1, world, seq, device="cuda")
                worst = fc.worst()
                gib = {ph: fc.peak(ph) / 2**30 for ph in ("forward", "backward", "optimizer", "async_save")}
                rows.append(
                    {"model": name, "world": world, "ckpt": ckpt, "shard_outer": outer, "seq": seq, **gib,
                     "worst": worst, "biggest": fc.biggest(worst)[0], "fits": fc.peak(worst) / 2**30 <= USABLE_GIB}
                )  # fmt: skip
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--grid", choices=["small", "full"], default="small")
    ap.add_argument("--big", type=int, metavar="SEQ", help="print the 7B/13B/70B forecasts at this seq instead")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--only", type=int, nargs="*", help="grid indices to run")
    ap.add_argument("--repeat", type=int, default=1, help="runs of the grid (median and range)")
    ap.add_argument("--summarize", nargs="*", metavar="JSON", help="summarise earlier runs' raw JSON instead")
    add_out(ap)
    args = ap.parse_args()
    if args.big:
        big = big_models(args.big)
        table = [
            [r["model"], r["world"], f"{r['ckpt']:g}", "yes" if r["shard_outer"] else "no", f"{r['forward']:.1f}",
             f"{r['backward']:.1f}", f"{r['optimizer']:.1f}", f"{r['async_save']:.1f}",
             f"{r['biggest']} ({r['worst']})", "yes" if r["fits"] else "**no**"]
            for r in big
        ]  # fmt: skip
        header = ["model", "GPUs", "ckpt", "shard-outer", "forward GiB", "backward GiB", "optimizer GiB"]
        header += ["async save GiB", "biggest part (phase)", f"fits ({USABLE_GIB:g} GiB)"]
        print(markdown_table(header, table, "lrrlrrrrlr"))
        print(f"raw: {save_results('forecast_big', args, big)}")
        return
    if args.summarize:
        runs = []
        for path in args.summarize:
            with open(path) as f:
                runs.append(json.load(f)["rows"])
        print(summary(runs))
        return
    runs = []
    points = grid(args.grid)
    for rep in range(args.repeat):
        rows: list[dict] = []
        for i, pt in enumerate(points):
            if args.only and i not in args.only:
                continue
            progress(f"[run {rep + 1}/{args.repeat}, {i + 1}/{len(points)}] {pt.label()}")
            got = compare(pt, args.device)
            progress("  " + ", ".join(f"{r['phase']} {r['error_pct']:+.1f}%" for r in got))
            rows += [{**r, "config": asdict(pt)} for r in got]
        runs.append(rows)
    print(summary(runs))
    print(f"raw: {save_results('forecast', args, [r for rows in runs for r in rows])}")


def summary(runs: list[list[dict]]) -> str:
    """One row per grid point: each phase's error, median of the runs with the range,
    then the forecast and measured MiB of the phase with the largest error."""
    by: dict[tuple[str, str], list[dict]] = {}
    for rows in runs:
        for r in rows:
            by.setdefault((r["point"], r["phase"]), []).append(r)
    points = list(dict.fromkeys(p for p, _ in by))
    phases = list(dict.fromkeys(ph for _, ph in by))
    table, within, total = [], 0, 0
    for pt in points:
        cells = []
        for ph in phases:
            errs = sorted(r["error_pct"] for r in by[(pt, ph)])
            med = statistics.median(errs)
            within += abs(med) <= 10
            total += 1
            span = f" ({errs[0]:+.1f}..{errs[-1]:+.1f})" if len(errs) > 1 else ""
            cells.append(f"{med:+.1f}%{span}")
        table.append([pt, *cells])
    n = len(runs)
    detail = []
    for (pt, ph), rs in by.items():
        fc = statistics.median(r["forecast_mib"] for r in rs)
        me = statistics.median(r["measured_mib"] for r in rs)
        err = statistics.median(r["error_pct"] for r in rs)
        detail.append([pt, ph, f"{fc:.1f}", f"{me:.1f}", f"{err:+.1f}%", rs[0]["biggest"]])
    header = ["point", "phase", "forecast MiB", "measured MiB", "error", "biggest part"]
    detailed = markdown_table(header, detail, "llrrrl")
    head = markdown_table(["point", *phases], table, "l" + "r" * len(phases))
    return (
        f"{detailed}\n\nError per phase, median of {n} run{'s' * (n > 1)} (range):\n\n{head}\n\n"
        f"{within} of {total} phases within 10%"
    )


if __name__ == "__main__":
    main()
