"""A rank that ran out of memory ends with one line, not a traceback: the rank, the
step and what it was doing (the forward, the backward, the optimizer step, an
evaluation, a save, or the setup that builds and shards the model), the allocator's
own account, and on the rank that holds it the memory forecast for the same phase
with its biggest part and the knob that shrinks it. On many GPUs an out-of-memory
error is the usual first failure of a layout, and each rank's traceback said only
where in torch the allocation was.

The loop says where it is (:class:`Where`, on the job); ``loop.run`` turns the
allocator's error into :class:`OutOfMemory`, which ``rank_main`` prints on the rank
it happened on (each such rank prints its own line), exit code 2. A restart under
``--max-restarts`` still happens: memory another process held may be free by then.
"""

from __future__ import annotations

import dataclasses

import torch

from isp_comm.memory_forecast import MemoryForecast
from isp_comm.train.preflight import advice

CPU_ALLOCATOR = "DefaultCPUAllocator: can't allocate memory"
"""What torch's CPU allocator raises (a ``RuntimeError``) when the host refuses memory."""


class OutOfMemory(Exception):
    """The allocator refused memory on this rank; ``str()`` is the run's one line."""


@dataclasses.dataclass
class Where:
    """Where a rank's run is, updated by the loop as it goes (no collective, no sync)."""

    step: int = 0
    phase: str = "setup"
    """``setup``, ``forward``, ``backward``, ``optimizer``, ``evaluate`` or ``save``."""


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is an allocator's refusal: CUDA's ``torch.OutOfMemoryError``, or
    the CPU allocator's ``RuntimeError``."""
    return isinstance(exc, torch.OutOfMemoryError) or (isinstance(exc, RuntimeError) and CPU_ALLOCATOR in str(exc))


def allocator_said(exc: BaseException) -> str:
    """The allocator's account of ``exc`` on one line: what it tried, what the device
    has, what torch holds; without its advice on ``PYTORCH_CUDA_ALLOC_CONF`` and the
    C++ location of the CPU allocator's check."""
    text = " ".join(str(exc).split())
    for cut in (" If reserved but unallocated", " See documentation for Memory Management"):
        text = text.split(cut, 1)[0]
    if text.startswith("[enforce fail"):
        text = text.split("] ", 1)[-1].removeprefix("err == 0. ")
    return text.rstrip(". ")


def out_of_memory_line(rank: int, where: Where, exc: BaseException, fc: MemoryForecast | None) -> str:
    """The run's one line for ``exc`` on ``rank`` (see the module's docstring)."""
    at = f"in the {where.phase} of step {where.step}"
    if where.phase == "setup":
        at = "while setting up (building, sharding or loading the model)"
    line = f"rank {rank} ran out of memory {at}: {allocator_said(exc)}"
    phase = "wrap" if where.phase == "setup" else where.phase
    if fc is not None and phase in fc.phases:
        line += (
            f". The memory forecast for that phase is {fc.peak(phase) / 2**20:,.0f} MiB per rank; {advice(fc, phase)}"
        )
    elif fc is None:
        line += ". isp-train --plan with the same flags prints the memory forecast per phase and what shrinks each"
    return line


def raise_if_out_of_memory(exc: RuntimeError, rank: int, where: Where, fc: MemoryForecast | None) -> None:
    """:class:`OutOfMemory` with the run's line in place of ``exc`` when the allocator
    raised it; nothing otherwise (the caller re-raises ``exc``)."""
    if is_out_of_memory(exc):
        raise OutOfMemory(out_of_memory_line(rank, where, exc, fc)) from exc
