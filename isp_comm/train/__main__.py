"""``torchrun --nproc-per-node N -m isp_comm.train``: train the reference llama with ISP."""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from isp_comm import ISPCommunicator, ISPConfig, ParallelGroups
from isp_comm.train.data import batch_at, markov_corpus, unigram_entropy
from models.llama import LlamaConfig, build


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="isp-train", description=__doc__)
    p.add_argument("--steps", type=int, default=60, help="optimizer steps")
    p.add_argument("--wp", type=int, default=0, help="weight-parallel size (0: world size)")
    p.add_argument("--batch", type=int, default=8, help="global batch, sequences")
    p.add_argument("--seq", type=int, default=64, help="sequence length")
    p.add_argument("--layers", type=int, default=4, help="transformer blocks")
    p.add_argument("--hidden", type=int, default=128, help="model width")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate")
    p.add_argument("--ckpt", type=float, default=0.0, help="activation checkpointing ratio")
    p.add_argument("--no-overlap", action="store_true", help="wait for every collective at once")
    p.add_argument("--log-every", type=int, default=10, help="print the loss every N steps")
    args = p.parse_args(argv)
    for name in ("steps", "batch", "seq", "layers", "hidden", "log_every"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    torch.set_num_threads(1)
    if not dist.is_initialized():
        if "RANK" not in os.environ:
            os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29512")
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.batch % world:
        if rank == 0:
            print(
                f"isp-train: error: --batch {args.batch} must be divisible by the world size {world}", file=sys.stderr
            )
        dist.destroy_process_group()
        return 2
    cfg = LlamaConfig(
        vocab_size=256,
        hidden=args.hidden,
        ffn_hidden=args.hidden * 8 // 3,
        n_layers=args.layers,
        n_heads=8,
        n_kv_heads=2,
        max_seq_len=args.seq,
    )
    model = build(cfg, seed=0)
    groups = ParallelGroups.create(wp_size=args.wp or world, sp_size=1)
    comm = ISPCommunicator(model, groups, ISPConfig(overlap=not args.no_overlap, activation_checkpointing=args.ckpt))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    hook = comm.scheduler_hook()
    tokens = markov_corpus(200_000, cfg.vocab_size)
    if rank == 0:
        n_params = sum(p.numel() for p in build(cfg).parameters())
        print(
            f"isp-train: world {world}, wp {groups.wp_size}, {n_params / 1e6:.2f}M params"
            f", unigram entropy {unigram_entropy(tokens, cfg.vocab_size):.3f} nats"
        )
    t0 = time.perf_counter()
    per_rank = args.batch // world
    for step in range(1, args.steps + 1):
        x, y = batch_at(tokens, step, args.batch, args.seq)
        x, y = x[rank * per_rank : (rank + 1) * per_rank], y[rank * per_rank : (rank + 1) * per_rank]
        hook.before_forward()
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        hook.before_backward()
        loss.backward()
        hook.after_backward()
        opt.step()
        opt.zero_grad()
        avg = loss.detach().clone()
        dist.all_reduce(avg)
        if rank == 0 and (step % args.log_every == 0 or step == 1):
            s = comm.stats()
            el = time.perf_counter() - t0
            print(
                f"step {step:4d}  loss {avg.item() / world:.4f}  {step * args.batch * args.seq / el:8.0f} tok/s  "
                f"exposed comm {100 * s['exposed_comm_s'] / el:4.1f}%",
                flush=True,
            )
    comm.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
