"""isp-comm: InternEvo-style ISP (weight + sequence parallel) communication for PyTorch."""

from isp_comm.communicator import ISPCommunicator, find_blocks
from isp_comm.config import ISPConfig
from isp_comm.context import CommContext
from isp_comm.errors import HookOrderError, ISPCommTimeout
from isp_comm.groups import ParallelGroups
from isp_comm.memory_forecast import MemoryForecast, forecast

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
