"""FSDP2 on isp-comm's shared-memory collectives: torchrun --standalone --nproc-per-node 2 examples/fsdp2_symm.py"""

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from isp_comm.integrations.fsdp2 import use_symm_collectives
from isp_comm.models.llama import LlamaConfig, build

dist.init_process_group()
model = build(LlamaConfig(n_layers=2), seed=0)
for m in [*model.layers, model]:
    fully_shard(m)
backend = use_symm_collectives([*model.layers, model])  # all-gathers and reduce-scatters on shared memory
opt = torch.optim.AdamW(model.parameters())
x = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(dist.get_rank()))
loss = torch.nn.functional.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
loss.backward()
opt.step()
print(f"rank {dist.get_rank()}: loss {loss.item():.3f} ({backend.name} backend)")
backend.close()
dist.destroy_process_group()
