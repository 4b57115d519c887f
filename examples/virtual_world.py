"""Rank 0 of a 64-GPU job (8 nodes of 8 H100s) on one process, collectives modelled: python examples/virtual_world.py"""

import torch

from isp_comm import ISPCommunicator, ISPConfig, ParallelGroups
from isp_comm.models.llama import LlamaConfig, build
from isp_comm.planner.links import ProfileLink
from isp_comm.planner.profile import from_target
from isp_comm.planner.targets import parse_target
from isp_comm.virtual import init_virtual_world, virtual_backend

init_virtual_world(world=64, rank=0)  # torch's fake process group: no peers exist
groups = ParallelGroups.create(wp_size=8)  # the 64-rank job's groups: WP 8, 8 replicas
link = ProfileLink(from_target(parse_target("h100x8", nodes=8)), "torch")  # or FlatLink(50e9)
model = build(LlamaConfig(n_layers=4), seed=0)
comm = ISPCommunicator(model, groups, ISPConfig(), backend=virtual_backend(torch.device("cpu"), link))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
tokens = torch.randint(0, 256, (2, 65))  # this rank's share of the job's batch
for _ in range(3):
    logits = model(tokens[:, :-1])
    loss = comm.cross_entropy(logits, tokens[:, 1:])
    loss.backward()
    comm.clip_grad_norm_(1.0)
    opt.step()
    opt.zero_grad()
stats = comm.stats()
print(
    f"loss {loss.item():.3f}; modelled collectives {stats['comm_s'] * 1e3:.2f} ms issued, "
    f"{stats['exposed_comm_s'] * 1e3:.2f} ms exposed"
)
comm.close()
