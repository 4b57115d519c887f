"""Vocab-parallel output head and cross-entropy, for large vocabularies.

With ``ISPConfig(vocab_parallel=True)`` the head's weight is split along the vocab
over the WP group and never gathered. Its forward all-gathers the hidden states of
the WP group's tokens instead (``[wp, batch, seq, hidden]``, much smaller than a
``vocab x hidden`` weight) and returns *vocab-sharded logits*
``[wp, batch, seq, my vocab rows]``: every token of the group against this rank's
slice of the vocabulary. :func:`vocab_parallel_cross_entropy` turns them into this
rank's loss (the mean over its own tokens, as ``F.cross_entropy`` would give) with
three small collectives over token vectors; full logits never exist anywhere.

[Note: gradients] Rank ``r``'s loss depends on every rank's vocab slice, so in
backward each rank first all-gathers the others' upstream gradients of their own
tokens' losses. The head shard's gradient is then the sum over the whole WP group
(no reduce-scatter needed, only the replica all-reduce and the world average the
engine applies to ``wp_summed``); the hidden states' gradient is partial per vocab
slice and is reduce-scattered back to the tokens' owners.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

from isp_comm.backends.base import Backend, Handle
from isp_comm.context import CommContext

_MAX_DIMS = 7  # the dimensions whose sizes WPComm.check_one_shape compares
ONE_SHAPE = "every rank of a WP group feeds inputs of one shape here: pad to one length, or pack"
"""What the WP group's gathers of each other's tokens need, in their wait's label: the
shared-memory backend compares sizes itself, so :meth:`WPComm.check_on_host` leaves
them to it, and its "collectives out of step" is prefixed by the label."""


class WPComm:
    """The WP group, its backend and the communication context whose ``wait`` keeps
    the deadline."""

    def __init__(self, group: ProcessGroup, size: int, rank: int, backend: Backend, ctx: CommContext) -> None:
        self.group, self.size, self.rank, self.backend, self.ctx = group, size, rank, backend, ctx

    def wait(self, handle: Handle, what: str) -> None:
        self.ctx.wait(handle, what)

    def all_gather(self, t: torch.Tensor, what: str) -> torch.Tensor:
        t = t.contiguous()
        if self.size == 1:
            return t[None]
        out = torch.empty((self.size, *t.shape), dtype=t.dtype, device=t.device)
        self.wait(
            self.ctx.record(self.backend.all_gather(out.view(-1), t.view(-1), self.group), "all-gather", self.group, t),
            what,
        )
        return out

    def reduce_scatter(self, t: torch.Tensor, what: str) -> torch.Tensor:
        t = t.contiguous()
        if self.size == 1:
            return t[0]
        out = torch.empty(t.shape[1:], dtype=t.dtype, device=t.device)
        self.wait(
            self.ctx.record(
                self.backend.reduce_scatter(out.view(-1), t.view(-1), self.group), "reduce-scatter", self.group, t
            ),
            what,
        )
        return out

    def gather_columns(self, mine: torch.Tensor, chunk: int, total: int, what: str) -> torch.Tensor:
        """``mine`` ``[wp, *rows, my columns]``: this rank's columns (at most ``chunk``,
        the same span on every rank) of every WP rank's rows. Returns this rank's own rows
        with every rank's columns, ``[*rows, total]``, by one all-to-all (padded to
        ``chunk``): the hidden-split embedding's output, the head's whole logits."""
        if mine.shape[-1] < chunk:
            mine = F.pad(mine, (0, chunk - mine.shape[-1]))
        mine = mine.contiguous()
        got = torch.empty_like(mine)  # [wp (column owner), *rows, chunk]
        self.wait(
            self.ctx.record(
                self.backend.all_to_all(got.view(-1), mine.view(-1), self.group), "all-to-all", self.group, mine
            ),
            what,
        )
        return got.movedim(0, -2).flatten(-2)[..., :total]

    def check_one_shape(self, t: torch.Tensor, fed: str, why: str) -> None:
        """A ``ValueError`` on every rank when the group's ranks bring ``t`` (``fed``:
        what it is) in different shapes, said before a gather that would move
        mismatched sizes (gloo has reset the connection, aborted a rank or gathered
        garbage, without a word; ``why``: what the caller needs of the shapes). One
        small all-gather read on the host: for generation and evaluation, which read
        it every step anyway, and in a training step only where that syncs nothing
        (:meth:`check_on_host`; docs/api.md)."""
        if self.size == 1:
            return
        mine = torch.full((_MAX_DIMS + 1,), -1, dtype=torch.int64, device=t.device)
        mine[0] = t.dim()
        mine[1 : 1 + min(t.dim(), _MAX_DIMS)] = torch.tensor(t.shape[:_MAX_DIMS])
        every = self.all_gather(mine, f"all-gather of the shapes of {fed}").tolist()
        if any(s != every[0] for s in every):
            shapes = ", ".join(f"WP rank {r}: {tuple(s[1 : 1 + s[0]])}" for r, s in enumerate(every))
            raise ValueError(f"the WP group's ranks brought {fed} of different shapes ({shapes}): {why}")

    def check_on_host(self, t: torch.Tensor, fed: str, why: str) -> None:
        """:meth:`check_one_shape` in a training step too, where it syncs nothing: ``t``
        on the CPU, with a backend that does not compare sizes itself (gloo, which
        gathered garbage, aborted a rank or reset the connection). On CUDA a step does
        not read the host, so it is not compared there (docs/api.md)."""
        if t.device.type == "cpu" and not self.backend.checks_sizes:
            self.check_one_shape(t, fed, why)

    def all_reduce(self, t: torch.Tensor, what: str) -> torch.Tensor:
        t = t.contiguous()
        if self.size > 1:
            self.wait(
                self.ctx.record(self.backend.all_reduce(t.view(-1), self.group), "all-reduce", self.group, t), what
            )
        return t


class _GatherTokens(torch.autograd.Function):
    """Forward: every WP rank's tokens, stacked on a new dim 0; backward: the sum of
    the partial gradients, each rank keeping its own tokens'."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: WPComm) -> torch.Tensor:
        ctx.comm = comm
        return comm.all_gather(x, f"all-gather of hidden states for the vocab-parallel head ({ONE_SHAPE})")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        return ctx.comm.reduce_scatter(grad, "reduce-scatter of the vocab-parallel head's input gradient"), None


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        logits: torch.Tensor,
        labels: torch.Tensor,
        vocab_start: int,
        ignore_index: int,
        comm: WPComm,
        reduction: str,
    ) -> torch.Tensor:
        # logits [wp, n, v_local]; labels [wp, n] (every rank's tokens)
        wp, n, v_local = logits.shape
        lf = logits.float()
        local_max = lf.amax(-1) if v_local else torch.full((wp, n), float("-inf"), device=lf.device)
        gmax = comm.all_gather(local_max, "all-gather of vocab-parallel logit maxima").amax(0)
        exp = (lf - gmax[..., None]).exp_()
        in_range = (labels >= vocab_start) & (labels < vocab_start + v_local)
        idx = (labels - vocab_start).clamp(0, max(v_local - 1, 0))
        target = lf.gather(-1, idx[..., None])[..., 0] - gmax if v_local else torch.zeros_like(gmax)
        sums = torch.stack((exp.sum(-1), target * in_range))
        sumexp, target = comm.all_reduce(sums, "all-reduce of vocab-parallel softmax sums").unbind(0)
        valid = labels != ignore_index
        losses = (sumexp.log() - target) * valid  # [wp, n], the same on every rank
        mine = valid[comm.rank]
        count = mine.sum()
        exp.div_(sumexp[..., None])  # the local slice of the softmax, kept for backward
        ctx.save_for_backward(exp, in_range, idx, valid, count)
        ctx.comm, ctx.dtype, ctx.reduction = comm, logits.dtype, reduction
        if reduction == "none":
            return losses[comm.rank]  # this rank's tokens, 0 where ignored
        total = losses[comm.rank].sum()
        return total / count if reduction == "mean" else total  # a mean over no token: NaN, as F.cross_entropy's

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        softmax, in_range, idx, valid, count = ctx.saved_tensors
        comm: WPComm = ctx.comm
        scale = (grad / count if ctx.reduction == "mean" else grad).to(softmax.dtype)  # per token with "none"
        # an ignored token's gradient is 0, also where the scale is not finite (no valid
        # token: a NaN would reach every WP rank's head gradient through the gather)
        mine = torch.where(valid[comm.rank], scale, 0.0)
        every = comm.all_gather(mine, "all-gather of vocab-parallel loss gradients")  # [wp, n]
        g = softmax * every[..., None]
        if g.shape[-1]:
            g.scatter_add_(-1, idx[..., None], -(every * in_range)[..., None])
        return g.to(ctx.dtype), None, None, None, None, None


