"""Sequence parallel for transformers' llama-class models, through their
attention-function registry (no module of the model is replaced).

Supported: decoder-only models whose attention layers call
``ALL_ATTENTION_FUNCTIONS[config._attn_implementation](module, q, k, v, mask, ...)``
with ``[batch, heads, seq, head_dim]`` tensors and rotary positions from
``position_ids``: ``SUPPORTED_MODEL_TYPES``. Anything else is refused with a
``ValueError`` rather than trained wrongly. Attention is causal over the whole
sequence; a padding mask, or a sliding window shorter than the sequences, is refused
(each rank must feed a contiguous, unpadded chunk of the sequences). Packed documents:
pass transformers' flash-attention keyword ``cu_seq_lens_q`` (boundaries over the
whole sequence, the same on every rank) to the model's forward; the local attention is
flash-attn on CUDA when installed, ``scaled_dot_product_attention`` otherwise.
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

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


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
    if cfg.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"sequence parallel supports transformers model types {SUPPORTED_MODEL_TYPES}, not {cfg.model_type!r}"
        )
    n_heads = cfg.num_attention_heads
    n_kv = getattr(cfg, "num_key_value_heads", None) or n_heads
    kv_repeats(n_heads, n_kv, dist.get_world_size(sp_group))  # raises when heads do not split

    boundaries = BoundaryCache()  # one host read of cu_seq_lens_q per step, not one per layer

    sp = dist.get_world_size(sp_group)

    def attention(module: nn.Module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):
        # (restarting positions without boundaries are refused once per forward, by
        # the model's pre-hook: see apply.SequenceCheck)
        window = kw.get("sliding_window")
        if window is not None and window < query.shape[2] * sp:  # the local chunk's length times sp
            raise ValueError(
                f"sequence parallel: a sliding window of {window} tokens over sequences of {query.shape[2] * sp} is "
                "not supported (attention here is causal over the whole sequence); train sequences no longer than "
                "the window, or without sequence parallel"
            )
        if attention_mask is not None:  # the mask function gives None for causal attention without padding
            raise ValueError(
                "sequence parallel: a padding attention_mask is not supported (each rank must feed a contiguous, "
                "unpadded chunk of the sequences); pack the documents with cu_seq_lens_q instead"
            )

        def local(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens=None) -> torch.Tensor:
            return local_attention(q, k, v, cu_seqlens, scale=scaling, dropout=dropout)

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

    def undo() -> None:
        cfg._attn_implementation = previous
        AttentionInterface._global_mapping.pop(key, None)
        AttentionMaskInterface._global_mapping.pop(key, None)

    return undo
