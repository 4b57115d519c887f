"""Timelines: Chrome/Perfetto trace JSON and a PNG with one lane per rank and stream.

isp-timeline TRACE.json -o timeline.png
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from isp_comm.trace import LANES, chrome_events

COLORS = {
    "compute": "#4c78a8",
    "all-gather": "#f58518",
    "reduce-scatter": "#54a24b",
    "all-reduce": "#b279a2",
    "all-to-all": "#72b7b2",
    "wait": "#e45756",
}


def write_trace(path: str, spans_by_rank: list[list[tuple[str, str, float, float]]]) -> None:
    with open(path, "w") as f:
        json.dump({"traceEvents": chrome_events(spans_by_rank), "displayTimeUnit": "ms"}, f)


def draw(trace_path: str, png_path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(trace_path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    if not events:
        raise ValueError(f"{trace_path} holds no spans")
    ranks = sorted({e["pid"] for e in events})
    t0 = min(e["ts"] for e in events)
    rows = [(r, lane) for r in ranks for lane in LANES]
    fig, ax = plt.subplots(figsize=(14, 0.32 * len(rows) + 1.5))
    for y, (r, lane) in enumerate(rows):
        bars = [
            ((e["ts"] - t0) / 1e3, max(e["dur"] / 1e3, 0.01))
            for e in events
            if e["pid"] == r and LANES[e["tid"]] == lane
        ]
        ax.broken_barh(bars, (y - 0.4, 0.8), facecolors=COLORS[lane])
    ax.set_yticks(range(len(rows)), [f"rank {r} {lane}" for r, lane in rows], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("ms")
    ax.set_title("isp-comm: compute and communication per rank (collective spans: issue to observed completion)")
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    plt.close(fig)


def parser() -> argparse.ArgumentParser:
    """isp-timeline's arguments."""
    ap = argparse.ArgumentParser(prog="isp-timeline", description="Draw an isp-comm trace as a PNG timeline.")
    ap.add_argument("trace", help="a trace.json written by isp-train")
    ap.add_argument("-o", "--output", default="", help="the PNG (default: timeline.png next to the trace)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    args.output = args.output or os.path.join(os.path.dirname(os.path.abspath(args.trace)), "timeline.png")
    try:
        draw(args.trace, args.output)
    except (OSError, ValueError, KeyError) as exc:
        said = f"{args.trace}: {exc}" if isinstance(exc, json.JSONDecodeError) else str(exc)  # json's names no file
        print(f"isp-timeline: error: {said}", file=sys.stderr)
        return 2
    print(args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
