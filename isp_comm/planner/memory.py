"""The memory forecast for a profile's device: the parts that are not tensors.

The forecast (:mod:`isp_comm.memory_forecast`) counts tensors. What a run reports, and
what must fit, holds more:

* on CPU, the reported figure is a rank's peak RSS (``peak_rss_mib`` in
  metrics.jsonl): the process baseline (torch loaded, the model on meta; read from the
  planning process), the forecast's tensors, the runtime's memory measured by the
  calibration (code pages of the kernels run, the data, the loop's threads), and a
  calibrated share of the step's transient tensors (what the allocator keeps of
  memory freed inside the step, and temporaries the forecast does not count);
* on CUDA, the reported figures are ``max_memory_allocated`` (the forecast, whose
  cuBLAS workspaces the caching allocator serves: the profile's size, two of them) and
  ``max_memory_reserved`` (allocated plus the allocator's rounding and
  fragmentation); the device also holds the CUDA context, NCCL's buffers and, with
  the nvshmem backend, NVSHMEM's symmetric heap (the forecast's, as isp-comm sizes
  it), which the allocator never sees.

Modelled, not measured (no GPU has been available): the rounding and fragmentation
(5% of the allocated peak), the context (600 MiB) and NCCL's buffers (128 MiB per
communicator: ``NCCL_BUFFSIZE`` 4 MiB x 2 directions x 16 channels).
"""

from __future__ import annotations

import dataclasses

from isp_comm.memory_forecast import MemoryForecast
from isp_comm.planner.profile import Profile

MARGIN = 0.05
"""The share of a device's memory a plan keeps free: a layout fits when what the
device holds at its highest phase is at most 95% of the device's memory."""
FRAGMENTATION = 0.05
"""CUDA: reserved over allocated, beyond the allocated peak (modelled)."""


@dataclasses.dataclass(frozen=True)
class DeviceMemory:
    """The forecast with the device's own parts, and whether it fits."""

    forecast: MemoryForecast
    """Tensors and the parts the reported figure holds (see the module note)."""
    baseline: int
    """CPU: the process baseline added to every phase (0 on CUDA)."""
    reserved: int
    """CUDA: the allocator's reserved peak (allocated plus rounding); CPU: the RSS peak."""
    device_total: int
    """What the device holds at the highest phase (CUDA: reserved, context, NCCL)."""
    outside: dict[str, int]
    """The parts outside the reported figure (CUDA: context, NCCL buffers, rounding)."""
    capacity: int
    """The device's memory (CPU: the host's available memory over its ranks)."""

    @property
    def fits(self) -> bool:
        return self.device_total <= (1 - MARGIN) * self.capacity

    @property
    def peak(self) -> int:
        """The reported figure's forecast peak (absolute)."""
        return max(self.forecast.peak(ph) for ph in self.forecast.names()) + self.baseline


TRANSIENT = ("activations", "logits and loss", "activation gradients")
"""The forecast's parts that live inside a step and grow with its tokens (names start so)."""


def transient(phases: dict[str, dict[str, float]]) -> float:
    """The step's transient tensors at their peak (``phases``: a forecast's phase ->
    part -> size): the largest of forward's and backward's :data:`TRANSIENT` parts."""
    return max(sum(v for k, v in phases[ph].items() if k.startswith(TRANSIENT)) for ph in ("forward", "backward"))


def communicators(world: int, wp: int, sp: int) -> int:
    """NCCL communicators a rank holds: the world's, and the WP, SP and replica groups'
    where they are other groups of more than one rank."""
    groups = {world} if world > 1 else set()
    n = len(groups)
    for size in (wp, sp, world // wp):
        if 1 < size < world:
            n += 1
    return n


def device_memory(
    fc: MemoryForecast, prof: Profile, *, world: int, wp: int, sp: int, baseline: int, capacity: int
) -> DeviceMemory:
    """The forecast ``fc`` on ``prof``'s device (see the module note)."""
    multi = "multi" if world > 1 else "single"
    if prof.device == "cpu":
        share = prof.transient_share.get(multi, 0.0)
        kept = int(share * transient(fc.phases))
        extra = {
            "runtime: code, data, threads (calibrated)": prof.runtime_bytes.get(multi, 0),
            f"allocator: {100 * share:.0f}% of the step's transient tensors (calibrated)": kept,
        }
        extra = {k: v for k, v in extra.items() if v}
        phases = {ph: ({**parts, **extra} if ph != "wrap" else parts) for ph, parts in fc.phases.items()}
        fc = dataclasses.replace(fc, phases=phases)
        peak = max(fc.peak(ph) for ph in fc.names()) + baseline
        return DeviceMemory(fc, baseline, peak, peak + fc.shm_bytes // max(prof.per_node, 1), {}, capacity)
    allocated = max(fc.peak(ph) for ph in fc.names())
    outside = {
        "allocator rounding and fragmentation (modelled, 5%)": int(FRAGMENTATION * allocated),
        "CUDA context": prof.cuda.get("context", 0),
        "NCCL buffers": prof.cuda.get("nccl_per_communicator", 0) * communicators(world, wp, sp),
    }
    if fc.device_heap_bytes:  # the nvshmem backend's heap, outside the allocator
        outside["NVSHMEM symmetric heap"] = fc.device_heap_bytes
    reserved = allocated + outside["allocator rounding and fragmentation (modelled, 5%)"]
    return DeviceMemory(fc, 0, reserved, allocated + sum(outside.values()), outside, capacity)
