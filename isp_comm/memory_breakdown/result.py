"""A measured breakdown: each phase's peak by part, what the device held at that
moment, and the table that puts it beside the memory forecast's."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

from isp_comm.memory_breakdown.parts import OTHER, by_category, category, forecast_part, part_order, tensor_parts

MIB = 2**20


@dataclasses.dataclass
class PhasePeak:
    """One phase's highest total of tracked storages: the total, the storages alive then
    (each with its bytes; their parts are read when the result is made) and what the
    device held at that moment (``allocated``/``reserved`` on CUDA, ``rss`` on CPU)."""

    tracked: int
    alive: list[tuple[Any, int]]
    device: dict[str, int]


@dataclasses.dataclass(frozen=True)
class Breakdown:
    """Per phase: the tracked peak, its parts (bytes) and the device lines.

    [Note: the device lines]
    Beyond the tracked tensors a peak holds memory no tensor names. On CUDA, at the
    moment of the tracked peak: ``workspace and untracked`` is the allocated bytes less
    the tracked storages on the GPU (cuBLAS's workspaces, one per handle and stream, and any
    allocation made outside an operator), ``allocator slack`` the reserved bytes less
    the allocated ones (the caching allocator's rounding, free blocks and fragmentation).
    On CPU, ``allocator slack and runtime`` is what the process's resident anonymous
    memory grew by since the breakdown attached, less what the tracked tensors grew by:
    memory glibc keeps after frees, and the runtime's own (gloo's buffers, the kernels'
    scratch). Either is measured, not modelled; both are relative to the moment the
    breakdown attached on CPU, absolute on CUDA."""

    phases: dict[str, dict[str, int]]
    """phase -> part -> bytes of tracked tensors at the phase's peak."""
    tracked: dict[str, int]
    """phase -> the tracked peak (the sum of its parts)."""
    device: dict[str, dict[str, int]]
    """phase -> the device lines (see [Note: the device lines])."""
    baseline: int
    """Tracked bytes when the breakdown attached (in every phase's figures)."""
    untracked: dict[str, int] = dataclasses.field(default_factory=dict)
    """CUDA: the allocator's blocks no tracked tensor holds when the result was made, by
    kind (``workspace: cuBLAS``, ``untracked (other)``: [Note: untracked blocks])."""

    @classmethod
    def of(
        cls, peaks: Mapping[str, PhasePeak], baseline: tuple[int, dict[str, int]], untracked: dict[str, int]
    ) -> Breakdown:
        phases, tracked, device = {}, {}, {}
        base_tracked, base_device = baseline
        for ph, peak in peaks.items():
            parts: dict[str, int] = {}
            for info, nbytes in peak.alive:
                parts[info.part] = parts.get(info.part, 0) + nbytes
            phases[ph] = dict(sorted(parts.items(), key=lambda kv: -kv[1]))
            tracked[ph] = peak.tracked
            lines: dict[str, int] = {}
            if "allocated" in peak.device:  # the GPU's tracked storages, not the host's (AdamW's step counts)
                lines["workspace and untracked"] = peak.device["allocated"] - peak.device["tracked"]
                lines["allocator slack"] = peak.device["reserved"] - peak.device["allocated"]
            elif "rss" in peak.device and "rss" in base_device:
                grown = peak.device["rss"] - base_device["rss"]
                lines["allocator slack and runtime"] = grown - (peak.tracked - base_tracked)
            device[ph] = lines
        return cls(phases, tracked, device, base_tracked, untracked)

    def categories(self, phase: str) -> dict[str, int]:
        """The phase's parts added up by category (:data:`~.parts.CATEGORIES`)."""
        return by_category(self.phases[phase])

    def unattributed(self, phase: str) -> int:
        """Tracked bytes of the phase's peak that no owner, hook or phase named."""
        return self.phases[phase].get(OTHER, 0)

    def against(self, phase: str, forecast_parts: Mapping[str, int]) -> list[tuple[str, int, int]]:
        """(part, forecast bytes, measured bytes) for every part of either, the
        forecast's (one phase of a ``MemoryForecast``'s ``phases``) named as measured."""
        fc: dict[str, int] = {}
        for part, nbytes in forecast_parts.items():
            fc[forecast_part(part)] = fc.get(forecast_part(part), 0) + nbytes
        measured = self.phases.get(phase, {})
        names = list(dict.fromkeys([*fc, *measured]))
        names.sort(key=part_order)
        return [(n, fc.get(n, 0), measured.get(n, 0)) for n in names]

    def table(self, phase: str, forecast_parts: Mapping[str, int] | None = None) -> str:
        """A markdown table of the phase's peak: part, category, measured MiB (and the
        forecast's MiB and the difference when given), then the tracked total against
        the forecast's tensors, the forecast's runtime lines (no tensor holds them) and
        the device lines."""
        fc = forecast_parts is not None
        head = "| part | category | measured MiB |" + (" forecast MiB | measured - forecast |" if fc else "")
        rows = [head, "|---|---|---:|" + ("---:|---:|" if fc else "")]
        tensors = tensor_parts(forecast_parts or {})
        entries = self.against(phase, tensors)
        if not fc:
            entries = [(n, 0, b) for n, b in self.phases[phase].items()]
        for part, want, got in entries:
            cells = f"| {part} | {category(part)} | {got / MIB:.2f} |"
            rows.append(cells + (f" {want / MIB:.2f} | {(got - want) / MIB:+.2f} |" if fc else ""))
        total = sum(tensors.values())
        rows.append(
            f"| **tracked peak** | | **{self.tracked[phase] / MIB:.2f}** |"
            + (f" **{total / MIB:.2f}** | {(self.tracked[phase] - total) / MIB:+.2f} |" if fc else "")
        )
        for part, nbytes in (forecast_parts or {}).items():
            if part not in tensors:
                rows.append(f"| {part} | forecast only: no tensor holds it | | {nbytes / MIB:.2f} | |")
        lines = {**self.device[phase], **{f"of the untracked, at the end: {k}": v for k, v in self.untracked.items()}}
        for line, nbytes in lines.items():
            rows.append(f"| {line} | device | {nbytes / MIB:.2f} |" + (" | |" if fc else ""))
        return "\n".join(rows)

    def as_dict(self) -> dict:
        """The figures as plain data (bytes), for JSON."""
        return dataclasses.asdict(self)

    def json(self) -> str:
        return json.dumps(self.as_dict())
