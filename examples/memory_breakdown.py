"""Where a step's peak goes, part by part: torchrun --standalone --nproc-per-node 2 examples/memory_breakdown.py"""

import torch
import torch.distributed as dist

from isp_comm import ISPCommunicator, ISPConfig, ParallelGroups, forecast
from isp_comm.memory_breakdown import MemoryBreakdown
from isp_comm.models.llama import Llama, LlamaConfig, build

dist.init_process_group()
cfg = LlamaConfig(n_layers=4)
with torch.device("meta"):  # the same run, forecast before it runs: 2 ranks, 2 sequences of 64 tokens each
    fc = forecast(Llama(cfg), ISPConfig(), world=2, wp=2, sp=1, batch=4, seq=64)
model = build(cfg, seed=0)
tracker = MemoryBreakdown()  # a dispatch mode: every tensor made inside it is counted, by part
with tracker:
    comm = ISPCommunicator(model, ParallelGroups.create(wp_size=2, sp_size=1), ISPConfig())
    optim = torch.optim.AdamW(model.parameters())
    tracker.attach(comm, optim)  # what they hold counts from here; the phases follow the step
    torch.manual_seed(dist.get_rank())
    for step in range(2):
        if step == 1:
            tracker.reset_peaks()  # the second step's peaks: the steady state, as the forecast's
        x = torch.randint(0, 256, (2, 65))
        logits = model(x[:, :-1])
        comm.cross_entropy(logits, x[:, 1:]).backward()
        del logits
        optim.step()
        optim.zero_grad()
if dist.get_rank() == 0:  # MiB by part at the backward's peak: measured, forecast, difference
    print(tracker.result().table("backward", fc.phases["backward"]))
comm.close()
dist.destroy_process_group()
