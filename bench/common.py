"""Helpers the benchmarks share: process memory figures, markdown tables, raw JSON."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

MIB = 2**20
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def proc_status_bytes(field: str) -> int:
    """A ``/proc/self/status`` memory field (``VmRSS``, ``VmHWM``, ...) in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def reset_peak_rss() -> None:
    """Reset this process's VmHWM to its current RSS."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]], align: str | None = None) -> str:
    """A markdown table; ``align`` has one character per column, ``l`` or ``r``."""
    align = align or "r" * len(header)
    rule = ["---" if a == "l" else "---:" for a in align]
    lines = [header, rule, *[[str(c) for c in r] for r in rows]]
    return "\n".join("| " + " | ".join(line) + " |" for line in lines)


def save_results(name: str, args: object, rows: list) -> str:
    """Write ``{"args": ..., "rows": ...}`` to ``bench/results/NAME.json``; returns the path."""
    os.makedirs(RESULTS, exist_ok=True)
    path = os.path.join(RESULTS, f"{name}.json")
    with open(path, "w") as f:
        json.dump({"args": vars(args) if hasattr(args, "__dict__") else args, "rows": rows}, f, indent=1)
    return path
