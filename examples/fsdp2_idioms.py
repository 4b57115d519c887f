"""FSDP2's and torchtitan's idioms, wrapped: torchrun --standalone --nproc-per-node 2 examples/fsdp2_idioms.py"""

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from isp_comm import ISPCommunicator, ISPConfig, ParallelGroups
from isp_comm.models.llama import LlamaConfig, build

dist.init_process_group()
cfg = LlamaConfig(n_layers=2)
x = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(dist.get_rank()))


def train_step(model, comm, opt):
    comm.cross_entropy(model(x[:, :-1]), x[:, 1:]).backward()
    opt.step()
    opt.zero_grad()


# torchtitan's checkpoint: the model's and the optimizer's own state dicts hold the shards as DTensors
model = build(cfg, seed=0)
comm = ISPCommunicator(model, ParallelGroups.create(wp_size=2), ISPConfig())
opt = torch.optim.AdamW(model.parameters())
train_step(model, comm, opt)
msd, osd = get_state_dict(model, opt)
dcp.save({"model": msd, "optim": osd}, checkpoint_id="ckpt")  # every rank writes only its own rows
train_step(model, comm, opt)

# resume on another WP size with torch's API: DCP fills the fresh state dicts, set_state_dict loads them
fresh = build(cfg, seed=1)
comm2 = ISPCommunicator(fresh, ParallelGroups.create(wp_size=1), ISPConfig())
opt2 = torch.optim.AdamW(fresh.parameters())
msd2, osd2 = get_state_dict(fresh, opt2)  # a fresh optimizer's states are made first, as under FSDP2
dcp.load({"model": msd2, "optim": osd2}, checkpoint_id="ckpt")
set_state_dict(fresh, opt2, model_state_dict=msd2, optim_state_dict=osd2)
train_step(fresh, comm2, opt2)
went_on, resumed = comm.full_state_dict(), comm2.full_state_dict()
worst = max((went_on[k] - resumed[k]).abs().max().item() for k in went_on)

# an optimizer stepped in the backward: one per parameter, stepped and zeroed from its gradient hook
opts = {p: torch.optim.AdamW([p]) for p in fresh.parameters()}
for p in fresh.parameters():
    p.register_post_accumulate_grad_hook(lambda p: (opts[p].step(), opts[p].zero_grad()))
comm2.cross_entropy(fresh(x[:, :-1]), x[:, 1:]).backward()  # each hook runs once its gradient is averaged
if dist.get_rank() == 0:
    assert worst < 1e-5, f"the resumed run differs from the one that went on by {worst}"
    print(f"resumed at wp 1 within {worst:.1e} of the run that went on; one step taken in the backward")
comm.close()
comm2.close()
dist.destroy_process_group()
