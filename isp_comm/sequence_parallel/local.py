"""Local (per-rank) causal attention: flash-attn on CUDA when installed, otherwise
``scaled_dot_product_attention``; both with variable-length packed sequences.

Tensors are ``[batch, heads, seq, head_dim]``; ``k``/``v`` may have fewer heads (GQA).
``cu_seqlens`` (``[n_docs + 1]`` ints, starting at 0 and ending at ``seq``) marks the
documents packed into every row: attention never crosses a boundary.

[Note: boundaries on the host] Slicing documents, checking the boundaries and
flash-attn's ``max_seqlen`` all need the boundaries as host integers. Reading a CUDA
tensor to the host stops the host until the GPU has caught up, so the boundaries
are read once per tensor (:class:`BoundaryCache`, shared by every attention layer of
a model, recomputes included) and passed on as a tuple of ints; a ``cu_seqlens``
given on the CPU costs no synchronisation at all.

[Note: packed documents under torch.compile]
Attention over packed documents reads the boundaries on the host and slices each
document (or builds flash-attn's varlen arguments). Traced by dynamo, the host read
is a graph break and the code after it is specialised on the boundaries' count and
values: a recompile for each new packing, seconds each, until dynamo's limit, then
eager. So that part runs outside the graph (``torch.compiler.disable``, in the lazy
form of [Note: dynamo loaded on first call], in ``DistributedAttention`` and in the
reference llama's attention): a compiled block over packed rows is its graphs before
and after attention, whatever the packing.
"""

from __future__ import annotations

import importlib.util
import weakref
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

Cuts = Sequence[int]


def flash_attn_usable(q: torch.Tensor) -> bool:
    """flash-attn runs only on CUDA in half precision, and only if it is installed."""
    return (
        q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and importlib.util.find_spec("flash_attn") is not None
    )


def check_async(cond: torch.Tensor, msg: str) -> None:
    """A check of values on the device that never stops the host: on CUDA an
    asynchronous device assert (the step fails at its next synchronisation, with
    ``msg``); on the CPU, where reading the value costs nothing, a ``ValueError`` now."""
    if cond.device.type == "cpu":
        if not bool(cond):
            raise ValueError(msg)
    else:
        torch._assert_async(cond, msg)


class BoundaryCache:
    """The host integers of the last ``cu_seqlens`` tensor seen (see [Note: boundaries
    on the host]): one read per tensor, whatever the number of layers using it."""

    def __init__(self) -> None:
        self._ref: weakref.ref | None = None
        self._version = -1
        self._cuts: tuple[int, ...] = ()

    def cuts(self, cu_seqlens: torch.Tensor | Cuts) -> tuple[int, ...]:
        if not isinstance(cu_seqlens, torch.Tensor):
            return tuple(int(c) for c in cu_seqlens)
        if self._ref is None or self._ref() is not cu_seqlens or self._version != cu_seqlens._version:
            if cu_seqlens.dim() != 1:
                raise ValueError(f"cu_seqlens must be 1-D, got shape {tuple(cu_seqlens.shape)}")
            self._cuts = tuple(cu_seqlens.tolist())  # the one host read
            self._ref, self._version = weakref.ref(cu_seqlens), cu_seqlens._version
        return self._cuts


def check_cu_seqlens(cu_seqlens: torch.Tensor | Cuts, seq: int) -> tuple[int, ...]:
    """The boundaries as host ints; ``ValueError`` unless they are 0, increasing, ..., ``seq``."""
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dim() != 1:
            raise ValueError(f"cu_seqlens must be 1-D with at least 2 entries, got shape {tuple(cu_seqlens.shape)}")
        cu_seqlens = cu_seqlens.tolist()
    c = tuple(int(x) for x in cu_seqlens)
    if len(c) < 2:
        raise ValueError(f"cu_seqlens must be 1-D with at least 2 entries, got {list(c)}")
    if c[0] != 0 or c[-1] != seq or any(b <= a for a, b in zip(c, c[1:])):
        raise ValueError(f"cu_seqlens must increase from 0 to the sequence length {seq}, got {list(c)}")
    return c


def _sdpa(q, k, v, scale, dropout):
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, dropout_p=dropout)


BLOCK = 512
"""Query rows per block of :func:`blockwise_attention`: a block's fp32 scores are
``BLOCK x seq`` per head (64 MiB a head at 32k), whatever the sequence."""


