"""The layouts transformers converts: a model whose published checkpoints hold its
parameters under other names, or one tensor per expert where the model has one.

[Note: one rank's experts]
transformers 5 keeps an MoE block's experts as one 3-D parameter per projection
(Mixtral's ``mlp.experts.gate_up_proj``, ``[experts, 2 x intermediate, hidden]``),
where published checkpoints, and ``save_pretrained``, hold one matrix per expert and
projection (``block_sparse_moe.experts.3.w1.weight``, ``[intermediate, hidden]``);
``from_pretrained`` stacks and concatenates them while loading. Such a parameter is
sharded along its dim 0, the experts, so a rank's rows are whole experts: it reads
and writes the matrices of its own experts only, and no rank builds a fused tensor
whole.

transformers itself says where each stored matrix goes: :func:`stored_layout` runs
its ``revert_weight_conversion`` (what ``save_pretrained`` runs) on one parameter at a
time, on meta tensors for the stored names and shapes, then on a small numbered probe
for which expert and which part each stored tensor is. A conversion that is not a
rename or such a cut (a transpose, an interleave, a rotary permutation) is refused
rather than guessed.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

PROBE = 4
"""Rows of the probe per part and per other dim: four, so that a part that is not one
contiguous run of rows (an interleave of pairs, a rotary permutation) does not look
like one."""


@dataclass(frozen=True)
class Cell:
    """One stored tensor of a fused parameter: rows ``part * size`` to
    ``(part + 1) * size`` along ``Fused.dim`` of expert ``expert``'s slice."""

    key: str
    expert: int
    part: int


@dataclass(frozen=True)
class Fused:
    """A parameter stored as one tensor per expert and part (see [Note: one rank's
    experts]): ``cells`` in transformers' order; each cell is ``shape``, its parts cut
    along ``dim`` of an expert's slice (the parameter's ``dim + 1``)."""

    cells: tuple[Cell, ...]
    shape: torch.Size
    dim: int

    def experts(self, first: int, count: int) -> Iterator[tuple[Cell, int]]:
        """The cells of experts ``first`` to ``first + count`` (a rank's rows), each
        with the offset of its rows along :attr:`dim` of the expert's slice."""
        for cell in self.cells:
            if first <= cell.expert < first + count:
                yield cell, cell.part * self.shape[self.dim]


Stored = str | Fused
"""Where a parameter is in a checkpoint: one tensor under this name, or cells."""


def transformers_model(model: nn.Module) -> nn.Module | None:
    """The transformers model in ``model`` (itself, or the one a peft model wraps), or
    ``None``. transformers is never imported here: its models exist only once it was."""
    tf = sys.modules.get("transformers")
    return next((m for m in model.modules() if tf is not None and isinstance(m, tf.PreTrainedModel)), None)


def converted_layouts(model: nn.Module) -> list[str]:
    """What transformers renames or fuses when ``from_pretrained`` reads a checkpoint of
    ``model``'s class (``"sources -> target"`` each; empty for a model whose files hold
    its parameters under their own names): what a refused load names, so that the user
    knows why."""
    base = transformers_model(model)
    if base is None:
        return []
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
    except ImportError:  # transformers 4: checkpoints hold the parameters as they are
        return []
    return [
        f"{', '.join(map(str, t.source_patterns))} -> {', '.join(map(str, t.target_patterns))}"
        for t in get_model_conversion_mapping(base, add_legacy=False)
    ]


def stored_layout(model: nn.Module, shapes: Mapping[str, torch.Size]) -> dict[str, Stored]:
    """Where each parameter of ``shapes`` (transformers' names and full shapes) is in
    a published checkpoint of ``model``, as ``save_pretrained`` writes it. ``{}`` when
    nothing is converted (the checkpoint holds every parameter under its own name). A
    conversion other than renames and experts cut into parts is a ``ValueError``."""
    if not converted_layouts(model):
        return {}
    from transformers.core_model_loading import revert_weight_conversion

    base = transformers_model(model)
    layout: dict[str, Stored] = {}
    for key, shape in shapes.items():
        meta = torch.empty(shape, device="meta")
        out = revert_weight_conversion(base, {key: meta})
        if len(out) == 1 and next(iter(out.values())) is meta:  # renamed (or not), the tensor as it is
            layout[key] = next(iter(out))
        else:
            layout[key] = _fused(base, key, shape, {k: v.shape for k, v in out.items()}, revert_weight_conversion)
    return layout


def _fused(base: nn.Module, key: str, shape: torch.Size, out: dict[str, torch.Size], revert: Any) -> Fused:
    """The cells of parameter ``key`` (full ``shape``), stored as the tensors ``out``
    (names and shapes): which expert and part each is, read off the conversion of a
    numbered probe of the parameter's structure."""
    refused = ValueError(
        f"{key} {tuple(shape)} is stored as {len(out)} tensors ({', '.join(sorted(out)[:2])}, ...), not cut into "
        "one tensor per expert and part, a conversion isp-comm does not read shard by shard: build the model with "
        "from_pretrained(path) before wrapping instead (each rank holds it whole until wrapping shards it)"
    )
    cell = set(out.values())
    experts = shape[0] if shape else 0
    if len(cell) != 1 or not experts or len(out) % experts:
        raise refused
    (cell_shape,) = cell
    parts = len(out) // experts
    if len(cell_shape) != len(shape) - 1:
        raise refused
    dims = [d for d in range(len(cell_shape)) if shape[d + 1] == parts * cell_shape[d]]
    dims = [d for d in dims if all(shape[i + 1] == cell_shape[i] for i in range(len(cell_shape)) if i != d)]
    if not dims:
        raise refused
    dim = dims[0]
    probe_shape = [experts] + [PROBE * (parts if d == dim else 1) for d in range(len(cell_shape))]
    probe = torch.arange(float(torch.Size(probe_shape).numel()), dtype=torch.float64).reshape(probe_shape)
    try:
        converted = revert(base, {key: probe})
    except Exception as exc:  # an operation that needs the real sizes: not a cut
        raise refused from exc
    cells = []
    for name, value in converted.items():  # which cell: its first number says; all of it must match
        first = int(value.reshape(-1)[0]) if name in out and value.numel() else -1
        expert, inner = divmod(first, probe.stride(0))
        part = inner // probe.stride(dim + 1) % (PROBE * parts) // PROBE
        if first < 0 or expert >= experts:
            raise refused
        if not torch.equal(probe[expert].narrow(dim, part * PROBE, PROBE), value):
            raise refused
        cells.append(Cell(name, expert, part))
    if len({(c.expert, c.part) for c in cells}) != len(out):
        raise refused
    return Fused(tuple(cells), cell_shape, dim)
