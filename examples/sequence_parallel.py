"""Sequence parallel on packed documents: torchrun --standalone --nproc-per-node 2 examples/sequence_parallel.py"""

import torch
import torch.distributed as dist
import torch.nn.functional as F

from isp_comm import ISPCommunicator, ISPConfig, ParallelGroups
from isp_comm.models.llama import LlamaConfig, build

dist.init_process_group()
model = build(LlamaConfig(n_layers=2), seed=0)
groups = ParallelGroups.create(wp_size=1, sp_size=2)  # both ranks share every sequence
comm = ISPCommunicator(model, groups, ISPConfig())  # attention is split over the SP group
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(0))  # the same on the SP group
inputs, labels = x[:, :-1], x[:, 1:]
lo, hi = groups.sp_rank * 8, (groups.sp_rank + 1) * 8  # this rank's chunk of the 16 tokens
cu = torch.tensor([0, 3, 11, 16])  # three documents packed in the 16 tokens, the same on every rank
pos = torch.cat([torch.arange(3), torch.arange(8), torch.arange(5)])  # positions restart per document
logits = model(inputs[:, lo:hi], position_ids=pos[lo:hi], cu_seqlens=cu)
loss = F.cross_entropy(logits.flatten(0, 1), labels[:, lo:hi].flatten())  # the mean over this rank's tokens
loss.backward()
opt.step()
print(f"rank {dist.get_rank()}: tokens {lo}-{hi}, loss {loss.item():.3f}")
comm.close()
dist.destroy_process_group()
