"""Local (per-rank) causal attention: flash-attn on CUDA when installed, otherwise
``scaled_dot_product_attention``; both with variable-length packed sequences.

Tensors are ``[batch, heads, seq, head_dim]``; ``k``/``v`` may have fewer heads (GQA).
``cu_seqlens`` (int, ``[n_docs + 1]``, starting at 0 and ending at ``seq``) marks the
documents packed into every row: attention never crosses a boundary.
"""

from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F


def flash_attn_usable(q: torch.Tensor) -> bool:
    """flash-attn runs only on CUDA in half precision, and only if it is installed."""
    return (
        q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and importlib.util.find_spec("flash_attn") is not None
    )


def check_cu_seqlens(cu_seqlens: torch.Tensor, seq: int) -> None:
    """``ValueError`` unless ``cu_seqlens`` is 0, increasing, ..., ``seq``."""
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be 1-D with at least 2 entries, got shape {tuple(cu_seqlens.shape)}")
    c = cu_seqlens.tolist()
    if c[0] != 0 or c[-1] != seq or any(b <= a for a, b in zip(c, c[1:])):
        raise ValueError(f"cu_seqlens must increase from 0 to the sequence length {seq}, got {c}")


def _sdpa(q, k, v, scale, dropout):
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, dropout_p=dropout)


def _flash(q, k, v, cu_seqlens, scale, dropout):
    from flash_attn import flash_attn_func, flash_attn_varlen_func

    b, h, s, d = q.shape
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))  # flash-attn takes [b, s, h, d]
    if cu_seqlens is None:
        out = flash_attn_func(qt, kt, vt, dropout_p=dropout, softmax_scale=scale, causal=True)
        return out.transpose(1, 2)
    # varlen: every row of the batch holds the same packing; rows are laid end to end
    cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
    cu_all = torch.cat([cu[:-1] + i * s for i in range(b)] + [cu[-1:] + (b - 1) * s])
    max_len = int((cu[1:] - cu[:-1]).max())
    out = flash_attn_varlen_func(
        *(t.reshape(b * s, t.shape[2], d) for t in (qt, kt, vt)),
        cu_seqlens_q=cu_all,
        cu_seqlens_k=cu_all,
        max_seqlen_q=max_len,
        max_seqlen_k=max_len,
        dropout_p=dropout,
        softmax_scale=scale,
        causal=True,
    )
    return out.view(b, s, h, d).transpose(1, 2)


def local_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor | None = None,
    scale: float | None = None,
    dropout: float = 0.0,
) -> torch.Tensor:
    """Causal attention of whole (gathered) sequences; see the module doc."""
    if cu_seqlens is not None:
        check_cu_seqlens(cu_seqlens, q.shape[2])
    if flash_attn_usable(q):
        return _flash(q, k, v, cu_seqlens, scale, dropout)
    if cu_seqlens is None:
        return _sdpa(q, k, v, scale, dropout)
    bounds = cu_seqlens.tolist()
    pieces = [_sdpa(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], scale, dropout) for a, b in zip(bounds, bounds[1:])]
    return torch.cat(pieces, dim=2)
