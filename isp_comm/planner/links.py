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
- both, hierarchical (a WP group of 16 on nodes of 8): inside each node a ring
  over the ``k`` local ranks, ``(k-1)/k x B`` on ``intra``, and across nodes a ring
  over the ``m`` ranks of one local index on ``B / k`` of the buffer, ``(m-1)/m x
  B / k`` on ``inter``. This is the least a node's NICs must carry: node j must
  receive the ``(m-1)/m`` of the buffer held elsewhere, through its ``k`` NICs.
  NCCL's rings reach it by crossing each node boundary once per channel, one NIC a
  channel (a flat ring charged ``(n-1)/n x B`` to one NIC would carry every byte
  ``k`` times). The two parts move at once (pipelined chunks).

An all-reduce is a reduce-scatter then an all-gather: twice the bytes on each tier
and twice the ring steps. An all-to-all sends ``(k-1)/n x B`` to the ranks of its
own node and ``(n-k)/n x B`` to the others, through its own NIC. Latency: one
``latency_s`` per ring step, ``k-1`` of the intra link's and ``m-1`` of the inter
link's (``n-1`` of one link's when only one tier is used). Bandwidth: the link's
per-rank ``bytes_per_s`` times NCCL's fraction at the message size ``B``
(``Link.curve``). Each tier then serves collectives as [Note: tiers of links] in
``isp_comm/backends/tiers.py`` says.
"""

from __future__ import annotations

import dataclasses

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
    nodes = len({r // per_node for r in ranks}) if INTER in links else 1
    k = n / nodes  # ranks of the group in each node
    twice = 2 if op == "all_reduce" else 1
    parts: list[tuple[str, float, float]] = []  # (tier, bytes on it, ring steps)
    if op == "all_to_all":
        if k > 1:
            parts.append((INTRA, (k - 1) / n * nbytes, k - 1))
        if nodes > 1:
            parts.append((INTER, (n - k) / n * nbytes, nodes - 1))
    elif nodes == 1:
        parts.append((INTRA, twice * (n - 1) / n * nbytes, twice * (n - 1)))
    elif k == 1:
        parts.append((INTER, twice * (n - 1) / n * nbytes, twice * (n - 1)))
    else:
        parts.append((INTRA, twice * (k - 1) / k * nbytes, twice * (k - 1)))
        parts.append((INTER, twice * (nodes - 1) / nodes * nbytes / k, twice * (nodes - 1)))
    latency, tiers = 0.0, []
    for tier, moved, steps in parts:
        link = links[tier][op]
        latency += link.latency_s * steps
        tiers.append((tier, moved / (link.bytes_per_s * interp(link.curve, nbytes))))
    return Demand(latency, tuple(tiers))


def group_ranks(group: int, span: int = 0) -> tuple[int, ...]:
    """Rank 0's group of ``group`` ranks spread evenly over ``span`` ranks (default:
    contiguous): a WP or SP group is ``0 .. group-1``, a replica group ``0, wp, 2 wp, ...``."""
    span = span or group
    return tuple(range(0, span, max(span // max(group, 1), 1)))[:group]


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
