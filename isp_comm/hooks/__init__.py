"""WHEN things happen: per-block forward/backward hooks and the scheduler hook."""

from isp_comm.hooks.engine import BlockEngine, Phase
from isp_comm.hooks.scheduler import SchedulerHook

__all__ = ["BlockEngine", "Phase", "SchedulerHook"]
