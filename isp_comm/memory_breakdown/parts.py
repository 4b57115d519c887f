"""The breakdown's lines: the memory forecast's parts, and the categories they add up to.

A measured part has the name of the forecast's part it is compared with
(``isp_comm/memory_forecast/phases.py``), so each line of the forecast has a measured
line beside it. The categories group them the way a reader asks where a peak went.
"""

from __future__ import annotations

from collections.abc import Mapping

CATEGORIES: dict[str, tuple[str, ...]] = {
    "parameter shards": ("master shards", "WP shards (gather dtype)", "replicated params", "one module materialised"),
    "pool slots": ("pool slots and landing", "shared memory: peers' pool pages"),
    "reduce-scatter buffers": ("reduce-scatter buffers",),
    "gathered outside the pool": (
        "outer gather",
        "cast copies",
        "replica gather buffers",
        "unsharded params",
        "all-gather buffers",
    ),
    "gradient buffers": (
        "gradient shards",
        "replicated grads",
        "all-reduce buffers",
        "block gradients (unsharded)",
        "deferred gradient sums",
    ),
    "optimizer state": ("optimizer state", "optimizer temporaries"),
    "activations and checkpoints": ("activations", "activation gradients", "no_grad activations"),
    "logits and loss": ("logits and loss",),
    "checkpoint staging": ("checkpoint staging",),
    "workspace": ("workspace", "runtime", "shared memory: collective scratch"),
    "allocator slack": ("allocator",),
    "other": ("other",),
}
"""Category -> the parts it holds (a part belongs to the first category one of whose
names it starts with: ``activations (2/4 blocks checkpointed)`` is an activation)."""

RUNTIME = "runtime"
"""The start of the forecast's parts that no tensor holds (gloo's buffers, what the
low-precision CPU kernels keep, the planner's calibrated runtime): resident memory the
forecast counts and a tensor tracker never sees."""


def tensor_parts(forecast_parts: Mapping[str, int]) -> dict[str, int]:
    """The forecast's parts a tracker can see: all but its runtime lines."""
    return {part: nbytes for part, nbytes in forecast_parts.items() if not part.startswith(RUNTIME)}


OTHER = "other"
"""Tracked tensors no owner, hook or phase accounts for (the breakdown's tests bound it)."""


def category(part: str) -> str:
    """The category a part (the forecast's or a measured one) belongs to."""
    for name, prefixes in CATEGORIES.items():
        if part.startswith(prefixes):
            return name
    return OTHER


def by_category(parts: Mapping[str, int]) -> dict[str, int]:
    """Parts' bytes added up by category, in :data:`CATEGORIES`' order (the empty ones left out)."""
    out = dict.fromkeys(CATEGORIES, 0)
    for part, nbytes in parts.items():
        out[category(part)] += nbytes
    return {k: v for k, v in out.items() if v}


def part_order(part: str) -> tuple[int, str]:
    """A sort key that lists parts by their category, in :data:`CATEGORIES`' order."""
    return list(CATEGORIES).index(category(part)), part


def forecast_part(part: str) -> str:
    """A forecast part's name as a measured line is named: without the annotations the
    forecast adds (``activations (2/4 blocks checkpointed)`` -> ``activations``)."""
    return part.split(" (", 1)[0] if part.startswith("activations (") else part