class VocabParallelHead:
    """The forward installed on the output head (an ``nn.Linear`` without bias whose
    weight is this rank's vocab rows ``[vocab_start, vocab_start + rows)``, ``chunk_rows``
    on every rank but the last ones of an uneven split, ``vocab_size`` in all).

    While :attr:`whole` is set (``ISPCommunicator.whole_logits``, which a wrapped
    model's ``generate`` enters) it returns what the unsplit head would: this rank's
    tokens against the whole vocabulary. [Note: whole logits] Every rank computes the
    WP group's tokens against its slice, as in training; one all-to-all (padded to
    ``chunk_rows``) then hands each rank every slice of its own tokens: a rank sends and
    receives ``wp x tokens x chunk_rows`` values, about its tokens' whole logits, small
    where generation asks for the last position only, and the head's weight is never
    gathered. No gradient flows through them: they are for inference."""

    def __init__(self, head: nn.Linear, vocab_start: int, chunk_rows: int, vocab_size: int, comm: WPComm) -> None:
        self.head, self.vocab_start, self.comm = head, vocab_start, comm
        self.chunk_rows, self.vocab_size = chunk_rows, vocab_size
        self.whole = False

    @torch._disable_dynamo  # its collectives run eagerly under torch.compile(model): [Note: compiled blocks]
    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.whole and torch.is_grad_enabled() and (x.requires_grad or self.head.weight.requires_grad):
            raise RuntimeError(
                "whole logits (generate(), comm.whole_logits()) are for inference: run them under torch.no_grad()"
            )
        # in generation, or by another's evaluation code, the host is read anyway; in training, on the CPU alone
        (self.comm.check_one_shape if self.whole else self.comm.check_on_host)(
            x,
            "the vocab-parallel head hidden states",
            "the head gathers the group's tokens, so every rank of a WP group needs one batch size (in "
            "generate(), with num_beams and num_return_sequences) and, where more than the last position is "
            "asked for (training: pad to one length or pack; assisted decoding, logits_to_keep=0), one length",
        )
        x_all = _GatherTokens.apply(x, self.comm) if self.comm.size > 1 else x[None]
        logits = F.linear(x_all, self.head.weight.to(x.dtype))
        return self._whole(logits) if self.whole else logits

    def _whole(self, logits: torch.Tensor) -> torch.Tensor:
        """``[wp, *tokens, my rows]`` -> this rank's ``[*tokens, vocab_size]``
        ([Note: whole logits])."""
        if self.comm.size == 1:
            return logits[0]
        what = "all-to-all of vocab-parallel logits for whole rows"
        return self.comm.gather_columns(logits, self.chunk_rows, self.vocab_size, what)


