"""Save at wp 2, resume at wp 1, export: torchrun --standalone --nproc-per-node 2 examples/sharded_state.py"""

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from isp_comm import ISPCommunicator, ISPConfig, ParallelGroups
from isp_comm.models.llama import LlamaConfig, build

dist.init_process_group()
cfg = LlamaConfig(n_layers=2)
model = build(cfg, seed=0)
comm = ISPCommunicator(model, ParallelGroups.create(wp_size=2), ISPConfig())
opt = torch.optim.AdamW(model.parameters())
x = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(dist.get_rank()))
torch.nn.functional.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten()).backward()
norm = comm.clip_grad_norm_(1.0, norm_type=2.0)  # global norm before clipping, the same on every rank
opt.step()
sd = comm.state_dict()  # original FQNs; sharded parameters are DTensors of their global shape
osd = comm.optimizer_state_dict(opt)  # any torch.optim optimizer, keyed by FQN, states sharded like params
dcp.save({"model": sd, "optim": osd}, checkpoint_id="ckpt")  # every rank writes only its own shards

# resume on another WP size: wrap a fresh model, hand DCP its (empty) state dicts to fill
fresh = build(cfg, seed=1)
comm2 = ISPCommunicator(fresh, ParallelGroups.create(wp_size=1), ISPConfig())
opt2 = torch.optim.AdamW(fresh.parameters())
sd2, osd2 = comm2.state_dict(), comm2.optimizer_state_dict(opt2)  # a fresh optimizer gets its states
dcp.load({"model": sd2, "optim": osd2}, checkpoint_id="ckpt")  # writes into the live shards
comm2.load_state_dict(sd2)
comm2.load_optimizer_state_dict(opt2, osd2)

# one full state dict for an export: gathered unit by unit, kept by rank 0 alone ({} elsewhere)
full, full2 = comm.full_state_dict(cpu=True, rank0_only=True), comm2.full_state_dict(cpu=True, rank0_only=True)
if dist.get_rank() == 0:
    assert all(torch.equal(full[k], full2[k]) for k in full), "the resumed weights differ"
    torch.save(full2, "model.pt")
    print(f"grad norm {norm.item():.4f}; resumed at wp 1 with the weights saved at wp 2; model.pt written")
comm.close()
comm2.close()
dist.destroy_process_group()
