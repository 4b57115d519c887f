"""DistributedAttention: sequence-sharded q/k/v in, head-sharded attention, sequence-
sharded output back (DeepSpeed-Ulysses, as InternEvo's ISP uses it).

Layout is ``[batch, heads, seq, head_dim]`` (what transformers' attention functions
and ``scaled_dot_product_attention`` take). With grouped-query attention each rank
needs whole KV heads: when the SP size exceeds the KV heads, KV heads are repeated up
to the SP size (it must be a multiple of them).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from isp_comm.backends.base import Backend
from isp_comm.hooks.trace import Tracer
from isp_comm.sequence_parallel.all_to_all import all_to_all

LocalAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


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
    """Wraps a local attention ``fn(q, k, v) -> out`` ([b, h, s, d] each) for SP."""

    def __init__(
        self,
        local_attention: LocalAttention,
        sp_group: ProcessGroup,
        backend: Backend,
        timeout_s: float = 300.0,
        trace: Callable[[], Tracer | None] | None = None,
    ):
        self.local = local_attention
        self.group, self.backend, self.timeout_s, self.trace = sp_group, backend, timeout_s, trace
        self.sp = dist.get_world_size(sp_group)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        rep = kv_repeats(q.shape[1], k.shape[1], self.sp)
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        # heads scattered, sequence gathered: every rank sees the whole sequence
        q, k, v = all_to_all((q, k, v), 1, 2, self.group, self.backend, self.timeout_s, self.trace)
        out = self.local(q, k, v)
        (out,) = all_to_all((out,), 2, 1, self.group, self.backend, self.timeout_s, self.trace)
        return out