def refuse_labels(head: VocabParallelHead, _module: nn.Module, _args: tuple, kwargs: dict[str, Any]) -> None:
    """The model's forward pre-hook under ``vocab_parallel`` (``head`` bound): a model's
    own loss (transformers' ``labels=``) would read the logits, this rank's vocab rows
    of every token of the WP group, as whole rows of its own tokens, and train on that
    silently. Inside ``comm.whole_logits()`` the rows are whole, and it may."""
    if kwargs.get("labels") is not None and not head.whole:
        raise ValueError(
            "with vocab_parallel the logits are this rank's vocab rows of every token of its WP group, and a "
            "model's own loss (labels=) would read them as whole rows: call the model without labels and take "
            "the loss with comm.cross_entropy(logits, labels), or evaluate under torch.no_grad() inside "
            "comm.whole_logits()"
        )


def find_output_head(model: nn.Module, head: nn.Module | None, blocks: list[nn.Module]) -> nn.Linear:
    """The head to split: ``head`` if given, else transformers' output embeddings,
    else the last ``nn.Linear`` outside the blocks; ``ValueError`` if it cannot be."""
    if head is None and hasattr(model, "get_output_embeddings"):
        head = model.get_output_embeddings()
    if head is None:
        inside = {id(m) for b in blocks for m in b.modules()}
        outside = [m for m in model.modules() if isinstance(m, nn.Linear) and id(m) not in inside]
        head = outside[-1] if outside else None
    off = "leave vocab_parallel off for this model (isp-train: without --vocab-parallel)"
    if not isinstance(head, nn.Linear):
        found = "no nn.Linear outside the blocks" if head is None else f"a {type(head).__name__}"
        raise ValueError(
            f"vocab_parallel needs the output head as an nn.Linear, and found {found}: pass the head's nn.Linear as "
            f"ISPCommunicator(..., head=model.lm_head), or {off}"
        )
    if head.bias is not None:
        raise ValueError(
            f"vocab_parallel supports an output head without bias, and this {type(head).__name__} has one: {off}"
        )
    if type(head).forward is not nn.Linear.forward:
        raise ValueError(
            f"vocab_parallel replaces the output head's forward, and {type(head).__name__} has one of its own: {off}"
        )
    if any(p is head.weight for m in model.modules() if m is not head for p in m.parameters(False)):
        raise ValueError(
            "vocab_parallel does not support a head tied to the embedding: untie them before wrapping "
            "(head.weight = nn.Parameter(head.weight.detach().clone()), and tie_word_embeddings=False in a "
            f"transformers config: the two then train apart), or {off}"
        )
    return head


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    comm: WPComm,
    vocab_start: int,
    ignore_index: int = -100,
    reduction: str = "mean",
) -> torch.Tensor:
    """This rank's cross-entropy over its own (non-ignored) tokens, their mean,
    ``"sum"`` or ``"none"`` (each token's, shaped like ``labels``, 0 where ignored),
    from the vocab-sharded logits ``[wp, *tokens, my vocab rows]`` of
    :class:`VocabParallelHead` and this rank's ``labels`` (``tokens`` shaped). As
    ``F.cross_entropy``: a rank without a valid token has a sum of 0, a mean of NaN,
    and no gradient."""
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    wp = logits.shape[0]
    if tuple(logits.shape[1:-1]) != tuple(labels.shape):
        raise ValueError(
            f"vocab-sharded logits {tuple(logits.shape)} do not match labels {tuple(labels.shape)}: "
            "expected logits [wp, *labels.shape, vocab rows]; pass the head's output as it came (not flattened "
            "or sliced) and labels shaped like this rank's input ids (shift the ids, not the logits: "
            "model(x[:, :-1]) against x[:, 1:])"
        )
    flat = logits.reshape(wp, labels.numel(), logits.shape[-1])  # also with no vocab row on this rank
    every = comm.all_gather(labels.reshape(-1), "all-gather of labels")
    out = _VocabParallelCE.apply(flat, every, vocab_start, ignore_index, comm, reduction)
    return out.view(labels.shape) if reduction == "none" else out
