"""DistributedAttention: sequence-sharded q/k/v in, head-sharded attention, sequence-
sharded output back (DeepSpeed-Ulysses, as InternEvo's ISP uses it).

Layout is ``[batch, heads, seq, head_dim]`` (what transformers' attention functions
and ``scaled_dot_product_attention`` take). Three input forms, all with one
all-to-all per tensor: separate ``q, k, v``; ``q`` plus packed ``kv``
``[batch, 2, kv_heads, seq, head_dim]``; packed ``qkv`` ``[batch, 3, heads, seq,
head_dim]``. With grouped-query attention each rank needs whole KV heads: when the SP
size exceeds the KV heads, KV heads are repeated up to the SP size (it must be a
multiple of them).

Variable-length packed sequences: ``cu_seqlens`` holds the document boundaries over
the whole (gathered) sequence, the same on every rank of the SP group; after the
exchange each rank sees whole sequences, so the local attention applies them as is.
They reach it as host ints, read once per tensor (see [Note: boundaries on the host]
in ``local.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from isp_comm.backends.base import Backend
from isp_comm.context import CommContext
from isp_comm.sequence_parallel.all_to_all import all_to_all
from isp_comm.sequence_parallel.local import BoundaryCache, check_cu_seqlens

LocalAttention = Callable[..., torch.Tensor]


def kv_repeats(n_heads: int, n_kv_heads: int, sp: int) -> int:
    """How often to repeat each KV head so the heads split over ``sp`` ranks; raises
    ``ValueError`` when no split is possible."""
    if n_heads % sp:
        raise ValueError(f"{n_heads} attention heads cannot be split over sequence-parallel size {sp}")
    if n_kv_heads % sp == 0:
        return 1
    if sp % n_kv_heads == 0 and n_heads % sp == 0:
        return sp // n_kv_heads
    raise ValueError(f"{n_kv_heads} key/value heads cannot be split over sequence-parallel size {sp}")


class DistributedAttention:
    """Wraps a local attention ``fn(q, k, v[, cu_seqlens=...]) -> out`` ([b, h, s, d]
    each) for SP; see the module doc for the accepted input forms."""

    def __init__(
        self,
        local_attention: LocalAttention,
        sp_group: ProcessGroup,
        backend: Backend,
        comm: CommContext | None = None,
        boundaries: BoundaryCache | None = None,
    ):
        self.local = local_attention
        self.group, self.backend, self.comm = sp_group, backend, comm
        self.sp = dist.get_world_size(sp_group)
        self.boundaries = boundaries if boundaries is not None else BoundaryCache()
        """Shared by every attention layer of a model: one host read of each ``cu_seqlens``."""

    def _a2a(self, tensors: tuple[torch.Tensor, ...], scatter, gather) -> tuple[torch.Tensor, ...]:
        return all_to_all(tensors, scatter, gather, self.group, self.backend, self.comm)

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None = None,
        v: torch.Tensor | None = None,
        *,
        cu_seqlens: torch.Tensor | Sequence[int] | None = None,
    ) -> torch.Tensor:
        """Attention of this rank's sequence chunk; returns ``[b, heads, chunk, d]``.

        ``q, k, v`` separate; ``q, kv`` (``v`` None) or ``qkv`` (``k`` and ``v`` None)
        packed along dim 1. Heads are scattered and the sequence gathered, so every
        rank attends over the whole sequence for its share of the heads."""
        if k is None:  # packed qkv [b, 3, h, s, d]: one exchange for all three
            kv_repeats(q.shape[2], q.shape[2], self.sp)
            (qkv,) = self._a2a((q,), 2, 3)
            q, k, v = qkv.unbind(1)
        elif v is None:  # q [b, h, s, d] + packed kv [b, 2, h_kv, s, d]
            rep = kv_repeats(q.shape[1], k.shape[2], self.sp)
            if rep > 1:
                k = k.repeat_interleave(rep, dim=2)
            q, kv = self._a2a((q, k), (1, 2), (2, 3))
            k, v = kv.unbind(1)
        else:
            rep = kv_repeats(q.shape[1], k.shape[1], self.sp)
            if rep > 1:
                k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
            q, k, v = self._a2a((q, k, v), 1, 2)
        out = self.local(q, k, v) if cu_seqlens is None else self._documents(q, k, v, cu_seqlens)
        (out,) = self._a2a((out,), 2, 1)
        return out

    @torch._disable_dynamo  # [Note: packed documents under torch.compile] in local.py
    def _documents(self, q, k, v, cu_seqlens: torch.Tensor | Sequence[int]) -> torch.Tensor:
        cuts = check_cu_seqlens(self.boundaries.cuts(cu_seqlens), q.shape[2])
        return self.local(q, k, v, cu_seqlens=cuts)
