"""The one link model of the planner and the virtual world: what a collective asks
of each tier of a rank's links (:class:`~isp_comm.backends.tiers.Demand`), from a
profile's collectives (a target's published figures, or a profile file). The step
model (:mod:`isp_comm.planner.step`) replays a step on it; :class:`ProfileLink`
gives it to a virtual world's backend, so that a virtual run and ``--plan`` share
their network and differ only in what is measured.

[Note: a collective's bytes on each tier]
A collective over ``n`` ranks of a buffer of ``B`` bytes (the gathered size for an
all-gather or a reduce-scatter, the tensor for an all-reduce, one rank's whole
input for an all-to-all), whose ranks lie on ``m`` nodes with ``k = n / m`` in
each (``per_node`` ranks to a node, rank ``r`` on node ``r // per_node``):

- ``m = 1``, inside a node: a ring over NVLink, ``(n-1)/n x B`` on tier ``intra``;
- ``k = 1``, one rank a node (a replica group, strided by wp >= per_node): a ring
  over the NICs, ``(n-1)/n x B`` on tier ``inter``;
- both (a WP group of 16 on nodes of 8): NCCL's ring over all ``n`` ranks, its
  channels spread evenly over each node's ``k`` NICs. Each channel's ring crosses
  every node boundary once, and each link of a ring carries ``(n-1)/n`` of the
  channel's part (every chunk but one passes it), so a GPU's NIC carries
  ``(n-1)/n x B / k`` on ``inter``, and its NVLink ``(k-1)/k x (n-1)/n x B`` on
  ``intra`` (of a node's ``k`` GPUs, ``k-1`` pass a channel's part on over NVLink,
  the last over its NIC). That is NCCL's own tuning model (``src/graph/tuning.cc``:
  a ring's bus bandwidth is its channels times their inter-node speed, its
  algorithm bandwidth ``n/(n-1)`` of that), and more than the least a node must
  receive, ``(m-1)/m x B / k``: the ring carries the node's own chunks around
  too (1.125 times the least for 8 nodes, 1.875 times for 2). The two parts move
  at once (pipelined chunks).
- a group spread unevenly (a WP group of 12 on nodes of 8: 8 ranks on one node, 4
  on the next): node j, holding ``c_j`` of the ranks, spreads the ring's
  crossings over its ``c_j`` NICs, each carrying ``(n-1)/(n c_j) x B``; the node
  with the fewest sets the pace on ``inter``, and the fullest node's ``(c_j-1)/c_j
  x (n-1)/n x B`` on ``intra`` (assuming the channels divide evenly over its NICs;
  NCCL's own tuner reads only the average ranks a node). The rings of one
  layout's groups can differ in shape (WP 6 on nodes of 8: ranks 0-5 stay in
  node 0, ranks 6-11 span two); :func:`layout_groups` gives one of each shape,
  and the planner times the slowest.

An all-reduce is a reduce-scatter then an all-gather: twice the bytes on each tier.
An all-to-all sends ``(k-1)/n x B`` to the ranks of its own node and ``(n-k)/n x
B`` to the others, through its own NIC. Latency: one ``latency_s`` per step, as
NCCL's tuning model counts them. An all-gather or a reduce-scatter runs the ring's
``n-1`` steps, ``m-1`` of them between nodes and ``n-m`` inside (NCCL has no tree
for them; its PAT algorithm, for one rank a node, is not modelled). An all-reduce
inside a node runs twice the ring's; across nodes NCCL's tuner takes the faster of
its ring and its tree, and the model takes the tree's ``2 (k-1)`` steps inside a
node and ``2 ceil(log2 m)`` between nodes with the ring's bytes (a double binary
tree moves as many bytes a rank as the ring, in fewer steps). An all-to-all:
``k-1`` and ``m-1``. Bandwidth: the link's per-rank ``bytes_per_s`` times NCCL's
fraction at the message size ``B`` (``Link.curve``). Each tier then serves
collectives as [Note: tiers of links] in ``isp_comm/backends/tiers.py`` says.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math

from isp_comm.backends.tiers import INTER, INTRA, NONE, Demand
from isp_comm.planner.profile import Profile, interp


def collective_demand(prof: Profile, backend: str, op: str, ranks: tuple[int, ...], nbytes: float) -> Demand:
    """What a collective ``op`` over global ``ranks`` (ascending) of a buffer of
    ``nbytes`` asks of each tier (see [Note: a collective's bytes on each tier])."""
    n = len(ranks)
    if n <= 1 or nbytes <= 0:
        return NONE
    links = prof.collectives.get(backend) or prof.collectives[prof.default_backend]
    per_node = max(prof.per_node, 1)
    # ranks of the group on each node (one tier of links: the group is one node)
    counts = collections.Counter(r // per_node for r in ranks).values() if INTER in links else [n]
    nodes, most, fewest = len(counts), max(counts), min(counts)
    twice = 2 if op == "all_reduce" else 1
    parts: list[tuple[str, float, float]] = []  # (tier, bytes on it, ring steps)
    if op == "all_to_all":
        if most > 1:
            parts.append((INTRA, (most - 1) / n * nbytes, most - 1))
        if nodes > 1:
            parts.append((INTER, (n - fewest) / n * nbytes, nodes - 1))
    elif nodes == 1:
        parts.append((INTRA, twice * (n - 1) / n * nbytes, twice * (n - 1)))
    else:  # NCCL's ring over the n, crossing nodes on channels spread over each node's NICs
        ring = twice * (n - 1) / n * nbytes
        if op == "all_reduce":  # its tree's steps: up and down a chain in a node, a binary tree across
            intra_steps, inter_steps = 2 * (most - 1), 2 * math.ceil(math.log2(nodes))
        else:  # the ring's n - 1 steps, m - 1 of them between nodes
            intra_steps, inter_steps = n - nodes, nodes - 1
        if most > 1:
            parts.append((INTRA, (most - 1) / most * ring, intra_steps))
        parts.append((INTER, ring / fewest, inter_steps))
    latency, tiers = 0.0, []
    for tier, moved, steps in parts:
        link = links[tier][op]
        latency += link.latency_s * steps
        tiers.append((tier, moved / (link.bytes_per_s * interp(link.curve, nbytes))))
    return Demand(latency, tuple(tiers))


@functools.lru_cache(maxsize=1024)
def layout_groups(group: int, world: int, strided: bool, per_node: int) -> tuple[tuple[int, ...], ...]:
    """One group of each shape (its ranks per node, sorted) among the groups of
    ``group`` ranks that partition ``world`` as :class:`~isp_comm.groups.ParallelGroups`
    lays them out: contiguous (WP, SP), or strided by ``world // group`` (replicas)."""
    stride = world // group if strided else 1
    shapes: dict[tuple[int, ...], tuple[int, ...]] = {}
    for i in range(world // group):
        ranks = tuple(range(i, world, stride)) if strided else tuple(range(i * group, (i + 1) * group))
        shape = tuple(sorted(collections.Counter(r // per_node for r in ranks).values()))
        shapes.setdefault(shape, ranks)
    return tuple(shapes.values())


def slowest_group(prof: Profile, backend: str, op: str, group: int, world: int, strided: bool, nbytes: float) -> Demand:
    """The demand of the slowest of a layout's groups (:func:`layout_groups`) for one
    collective: every group issues it at once, and the step waits for the last."""
    every = layout_groups(group, world, strided, max(prof.per_node, 1))
    return max((collective_demand(prof, backend, op, ranks, nbytes) for ranks in every), key=lambda d: d.seconds)


@dataclasses.dataclass(frozen=True)
class ProfileLink:
    """:class:`~isp_comm.backends.virtual.LinkModel` on ``profile``'s collectives of
    ``backend`` (``""``: the profile's default): a group's nodes are read off its
    ranks (``rank // per_node``), so a strided group (the replicas of a shard)
    crosses nodes as it would in the job."""

    profile: Profile
    backend: str = ""

    def demand(self, op: str, ranks: tuple[int, ...], nbytes: int) -> Demand:
        return collective_demand(self.profile, self.backend or self.profile.default_backend, op, ranks, nbytes)

    def seconds(self, op: str, ranks: tuple[int, ...], nbytes: int) -> float:
        return self.demand(op, ranks, nbytes).seconds

    def describe(self) -> str:
        return f"the planner's links of {self.profile.name} ({self.profile.source}), NVLink and InfiniBand as tiers"
