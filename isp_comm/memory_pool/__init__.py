"""WHERE bytes land: the gathered-block slot pool and the reduce-scatter buffers."""

from isp_comm.memory_pool.plan import (
    MemoryPlan,
    copied_collectives,
    gather_landing,
    make_plan,
    releases_reduce_buffers,
    shared_memory_need,
)
from isp_comm.memory_pool.slots import ReduceScatterBuffers, SlotPool

__all__ = [
    "MemoryPlan",
    "ReduceScatterBuffers",
    "SlotPool",
    "copied_collectives",
    "gather_landing",
    "make_plan",
    "releases_reduce_buffers",
    "shared_memory_need",
]
