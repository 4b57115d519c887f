"""MaxPool sizing: one slot size per dtype, the largest any block needs, fixed at wrap time."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch


@dataclass(frozen=True)
class MemoryPlan:
    """What the all-gather pool and the reduce-scatter buffers hold, computed once."""

    n_slots: int
    slot_numel: dict[torch.dtype, int]
    """Elements of one gathered-block slot, per gather dtype."""
    slot_set_by: dict[torch.dtype, int]
    """Index of the block that sets each dtype's slot size (the largest)."""
    staging_numel: dict[torch.dtype, int]
    """Elements of the rank-major all-gather landing buffer (0 when wp == 1 or when
    gathers land in the slots directly)."""
    rs_numel: dict[torch.dtype, int]
    """Elements of one reduce-scatter input buffer, per reduce dtype."""
    rs_buffers: int
    """Reduce-scatter buffers (= max in-flight reduce-scatters)."""
    wp_size: int
    send_numel: dict[torch.dtype, int] = field(default_factory=dict)
    """Elements of the cast send buffer, per gather dtype: the largest shard of the
    blocks gathered in another dtype than their own (empty at wp 1: no send buffer)."""
    shm_bytes: int = 0
    """Shared memory (``/dev/shm``) this host needs for the symmetric-memory backend,
    about: every local rank's pool buffers and collective scratch (0: not used)."""
    pool_bytes: int = field(init=False)
    """Slots plus staging plus cast send buffers plus reduce-scatter buffers, in bytes."""
    rs_bytes: int = field(init=False)
    """The reduce-scatter buffers alone (inputs and outputs), in bytes."""

    def __post_init__(self) -> None:
        def nbytes(d: dict[torch.dtype, int]) -> int:
            return sum(n * dt.itemsize for dt, n in d.items())

        rs = self.rs_buffers * sum(self.rs_pair_bytes(dt) for dt in self.rs_numel)
        object.__setattr__(self, "rs_bytes", rs)
        gather = self.n_slots * nbytes(self.slot_numel) + nbytes(self.staging_numel) + nbytes(self.send_numel)
        object.__setattr__(self, "pool_bytes", gather + rs)

    def rs_out_numel(self, dtype: torch.dtype) -> int:
        """Elements of one reduce-scatter output buffer of ``dtype``: a rank's share of the input."""
        return -(-self.rs_numel[dtype] // self.wp_size)

    def rs_pair_bytes(self, dtype: torch.dtype) -> int:
        """One reduce-scatter pair of ``dtype`` (input and output), in bytes."""
        return (self.rs_numel[dtype] + self.rs_out_numel(dtype)) * dtype.itemsize

    def describe(self) -> str:
        parts = [
            f"{self.n_slots} slots x {n} {str(dt).removeprefix('torch.')} (set by block {self.slot_set_by[dt]})"
            for dt, n in self.slot_numel.items()
        ]
        shm = f"; shared memory for this host about {self.shm_bytes / 2**20:.1f} MiB" if self.shm_bytes else ""
        return f"isp-comm memory plan: {'; '.join(parts)}; pool {self.pool_bytes / 2**20:.2f} MiB{shm}"


Landing = Literal["slot", "per-parameter", "staging"]


def releases_reduce_buffers(wanted: bool | None, device_type: str, symmetric: bool) -> bool:
    """Whether the reduce-scatter pairs are given back when a backward ends
    (``ISPConfig.release_reduce_buffers``, ``wanted``) for parameters on
    ``device_type``; ``symmetric``: the backend's group buffers are symmetric
    (``Backend.symmetric_buffers``). ``None`` decides as that field says."""
    if wanted is None:
        return device_type == "cuda" and not symmetric
    if wanted and symmetric:
        raise ValueError(
            "release_reduce_buffers=True: this backend's reduce-scatter buffers are symmetric, allocated by "
            "the WP group together at wrap, so one rank cannot give them back and make them again; leave it "
            "None (kept) or use backend='torch'"
        )
    return wanted


def gather_landing(wp_size: int, comm_granularity: str) -> Landing:
    """Where a block's all-gather lands: the one decision, which the plan sizes the
    landing buffer by and ``BlockState.unshard`` issues by.

    ``"slot"`` (wp 1): the gather is a copy straight into the slot; ``"per-parameter"``
    (``comm_granularity="module"``): one collective per parameter, each landing in its
    region of the slot, written by the peers; ``"staging"`` (``"block"``): one
    collective into the rank-major landing buffer, copied param-major into the slot.
    (Whether peers write a buffer directly is the backend's to see: it knows which
    addresses it registered.)"""
    if wp_size == 1:
        return "slot"
    return "per-parameter" if comm_granularity == "module" else "staging"


def make_plan(
    gathered: list[tuple[torch.dtype, int]],
    reduce: list[tuple[torch.dtype, int]],
    n_slots: int,
    rs_buffers: int,
    wp_size: int,
    landing: Landing = "staging",
    cast: Sequence[tuple[torch.dtype, int]] = (),
) -> MemoryPlan:
    """``gathered``/``reduce``: per block, its gather / reduce dtype and gathered numel;
    ``landing``: from :func:`gather_landing` (a landing buffer only for ``"staging"``);
    ``cast``: per block gathered in another dtype than its own, that dtype and its
    shard's numel (the cast send buffer; none at wp 1, where the cast is into the slot)."""
    slot: dict[torch.dtype, int] = {}
    set_by: dict[torch.dtype, int] = {}
    for i, (dt, n) in enumerate(gathered):
        if n > slot.get(dt, -1):
            slot[dt], set_by[dt] = n, i
    rs: dict[torch.dtype, int] = {}
    for dt, n in reduce:
        rs[dt] = max(rs.get(dt, 0), n)
    staging = {dt: (n if landing == "staging" else 0) for dt, n in slot.items()}
    send: dict[torch.dtype, int] = {}
    for dt, n in cast if landing != "slot" else ():
        send[dt] = max(send.get(dt, 0), n)
    return MemoryPlan(
        n_slots=n_slots,
        slot_numel=slot,
        slot_set_by=set_by,
        staging_numel=staging,
        rs_numel=rs,
        rs_buffers=rs_buffers,
        wp_size=wp_size,
        send_numel=send,
    )


def shared_memory_need(
    pool_bytes: int,
    pooled: bool,
    sizes: tuple[int, int, int],
    gathered_bytes: int,
    shard_bytes: int,
    replicated_bytes: int,
) -> tuple[int, list[int]]:
    """What one rank puts in shared memory: the pool's symmetric buffers (when pooled
    over more than one rank), and the largest collective of each group that uses the
    backend's scratch. ``sizes``: (wp, replica, world); ``gathered_bytes`` /
    ``shard_bytes``: the largest gathered unit and the largest flat shard (WP gathers,
    replica all-reduces); ``replicated_bytes``: the replicated parameters (the world
    all-reduce of their gradients)."""
    wp, replica, world = sizes
    buffers = pool_bytes if pooled and wp > 1 else 0
    largest = []
    if wp > 1:
        largest.append(gathered_bytes)
    if replica > 1:
        largest.append(shard_bytes)
    if world > 1 and replicated_bytes:
        largest.append(replicated_bytes)
    return buffers, largest


Copied = tuple[str, str, list[int]]
"""A planned collective that does not run on the pool's buffers: (its group, ``"wp"``,
``"replica"`` or ``"world"``; its kind; the per-rank input bytes of each size)."""


def copied_collectives(
    sizes: tuple[int, int, int],
    pooled: bool,
    blocks: list[tuple[int, list[int]]],
    outer: tuple[int, list[int]] | None,
    replica_collectives: list[tuple[str, list[int]]],
    replicated_bytes: int,
) -> list[Copied]:
    """The collectives known at wrap time that a backend serves from scratch of its
    own (on NVSHMEM: exact-size scratch in the symmetric heap, so its heap is sized by
    them). ``sizes``: (wp, replica, world); ``pooled``: the blocks' gathers and
    reduce-scatters run on the pool's buffers; ``blocks`` / ``outer``: per block and
    for the outer parameters' unit, its shard's bytes in the gather dtype and each
    reduce group's gathered bytes; ``replica_collectives``: the replica group's collectives as
    (kind, per-rank input bytes of each): the all-reduces of every reduce group's
    shard, or, with pieces, the reduce-scatters into them and the all-gathers back;
    ``replicated_bytes``: the replicated parameters (the
    world all-reduce of their gradients, in buckets whose sizes add up to it: one size
    of that sum bounds their scratch). Batch-dependent collectives (sequence
    parallelism, the vocab-parallel loss) and full state dicts are not known here."""
    wp, replica, world = sizes
    out: list[Copied] = []
    if wp > 1:
        gathers = [] if pooled else [g for g, _ in blocks]
        reduces = [] if pooled else [r for _, rs in blocks for r in rs]
        if outer is not None:
            gathers.append(outer[0])
            reduces += outer[1]
        out += [("wp", "all_gather", gathers), ("wp", "reduce_scatter", reduces)]
    if replica > 1:
        out += [("replica", kind, n) for kind, n in replica_collectives]
    if world > 1 and replicated_bytes:
        out.append(("world", "all_reduce", [replicated_bytes]))
    return [c for c in out if c[2]]
