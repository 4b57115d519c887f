"""The planner's step for compiled blocks against isp-train on this machine's CPU.

    python bench/compiled_step.py --profile FILE [--repeats 3] [--steps 12] [--out DIR]

For each point of a small grid (world 1, one thread, the reference llama in fp32),
isp-train trains eager and with ``--compile`` (every block ``torch.compile``d, what
the planner's compiled step models: [Note: fused regions] in
``isp_comm/planner/fusion.py``), interleaved: each round runs every point eager then
compiled, so a slow stretch of the machine falls on both. Measured per run: the
median ``step_s`` after two warm-up steps (bench/plan_check.py's ``measure``); over
rounds, the median and range, and the median of each round's compiled over eager
ratio. Predicted: ``isp-train --plan --profile FILE``, with and without ``--compile``.
The profile must come from bench/calibrate.py on this machine.

Prints a markdown table and writes OUT/compiled_step.json (--out, default bench/results/local).

    python bench/compiled_step.py --profile FILE --rescore RESULTS

runs nothing: it scores the runs saved in RESULTS (a compiled_step.json) with FILE's
predictions (a calibration on a busy machine moves the absolute figures more than
the ratio; two calibrations side by side tell which part is which).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import add_out, markdown_table, progress, save_results  # noqa: E402
from bench.plan_check import MEDIUM, SMALL, measure, predict  # noqa: E402

GRID: list[tuple[str, list[str]]] = [
    ("S seq256 b4", [*SMALL, "--seq", "256", "--batch", "4"]),
    ("M seq128 b4", [*MEDIUM, "--seq", "128", "--batch", "4"]),
    ("M seq256 b8", [*MEDIUM, "--seq", "256", "--batch", "8"]),
    ("M seq128 b4 ckpt1", [*MEDIUM, "--seq", "128", "--batch", "4", "--ckpt", "1"]),
]
MODES = {"eager": [], "compiled": ["--compile"]}


def _span(values: list[float]) -> str:
    return f"{statistics.median(values) * 1e3:.1f} ({min(values) * 1e3:.1f}-{max(values) * 1e3:.1f})"


def _predicted(profile: str, flags: list[str]) -> dict[str, float]:
    """``isp-train --plan``'s step for ``flags`` on ``profile``, eager and compiled."""
    return {m: predict(profile, 1, [*flags, *extra])[0]["step_s"] for m, extra in MODES.items()}


def run(profile: str, repeats: int, steps: int) -> list[dict]:
    """Every point's predictions, then ``repeats`` rounds of its runs, eager and compiled."""
    rows = []
    for name, flags in GRID:
        row = {"point": name, "flags": flags, "measured": {m: [] for m in MODES}}
        row["predicted"] = _predicted(profile, flags)
        rows.append(row)
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(repeats):
            for row in rows:
                for mode, extra in MODES.items():
                    progress(f"bench/compiled_step.py: {row['point']} {mode}, round {r + 1}/{repeats}")
                    got = measure(1, [*row["flags"], *extra], steps, os.path.join(tmp, "run"))
                    row["measured"][mode].append(got["step_s"])
    return rows


def rescore(profile: str, results: str) -> list[dict]:
    """RESULTS' rows with ``profile``'s predictions in place of their own."""
    with open(results) as f:
        rows = json.load(f)["rows"]
    for row in rows:
        row["predicted"] = _predicted(profile, row["flags"])
    return rows


def table(rows: list[dict]) -> str:
    """Measured ms/step (median and range over rounds), predicted, and the ratios."""
    out = []
    for row in rows:
        meas, pred = row["measured"], row["predicted"]
        ratios = [c / e for e, c in zip(meas["eager"], meas["compiled"])]
        cells = [row["point"]]
        for mode in MODES:
            med = statistics.median(meas[mode])
            cells += [_span(meas[mode]), f"{pred[mode] * 1e3:.1f}", f"{100 * (pred[mode] / med - 1):+.1f}%"]
        cells += [f"{statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f})"]
        cells += [f"{pred['compiled'] / pred['eager']:.3f}"]
        out.append(cells)
    header = ["point", "eager ms", "planned", "error", "compiled ms", "planned", "error"]
    header += ["compiled/eager measured", "compiled/eager planned"]
    return markdown_table(header, out, "l" + "r" * (len(header) - 1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", required=True, help="this machine's profile (bench/calibrate.py)")
    ap.add_argument("--repeats", type=int, default=3, help="rounds (each point eager, then compiled)")
    ap.add_argument("--steps", type=int, default=12, help="steps per run (the first two are warm-up)")
    ap.add_argument("--rescore", metavar="RESULTS", help="score a saved compiled_step.json's runs; run nothing")
    add_out(ap)
    args = ap.parse_args()
    rows = rescore(args.profile, args.rescore) if args.rescore else run(args.profile, args.repeats, args.steps)
    print(table(rows))
    print(save_results("compiled_step_rescore" if args.rescore else "compiled_step", args, rows))


if __name__ == "__main__":
    main()
