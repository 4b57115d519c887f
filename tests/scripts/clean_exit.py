"""A library user's whole script, ending the ordinary way (no os._exit): wrap, train,
save asynchronously with DCP's own stager, close, destroy the process group, exit.
Run under torchrun by tests/test_reliability.py, many times in a row."""

import sys
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from isp_comm import ISPCommunicator, ISPConfig, ParallelGroups
from tests.parity import Case, batches, loss_fn

torch.set_num_threads(1)
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
case = Case(optim="adamw", steps=2)
model = case.build()
comm = ISPCommunicator(model, ParallelGroups.create(wp_size=world), ISPConfig(backend=sys.argv[1]))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step in batches(case, world):
    for x, y in step:
        loss_fn(model(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
    opt.step()
    opt.zero_grad()
folder = [tempfile.mkdtemp(prefix="isp-clean-exit-") if rank == 0 else None]
dist.broadcast_object_list(folder)
future = dcp.async_save({"model": comm.state_dict(), "optim": comm.optimizer_state_dict(opt)}, checkpoint_id=folder[0])
future.result()
comm.close()
dist.barrier()
if rank == 0:
    import shutil

    shutil.rmtree(folder[0], ignore_errors=True)
dist.destroy_process_group()
