"""The wrapper's own cost per block, on CPU: many tiny blocks, so that a step's time is
mostly what the wrapper does around each block, not the block's compute.

    python bench/overhead.py [--blocks 64] [--width 16] [--steps 20] [--repeats 5] [--bf16]

World 1, one thread, gloo. The same model of ``--blocks`` llama blocks of width
``--width`` (batch 1, seq 8) runs forward, backward and an SGD step under:
- ``plain``: plain PyTorch (the floor);
- ``fsdp2``: ``fully_shard`` per block and root (with ``MixedPrecisionPolicy(bf16,
  fp32)`` under ``--bf16``);
- ``isp``: ``ISPCommunicator`` (``param_dtype=bf16, reduce_dtype=fp32`` under ``--bf16``).

The runs alternate ``--repeats`` times (plain, fsdp2, isp, plain, ...), each a timed
window of ``--steps`` steps after 3 warm-up steps. Per-block overhead = (median ms
per step - plain's median) / blocks. Goal (issue 21): isp's per-block overhead at
most FSDP2's. Prints a markdown table; raw figures to --out (default bench/results/local/overhead.json).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench.common import LOCAL, wrap_world1  # noqa: E402
from isp_comm.models.llama import Llama, LlamaConfig  # noqa: E402

RUNS = ("plain", "fsdp2", "isp")


def build(kind: str, cfg: LlamaConfig, bf16: bool):
    torch.manual_seed(0)
    model = Llama(cfg)
    comm = wrap_world1(kind, model, bf16)
    return model, comm


def window(kind: str, cfg: LlamaConfig, args) -> float:
    """ms per step of one timed window (a fresh model each time)."""
    model, comm = build(kind, cfg, args.bf16)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randint(0, cfg.vocab_size, (1, 8))
    autocast = kind == "plain" and args.bf16

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits = model(x)
        F.cross_entropy(logits.flatten(0, 1).float(), x.flatten()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(3):
        step()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step()
    ms = (time.perf_counter() - t0) / args.steps * 1e3
    if comm is not None:
        comm.close()
    return ms


def main() -> None:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))  # the first paragraph
    ap.add_argument("--blocks", type=int, default=64)
    ap.add_argument("--width", type=int, default=16)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--out", default=os.path.join(LOCAL, "overhead.json"), help="the raw JSON (untracked by default)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    os.environ.update(RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # no port: one process
    w = args.width
    cfg = LlamaConfig(vocab_size=32, hidden=w, ffn_hidden=2 * w, n_layers=args.blocks, n_heads=2, n_kv_heads=1)
    times: dict[str, list[float]] = {k: [] for k in RUNS}
    for _ in range(args.repeats):
        for kind in RUNS:
            times[kind].append(window(kind, cfg, args))
    dist.destroy_process_group()
    med = {k: statistics.median(v) for k, v in times.items()}
    print(
        f"\n{args.blocks} blocks of width {w}, world 1, 1 thread, {'bf16' if args.bf16 else 'fp32'}; "
        f"median of {args.repeats} alternating windows of {args.steps} steps (range)\n"
    )
    print("| run | ms/step | per-block overhead vs plain, us |")
    print("|---|---:|---:|")
    rows = []
    for kind in RUNS:
        over = (med[kind] - med["plain"]) / args.blocks * 1e3
        lo, hi = min(times[kind]), max(times[kind])
        print(
            f"| {kind} | {med[kind]:.2f} ({lo:.2f}-{hi:.2f}) | {over:.0f} |"
            if kind != "plain"
            else f"| {kind} | {med[kind]:.2f} ({lo:.2f}-{hi:.2f}) | - |"
        )
        rows.append({"run": kind, "ms": times[kind], "median_ms": med[kind], "per_block_us": over})
    isp, fsdp = rows[2]["per_block_us"], rows[1]["per_block_us"]
    print(f"\nisp / fsdp2 per-block overhead: {isp / fsdp:.2f}x (goal <= 1.00x)")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
