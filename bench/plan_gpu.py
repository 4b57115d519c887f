"""The planner against measurement on one GPU: step time and peak memory at world 1.

    python bench/plan_gpu.py [--repeats 3] [--steps 10] [--out DIR]

Four sizes of isp-train's reference llama around bench/gpu.py's 697M one (hidden
2048, 12 layers, vocab 32000; isp-train's MLP is llama's, 8/3 of the hidden size
rounded up to a multiple of 256: 5632, as bench/gpu.py's), trained on random tokens
of a 32000-word vocabulary (a .npy file), at seq 2048 x batch 4 in bf16:
``isp-train --plan --device cuda`` predicts on the nominal target of this GPU (the
published peak and bandwidth of bench's table, nothing calibrated here), and
isp-train trains the same flags ``--repeats`` times. Measured per run: the median
``step_s`` of metrics.jsonl after its first two steps, and ``peak_alloc_mib``
(``torch.cuda.max_memory_allocated``); over runs, the median and range. Predicted:
``step_s`` and the highest of the wrap, forward, backward and optimizer phases.
The measured runs save no final checkpoint (``--no-final-save``) and each run's
folder is removed once measured, so the disk holds none of them.

``--virtual`` checks the multi-GPU predictions too: isp-train ``--virtual-world N``
(one rank of an N-rank job on this GPU, every collective taking the planner's
modelled time on published H100 figures, docs/virtual.md) against ``--plan --target
h100x8 --nodes N/8`` of the same flags, for the layouts of :data:`VIRTUAL` (wp = N,
4 sequences a rank). The two share the link model, so this checks the compute, the
memory and the overlap of a prediction, not the network's.

Prints a markdown table and writes OUT/plan_gpu.json (--out, default bench/results/local).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import add_out, save_results  # noqa: E402
from bench.plan_check import error_table, scored_row  # noqa: E402
from isp_comm.planner.calibrate import measure_run  # noqa: E402

SIZES = {  # name: (hidden, layers, heads, kv heads)
    "170M": (1024, 12, 8, 4),
    "390M": (1536, 12, 12, 4),
    "680M": (2048, 12, 16, 8),
    "1.4B": (2560, 16, 20, 4),
}
VOCAB = 32000
FLAGS = ["--device", "cuda", "--seq", "2048", "--batch", "4", "--no-trace", "--log-every", "1000"]
MEASURED = ["--no-final-save"]
"""Flags of the measured runs only: no final checkpoint (8 GB a run at 680M, 15 GB at
1.4B, into a folder a later run reuses: the defaults wrote 93 GB on a 64 GiB disk)."""
PHASES = ("wrap", "forward", "backward", "optimizer")
PEAK = "peak_alloc_mib"
"""The measured peak compared (``torch.cuda.max_memory_allocated``)."""
VIRTUAL = [("680M", 8), ("1.4B", 16), ("1.4B", 64)]
"""(model, world N): one node of 8 H100s, two, and eight."""


def virtual_flags(world: int) -> tuple[list[str], list[str]]:
    """The flags a virtual run of ``world`` ranks and its plan share, and the run's own."""
    layout = ["--wp", str(world), "--batch", str(4 * world), "--target", "h100x8", "--nodes", str(world // 8)]
    return layout, ["--virtual-world", str(world)]


def model_flags(hidden: int, layers: int, heads: int, kv: int) -> list[str]:
    return ["--hidden", str(hidden), "--layers", str(layers), "--heads", str(heads), "--kv-heads", str(kv)]


def predict(flags: list[str]) -> dict:
    cmd = [sys.executable, "-m", "isp_comm.train", "--plan", *flags]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if res.returncode:
        raise RuntimeError(res.stderr[-2000:])
    return json.loads(res.stdout.strip().splitlines()[-1])


def measure(flags: list[str], steps: int, out: str) -> dict:
    """One measured run into ``out``, without a final checkpoint; the folder is
    removed after (only its metrics were wanted)."""
    try:
        return measure_run([*flags, *MEASURED], 1, steps, out, 600)
    finally:
        shutil.rmtree(out, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--sizes", default=",".join(SIZES), help="which of the four models")
    ap.add_argument("--virtual", action="store_true", help="also one rank of 8, 16 and 64-GPU jobs (--virtual-world)")
    add_out(ap)
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        data = os.path.join(tmp, "tokens.npy")  # the vocabulary is the largest id + 1
        tokens = np.random.default_rng(0).integers(0, VOCAB, 2_000_000, dtype=np.int32)
        tokens[0] = VOCAB - 1
        np.save(data, tokens)
        for name in args.sizes.split(","):
            flags = [*model_flags(*SIZES[name]), "--data", data, *FLAGS]
            pred = predict(flags)
            runs = [measure(flags, args.steps, os.path.join(tmp, f"run{r}")) for r in range(args.repeats)]
            peak = max(pred[ph] for ph in PHASES)
            head = {"name": name, "size": SIZES[name]}
            rows.append(scored_row(head, pred["step_s"], peak, runs, PEAK))
        for name, world in VIRTUAL if args.virtual else []:
            layout, own = virtual_flags(world)
            flags = [*model_flags(*SIZES[name]), "--data", data, *FLAGS, *layout]
            pred = predict(flags)
            runs = [measure([*flags, *own], args.steps, os.path.join(tmp, f"v{r}")) for r in range(args.repeats)]
            peak = max(pred[ph] for ph in PHASES)
            rows.append(
                scored_row({"name": f"{name} N={world}", "size": SIZES[name]}, pred["step_s"], peak, runs, PEAK)
            )
    print(error_table(rows, {"model": "name"}, PEAK, "measured peak allocated MiB", mib=".0f"))
    print(save_results("plan_gpu", args, rows))


if __name__ == "__main__":
    main()
