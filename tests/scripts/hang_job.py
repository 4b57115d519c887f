"""A torchrun job through the library whose rank 1 stalls at step 3 (reliability
test of the hang diagnosis): ``stop`` stops it (SIGSTOP), ``extra`` makes it run one
extra forward. Arguments: backend, fault, diagnosis folder, deadline in seconds.
Each rank writes its pid to ``FOLDER/pids/`` so the test can end a stopped rank."""

import os
import signal
import sys

import torch
import torch.distributed as dist

from isp_comm import ISPCommunicator, ISPConfig, ParallelGroups
from tests.parity import Case, batches, loss_fn

backend, fault, folder, deadline = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
torch.set_num_threads(1)
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
os.makedirs(os.path.join(folder, "pids"), exist_ok=True)
with open(os.path.join(folder, "pids", str(rank)), "w") as f:
    f.write(str(os.getpid()))
case = Case(steps=5)
model = case.build()
config = ISPConfig(backend=backend, timeout_s=deadline, diagnosis_dir=folder)
comm = ISPCommunicator(model, ParallelGroups.create(wp_size=world), config)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step, micros in enumerate(batches(case, world), start=1):
    comm.set_step(step)
    x, y = micros[0]
    x, y = x.chunk(world)[rank], y.chunk(world)[rank]
    if rank == 1 and step == 3:
        if fault == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        else:
            with torch.no_grad():
                model(x)
    loss = loss_fn(model(x), y)
    loss.backward()
    comm.clip_grad_norm_(1.0)
    opt.step()
    opt.zero_grad()
    comm.all_reduce(loss.detach(), what="the step's loss")
comm.close()
dist.destroy_process_group()
