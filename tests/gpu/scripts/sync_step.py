"""One training step that must not synchronise the host: run under torchrun. WP with
SP, activation checkpointing, the outer parameters sharded and the head
vocab-parallel, bf16. The third step runs under
``torch.cuda.set_sync_debug_mode("error")``: any synchronising call raises.

    torchrun --nproc-per-node 2 tests/gpu/scripts/sync_step.py            # NCCL, one GPU per rank
    torchrun --nproc-per-node 4 tests/gpu/scripts/sync_step.py --one-gpu --backend symm --wp 2 --sp 2

``--one-gpu``: every rank on cuda:0 over a gloo process group (what the step runs on
is the backend: symm needs TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1, nvshmem an MPS
daemon; tests/gpu/test_gpu_shared.py sets both). With nvshmem each rank prints its
NVSHMEM status after the steps, or, when NVSHMEM runs it limited (its collectives
would abort), prints that status and leaves at once with exit code 0.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))

from isp_comm import ISPCommunicator, ISPConfig, ParallelGroups  # noqa: E402
from isp_comm.models.llama import LlamaConfig, build  # noqa: E402
from tests.gpu.mps import nvshmem_status  # noqa: E402


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backend", default="auto", choices=("auto", "torch", "symm", "nvshmem"))
    ap.add_argument("--wp", type=int, default=2)
    ap.add_argument("--sp", type=int, default=2)
    ap.add_argument("--one-gpu", action="store_true", help="every rank on cuda:0, over gloo")
    return ap.parse_args()


def main() -> None:
    args = parse()
    rank = int(os.environ["LOCAL_RANK"])
    dev = torch.device("cuda", 0 if args.one_gpu else rank)
    if args.one_gpu:
        dist.init_process_group("gloo")
    else:
        dist.init_process_group("nccl", device_id=dev)
    torch.cuda.set_device(dev)
    torch.manual_seed(0)
    model = build(LlamaConfig(vocab_size=64, hidden=64, ffn_hidden=96, n_layers=4, n_heads=8, n_kv_heads=2)).to(dev)
    cfg = ISPConfig(
        backend=args.backend,
        param_dtype=torch.bfloat16,
        reduce_dtype=torch.float32,
        activation_checkpointing=0.5,
        shard_outer_params=True,
        vocab_parallel=True,
    )
    if args.backend == "nvshmem":  # NVSHMEM's init comes first, so that a limited PE can leave before any collective
        from isp_comm.backends import make_backend

        backend = make_backend("nvshmem", dev, cfg.timeout_s)  # starts NVSHMEM: NVSHMEM_SYMMETRIC_SIZE is set
        if nvshmem_status() == "STATUS_LIMITED_MPG":
            print(f"rank {rank}: NVSHMEM status STATUS_LIMITED_MPG", flush=True)
            os._exit(0)
        import isp_comm.communicator as communicator

        communicator.make_backend = lambda *a: backend
    comm = ISPCommunicator(model, ParallelGroups.create(wp_size=args.wp, sp_size=args.sp), cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    seq, sp_rank = 32, dist.get_rank() % args.sp
    lo, hi = sp_rank * seq // args.sp, (sp_rank + 1) * seq // args.sp
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
    if args.backend == "nvshmem":
        print(f"rank {rank}: NVSHMEM status {nvshmem_status()}", flush=True)  # before close: it finalizes
    comm.close()
    print(f"rank {dist.get_rank()}: a whole step without a host synchronisation")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
