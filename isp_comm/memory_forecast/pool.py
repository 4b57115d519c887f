"""The pool: gathered slots, landing, cast send and reduce-scatter buffers, sized by
:func:`~isp_comm.memory_pool.make_plan` exactly as wrapping does, the host's shared
memory for the CPU symmetric-memory backend, and NVSHMEM's symmetric heap."""

from __future__ import annotations

from isp_comm.backends.nvshmem_backend import heap_size_for, scratch_need
from isp_comm.backends.symm_cpu import scratch_bytes
from isp_comm.config import ISPConfig
from isp_comm.memory_forecast.weights import UnitLayout, flat_bytes
from isp_comm.memory_pool import MemoryPlan, copied_collectives, gather_landing, make_plan, shared_memory_need


def pool_plan(layouts: list[UnitLayout], config: ISPConfig, wp: int) -> MemoryPlan:
    """The memory plan of the blocks' units (as the communicator makes it)."""
    block_layouts = [(lay, tr) for i, lay, tr in layouts if i >= 0]
    return make_plan(
        [(lay.gather_dtype, lay.gathered_numel) for lay, _ in block_layouts],
        [(g.dtype, g.gathered_numel) for lay, _ in block_layouts for g in lay.full_groups]
        + [(g.dtype, g.scattered_bound) for lay, _ in block_layouts for g in lay.full_groups if g.replicas > 1],
        config.n_slots,
        config.max_inflight_reduce_scatter,
        wp,
        gather_landing(wp, config.comm_granularity),
        [(lay.gather_dtype, lay.shard_numel) for lay, _ in block_layouts if lay.gather_dtype != lay.dtype],
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


def _nbytes(numel: dict) -> int:
    return sum(n * dt.itemsize for dt, n in numel.items())


def shared_pages(
    plan: MemoryPlan,
    layouts: list[UnitLayout],
    config: ISPConfig,
    device: str,
    sizes: tuple[int, int],
    all_reduced: int,
) -> dict[str, int]:
    """Pages of shared memory a rank's RSS holds beyond its own pool, under the CPU
    symmetric-memory backend (empty off it). Every page a process touches in a mapping
    counts in its RSS, its peers' segments too (see [Note: peers' pages]).
    ``sizes``: (world, wp); ``all_reduced``: the bytes of the gradients all-reduced
    whole over the world (one flat buffer).

    [Note: peers' pages]
    A direct all-gather writes this rank's chunk (1/wp) into every peer's landing
    buffer (or, landing per parameter, its slots), and a direct reduce-scatter reads
    this rank's chunk of every peer's reduce-scatter inputs: (wp-1)/wp of one peer's
    buffers, over its wp-1 peers. A collective through the scratch copies the input
    into this rank's scratch and reads every peer's: its group's size times its bytes,
    the largest of the group's (the segment is reused). Measured with
    /proc/PID/smaps per segment (docs/forecast.md): at 2 ranks, 3 layers of width 448,
    the peers' pool buffers held 12.5 MiB and the world's scratch 1.8 MiB, as here."""
    world, wp = sizes
    if not (device == "cpu" and config.backend in ("auto", "symm") and world > 1):
        return {}
    pooled = config.memory_pool and wp > 1
    peers = 0
    if pooled:
        target = plan.staging_numel if _nbytes(plan.staging_numel) else plan.slot_numel
        landing = _nbytes(target) * (1 if _nbytes(plan.staging_numel) else plan.n_slots)
        peers = (wp - 1) * (landing + plan.rs_buffers * _nbytes(plan.rs_numel)) // wp
    wp_gathers = [lay.gathered_numel * lay.gather_dtype.itemsize for i, lay, _ in layouts if i == -1 or not pooled]
    groups = {
        "wp": wp * max([g // wp for g in wp_gathers], default=0) if wp > 1 else 0,
        "replica": (world // wp) * max(flat_bytes(lay) for _, lay, _ in layouts) if world > wp else 0,
        "world": world * all_reduced,
    }
    return {"shared memory: peers' pool pages": peers, "shared memory: collective scratch": sum(groups.values())}


def nvshmem_heap(
    plan: MemoryPlan,
    layouts: list[UnitLayout],
    config: ISPConfig,
    device: str,
    sizes: tuple[int, int],
    replicated_bytes: int,
) -> tuple[int, int]:
    """NVSHMEM's symmetric heap as the nvshmem backend sizes it when the variable is
    unset (see [Note: the symmetric heap] in ``nvshmem_backend.py``), and how much of
    the pool and of the master shards it holds (bytes the allocator no longer sees):
    ``(0, 0)`` off the nvshmem backend. ``sizes``: (world, wp)."""
    world, wp = sizes
    if not (device == "cuda" and config.backend == "nvshmem" and world > 1):
        return 0, 0
    blocks = [lay for i, lay, _ in layouts if i >= 0]
    outer = [lay for i, lay, _ in layouts if i == -1]

    def unit_sizes(lay) -> tuple[int, list[int]]:
        return lay.shard_numel * lay.gather_dtype.itemsize, [
            g.gathered_numel * g.dtype.itemsize for g in lay.full_groups
        ]

    pooled = config.memory_pool and wp > 1
    in_heap = 0
    if pooled and wp == world:  # the WP group is NVSHMEM's: the pool and the uncast shards live in the heap
        in_heap = plan.pool_bytes + sum(flat_bytes(lay) for lay in blocks if lay.gather_dtype == lay.dtype)
    copied = copied_collectives(
        (wp, world // wp, world),
        pooled,
        [unit_sizes(lay) for lay in blocks],
        unit_sizes(outer[0]) if outer else None,
        [("all_reduce", [g.shard_numel * g.dtype.itemsize for lay in blocks for g in lay.full_groups])],
        replicated_bytes,
    )
    world_sized = {"wp": wp == world, "replica": world // wp == world, "world": True}
    scratch = sum(scratch_need(kind, n, world) for g, kind, n in copied if world_sized[g])
    return heap_size_for(in_heap + scratch), in_heap
