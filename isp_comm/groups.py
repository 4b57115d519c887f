"""ParallelGroups: the weight-parallel, sequence-parallel and replica groups of a world."""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed import ProcessGroup


def first_error(error: str | None) -> str | None:
    """Collective over the world: the first rank's error message, or ``None`` when no
    rank had one, so that every rank raises alike (or none does) and nobody waits on
    a peer that gave up."""
    every: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(every, error)
    return next((e for e in every if e), None)


def _check_size(name: str, size: object, world: int) -> int:
    if isinstance(size, bool) or not isinstance(size, int):
        raise ValueError(f"{name} must be an int, got {size!r}")
    if size < 1:
        raise ValueError(f"{name} must be >= 1, got {size}")
    if world % size != 0:
        raise ValueError(f"{name}={size} does not divide the world size {world}")
    return size


def _my_group(world: int, rank: int, groups_ranks: list[list[int]]) -> tuple[ProcessGroup, list[int]]:
    """Create every group (new_group is collective over the world) and keep ours."""
    mine = None
    for ranks in groups_ranks:
        pg = dist.new_group(ranks)
        if rank in ranks:
            mine = (pg, ranks)
    assert mine is not None, f"rank {rank} is in none of {groups_ranks}"
    return mine


@dataclass(frozen=True)
class ParallelGroups:
    """The process groups ISP needs, for this rank.

    Ranks are laid out contiguously: WP group ``k`` is ranks ``[k*wp, (k+1)*wp)`` and
    SP group ``j`` is ranks ``[j*sp, (j+1)*sp)``. Ranks holding the same weight shard
    (same position in their WP group) form a *replica* group, over which sharded
    gradients are summed after the WP reduce-scatter.
    """

    wp_group: ProcessGroup
    sp_group: ProcessGroup
    replica_group: ProcessGroup
    world_group: ProcessGroup
    wp_ranks: tuple[int, ...]
    sp_ranks: tuple[int, ...]
    replica_ranks: tuple[int, ...]
    rank: int
    world_size: int

    @property
    def wp_size(self) -> int:
        return len(self.wp_ranks)

    @property
    def wp_rank(self) -> int:
        return self.wp_ranks.index(self.rank)

    @property
    def sp_size(self) -> int:
        return len(self.sp_ranks)

    @property
    def sp_rank(self) -> int:
        return self.sp_ranks.index(self.rank)

    @property
    def replica_size(self) -> int:
        return len(self.replica_ranks)

    @property
    def replica_rank(self) -> int:
        return self.replica_ranks.index(self.rank)

    @classmethod
    def create(cls, wp_size: int, sp_size: int = 1) -> ParallelGroups:
        """Build the groups; must be called on every rank after ``init_process_group``."""
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError(
                "ParallelGroups.create needs torch.distributed to be initialised: "
                "call torch.distributed.init_process_group() first"
            )
        world, rank = dist.get_world_size(), dist.get_rank()
        wp = _check_size("wp_size", wp_size, world)
        sp = _check_size("sp_size", sp_size, world)
        wp_group, wp_ranks = _my_group(world, rank, [list(range(k, k + wp)) for k in range(0, world, wp)])
        sp_group, sp_ranks = _my_group(world, rank, [list(range(j, j + sp)) for j in range(0, world, sp)])
        replica_group, replica_ranks = _my_group(world, rank, [list(range(i, world, wp)) for i in range(wp)])
        return cls(
            wp_group=wp_group,
            sp_group=sp_group,
            replica_group=replica_group,
            world_group=dist.group.WORLD,
            wp_ranks=tuple(wp_ranks),
            sp_ranks=tuple(sp_ranks),
            replica_ranks=tuple(replica_ranks),
            rank=rank,
            world_size=world,
        )
