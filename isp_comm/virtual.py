"""A virtual world: this process trains as rank R of an N-rank job whose peers do
not exist, with collectives that take their modelled time.

From one's own training loop::

    from isp_comm import ISPCommunicator, ISPConfig, ParallelGroups
    from isp_comm.virtual import FlatLink, init_virtual_world, virtual_backend

    init_virtual_world(world=64, rank=0)          # torch's fake process group
    groups = ParallelGroups.create(wp_size=8)     # the groups of the 64-rank job
    backend = virtual_backend(device, FlatLink(50e9))   # or the planner's link model
    comm = ISPCommunicator(model, groups, ISPConfig(...), backend=backend)
    ...                                           # the job's batch per rank, as usual
    comm.stats()["comm_s"], comm.stats()["exposed_comm_s"]

The planner's link model (a target's published NVLink and InfiniBand figures, or a
profile file, NVLink and InfiniBand as two tiers that run at once) is
:class:`isp_comm.planner.links.ProfileLink`. What is real and what
is modelled: [Note: what a virtual collective does] in
``isp_comm/backends/virtual.py``, and docs/virtual.md.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from isp_comm.backends.virtual import FlatLink, LinkModel, VirtualBackend


def init_virtual_world(world: int, rank: int = 0) -> None:
    """Initialise ``torch.distributed`` as ``rank`` of ``world`` on torch's fake
    process group (``FakeStore``, backend ``"fake"``): groups of any ranks can be
    made, and a collective sent to it directly returns this rank's own data at once
    (no peer, no wait). The communicator's collectives go to the virtual backend."""
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"a virtual world needs a size >= 1, got {world!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world:
        raise ValueError(f"virtual rank must be in [0, {world}), got {rank!r}")
    if dist.is_initialized():
        raise ValueError("torch.distributed is initialised already: a virtual world needs a process of its own")
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)


def is_virtual() -> bool:
    """Whether this process's default process group is the fake one."""
    return dist.is_initialized() and dist.get_backend() == "fake"


def virtual_backend(
    device: torch.device, link: LinkModel, timeout_s: float = 300.0, *, record_streams: bool = True
) -> VirtualBackend:
    """The backend to hand :class:`~isp_comm.ISPCommunicator` (``backend=``) in a
    virtual world: collectives that complete after ``link``'s time (device-side
    spins on side streams on CUDA, a comm thread on CPU), each tier of links on a
    clock of its own (see [Note: tiers of links] in ``isp_comm/backends/tiers.py``).
    ``record_streams=False``: the caller waits for every collective on the stream
    that allocated its tensors before freeing them, as FSDP2 does (CUDA; see
    [Note: the virtual backend on CUDA] in ``isp_comm/backends/virtual.py``)."""
    if not is_virtual():
        raise ValueError("virtual_backend needs a virtual world: call init_virtual_world(world, rank) first")
    return VirtualBackend(device, link, timeout_s, record_streams=record_streams)


__all__ = ["FlatLink", "LinkModel", "VirtualBackend", "init_virtual_world", "is_virtual", "virtual_backend"]
