"""One training step that must not synchronise the host: run under torchrun with one
process per GPU (NCCL). WP 2 with SP 2, activation checkpointing, the outer
parameters sharded and the head vocab-parallel, bf16. The third step runs under
``torch.cuda.set_sync_debug_mode("error")``: any synchronising call raises.

torchrun --nproc-per-node 2 tests/gpu/scripts/sync_step.py
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))

from isp_comm import ISPCommunicator, ISPConfig, ParallelGroups  # noqa: E402
from models.llama import LlamaConfig, build  # noqa: E402


def main() -> None:
    rank = int(os.environ["LOCAL_RANK"])
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", device_id=dev)
    torch.cuda.set_device(dev)
    torch.manual_seed(0)
    model = build(LlamaConfig(vocab_size=64, hidden=64, ffn_hidden=96, n_layers=4, n_heads=8, n_kv_heads=2)).to(dev)
    cfg = ISPConfig(
        param_dtype=torch.bfloat16,
        reduce_dtype=torch.float32,
        activation_checkpointing=0.5,
        shard_outer_params=True,
        vocab_parallel=True,
    )
    comm = ISPCommunicator(model, ParallelGroups.create(wp_size=2, sp_size=2), cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    seq, sp_rank = 32, dist.get_rank() % 2
    lo, hi = sp_rank * seq // 2, (sp_rank + 1) * seq // 2
    positions = torch.arange(lo, hi, device=dev)
    g = torch.Generator(device="cpu").manual_seed(1)
    for step in range(3):
        x = torch.randint(0, 64, (2, seq), generator=g).to(dev)
        if step == 2:
            torch.cuda.set_sync_debug_mode("error")
        try:
            loss = comm.cross_entropy(model(x[:, lo:hi], position_ids=positions), x[:, lo:hi])
            loss.backward()
            comm.clip_grad_norm_(1.0)
            opt.step()
            opt.zero_grad()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    comm.close()
    dist.destroy_process_group()
    print(f"rank {dist.get_rank() if dist.is_initialized() else rank}: a whole step without a host synchronisation")


if __name__ == "__main__":
    main()
