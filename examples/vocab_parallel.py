"""Sharded head, vocab-parallel loss: torchrun --standalone --nproc-per-node 2 examples/vocab_parallel.py"""

import torch
import torch.distributed as dist

from isp_comm import ISPCommunicator, ISPConfig, ParallelGroups
from isp_comm.models.llama import LlamaConfig, build

dist.init_process_group()
model = build(LlamaConfig(n_layers=2, vocab_size=1024), seed=0)
config = ISPConfig(shard_outer_params=True, vocab_parallel=True)  # the head is found, or pass head=
comm = ISPCommunicator(model, ParallelGroups.create(wp_size=2), config)
opt = torch.optim.AdamW(model.parameters())
x = torch.randint(0, 1024, (2, 17), generator=torch.Generator().manual_seed(dist.get_rank()))
logits = model(x[:, :-1])  # vocab-sharded: [wp, batch, seq, vocab / wp], full logits nowhere
loss = comm.cross_entropy(logits, x[:, 1:])  # this rank's mean loss (in fp32, chunked, when vocab_parallel is off)
loss.backward()
opt.step()
print(f"rank {dist.get_rank()}: logits {tuple(logits.shape)}, loss {loss.item():.3f}")
comm.close()
dist.destroy_process_group()
