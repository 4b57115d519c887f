"""What a forecast returns: bytes per phase and part, its table, and the knob that shrinks each part."""

from __future__ import annotations

import dataclasses
import json
from typing import Literal

Optimizer = Literal["adamw", "sgd", "sgd_momentum"]
PHASES = ("wrap", "forward", "backward", "optimizer", "save", "async_save", "load", "evaluate")
"""Every phase a forecast may hold, in a step's order; ``evaluate`` only when the run
validates (``forecast(..., evaluate=True)``)."""
MIB = 2**20


@dataclasses.dataclass(frozen=True)
class MemoryForecast:
    """Per-rank bytes above the process baseline, for each phase and named part."""

    phases: dict[str, dict[str, int]]
    """phase -> part -> bytes (the device's: CUDA allocated, or CPU RSS)."""
    shm_bytes: int
    """The host's shared memory (``/dev/shm``) for the CPU symmetric-memory backend,
    all of the host's ranks together (0: not used)."""
    host_staging: dict[str, int]
    """On CUDA: the host memory (pinned for async saves) that DCP stages a checkpoint
    in, per phase (save, async_save, load); on CPU that is the device's, in ``phases``."""
    activations_by_block: list[int]
    """Bytes each block keeps for backward (a checkpointed one: its input only)."""
    device_heap_bytes: int = 0
    """On CUDA with the nvshmem backend: NVSHMEM's symmetric heap as isp-comm sizes it
    (the pool, the shards gathered from it and the planned scratch, plus margin, in
    512 MiB granules), which ``max_memory_allocated`` does not see: what lives in it is
    not in ``phases`` (0: no heap)."""

    def names(self) -> list[str]:
        """The phases this forecast holds, in :data:`PHASES`'s order."""
        return [ph for ph in PHASES if ph in self.phases]

    def peak(self, phase: str) -> int:
        return sum(self.phases[phase].values())

    def biggest(self, phase: str) -> tuple[str, int]:
        """The largest part of ``phase``: (name, bytes)."""
        return max(self.phases[phase].items(), key=lambda kv: kv[1])

    def worst(self) -> str:
        """The phase with the highest peak."""
        return max(self.names(), key=self.peak)

    def as_mib(self, baseline_bytes: int = 0) -> dict[str, float]:
        """phase -> MiB, absolute (``baseline_bytes`` added): comparable with a run's
        logged peak (``peak_rss_mib`` on CPU, ``peak_alloc_mib`` on CUDA)."""
        return {ph: round((self.peak(ph) + baseline_bytes) / MIB, 1) for ph in self.names()}

    def table(self, baseline_bytes: int = 0) -> str:
        """A markdown table: parts down, phases across, MiB; then the peaks."""
        names, parts = self.names(), []
        for ph in names:
            parts += [p for p in self.phases[ph] if p not in parts]
        head = "| part | " + " | ".join(names) + " |"
        rows = [head, "|---|" + "---:|" * len(names)]
        for part in parts:
            cells = [self.phases[ph].get(part) for ph in names]
            rows.append(f"| {part} | " + " | ".join("" if c is None else f"{c / MIB:.1f}" for c in cells) + " |")
        if baseline_bytes:
            rows.append("| process baseline | " + " | ".join(f"{baseline_bytes / MIB:.1f}" for _ in names) + " |")
        rows.append("| **peak** | " + " | ".join(f"**{v:.1f}**" for v in self.as_mib(baseline_bytes).values()) + " |")
        return "\n".join(rows)

    def json_line(self, baseline_bytes: int = 0) -> str:
        return json.dumps(self.as_mib(baseline_bytes))


KNOBS = {
    "activations": "--ckpt (activation checkpointing)",
    "logits and loss": "--vocab-parallel, or a smaller --batch",
    "replicated params": "--shard-outer",
    "replicated grads": "--shard-outer",
    "optimizer state": "a larger --wp",
    "master shards": "a larger --wp",
    "gradient shards": "a larger --wp",
    "deferred gradient sums": "--replica-sync micro, or --state-sharding wp",
    "reduce-scatter buffers": "ISPConfig.max_inflight_reduce_scatter",
    "block gradients (unsharded)": "a larger --wp, or smaller blocks",
    "checkpoint staging": "a synchronous save (no --async-save)",
    "no_grad activations (one block)": "a smaller --batch",
}
"""The knob that shrinks each part (isp-train's flags)."""
