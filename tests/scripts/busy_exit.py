"""A script that leaves while the shared-memory backend's worker is busy (collectives
queued, no close()): the interpreter's own exit must not abort. Before the worker was
stopped at exit, a rank aborted in about 2 runs of 5 ("terminate called without an
active exception", SIGABRT): the daemon worker, inside a torch copy, was ended from a
C++ destructor as it took the GIL back during finalisation. Run by
tests/test_reliability.py under torchrun."""

import sys

import torch
import torch.distributed as dist

from isp_comm.backends.symm_cpu import SymmCpuBackend

torch.set_num_threads(1)
dist.init_process_group("gloo")
backend = SymmCpuBackend(timeout_s=30.0)
inp = torch.ones(4 << 20)  # 16 MiB per rank: each all-gather keeps the worker in copies a while
out = torch.empty(dist.get_world_size() * inp.numel())
handles = [backend.all_gather(out, inp, dist.group.WORLD) for _ in range(40)]
handles[0].wait(30.0)
sys.exit(0)  # 39 collectives still queued or running
