"""Turning sequence parallel on for a model, and checking what each rank feeds it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from isp_comm.backends.base import Backend
from isp_comm.context import CommContext
from isp_comm.sequence_parallel.attention import DistributedAttention, kv_repeats
from isp_comm.sequence_parallel.hf import apply_hf_sequence_parallel, is_hf_model
from isp_comm.sequence_parallel.local import BoundaryCache, check_async


def apply_sequence_parallel(
    model: nn.Module,
    sp_group: ProcessGroup,
    sp_size: int,
    backend: Backend,
    comm: CommContext,
) -> Callable[[], None]:
    """Attention goes through all-to-all over the SP group: transformers models via
    their attention registry, other models via modules exposing ``attention_fn``
    (and ``n_heads`` / ``n_kv_heads``), like ``isp_comm/models/llama.py``. A peft wrapper
    (``get_base_model()``) is seen through. Returns the undo."""
    base = without_peft(model)
    if is_hf_model(base):
        return apply_hf_sequence_parallel(base, sp_group, backend, comm)
    hooked = [m for m in model.modules() if callable(getattr(m, "attention_fn", None))]
    if not hooked:
        raise ValueError(
            "sp_size > 1 but the model exposes no attention hook: give its attention modules an "
            "attention_fn(q, k, v) attribute (see isp_comm/models/llama.py) or use a supported transformers model"
        )
    for m in hooked:  # every check before any change
        kv_repeats(m.n_heads, m.n_kv_heads, sp_size)
    previous = [(m, m.attention_fn) for m in hooked]
    boundaries = BoundaryCache()  # shared: one host read of cu_seqlens per step, not one per layer
    for m, fn in previous:
        m.attention_fn = DistributedAttention(fn, sp_group, backend, comm, boundaries)

    def undo() -> None:
        for m, fn in previous:
            m.attention_fn = fn

    return undo


def without_peft(model: nn.Module) -> nn.Module:
    """The model a peft wrapper holds, else ``model``."""
    return model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model


def boundaries_key(model: nn.Module) -> str:
    """The forward keyword of the document boundaries: transformers' flash-attention
    one for its models, ``cu_seqlens`` for models like ``isp_comm/models/llama.py``."""
    return "cu_seq_lens_q" if is_hf_model(without_peft(model)) else "cu_seqlens"


class SequenceCheck:
    """The model's forward pre-hook under SP: what each rank feeds must fit together.

    - Every rank of an SP group feeds an equal chunk (seq_len / sp tokens) of the
      model's input (``input_ids``, ``inputs_embeds`` or its first tensor argument):
      a ``ValueError`` here beats a hang or a shape error inside attention. The
      lengths are host integers, but comparing them takes a collective whose result
      is read on the host, so each chunk length is checked once, the first time this
      rank sees it (all ranks see a new length at the same forward when the data
      agrees; a rank alone with a new length waits, and its deadline names the check).
    - Positions that restart inside the chunk (packed documents), or at the first
      token of a chunk after the first, need the document boundaries
      (``boundaries_key``), or attention would cross documents: checked once per
      forward, without stopping the host (``check_async``).
    - A call without ``position_ids`` gets the chunk's global positions (``lo, lo +
      1, ...``, as the unwrapped model numbers the whole sequence), where the model
      would number each chunk from 0: every rank after the first would rotate its
      queries and keys as the sequence's start (before, silently). With document
      boundaries the positions restart per document: they must be passed.
    """

    def __init__(self, sp_group: ProcessGroup, sp_size: int, backend: Backend, ctx: CommContext, model: nn.Module):
        self.group, self.size, self.backend, self.ctx = sp_group, sp_size, backend, ctx
        self.boundaries_key = boundaries_key(model)
        self.batched_positions = is_hf_model(without_peft(model))  # transformers' take [batch, seq]
        self.rank = dist.get_rank(sp_group)
        self._checked: set[int] = set()
        self.paused = False
        """Set while the model runs whole sequences (a wrapped model's ``generate``)."""

    def __call__(self, _module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict] | None:
        if self.paused:
            return None
        x = kwargs.get("input_ids", kwargs.get("inputs_embeds"))
        if x is None:
            x = next((a for a in args if isinstance(a, torch.Tensor)), None)
        if x is None or x.dim() < 2:
            return None
        if x.shape[1] not in self._checked:
            self._check_lengths(x)
            self._checked.add(x.shape[1])
        pos = kwargs.get("position_ids")
        if pos is None and len(args) <= 1:  # no positions, neither by keyword nor after the input
            if kwargs.get(self.boundaries_key) is not None:
                raise ValueError(
                    f"under sequence parallel, {self.boundaries_key} needs position_ids: each document's positions "
                    "restart at 0, over the whole sequence (pass this rank's chunk of them)"
                )
            lo = self.rank * x.shape[1]  # equal chunks (checked above)
            pos = torch.arange(lo, lo + x.shape[1], device=x.device)
            return args, {**kwargs, "position_ids": pos[None] if self.batched_positions else pos}
        if pos is not None and pos.shape[-1] > 1 and kwargs.get(self.boundaries_key) is None:
            check_async(
                (pos.diff(dim=-1) == 1).all(),
                "position_ids restart inside the chunk (packed documents): under sequence parallel pass "
                f"{self.boundaries_key} with the document boundaries of the whole sequence",
            )
        if pos is not None and pos.numel() and self.rank > 0 and kwargs.get(self.boundaries_key) is None:
            check_async(  # a chunk after the first that starts at position 0: a document starts at its edge
                (pos[..., 0] != 0).all(),
                f"position_ids start at 0 on sequence-parallel rank {self.rank}: a document starts at this chunk's "
                f"first token (packed documents: pass {self.boundaries_key} with the boundaries of the whole "
                "sequence), or the positions are the chunk's own (pass the sequence's: lo, lo + 1, ...)",
            )
        return None

    def _check_lengths(self, x: torch.Tensor) -> None:
        mine = torch.tensor([x.shape[1]], dtype=torch.int64, device=x.device)
        every = torch.empty(self.size, dtype=torch.int64, device=x.device)
        handle = self.ctx.record(self.backend.all_gather(every, mine, self.group), "all-gather", self.group, mine)
        self.ctx.wait(handle, "sequence chunk check")
        lengths = every.tolist()
        if len(set(lengths)) != 1:
            raise ValueError(
                f"sequence chunks differ across the sequence-parallel group: {lengths} tokens; the sequence "
                f"length ({sum(lengths)}) must be divisible by sp_size={self.size} and every rank feed an equal chunk"
            )
