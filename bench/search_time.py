"""How long a user waits for ``isp-train --plan --search`` on published shapes.

    python bench/search_time.py [--repeats 3] [--out DIR]

Runs the command as a user types it (a fresh process each time: Python's start and
the imports included) on a folder holding only a Hugging Face ``config.json``, for
Llama-3-8B on one node of 8 H100s and Llama-3-70B on 8 and on 128 nodes (seq 8192,
one sequence a rank, bf16), ``--repeats`` times each, in rounds. Prints the median
wall time with its range, the layouts counted and the fastest layout that fits;
writes OUT/search_time.json. The planner plans from published figures
(``--target h100x8``), so nothing here needs a GPU or a calibration.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import add_out, markdown_table, progress, save_results  # noqa: E402

SHAPES = {  # Hugging Face config.json fields of the published models
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32),
    "llama3-70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64),
}
POINTS = [("llama3-8b", 1), ("llama3-70b", 8), ("llama3-70b", 128)]  # (shape, nodes of 8)


def write_config(folder: str, shape: str) -> str:
    """A folder holding ``shape``'s config.json, as a user passes to ``--model``."""
    path = os.path.join(folder, shape)
    os.makedirs(path, exist_ok=True)
    cfg = {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 128256,
        "num_key_value_heads": 8, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
        "max_position_embeddings": 8192, "tie_word_embeddings": False, "hidden_act": "silu",
        **SHAPES[shape],
    }  # fmt: skip
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return path


def run_search(model: str, nodes: int) -> dict:
    """One ``--plan --search``: wall seconds, layouts counted, the first row."""
    cmd = [sys.executable, "-m", "isp_comm.train", "--plan", "--search", "--model", model, "--target", "h100x8"]
    cmd += ["--nodes", str(nodes), "--seq", "8192", "--batch", str(8 * nodes), "--bf16"]
    t0 = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=True).stdout
    seconds = time.perf_counter() - t0
    counted = re.search(r"^(\d+) layouts, (\d+) fit", out, re.M)
    first = next(line for line in out.splitlines() if line.startswith("| 1 |"))
    return {"seconds": seconds, "layouts": int(counted[1]), "fit": int(counted[2]), "first": first}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    add_out(ap)
    args = ap.parse_args()
    runs: dict[tuple[str, int], list[dict]] = {p: [] for p in POINTS}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            for shape, nodes in POINTS:
                progress(f"bench/search_time.py: {shape} on {nodes} x 8, run {r + 1}/{args.repeats}")
                runs[shape, nodes].append(run_search(write_config(tmp, shape), nodes))
    rows, table = [], []
    for (shape, nodes), done in runs.items():
        secs = [d["seconds"] for d in done]
        rows.append({"shape": shape, "gpus": 8 * nodes, "seconds": secs, **{k: done[0][k] for k in ("layouts", "fit")}})
        rows[-1]["first"] = done[0]["first"]
        med = f"{statistics.median(secs):.1f} ({min(secs):.1f}-{max(secs):.1f})"
        table.append([shape, 8 * nodes, done[0]["layouts"], done[0]["fit"], med])
    print(markdown_table(["model", "GPUs", "layouts", "fit", "seconds, median (range)"], table, "lrrrr"))
    for row in rows:
        print(f"{row['shape']} on {row['gpus']}: {row['first']}")
    print(f"raw JSON: {save_results('search_time', args, rows)}")


if __name__ == "__main__":
    main()
