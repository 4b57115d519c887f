"""The planner's link model as a virtual world's clock: a collective's time on a
profile (a target's published figures, or a profile file), the same function the
step-time model adds up (:func:`isp_comm.planner.step.collective_time`), so that a
virtual run and ``--plan`` share their network and differ only in what is measured."""

from __future__ import annotations

import dataclasses

from isp_comm.planner.profile import Profile
from isp_comm.planner.step import collective_time


@dataclasses.dataclass(frozen=True)
class ProfileLink:
    """:class:`~isp_comm.backends.virtual.LinkModel` on ``profile``'s collectives of
    ``backend`` (``""``: the profile's default). A group's span is from its lowest to
    its highest rank, so a strided group (the replicas of a shard) crosses nodes as
    it would in the job."""

    profile: Profile
    backend: str = ""

    def seconds(self, op: str, ranks: tuple[int, ...], nbytes: int) -> float:
        span = ranks[-1] - ranks[0] + 1 if ranks else 0
        return collective_time(self.profile, self.backend or self.profile.default_backend, op, len(ranks), nbytes, span)

    def describe(self) -> str:
        return f"the planner's links of {self.profile.name} ({self.profile.source})"