def _eager(q, k, v, scale, dropout, softcap: float | None, sinks: torch.Tensor | None) -> torch.Tensor:
    """Causal attention written out, with logit softcapping and attention sinks (see
    :func:`blockwise_attention`), for the one case that it cannot do: dropout, whose
    mask a recompute in backward cannot replay without storing it. Holds the ``[b, h,
    s, s]`` scores and probabilities (autograd saves them), as transformers' eager
    attention of those models does; softmax in fp32 as theirs."""
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = torch.matmul(q, k.transpose(2, 3)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    s = q.shape[2]
    future = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)
    scores = scores.masked_fill(future, float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks.to(scores.dtype).reshape(1, -1, 1, 1).expand(*scores.shape[:3], 1)], dim=-1)
    probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    if sinks is not None:
        probs = probs[..., :-1]
    probs = F.dropout(probs, p=dropout) if dropout else probs
    return torch.matmul(probs, v)


def _acc(t: torch.Tensor) -> torch.dtype:
    """The dtype of the softmax and the gradients' sums: fp32, or ``t``'s if wider
    (fp64 inputs, as gradcheck's, are never rounded to fp32)."""
    return torch.promote_types(t.dtype, torch.float32)


def _block_scores(
    q5: torch.Tensor, k: torch.Tensor, a: int, b: int, scale: float, softcap: float | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The fp32 logits of query rows ``a:b`` against keys ``0:b`` (the later ones are
    masked for every row): ``[batch, kv_heads, rep, b - a, b]``, capped and masked, and
    the capped ones' ``tanh`` (``None`` without ``softcap``) for the backward.

    ``q5`` is ``q`` as ``[batch, kv_heads, rep, seq, d]``: the ``rep`` query heads of a
    KV head are one matmul's rows, so no repeated ``k`` is made (GQA)."""
    rows = q5[:, :, :, a:b]
    raw = torch.matmul(rows.flatten(2, 3), k[:, :, :b].transpose(2, 3)).to(_acc(q5)).mul_(scale)
    raw = raw.unflatten(2, rows.shape[2:4])
    tanh = None
    if softcap is not None:
        tanh = raw.div_(softcap).tanh_()
        raw = tanh * softcap
    future = torch.ones(b - a, b - a, dtype=torch.bool, device=q5.device).triu_(1)
    raw[..., a:b].masked_fill_(future, float("-inf"))
    return raw, tanh


class _BlockwiseAttention(torch.autograd.Function):
    """Causal attention one block of query rows at a time; see :func:`blockwise_attention`.

    [Note: what blockwise attention keeps]
    The forward keeps ``q, k, v`` and each row's log-sum-exp (fp32, :func:`_acc`) over
    its logits and its head's sink (``lse``); the backward recomputes each block's logits and
    probabilities ``p = exp(logit - lse)`` from them, and the softmax's backward
    from ``p`` and ``dp`` as autograd would (not from the output, rounded to ``q``'s
    dtype: the sinks' gradient, a sum over every row, would feel that rounding). No tensor of ``seq x seq``
    per head is made or saved: the largest are a block's, ``BLOCK x seq`` per head
    (fp32 scores, probabilities, their gradient). All of it is tensor ops on shapes
    known on the host: no value is read back (no synchronisation on CUDA)."""

    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        sinks: torch.Tensor | None,
        scale: float,
        softcap: float | None,
        block: int,
    ) -> torch.Tensor:
        q5 = q.unflatten(1, (k.shape[1], q.shape[1] // k.shape[1]))
        sink = None if sinks is None else sinks.to(_acc(q)).view(1, *q5.shape[1:3], 1)
        out = q5.new_empty(q5.shape[:4] + v.shape[3:])
        lse = q5.new_empty(q5.shape[:4], dtype=_acc(q))
        for a in range(0, q.shape[2], block):
            b = min(a + block, q.shape[2])
            scores, _ = _block_scores(q5, k, a, b, scale, softcap)
            row_lse = torch.logsumexp(scores, dim=-1)
            lse[..., a:b] = row_lse if sink is None else torch.logaddexp(row_lse, sink)
            p = scores.sub_(lse[..., a:b, None]).exp_().to(v.dtype)  # the softmax, sink dropped
            out[:, :, :, a:b] = torch.matmul(p.flatten(2, 3), v[:, :, :b]).unflatten(2, p.shape[2:4])
        ctx.save_for_backward(q, k, v, sinks, lse)
        ctx.scale, ctx.softcap, ctx.block = scale, softcap, block
        return out.flatten(1, 2)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, sinks, lse = ctx.saved_tensors
        q5, do5 = q.unflatten(1, lse.shape[1:3]), dout.unflatten(1, lse.shape[1:3])
        dq = torch.empty_like(q5)
        dk, dv = (torch.zeros(t.shape, dtype=lse.dtype, device=t.device) for t in (k, v))
        sink = None if sinks is None else sinks.to(lse.dtype).view(1, *lse.shape[1:3], 1)
        dsink = None if sinks is None else torch.zeros_like(sink)
        for a in range(0, q.shape[2], ctx.block):
            b = min(a + ctx.block, q.shape[2])
            scores, tanh = _block_scores(q5, k, a, b, ctx.scale, ctx.softcap)
            p = scores.sub_(lse[..., a:b, None]).exp_()
            rows_do = do5[:, :, :, a:b].flatten(2, 3)
            dv[:, :, :b] += torch.matmul(p.to(v.dtype).flatten(2, 3).transpose(2, 3), rows_do).to(lse.dtype)
            ds = torch.matmul(rows_do, v[:, :, :b].transpose(2, 3)).to(lse.dtype).unflatten(2, p.shape[2:4]).mul_(p)
            # softmax's backward: p * (dp - delta), delta = rowsum(p * dp) (the sink's dp is 0)
            delta = ds.sum(-1)
            ds.sub_(p.mul_(delta[..., None]))
            if sink is not None:  # d(out)/d(sink) = -p_sink * out, so d(sink) = -sum(p_sink * delta)
                dsink -= (torch.exp(sink - lse[..., a:b]) * delta).sum((0, 3), keepdim=True)
            if tanh is not None:
                ds.mul_(tanh.square_().neg_().add_(1))  # d(c tanh(x / c))/dx = 1 - tanh^2
            ds = ds.mul_(ctx.scale).to(q.dtype).flatten(2, 3)
            dq[:, :, :, a:b] = torch.matmul(ds, k[:, :, :b]).unflatten(2, p.shape[2:4])
            dk[:, :, :b] += torch.matmul(ds.transpose(2, 3), q5[:, :, :, a:b].flatten(2, 3)).to(lse.dtype)
        dsinks = None if sinks is None else dsink.view(sinks.shape).to(sinks.dtype)
        return dq.flatten(1, 2), dk.to(k.dtype), dv.to(v.dtype), dsinks, None, None, None


def blockwise_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    block: int = BLOCK,
) -> torch.Tensor:
    """Causal attention with what neither SDPA nor flash-attn here computes: logit
    softcapping (``softcap * tanh(scores / softcap)`` before the mask, Gemma 2) and
    attention sinks (``sinks``: one logit per head of ``q`` joining every row's softmax
    and dropped after it, GPT-OSS), ``block`` query rows at a time, forward and
    backward (see [Note: what blockwise attention keeps]): memory ``block x seq`` per
    head, not ``seq x seq``. The softmax in fp32 (fp64 for fp64 inputs) and its
    probabilities in ``q``'s dtype before they meet ``v``, as transformers' eager attention of those models; the
    result depends on ``block`` only by float rounding. GQA: ``k``/``v`` may have fewer
    heads, as ``repeat_interleave`` would share them. No dropout: see :func:`_eager`.
    Tested on the CPU only (pure torch ops, nothing device-specific)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return _BlockwiseAttention.apply(q, k, v, sinks, scale, softcap, block)


def _flash(q, k, v, cuts: tuple[int, ...] | None, scale, dropout):
    from flash_attn import flash_attn_func, flash_attn_varlen_func

    b, h, s, d = q.shape
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))  # flash-attn takes [b, s, h, d]
    if cuts is None:
        out = flash_attn_func(qt, kt, vt, dropout_p=dropout, softmax_scale=scale, causal=True)
        return out.transpose(1, 2)
    # varlen: every row of the batch holds the same packing; rows are laid end to end.
    # Built on the host and copied without a synchronisation (see [Note: boundaries on the host])
    every = [c + i * s for i in range(b) for c in cuts[:-1]] + [b * s]
    cu_all = torch.tensor(every, dtype=torch.int32).to(q.device, non_blocking=True)
    max_len = max(y - x for x, y in zip(cuts, cuts[1:]))
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
    cu_seqlens: torch.Tensor | Cuts | None = None,
    scale: float | None = None,
    dropout: float = 0.0,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of whole (gathered) sequences; see the module doc.
    ``cu_seqlens``: a tensor or, to spare the host a read, host ints. ``softcap``
    (logit softcapping) and ``sinks`` (one per head of ``q``) take
    :func:`blockwise_attention`, or with ``dropout`` the written-out ``_eager``."""
    cuts = None if cu_seqlens is None else check_cu_seqlens(cu_seqlens, q.shape[2])
    if softcap is not None or sinks is not None:

        def attend(q, k, v):
            if dropout:  # a dropout mask cannot be replayed in a recompute
                return _eager(q, k, v, scale, dropout, softcap, sinks)
            return blockwise_attention(q, k, v, scale, softcap, sinks)

    elif flash_attn_usable(q):
        return _flash(q, k, v, cuts, scale, dropout)
    else:

        def attend(q, k, v):
            return _sdpa(q, k, v, scale, dropout)

    if cuts is None:
        return attend(q, k, v)
    pieces = [attend(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b]) for a, b in zip(cuts, cuts[1:])]
    return torch.cat(pieces, dim=2)
