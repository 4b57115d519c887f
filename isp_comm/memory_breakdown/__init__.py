"""Where every byte of a measured peak goes, by the memory forecast's parts.

``MemoryBreakdown`` is a ``TorchDispatchMode`` a training loop runs inside (an
``ISPCommunicator``'s, or PyTorch FSDP2's for the same comparison): it notes
every tensor storage made while it is active, names the part of the forecast each
belongs to (its owner, a hook, or the phase it was made in: [Note: how a storage gets
its part] in :mod:`.tracker`), follows the step's phases by itself, and keeps each
phase's peak with what was alive then. Its result puts each measured part beside the
forecast's line of the same name (:class:`~.result.Breakdown`), with what the device
held beyond the tracked tensors at that moment (CUDA's workspaces and allocator slack,
or the CPU process's allocator slack and runtime: [Note: the device lines]).

[Note: the package]
:mod:`.parts` (the lines and their categories), :mod:`.fsdp2` (which tensors
FSDP2's units hold), :mod:`.owners` (which tensors an ``ISPCommunicator``, its
model and optimizer own), :mod:`.result` (the figures and their table) and
:mod:`.tracker` (the mode and its hooks), each importing only the ones before it.
It sits above the memory forecast, whose parts it names, and below the planner and
isp-train.
"""

from isp_comm.memory_breakdown.parts import CATEGORIES, category
from isp_comm.memory_breakdown.result import Breakdown
from isp_comm.memory_breakdown.tracker import MemoryBreakdown

__all__ = ["CATEGORIES", "Breakdown", "MemoryBreakdown", "category"]
