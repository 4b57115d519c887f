"""Sequence parallel for transformers' llama-class models, through their
attention-function registry (no module of the model is replaced).

Supported: decoder-only models whose attention layers call
``ALL_ATTENTION_FUNCTIONS[config._attn_implementation](module, q, k, v, mask, ...)``
with ``[batch, heads, seq, head_dim]`` tensors and rotary positions from
``position_ids``: ``SUPPORTED_MODEL_TYPES``, each tested against the plain model.
Anything else is refused with a ``ValueError`` rather than trained wrongly, and so is
whatever reaches the attention function that the SP attention does not reproduce:
a keyword outside ``_NEUTRAL_KWARGS`` and ``_IMPLEMENTED_KWARGS``, a layer that is not
causal, a rotary embedding that rescales with the longest position a forward sees
(``dynamic``, ``longrope``: each rank would see its chunk's), a padding mask, a
sliding window shorter than the sequences, or document boundaries that the model's
layers do not pass on. Logit softcapping (Gemma 2) and attention sinks (GPT-OSS) are
reproduced (``local_attention``'s eager path). Packed documents: pass transformers'
flash-attention keyword ``cu_seq_lens_q`` (boundaries over the whole sequence, the
same on every rank) to the model's forward; the local attention is flash-attn on CUDA
when installed, ``scaled_dot_product_attention`` otherwise.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from isp_comm.backends.base import Backend
from isp_comm.context import CommContext
from isp_comm.sequence_parallel.attention import DistributedAttention, kv_repeats
from isp_comm.sequence_parallel.local import BoundaryCache, local_attention

SUPPORTED_MODEL_TYPES = (
    "llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3", "olmo2", "granite", "cohere",
    "stablelm", "phi", "glm", "gpt_oss", "mixtral", "qwen3_moe", "olmoe",
)  # fmt: skip
"""The transformers model types whose attention the SP attention reproduces, each
tested against the plain model (``tests/test_sequence_parallel.py``)."""

_NEUTRAL_KWARGS = frozenset(
    {"position_ids", "use_cache", "output_attentions", "output_hidden_states", "output_router_logits",
     "return_dict", "num_items_in_batch", "cache_position", "cu_seq_lens_k", "max_length_q", "max_length_k"}
)  # fmt: skip
"""Keywords that reach the attention function without changing its math (positions
are already in the rotated q and k; the flash-attention lengths follow from
``cu_seq_lens_q``)."""

_IMPLEMENTED_KWARGS = frozenset({"sliding_window", "softcap", "s_aux", "cu_seq_lens_q", "is_causal"})
"""Keywords the SP attention reads: any other one is refused, never ignored."""

_KNOWN_KWARGS = _NEUTRAL_KWARGS | _IMPLEMENTED_KWARGS
"""Every keyword the SP attention takes (it checks each call's, every block's)."""

_DYNAMIC_ROPE = ("dynamic", "longrope")
"""Rotary types whose frequencies follow the longest position of the forward."""


def is_hf_model(model: nn.Module) -> bool:
    """Whether ``model`` is a transformers model. transformers is never imported here
    (that alone costs a rank 64 MiB): a model of its classes exists only once it was."""
    tf = sys.modules.get("transformers")
    return tf is not None and isinstance(model, tf.PreTrainedModel)


def apply_hf_sequence_parallel(
    model: nn.Module,
    sp_group: ProcessGroup,
    backend: Backend,
    comm: CommContext | None = None,
) -> Callable[[], None]:
    """Route ``model``'s attention through a registered SP attention function; returns
    the function that undoes it."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    cfg = model.config
    sp = dist.get_world_size(sp_group)
    _check_model(model, sp)
    sp_rank = dist.get_rank(sp_group)
    boundaries = BoundaryCache()  # one host read of cu_seq_lens_q per step, not one per layer
    # whether the model's forward was given document boundaries, read and cleared by its
    # first attention call: every layer is the same code, and a recompute in backward
    # (perhaps after a later forward) is not that forward's
    given: dict[str, bool | None] = {"cu_seq_lens_q": None}

    def note_boundaries(_module: nn.Module, _args: tuple, kwargs: dict) -> None:
        given["cu_seq_lens_q"] = kwargs.get("cu_seq_lens_q") is not None

    def attention(module: nn.Module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):
        # (restarting positions without boundaries are refused once per forward, by
        # the model's pre-hook: see apply.SequenceCheck)
        _check_call(module, query.shape[2] * sp, attention_mask, kw, bool(given.pop("cu_seq_lens_q", None)))
        sinks = kw.get("s_aux")
        if sinks is not None:  # one per head: this rank attends with its share of the heads (all_to_all's order)
            sinks = sinks.chunk(sp)[sp_rank]

        def local(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens=None) -> torch.Tensor:
            return local_attention(
                q, k, v, cu_seqlens, scale=scaling, dropout=dropout, softcap=kw.get("softcap"), sinks=sinks
            )

        sp_attention = DistributedAttention(local, sp_group, backend, comm, boundaries)
        out = sp_attention(query, key, value, cu_seqlens=kw.get("cu_seq_lens_q"))
        return out.transpose(1, 2).contiguous(), None

    def mask(*, attention_mask=None, **kw):
        # transformers folds packed documents, read from restarting position_ids, into a
        # mask: here cu_seq_lens_q bounds them instead, so only a padding mask is made
        # (for the attention to refuse); sdpa_mask gives None for one without padding
        return None if attention_mask is None else sdpa_mask(attention_mask=attention_mask, **kw)

    key = f"isp_sp_{id(model):x}"
    AttentionInterface.register(key, attention)
    AttentionMaskInterface.register(key, mask)
    previous = cfg._attn_implementation
    cfg._attn_implementation = key
    hook = model.register_forward_pre_hook(note_boundaries, with_kwargs=True)

    def undo() -> None:
        hook.remove()
        cfg._attn_implementation = previous
        AttentionInterface._global_mapping.pop(key, None)
        AttentionMaskInterface._global_mapping.pop(key, None)

    return undo


