"""A script that wraps a model and leaves without ``comm.close()`` or
``destroy_process_group()``, as a short script or an error path does: the
interpreter's own exit must not abort. Before the heartbeat thread was stopped at
exit, a rank aborted in about half the runs under torchrun ("terminate called without
an active exception", SIGABRT): the daemon thread, inside a store call, was ended from
a C++ destructor as it took the GIL back during finalisation. Argument: the backend.
Run by tests/test_reliability.py."""

import sys

import torch
import torch.distributed as dist

from isp_comm import ISPCommunicator, ISPConfig, ParallelGroups
from isp_comm.models.llama import LlamaConfig, build

torch.set_num_threads(1)
dist.init_process_group("gloo")
model = build(LlamaConfig(n_layers=2), seed=0)
comm = ISPCommunicator(model, ParallelGroups.create(wp_size=dist.get_world_size()), ISPConfig(backend=sys.argv[1]))
print(dist.get_rank(), "leaving without close()", flush=True)
