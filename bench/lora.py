"""LoRA fine-tuning against full fine-tuning, isp-comm beside FSDP2, at world 4.

    python bench/lora.py [--world 4] [--repeats 3] [--steps 7] [--warmup 2]

The e2e benchmark's reference llama (about 30M parameters: 8 layers, hidden 512, FFN
1408, 16/4 heads, vocab 8192), sequence 256, global batch 4, AdamW over the trainable
parameters. LoRA: ``peft.get_peft_model`` with rank 8 (alpha 16, no dropout) on
q/k/v/o of every block, applied before wrapping (isp-comm) or sharding (FSDP2, per
block and root). For each run: the median step time after warm-up (slowest rank),
the peak RSS per rank (VmHWM from set-up on, the largest rank) and the bytes
reduce-scattered per step and rank (isp-comm's counter; for FSDP2 the inputs of its
``reduce_scatter_single`` calls, counted by wrapping that function). Every run is
repeated ``--repeats`` times; the table shows medians and ranges. Writes
OUT/lora.json (--out, default bench/results/local).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import MIB, add_out, markdown_table, proc_status_bytes, reset_peak_rss, save_results  # noqa: E402
from bench.e2e import BATCH, CORES, SEQ, batch, model_config  # noqa: E402
from isp_comm import ISPCommunicator, ISPConfig, ParallelGroups  # noqa: E402
from isp_comm.models.llama import build  # noqa: E402
from isp_comm.testing import run_ranks  # noqa: E402

RUNS = (("isp", "full"), ("isp", "lora"), ("fsdp2", "full"), ("fsdp2", "lora"))


def _lora(model: torch.nn.Module) -> torch.nn.Module:
    import peft

    cfg = peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    return peft.get_peft_model(model, cfg)


def _worker(rank: int, world: int, system: str, tuning: str, steps: int) -> dict:
    torch.set_num_threads(max(1, CORES // world))
    reset_peak_rss()
    model = build(model_config(8), seed=0)
    if tuning == "lora":
        torch.manual_seed(0)  # the same adapters on every rank (isp-comm checks it at wrap time)
        model = _lora(model)
    comm, counted = None, [0]
    if system == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        base = model.get_base_model() if tuning == "lora" else model
        for m in [*base.layers, model]:
            fully_shard(m)
        plain_rs = dist.reduce_scatter_single  # what FSDP2's reduce-scatter calls in torch 2.13

        def counting(*args, **kwargs):
            inp = kwargs.get("input", args[1] if len(args) > 1 else None)
            counted[0] += inp.numel() * inp.element_size()
            return plain_rs(*args, **kwargs)

        dist.reduce_scatter_single = counting
    else:
        comm = ISPCommunicator(model, ParallelGroups.create(wp_size=world), ISPConfig())
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, foreach=False)
    per = BATCH // world
    times, reduced = [], []
    for step in range(steps):
        x, y = batch(step)
        x, y = x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]
        before = comm.stats()["bytes_reduced"] if comm else counted[0]
        dist.barrier()
        t0 = time.perf_counter()
        F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        opt.step()
        opt.zero_grad()
        t = torch.tensor([time.perf_counter() - t0])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        times.append(t.item())
        reduced.append((comm.stats()["bytes_reduced"] if comm else counted[0]) - before)
    if comm is not None:
        comm.close()
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {"times": times, "reduced": reduced, "rss": proc_status_bytes("VmHWM") / MIB, "trainable": trainable}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    add_out(ap)
    args = ap.parse_args()
    raw = []
    for repeat in range(args.repeats):
        for system, tuning in RUNS:
            res = run_ranks(_worker, args.world, system, tuning, args.steps, timeout_s=3600, start="spawn")
            w = args.warmup
            row = {
                "repeat": repeat,
                "run": f"{system} {tuning}",
                "step_s": statistics.median(res[0]["times"][w:]),
                "rss_mib": max(r["rss"] for r in res),
                "reduced_mib": statistics.median(res[0]["reduced"][w:]) / MIB,
                "trainable_rank0": res[0]["trainable"],
            }
            raw.append(row)
            print(f"repeat {repeat} {row['run']}: {row['step_s']:.3f} s, {row['rss_mib']:.0f} MiB", flush=True)
    table = []
    for system, tuning in RUNS:
        mine = [r for r in raw if r["run"] == f"{system} {tuning}"]

        def cell(key: str, fmt: str, rows: list = mine) -> str:
            vals = [r[key] for r in rows]
            return f"{statistics.median(vals):{fmt}} ({min(vals):{fmt}}-{max(vals):{fmt}})"

        table.append([system, tuning, cell("step_s", ".3f"), cell("rss_mib", ".0f"), cell("reduced_mib", ".2f")])
    print(
        f"\nworld {args.world}, 30M-parameter llama, LoRA r=8 on q/k/v/o, seq {SEQ}, global batch {BATCH}, "
        f"AdamW, {CORES} cores; median of {args.repeats} repeats (range)\n"
    )
    header = ["system", "tuning", "step s", "peak RSS/rank MiB", "reduce-scattered MiB/step/rank"]
    print(markdown_table(header, table, "llrrr"))
    save_results("lora", args, raw)


if __name__ == "__main__":
    main()
