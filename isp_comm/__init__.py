"""isp-comm: InternEvo-style ISP (weight + sequence parallel) communication for PyTorch.

The public names load on first use (PEP 562), so that importing a light submodule
(``isp_comm.processes``, ``isp_comm.train``'s entry point) does not import torch: a
Ctrl-C in the seconds torch takes to import is then answered by the command, not by
a ``KeyboardInterrupt`` traceback.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from isp_comm.communicator import ISPCommunicator, find_blocks
    from isp_comm.config import ISPConfig
    from isp_comm.context import CommContext
    from isp_comm.errors import HookOrderError, ISPCommTimeout
    from isp_comm.groups import ParallelGroups
    from isp_comm.memory_forecast import MemoryForecast, forecast

_HOMES = {
    "CommContext": "isp_comm.context",
    "HookOrderError": "isp_comm.errors",
    "ISPCommTimeout": "isp_comm.errors",
    "ISPCommunicator": "isp_comm.communicator",
    "ISPConfig": "isp_comm.config",
    "MemoryForecast": "isp_comm.memory_forecast",
    "ParallelGroups": "isp_comm.groups",
    "find_blocks": "isp_comm.communicator",
    "forecast": "isp_comm.memory_forecast",
}
__all__ = [
    "CommContext",
    "HookOrderError",
    "ISPCommTimeout",
    "ISPCommunicator",
    "ISPConfig",
    "MemoryForecast",
    "ParallelGroups",
    "find_blocks",
    "forecast",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    """A public name, imported from its module on first use."""
    if name not in _HOMES:
        raise AttributeError(f"module 'isp_comm' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOMES[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_HOMES])
