"""Turning sequence parallel on for a model, and checking what each rank feeds it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed import ProcessGroup

from isp_comm.backends.base import Backend
from isp_comm.context import CommContext
from isp_comm.sequence_parallel.attention import DistributedAttention, kv_repeats
from isp_comm.sequence_parallel.hf import apply_hf_sequence_parallel, is_hf_model


def apply_sequence_parallel(
    model: nn.Module,
    sp_group: ProcessGroup,
    sp_size: int,
    backend: Backend,
    comm: CommContext,
) -> Callable[[], None]:
    """Attention goes through all-to-all over the SP group: transformers models via
    their attention registry, other models via modules exposing ``attention_fn``
    (and ``n_heads`` / ``n_kv_heads``), like ``models/llama.py``. A peft wrapper
    (``get_base_model()``) is seen through. Returns the undo."""
    base = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    if is_hf_model(base):
        return apply_hf_sequence_parallel(base, sp_group, backend, comm)
    hooked = [m for m in model.modules() if callable(getattr(m, "attention_fn", None))]
    if not hooked:
        raise ValueError(
            "sp_size > 1 but the model exposes no attention hook: give its attention modules an "
            "attention_fn(q, k, v) attribute (see models/llama.py) or use a supported transformers model"
        )
    for m in hooked:  # every check before any change
        kv_repeats(m.n_heads, m.n_kv_heads, sp_size)
    previous = [(m, m.attention_fn) for m in hooked]
    for m, fn in previous:
        m.attention_fn = DistributedAttention(fn, sp_group, backend, comm)

    def undo() -> None:
        for m, fn in previous:
            m.attention_fn = fn

    return undo


def check_sequence_chunks(
    args: tuple,
    kwargs: dict[str, Any],
    sp_group: ProcessGroup,
    sp_size: int,
    backend: Backend,
    ctx: CommContext,
) -> None:
    """Every rank of an SP group must feed an equal chunk (seq_len / sp tokens) of the
    model's input (``input_ids``, ``inputs_embeds`` or its first tensor argument): a
    ``ValueError`` here beats a hang or a shape error inside attention."""
    x = kwargs.get("input_ids", kwargs.get("inputs_embeds"))
    if x is None:
        x = next((a for a in args if isinstance(a, torch.Tensor)), None)
    if x is None or x.dim() < 2:
        return
    mine = torch.tensor([x.shape[1]], dtype=torch.int64, device=x.device)
    every = torch.empty(sp_size, dtype=torch.int64, device=x.device)
    ctx.wait(backend.all_gather(every, mine, sp_group), "sequence chunk check")
    lengths = every.tolist()
    if len(set(lengths)) != 1:
        raise ValueError(
            f"sequence chunks differ across the sequence-parallel group: {lengths} tokens; the sequence "
            f"length ({sum(lengths)}) must be divisible by sp_size={sp_size} and every rank feed an equal chunk"
        )
