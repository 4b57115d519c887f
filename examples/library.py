"""Wrap a model, train it, save a sharded checkpoint: torchrun --standalone --nproc-per-node 2 examples/library.py"""

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from isp_comm import ISPCommunicator, ISPConfig, ParallelGroups
from isp_comm.models.llama import LlamaConfig, build

dist.init_process_group()  # under torchrun: gloo for CPU tensors, nccl for CUDA ones
model = build(LlamaConfig(n_layers=4), seed=0)  # the same weights on every rank
groups = ParallelGroups.create(wp_size=dist.get_world_size(), sp_size=1)
comm = ISPCommunicator(model, groups, ISPConfig(overlap=True))  # shards every block's linears
optim = torch.optim.AdamW(model.parameters())  # create it *after* wrapping
torch.manual_seed(dist.get_rank())  # each rank trains on its own micro-batches
for _ in range(3):
    x = torch.randint(0, 256, (2, 33))
    loss = torch.nn.functional.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
    loss.backward()
    norm = comm.clip_grad_norm_(1.0)  # the global norm (not torch.nn.utils.clip_grad_norm_)
    optim.step()
    optim.zero_grad()
state = {"model": comm.state_dict(), "optim": comm.optimizer_state_dict(optim)}  # sharded DTensors
dcp.save(state, checkpoint_id="ckpt")  # each rank writes its own shards
if dist.get_rank() == 0:
    print(f"loss {loss.item():.3f}, global grad norm {norm.item():.3f}, checkpoint in ckpt/")
comm.close()
dist.destroy_process_group()
