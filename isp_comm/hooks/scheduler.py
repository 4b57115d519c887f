"""The scheduler hook: InternEvo-style calls a training loop makes around each micro-step."""

from __future__ import annotations

from enum import Enum, auto

from isp_comm.errors import HookOrderError
from isp_comm.hooks.engine import BlockEngine


class _Step(Enum):
    IDLE = auto()
    FORWARD = auto()
    AFTER_FORWARD = auto()
    BACKWARD = auto()


_ALLOWED = {
    "before_forward": (_Step.IDLE, _Step.AFTER_FORWARD),
    "after_forward": (_Step.FORWARD,),
    "before_backward": (_Step.FORWARD, _Step.AFTER_FORWARD),
    "after_backward": (_Step.BACKWARD,),
}


class SchedulerHook:
    """``before_forward`` / ``after_forward`` / ``before_backward`` / ``after_backward``.

    The engine works without these calls too (module hooks and an autograd callback
    drive it); the hook adds an early prefetch of block 0, an explicit drain point
    and a check that the loop calls things in order.
    """

    def __init__(self, engine: BlockEngine) -> None:
        self._engine = engine
        self._step = _Step.IDLE

    def _advance(self, call: str, to: _Step) -> None:
        if self._step not in _ALLOWED[call]:
            allowed = " or ".join(s.name.lower() for s in _ALLOWED[call])
            raise HookOrderError(
                f"{call}() called in state '{self._step.name.lower()}'; it is only valid after "
                f"{allowed} (order: before_forward, [after_forward], before_backward, after_backward)"
            )
        self._step = to

    def before_forward(self) -> None:
        self._advance("before_forward", _Step.FORWARD)
        self._engine.root_pre_forward(from_hook=True)

    def after_forward(self) -> None:
        self._advance("after_forward", _Step.AFTER_FORWARD)

    def before_backward(self) -> None:
        self._advance("before_backward", _Step.BACKWARD)

    def after_backward(self) -> None:
        self._advance("after_backward", _Step.IDLE)
        self._engine.end_backward()
