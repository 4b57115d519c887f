"""Hidden-split embedding lookup: the embedding table is never gathered.

With ``shard_outer_params`` an untied ``nn.Embedding`` is split along its hidden dim
over the WP group: rank ``r`` holds every vocabulary row's columns
``[r * chunk, r * chunk + cols)``. A lookup needs only rows, so instead of gathering
the ``vocab x hidden`` table each rank looks up *its columns* for the tokens of the
whole WP group (the token ids are all-gathered: a few bytes per token) and one
all-to-all hands every rank the other ranks' columns for its own tokens
(``[tokens, hidden]`` in all, the size of the output). InternEvo splits its
embedding the same way.

[Note: gradients] The backward is the inverse all-to-all: each rank receives the
output gradient of its columns for every token of the group and adds it into its
shard's rows (``index_add``, in the master's dtype: fp32 under bf16 compute), so
the shard's gradient is the sum over the WP group (as for the vocab-parallel head:
the engine only all-reduces it over replicas and divides by the world, see
``wp_summed`` in the engine). A ``padding_idx`` row gets no gradient, as in
``nn.Embedding``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from isp_comm.vocab_parallel import ONE_SHAPE, WPComm


def supports_hidden_split(embedding: nn.Embedding) -> bool:
    """The lookups this module reproduces exactly (no max_norm renorm, dense grads),
    by an ``nn.Embedding`` whose forward is the plain lookup: a subclass with a forward
    of its own (Gemma's, scaled by the square root of the hidden size) stays with the
    gathered outer parameters, which run it as it is."""
    plain = type(embedding).forward is nn.Embedding.forward
    return plain and embedding.max_norm is None and not embedding.scale_grad_by_freq and not embedding.sparse


class _HiddenSplitLookup(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        ids: torch.Tensor,
        shard: torch.Tensor,
        hidden: int,
        chunk: int,
        padding_idx: int | None,
        comm: WPComm,
        dtype: torch.dtype | None,
    ) -> torch.Tensor:
        # ids: this rank's tokens; shard: [vocab, cols] (cols <= chunk, this rank's columns),
        # the master; looked up in ``dtype`` (param_dtype) when set
        # the label says what the ranks need where a backend that compares sizes itself refuses them (shared memory)
        every = comm.all_gather(ids, f"all-gather of token ids for the hidden-split embedding ({ONE_SHAPE})")
        cols = shard.shape[1]
        try:
            mine = F.embedding(every, shard if dtype is None else shard.to(dtype))  # [wp, *ids, cols]
        except IndexError:  # said only where it fails: a check of every step's ids would sync the host
            raise IndexError(
                f"a token id outside the vocabulary [0, {shard.shape[0]}) in the WP group's ids: one of this "
                "rank's, or, with shard_outer_params, ids gathered from ranks that fed inputs of different shapes "
                "(a training step on CUDA does not compare them): the ranks of a WP group must feed inputs of one "
                "shape"
            ) from None
        out = comm.gather_columns(mine, chunk, hidden, "all-to-all of the hidden-split embedding")  # [*ids, hidden]
        ctx.save_for_backward(every)
        ctx.meta = (hidden, chunk, cols, padding_idx, comm, shard.shape[0], shard.dtype)
        return out.contiguous()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        (every,) = ctx.saved_tensors
        hidden, chunk, cols, padding_idx, comm, vocab, master = ctx.meta
        wp = comm.size
        g = F.pad(grad, (0, wp * chunk - hidden)) if wp * chunk > hidden else grad
        g = g.unflatten(-1, (wp, chunk)).movedim(-2, 0).contiguous()  # [wp (column owner), *ids, chunk]
        back = torch.empty_like(g)  # [wp (token owner), *ids, chunk]: my columns' gradient
        handle = comm.ctx.record(
            comm.backend.all_to_all(back.view(-1), g.view(-1), comm.group), "all-to-all", comm.group, g
        )
        comm.wait(handle, "all-to-all of the hidden-split embedding's gradient")
        rows = every.reshape(-1)
        # accumulated in the master's dtype (fp32 under bf16 compute): a frequent token's
        # row sums many contributions, which bf16 would round at every addition
        g_shard = torch.zeros(vocab, cols, dtype=master, device=grad.device)
        g_shard.index_add_(0, rows, back.reshape(-1, chunk)[:, :cols].to(master))
        if padding_idx is not None:
            g_shard[padding_idx] = 0
        return None, g_shard, None, None, None, None, None


class HiddenSplitEmbedding:
    """The forward installed on an ``nn.Embedding`` whose weight is this rank's columns.

    While :attr:`checking` is set (a wrapped model's ``generate``, where each rank
    brings prompts of its own) the ranks' id shapes are compared before the gather,
    and in training where that syncs nothing (:meth:`WPComm.check_on_host`)."""

    def __init__(self, embedding: nn.Embedding, hidden: int, chunk: int, comm: WPComm, dtype: torch.dtype | None):
        self.embedding, self.hidden, self.chunk, self.comm, self.dtype = embedding, hidden, chunk, comm, dtype
        self.checking = False

    @torch._disable_dynamo  # its collectives run eagerly under torch.compile(model): [Note: compiled blocks]
    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        e = self.embedding
        (self.comm.check_one_shape if self.checking else self.comm.check_on_host)(
            ids,
            "the hidden-split embedding (shard_outer_params) token ids",
            "it gathers the group's ids, so every rank of a WP group feeds ids of one shape: in training, pad "
            "to one length or pack; in generate(), one batch size and prompts padded to one length",
        )
        return _HiddenSplitLookup.apply(ids, e.weight, self.hidden, self.chunk, e.padding_idx, self.comm, self.dtype)
