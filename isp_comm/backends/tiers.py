"""Tiers of links: what a collective asks of a rank's links, and the order in which
they serve it. The virtual backend (``isp_comm/backends/virtual.py``) keeps its
collectives' time on it, and the planner's step model (``isp_comm/planner/step.py``)
replays a step on the same rules, so that both share one link model.

[Note: tiers of links]
A rank reaches its peers over more than one kind of link: inside a node over its
NVLink ports (tier ``intra``), across nodes over its share of the node's NICs
(tier ``inter``). A link model (``isp_comm/planner/links.py``, or the virtual
backend's flat link) turns a collective into a :class:`Demand`: a fixed latency,
and for each tier the seconds its bytes would take that tier alone. Then:

- **The tiers run at once.** A collective inside a node and one across nodes,
  issued together, each take their own time; a collective that uses both tiers (a
  group spanning nodes with several ranks in each, NCCL's ring) takes the longer
  of its two parts, the parts moving concurrently as NCCL's pipelined rings do.
- **A tier serves one collective at a time, in issue order.** A collective's part
  on a tier starts when the tier is done with the parts issued before it. Two 4 ms
  collectives on one tier, issued together, end at 4 and 8 ms, whether they belong
  to one group or two: the tier's bandwidth is shared by taking turns. Fair sharing
  (processor sharing) would end both at 8 ms; the tier's busy time, and so the end
  of the last of a batch, is the same. Issue order is chosen because it fixes a
  collective's end when it is issued, never moved by a later one: a CUDA stream per
  tier gives exactly this order without knowing the future (the virtual backend's
  device-side spins), and the planner can replay it in one pass.
- **A group runs its collectives one after another** (NCCL's one stream per
  communicator): a collective starts no sooner than the previous one of its group
  ended, latency included.
- **Latency** holds the group, not the tiers: it is added after the last part.

:class:`TierSchedule` is these rules on an explicit clock: the CPU comm thread
feeds it host times, the planner its simulated compute time. The CUDA path builds
the same order out of streams (see [Note: the virtual backend on CUDA] in
``isp_comm/backends/virtual.py``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable

INTRA, INTER = "intra", "inter"
"""The tiers of a profile's links: inside a node (NVLink) and across nodes (InfiniBand)."""


@dataclasses.dataclass(frozen=True)
class Demand:
    """What one collective asks of this rank's links: ``latency_s`` (ring steps'
    fixed cost) and, per tier, the seconds its bytes take at that tier's bandwidth
    alone (see [Note: tiers of links])."""

    latency_s: float = 0.0
    tiers: tuple[tuple[str, float], ...] = ()
    """(tier, seconds) for each tier the collective moves bytes on."""

    def __post_init__(self) -> None:
        if self.latency_s < 0 or any(s < 0 for _, s in self.tiers):
            raise ValueError(f"a collective's demand cannot be negative: {self}")

    def __bool__(self) -> bool:
        """Whether the collective takes any time."""
        return self.latency_s > 0 or any(s > 0 for _, s in self.tiers)

    @property
    def seconds(self) -> float:
        """The collective's time alone: latency plus its longest tier."""
        return self.latency_s + max((s for _, s in self.tiers), default=0.0)

    def on(self, tier: str) -> float:
        """Seconds on ``tier`` (0 when it does not use it)."""
        return sum(s for t, s in self.tiers if t == tier)

    def times(self, k: float) -> Demand:
        """``k`` such collectives back to back in one group, as one."""
        return Demand(k * self.latency_s, tuple((t, k * s) for t, s in self.tiers))


NONE = Demand()
"""A collective that takes no time (a group of one rank, an empty buffer)."""


class TierSchedule:
    """The rules of [Note: tiers of links] on an explicit clock. :meth:`place` is
    called in issue order, with issue times that never decrease; it returns the
    collective's end, which no later call changes."""

    def __init__(self) -> None:
        self._tier_free: dict[str, float] = {}
        self._group_end: dict[Hashable, float] = {}
        self.busy: dict[str, float] = {}
        """Seconds each tier has been busy (the sum of the parts placed on it)."""

    def place(self, now: float, group: Hashable, demand: Demand, after: float = 0.0) -> float:
        """A collective of ``group`` issued at ``now`` that may not start before
        ``after`` (a collective it depends on, e.g. a replica reduce-scatter on its
        WP reduce-scatter); returns when it ends."""
        start = max(now, after, self._group_end.get(group, 0.0))
        end = start
        for tier, seconds in demand.tiers:
            if seconds <= 0:
                continue
            begin = max(start, self._tier_free.get(tier, 0.0))
            self._tier_free[tier] = begin + seconds
            self.busy[tier] = self.busy.get(tier, 0.0) + seconds
            end = max(end, begin + seconds)
        end += demand.latency_s
        self._group_end[group] = end
        return end

    def ahead(self, now: float) -> tuple[tuple[Hashable, float], ...]:
        """What is still busy past ``now``: each tier's and group's end, less ``now``
        (0 when it is free). Two schedules with the same ``ahead`` place every
        collective issued from then on alike, one shifted from the other."""
        ends = [*self._tier_free.items(), *((("group", g), e) for g, e in self._group_end.items())]
        return tuple(sorted(((key, max(end - now, 0.0)) for key, end in ends), key=repr))

    def repeat(self, shift: float, busy: dict[str, float], times: int) -> None:
        """As if what was placed since the schedule looked as it does now, shifted
        by ``shift`` before, had been placed ``times`` more times: every end moves
        ``times * shift`` on and each tier is ``busy[tier]`` longer each time."""
        for ends in (self._tier_free, self._group_end):
            for key in ends:
                ends[key] += times * shift
        for tier, seconds in busy.items():
            self.busy[tier] = self.busy.get(tier, 0.0) + times * seconds

    def horizon(self) -> float:
        """When every collective placed so far has ended."""
        return max(self._group_end.values(), default=0.0)
