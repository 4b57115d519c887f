"""Per-rank peak RSS of ISP training against depth, with the pool on and off.

    python bench/memory.py [--layers 8 32] [--world 2] [--steps 3]

The model is built on the meta device and materialised shard by shard at wrap time,
so no rank ever holds the full model. The peak is reset after wrapping
(/proc/self/clear_refs) and read after the steps (VmHWM). Prints a markdown table and
writes OUT/memory.json (--out, default bench/results/local).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import MIB, add_out, proc_status_bytes, reset_peak_rss, save_results  # noqa: E402
from isp_comm import ISPCommunicator, ISPConfig, ParallelGroups  # noqa: E402
from isp_comm.models.llama import LlamaConfig, build  # noqa: E402
from isp_comm.testing import run_ranks  # noqa: E402


def _worker(rank: int, world: int, layers: int, pool: bool, steps: int, seq: int, batch: int) -> dict:
    cfg = LlamaConfig(vocab_size=8192, hidden=512, ffn_hidden=1408, n_layers=layers, n_heads=16, n_kv_heads=4)
    with torch.device("meta"):
        model = build(cfg)
    comm = ISPCommunicator(model, ParallelGroups.create(wp_size=world), ISPConfig(memory_pool=pool))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)  # no param-sized temporaries
    shard_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    g = torch.Generator().manual_seed(rank)
    reset_peak_rss()
    base = proc_status_bytes("VmRSS")
    pinned = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in pinned and t.device.type != "meta":
            saved[st.data_ptr()] = st.nbytes()
        return t

    saved_peak = 0
    for _ in range(steps):
        saved.clear()
        x = torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=g)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = F.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
        saved_peak = max(saved_peak, sum(saved.values()))
        loss.backward()
        opt.step()
        opt.zero_grad()
    out = {
        "layers": layers,
        "pool": pool,
        "rank": rank,
        "peak_rss": proc_status_bytes("VmHWM"),
        "rss_after_wrap": base,
        "param_bytes": shard_bytes,
        "saved_bytes": saved_peak,
        "optim_bytes": 2 * shard_bytes,
        "pool_bytes": comm.memory_plan().pool_bytes,
        "peak_live_gathered": comm.stats()["peak_live_gathered_bytes"],
        "full_block_bytes": sum(u.gathered_numel * 4 for u in comm.units),
    }
    comm.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=2, help="sequences per rank")
    add_out(ap)
    args = ap.parse_args()
    rows = []
    for layers in args.layers:
        for pool in (True, False):
            res = run_ranks(
                _worker, args.world, layers, pool, args.steps, args.seq, args.batch, timeout_s=1800, start="spawn"
            )
            rows.append(max(res, key=lambda r: r["peak_rss"]))
    print(f"world {args.world}, seq {args.seq}, {args.batch} sequences/rank, AdamW; MiB per rank (max over ranks)\n")
    print(
        "| layers | pool | peak RSS | RSS after wrap | shard params | grads | AdamW state | saved for backward "
        "| pool bytes | all blocks gathered |"
    )
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['layers']} | {'on' if r['pool'] else 'off'} | {r['peak_rss'] / MIB:.0f} | "
            f"{r['rss_after_wrap'] / MIB:.0f} | {r['param_bytes'] / MIB:.0f} | {r['param_bytes'] / MIB:.0f} | "
            f"{r['optim_bytes'] / MIB:.0f} | {r['saved_bytes'] / MIB:.0f} | "
            f"{r['pool_bytes'] / MIB:.0f} | {r['full_block_bytes'] / MIB:.0f} |"
        )
    save_results("memory", args, rows)


if __name__ == "__main__":
    main()
