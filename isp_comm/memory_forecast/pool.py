"""The pool: gathered slots, landing and reduce-scatter buffers, sized by
:func:`~isp_comm.memory_pool.make_plan` exactly as wrapping does, and the host's
shared memory for the CPU symmetric-memory backend."""

from __future__ import annotations

from isp_comm.backends.symm_cpu import scratch_bytes
from isp_comm.config import ISPConfig
from isp_comm.memory_forecast.weights import UnitLayout, flat_bytes
from isp_comm.memory_pool import MemoryPlan, gather_landing, make_plan, shared_memory_need


def pool_plan(layouts: list[UnitLayout], config: ISPConfig, wp: int) -> MemoryPlan:
    """The memory plan of the blocks' units (as the communicator makes it)."""
    block_layouts = [(lay, tr) for i, lay, tr in layouts if i >= 0]
    return make_plan(
        [(lay.gather_dtype, lay.gathered_numel) for lay, _ in block_layouts],
        [(g.dtype, g.gathered_numel) for lay, _ in block_layouts for g in lay.full_groups],
        config.n_slots,
        config.max_inflight_reduce_scatter,
        wp,
        gather_landing(wp, config.comm_granularity),
    )


def host_shared_memory(
    plan: MemoryPlan,
    layouts: list[UnitLayout],
    config: ISPConfig,
    device: str,
    sizes: tuple[int, int],
    replicated_bytes: int,
    local_world: int | None,
) -> int:
    """Bytes of ``/dev/shm`` the host's ranks take together under the CPU
    symmetric-memory backend (0: not used). ``sizes``: (world, wp)."""
    world, wp = sizes
    if not (device == "cpu" and config.backend in ("auto", "symm") and world > 1):
        return 0
    gathered = [lay for i, lay, _ in layouts if i >= -1]  # the blocks and the outer unit
    buffers, largest = shared_memory_need(
        plan.pool_bytes,
        config.memory_pool,
        (wp, world // wp, world),
        max(lay.gathered_numel * lay.dtype.itemsize for lay in gathered),
        max(flat_bytes(lay) for lay in gathered),
        replicated_bytes,
    )
    return (buffers + sum(scratch_bytes(n) for n in largest)) * (local_world or world)
