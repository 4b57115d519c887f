"""Gradients cross the replicas once a step: torchrun --standalone --nproc-per-node 2 examples/replica_sync.py"""

import torch
import torch.distributed as dist

from isp_comm import ISPCommunicator, ISPConfig, ParallelGroups
from isp_comm.models.llama import LlamaConfig, build

dist.init_process_group()
model = build(LlamaConfig(n_layers=2, vocab_size=1024), seed=0)
comm = ISPCommunicator(model, ParallelGroups.create(wp_size=1), ISPConfig())  # wp 1: two replicas
opt = torch.optim.AdamW(model.parameters())
hook = comm.scheduler_hook()
g = torch.Generator().manual_seed(dist.get_rank())
micro_batches = [torch.randint(0, 1024, (2, 17), generator=g) for _ in range(4)]
for i, x in enumerate(micro_batches):
    comm.set_requires_replica_sync(i == len(micro_batches) - 1)  # before the micro-step's forward
    hook.before_forward()
    loss = comm.cross_entropy(model(x[:, :-1]), x[:, 1:]) / len(micro_batches)
    hook.before_backward()
    loss.backward()
    hook.after_backward()
comm.clip_grad_norm_(1.0)  # the last backward reduced all four micro-steps' gradients
opt.step()
opt.zero_grad()
print(f"rank {dist.get_rank()}: {comm.stats()['all_reduces']} all-reduces for 4 micro-steps")
comm.close()
dist.destroy_process_group()
