"""Cross-entropy over the vocabulary that never holds the logits in fp32 whole.

[Note: the loss's memory]
``F.cross_entropy(logits.float(), labels)`` on ``N`` tokens of a vocabulary of ``V``
keeps, through its backward, an fp32 copy of the logits, their log-softmax, and the
logits' fp32 gradient: three ``N x V`` fp32 tensors (11.7 GiB for 8,192 tokens of
Llama-3's 128,256 words), all alive at once when the backward begins, the step's
peak. :func:`cross_entropy` works on the logits in their own dtype, one chunk of
tokens at a time: the forward computes each chunk's log-sum-exp in fp32 and keeps
only it (``N`` floats) and the logits; the backward recomputes each chunk's softmax
in fp32 and writes the chunk's gradient, in the logits' dtype, into one gradient
tensor. At most one fp32 chunk (:data:`CHUNK_BYTES`) lives beside the logits and
their gradient. The arithmetic per token is the same as ``F.cross_entropy``'s in
fp32: softmax minus the one-hot label, scaled by the reduction.
"""

from __future__ import annotations

from typing import Any, Literal

import torch

CHUNK_BYTES = 256 * 2**20
"""The fp32 chunk of logits the loss works on at a time (its rows: as many tokens as fit)."""


class _ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, labels: torch.Tensor, ignore_index: int, rows: int, reduction: str):
        n = logits.shape[0]
        valid = labels != ignore_index
        lse = torch.empty(n, dtype=torch.float32, device=logits.device)
        losses = torch.empty(n, dtype=torch.float32, device=logits.device)  # per token, 0 where ignored
        for a in range(0, n, rows):
            x = logits[a : a + rows].float()
            lse[a : a + rows] = torch.logsumexp(x, dim=-1)
            target = x.gather(1, labels[a : a + rows].clamp(min=0)[:, None]).squeeze(1)
            losses[a : a + rows] = (lse[a : a + rows] - target) * valid[a : a + rows]
        count = valid.sum()
        ctx.save_for_backward(logits, labels, lse, count)
        ctx.rows, ctx.reduction, ctx.ignore_index = rows, reduction, ignore_index
        if reduction == "none":
            return losses
        total = losses.sum()
        return total / count if reduction == "mean" else total

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        logits, labels, lse, count = ctx.saved_tensors
        valid = labels != ctx.ignore_index
        scale = grad / count if ctx.reduction == "mean" else grad  # per token with "none"
        out = torch.empty_like(logits)
        for a in range(0, logits.shape[0], ctx.rows):
            b = min(a + ctx.rows, logits.shape[0])
            p = torch.exp(logits[a:b].float() - lse[a:b, None])  # softmax
            keep = valid[a:b]
            p.scatter_add_(1, labels[a:b].clamp(min=0)[:, None], -keep[:, None].to(p.dtype))  # minus the one-hot label
            mine = scale[a:b] if scale.dim() else scale
            p.mul_(torch.where(keep, mine, 0.0)[:, None])  # 0 for an ignored token, also where no token counts
            out[a:b].copy_(p)
        return out, None, None, None, None


def cross_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int = -100,
    reduction: Literal["mean", "sum", "none"] = "mean",
    chunk_bytes: int = CHUNK_BYTES,
) -> torch.Tensor:
    """``F.cross_entropy(logits.float(), labels, ignore_index=..., reduction=...)`` over
    the last dim, in fp32, holding at most ``chunk_bytes`` of fp32 logits at a time
    (see [Note: the loss's memory]); the gradient comes back in the logits' dtype.
    ``"none"``: each token's loss, shaped like ``labels``, 0 where ignored (the
    per-sequence log-likelihoods of DPO or RL are sums of their negatives)."""
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    flat, targets = logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)
    if flat.shape[0] != targets.shape[0]:
        raise ValueError(f"logits {tuple(logits.shape)} do not match labels {tuple(labels.shape)}")
    rows = max(1, chunk_bytes // (4 * flat.shape[1]))
    out = _ChunkedCrossEntropy.apply(flat, targets, ignore_index, rows, reduction)
    return out.view(labels.shape) if reduction == "none" else out
