"""The buffers a communicator's units need, sized once at wrap time.

The MaxPool plan of the units (:mod:`isp_comm.memory_pool`), the slot pool and the
reduce-scatter pairs it sizes, and what the backend must know before the first
collective: whether its shared memory holds them (CPU), the scratch of each group's
lane (CUDA symmetric memory) and its fixed heap (NVSHMEM), with the flat shards
moved into it where the backend reads gather sources only from symmetric buffers.
Every rank computes the same sizes from the same units, so the collective
allocations and the refusals happen on every rank alike.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from dataclasses import dataclass

import torch
from torch import nn

from isp_comm.backends import Backend
from isp_comm.config import ISPConfig
from isp_comm.discovery import Units
from isp_comm.groups import ParallelGroups
from isp_comm.layout import replica_collectives, replica_largest
from isp_comm.memory_pool import (
    MemoryPlan,
    ReduceScatterBuffers,
    SlotPool,
    copied_collectives,
    gather_landing,
    make_plan,
    shared_memory_need,
)
from isp_comm.units import BlockUnit

log = logging.getLogger("isp_comm")


@dataclass
class Buffers:
    """What :func:`make_buffers` sized and made."""

    plan: MemoryPlan
    pool: SlotPool
    rs_buffers: ReduceScatterBuffers
    moved: list[BlockUnit]
    """The blocks whose flat shards live in the backend's symmetric memory."""

    def close(self, cut_short: bool) -> None:
        """Free the pool and the pairs; the moved shards leave the backend's memory
        before the backend frees it, unless the step was cut short (a peer may still
        read them: [Note: buffers of a failed step])."""
        self.pool.close()
        self.rs_buffers.close()
        if not cut_short:
            for unit in self.moved:
                unit.move_shard(torch.empty_like(unit.flat_shard))


def make_buffers(
    units: Units,
    replicated: list[nn.Parameter],
    groups: ParallelGroups,
    config: ISPConfig,
    backend: Backend,
    release_pairs: bool,
) -> Buffers:
    """The slot pool and the reduce-scatter buffers, sized once by the MaxPool plan;
    with shared memory, its need is checked (and reserved, or refused, on every rank
    alike) first. ``replicated``: the parameters no unit holds (the world's gradient
    all-reduce); ``release_pairs``: the pairs are plain buffers given back between
    backwards (see :func:`~isp_comm.memory_pool.releases_reduce_buffers`)."""
    blocks, device = units.blocks, units.blocks[0].device
    group = groups.wp_group if config.memory_pool else None  # a fixed pool: allocated collectively
    alloc = functools.partial(backend.empty, device=device, group=group)
    gdt = [(u.gather_dtype, u.gathered_numel) for u in blocks]
    rdt = [(g.dtype, g.gathered_numel) for u in blocks for g in u.full_groups]  # frozen ones may thaw
    rdt += [(g.dtype, g.scattered_bound) for u in blocks for g in u.full_groups if g.replicas > 1]
    landing = gather_landing(groups.wp_size, config.comm_granularity)
    cast = [(u.gather_dtype, u.shard_numel) for u in blocks if u.gather_dtype != u.dtype]
    plan = make_plan(gdt, rdt, config.n_slots, config.max_inflight_reduce_scatter, groups.wp_size, landing, cast)
    largest = _largest_collectives(units, replicated)
    sizes = (groups.wp_size, groups.replica_size, groups.world_size)
    shm = backend.check_capacity(*shared_memory_need(plan.pool_bytes, config.memory_pool, sizes, *largest))
    if not backend.disabled:
        plan = dataclasses.replace(plan, shm_bytes=shm)
    _reserve_scratch(units, largest, groups, backend)
    moved = _shards_to_move(blocks, groups, config, backend)
    _plan_heap(units, plan, replicated, sum(u.flat_shard.nbytes for u in moved), groups, config, backend)
    for u in moved:  # NVSHMEM: the heap is sized by now
        u.move_shard(alloc(u.flat_shard.numel(), u.dtype))
    if groups.rank == 0:
        log.info(plan.describe())
    plain = functools.partial(_plain_buffer, device=device)  # made in a backward, by this rank alone
    pairs = ReduceScatterBuffers(
        plan, plain if release_pairs else alloc, pooled=config.memory_pool, release=release_pairs
    )
    return Buffers(plan, SlotPool(plan, alloc, pooled=config.memory_pool), pairs, moved)


