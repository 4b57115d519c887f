"""A torchrun job whose rank 1 is killed mid-backward (reliability test)."""

import os
import signal
import sys

import torch
import torch.distributed as dist

from isp_comm import ISPCommunicator, ISPConfig, ParallelGroups
from tests.parity import Case, batches, loss_fn

torch.set_num_threads(1)
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
case = Case(steps=50)
model = case.build()
comm = ISPCommunicator(model, ParallelGroups.create(wp_size=world), ISPConfig(backend=sys.argv[1], timeout_s=5))
if rank == 1:
    model.layers[1].register_forward_hook(
        lambda _m, _i, out: (out.register_hook(lambda _g: os.kill(os.getpid(), signal.SIGKILL)), None)[1]
    )
for step in batches(case, world):
    for x, y in step:
        loss_fn(model(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
comm.close()