def _check_model(model: nn.Module, sp: int) -> None:
    """Refuse, before any change, a model whose attention SP would not reproduce: a
    model type not tested, heads that do not split over ``sp``, or a rotary embedding
    whose frequencies follow the longest position of the forward (``dynamic`` NTK,
    ``longrope``): each rank would pick them from its own chunk's positions, where the
    plain model picks them from the whole sequence's."""
    cfg = model.config
    if cfg.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"sequence parallel supports transformers model types {SUPPORTED_MODEL_TYPES}, not {cfg.model_type!r}"
        )
    n_heads = cfg.num_attention_heads
    n_kv = getattr(cfg, "num_key_value_heads", None) or n_heads
    kv_repeats(n_heads, n_kv, sp)  # raises when heads do not split
    for m in model.modules():
        kinds = getattr(m, "rope_type", None)
        for kind in kinds.values() if isinstance(kinds, dict) else [kinds]:
            if isinstance(kind, str) and any(d in kind for d in _DYNAMIC_ROPE):
                raise ValueError(
                    f"sequence parallel: the rotary embedding of type {kind!r} rescales its frequencies with the "
                    "longest position of each forward, which under sequence parallel is each rank's chunk's, not "
                    "the sequence's; train with a static rope type (rope_parameters) or without sequence parallel"
                )


def _check_call(module: nn.Module, seq: int, attention_mask, kw: dict, boundaries_given: bool) -> None:
    """Refuse, at each attention call, what the SP attention (causal, over the whole
    sequence of ``seq`` tokens) would not reproduce: see the module doc."""
    unknown = sorted(k for k, v in kw.items() if v is not None and k not in _KNOWN_KWARGS)
    if unknown:
        raise ValueError(
            f"sequence parallel: the model passes {', '.join(unknown)} to its attention function, which the "
            "sequence-parallel attention does not implement; train this model without sequence parallel"
        )
    if not getattr(module, "is_causal", True) or kw.get("is_causal") is False:
        raise ValueError(
            f"sequence parallel: {type(module).__name__} attends bidirectionally, and the sequence-parallel "
            "attention is causal; train it causal (use_bidirectional_attention=False) or without sequence parallel"
        )
    window = kw.get("sliding_window")
    if window is not None and window < seq:
        raise ValueError(
            f"sequence parallel: a sliding window of {window} tokens over sequences of {seq} is "
            "not supported (attention here is causal over the whole sequence); train sequences no longer than "
            "the window, or without sequence parallel"
        )
    if attention_mask is not None:  # the mask function gives None for causal attention without padding
        raise ValueError(
            "sequence parallel: a padding attention_mask is not supported (each rank must feed a contiguous, "
            "unpadded chunk of the sequences); pack the documents with cu_seq_lens_q instead"
        )
    if boundaries_given and kw.get("cu_seq_lens_q") is None:
        raise ValueError(
            f"sequence parallel: {type(module).__name__} does not pass cu_seq_lens_q on to its attention function, "
            "so its attention would cross the packed documents; train this model on unpacked rows (one document "
            "per row, positions without restarts; isp-train: --no-pack-boundaries) or without sequence parallel"
        )