def _plain_buffer(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.empty(numel, dtype=dtype, device=device)


def _reserve_scratch(units: Units, largest: tuple[int, int, int], groups: ParallelGroups, backend: Backend) -> None:
    """Each group's lanes get their scratch (CUDA symmetric memory): a collective's
    input bytes per rank, per lane."""
    g, device = groups, units.blocks[0].device
    gathered, _, repl = largest
    sent = max(u.flat_shard.nbytes for u in (*units.blocks, units.root) if u is not None)
    replica = {kind: max(sizes, default=0) for kind, sizes in replica_collectives(units.sharded())}
    for group, size, nbytes, lane in (
        (g.wp_group, g.wp_size, sent, "gather"),
        (g.wp_group, g.wp_size, gathered, "reduce"),
        (g.replica_group, g.replica_size, replica.get("all_reduce", replica.get("reduce_scatter", 0)), "reduce"),
        (g.replica_group, g.replica_size if "all_gather" in replica else 1, replica.get("all_gather", 0), "gather"),
        (g.world_group, g.world_size, repl, "reduce"),
        (g.sp_group, g.sp_size, 0, "all_to_all"),  # decided here, sized by the batch at first use
    ):
        if size > 1:
            backend.reserve(group, nbytes, device, lane)


def _shards_to_move(
    blocks: list[BlockUnit], groups: ParallelGroups, config: ISPConfig, backend: Backend
) -> list[BlockUnit]:
    """The blocks whose gathers read their flat shard itself (no cast), when the
    backend reads gather sources only from symmetric buffers (see
    :attr:`~isp_comm.backends.base.Backend.symmetric_sources`) and the pool has them."""
    if not (backend.symmetric_sources and config.memory_pool and groups.wp_size > 1):
        return []
    return [u for u in blocks if u.gather_dtype == u.dtype and u.flat_shard.numel()]


def _plan_heap(
    units: Units,
    plan: MemoryPlan,
    replicated: list[nn.Parameter],
    shard_bytes: int,
    groups: ParallelGroups,
    config: ISPConfig,
    backend: Backend,
) -> None:
    """Tell the backend what its fixed device memory must hold (see
    :meth:`~isp_comm.backends.base.Backend.plan_symmetric`): the pool's buffers and
    the shards moved beside them (``shard_bytes``), and the planned collectives that
    do not run on them."""
    g, pooled = groups, config.memory_pool

    def unit_sizes(u: BlockUnit) -> tuple[int, list[int]]:
        return u.shard_numel * u.gather_dtype.itemsize, [r.gathered_numel * r.dtype.itemsize for r in u.full_groups]

    copied = copied_collectives(
        (g.wp_size, g.replica_size, g.world_size),
        pooled,
        [unit_sizes(u) for u in units.blocks],
        unit_sizes(units.root) if units.root is not None else None,
        replica_collectives(units.sharded()),
        sum(p.numel() * p.element_size() for p in replicated),
    )
    by_name = {"wp": g.wp_group, "replica": g.replica_group, "world": g.world_group}
    buffers = plan.pool_bytes + shard_bytes if pooled and g.wp_size > 1 else 0
    backend.plan_symmetric(g.wp_group, buffers, [(by_name[w], kind, n) for w, kind, n in copied])


def _largest_collectives(units: Units, replicated: list[nn.Parameter]) -> tuple[int, int, int]:
    """Bytes per rank of the largest collective of each group: a gathered unit (WP;
    the blocks and the outer parameters' unit), the replica collectives' largest
    buffer (a flat shard's all-reduce, or every replica's pieces), every replicated
    parameter (world)."""
    gathered = [u for u in (*units.blocks, units.root) if u is not None]
    return (
        max(u.gathered_numel * u.flat_shard.element_size() for u in gathered),
        replica_largest(units.sharded()),
        sum(p.numel() * p.element_size() for p in replicated),
    )
