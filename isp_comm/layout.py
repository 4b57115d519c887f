"""The layout maths of sharded parameters: where each one lives in a flat shard, in a
gathered slot and in the gradient buffers. Nothing here touches a module (see
:mod:`isp_comm.units` for what binds the layout to one).

[Note: layouts]
Every sharded parameter ``p`` (an ``nn.Linear`` weight or bias, shape ``(out, *rest)``)
is split along dim 0 into ``wp`` chunks of ``chunk = ceil(out / wp)`` rows, the last
ones zero-padded (as FSDP2 pads). A 2-D parameter sharded along dim 1 (an embedding
split over its hidden dim) is laid out as its transpose: "rows" are then its columns,
and every view handed out is transposed back, so users see the usual shapes.
Rank ``r``'s chunks of all the block's parameters, concatenated, are its *flat shard*
of ``S`` elements; the user-visible shard parameters are views of it, so the
all-gather input needs no copy.

A block whose parameters mix dtypes keeps its flat shard as raw bytes (parameters
ordered by element size, so every typed view is aligned): it is gathered as bytes
(one collective) unless ``param_dtype`` casts it, and its gradients are
reduce-scattered in one group per dtype (FSDP2 does the same). Offsets and sizes are
then in bytes for storage and gathering, in elements within each reduce group.

* The all-gather output is *rank-major*: ``[rank 0's flat shard | rank 1's | ...]``.
* A gathered *slot* is *param-major*: parameter ``p`` occupies
  ``[wp * off_p, wp * (off_p + n_p))`` as its padded full tensor, so the module's
  weight is a plain contiguous view of the slot. Rank-major to param-major is one
  ``split_with_sizes_copy``; gradients go the other way with one ``_chunk_cat``.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class ShardedParam:
    """Where one parameter lives in the flat shard and in a gathered slot."""

    module: nn.Module
    name: str  # attribute on ``module``: "weight" or "bias"
    fqn: str  # key in the model's state dict
    shape: torch.Size  # full, unpadded shape
    chunk_rows: int  # rows per rank, padded
    valid_rows: int  # rows this rank really holds (<= chunk_rows, may be 0)
    offset: int  # start in the flat shard (in bytes when the shard is raw bytes)
    dim: int = 0  # the dim split over ranks (0, or 1 for a 2-D parameter)
    dtype: torch.dtype = torch.float32

    @property
    def rows_shape(self) -> torch.Size:
        """The shape whose dim 0 is split: ``shape``, or its transpose when ``dim`` is 1."""
        return self.shape if self.dim == 0 else torch.Size((self.shape[1], self.shape[0]))

    def user(self, t: torch.Tensor) -> torch.Tensor:
        """A tensor laid out as ``rows_shape`` seen in the parameter's own shape."""
        return t if self.dim == 0 else t.t()

    @property
    def inner(self) -> int:
        return self.rows_shape[1:].numel()

    @property
    def shard_numel(self) -> int:
        return self.chunk_rows * self.inner

    @property
    def full_numel(self) -> int:
        return self.shape.numel()

    @property
    def shard_shape(self) -> torch.Size:
        """This rank's piece, laid out as ``rows_shape``."""
        return torch.Size((self.valid_rows, *self.rows_shape[1:]))

    def rows_of(self, full: torch.Tensor, rank: int) -> torch.Tensor:
        """``rank``'s piece of a full tensor, in the parameter's own shape."""
        size = self.shape[self.dim]
        lo = min(rank * self.chunk_rows, size)
        return full.narrow(self.dim, lo, min(self.chunk_rows, size - lo))


@dataclass(frozen=True)
class Layout:
    """Where each parameter's shard sits in a flat buffer, in that buffer's elements
    (bytes when ``raw``, and typed views are cut from them)."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    numel: int
    raw: bool = False

    @staticmethod
    def packed(params: list[ShardedParam], raw: bool) -> Layout:
        sizes = tuple(sp.shard_numel * (sp.dtype.itemsize if raw else 1) for sp in params)
        offsets = (0, *itertools.accumulate(sizes))[: len(sizes)]
        return Layout(offsets, sizes, sum(sizes), raw)


@dataclass(frozen=True)
class ReduceGroup:
    """Parameters whose gradients are reduce-scattered together, in ``dtype``."""

    dtype: torch.dtype
    members: tuple[int, ...]  # indices into the unit's params
    layout: Layout  # elements of ``dtype``, over the members only
    wp_size: int

    @property
    def shard_numel(self) -> int:
        return self.layout.numel

    @property
    def gathered_numel(self) -> int:
        return self.wp_size * self.layout.numel


def to_param_major(rank_major: torch.Tensor, slot: torch.Tensor, layout: Layout, wp: int) -> None:
    """Rank-major all-gather output -> param-major slot (see the layouts note)."""
    outs = [slot[wp * off : wp * (off + size)].view(wp, -1) for off, size in zip(layout.offsets, layout.sizes)]
    torch.split_with_sizes_copy(
        rank_major[: wp * layout.numel].view(wp, layout.numel), list(layout.sizes), dim=1, out=outs
    )


def full_views(slot: torch.Tensor, params: tuple[ShardedParam, ...], layout: Layout, wp: int) -> list[torch.Tensor]:
    """The unpadded full parameters as views of a param-major slot."""
    views = []
    for sp, off in zip(params, layout.offsets):
        if layout.raw:
            region = slot[wp * off : wp * off + sp.full_numel * sp.dtype.itemsize].view(sp.dtype)
        else:
            region = slot[wp * off : wp * off + sp.full_numel]
        views.append(sp.user(region.view(sp.rows_shape)))
    return views


class BlockLayout:
    """The flat-shard, gather and reduce layouts of one unit's parameters.

    ``found`` are the parameters in discovery order (offsets not yet set); a block
    mixing dtypes keeps them widest first (``order``: the discovery index of each)."""

    def __init__(
        self,
        found: list[ShardedParam],
        wp_size: int,
        wp_rank: int,
        param_dtype: torch.dtype | None = None,
        reduce_dtype: torch.dtype | None = None,
    ) -> None:
        self.wp_size, self.wp_rank = wp_size, wp_rank
        dtypes = {sp.dtype for sp in found}
        self.mixed = len(dtypes) > 1
        # mixed: widest elements first, so every typed view of the raw bytes is aligned
        self.order = sorted(range(len(found)), key=lambda i: -found[i].dtype.itemsize) if self.mixed else None
        if self.order is not None:
            found = [found[i] for i in self.order]
        store = Layout.packed(found, raw=self.mixed)
        self.params = tuple(
            ShardedParam(sp.module, sp.name, sp.fqn, sp.shape, sp.chunk_rows, sp.valid_rows, off, sp.dim, sp.dtype)
            for sp, off in zip(found, store.offsets)
        )
        self.store = store
        self.dtype = torch.uint8 if self.mixed else dtypes.pop()  # of the flat shard
        self.gather_dtype = param_dtype or self.dtype
        self.gather = store if self.gather_dtype == self.dtype else Layout.packed(list(self.params), raw=False)
        self.shard_numel = self.gather.numel  # what one rank sends in an all-gather
        self._reduce_dtype = reduce_dtype or param_dtype
        self.full_groups = self._reduce_groups(None)  # every parameter: what buffers are sized for

    def _reduce_groups(self, trainable: tuple[bool, ...] | None) -> tuple[ReduceGroup, ...]:
        """The parameters whose gradients are reduced (``trainable``, else all), in one
        group in the reduce dtype when it is set, else one group per parameter dtype."""
        by: dict[torch.dtype, list[int]] = {}
        for i, sp in enumerate(self.params):
            if trainable is None or trainable[i]:
                by.setdefault(self._reduce_dtype or sp.dtype, []).append(i)
        return tuple(
            ReduceGroup(dt, tuple(ix), Layout.packed([self.params[i] for i in ix], raw=False), self.wp_size)
            for dt, ix in by.items()
        )

    @staticmethod
    def shard_view(flat: torch.Tensor, sp: ShardedParam) -> torch.Tensor:
        """``sp``'s piece of a flat shard (or of a buffer laid out like it), in the
        parameter's own shape."""
        if flat.dtype == torch.uint8:  # raw bytes of a block mixing dtypes
            n = sp.valid_rows * sp.inner * sp.dtype.itemsize
            return sp.user(flat[sp.offset : sp.offset + n].view(sp.dtype).view(sp.shard_shape))
        return sp.user(flat[sp.offset : sp.offset + sp.valid_rows * sp.inner].view(sp.shard_shape))

    # ---- gathered layout ------------------------------------------------------------
    @property
    def gathered_numel(self) -> int:
        return self.wp_size * self.shard_numel

    def copy_out(self, rank_major: torch.Tensor, slot: torch.Tensor) -> None:
        """Rank-major all-gather output -> param-major slot (see the layouts note)."""
        to_param_major(rank_major, slot, self.gather, self.wp_size)

    def full_views(self, slot: torch.Tensor) -> list[torch.Tensor]:
        """The unpadded full parameters as views of a param-major slot."""
        return full_views(slot, self.params, self.gather, self.wp_size)

    def pack_grads(self, grads: tuple[torch.Tensor | None, ...], out: torch.Tensor, group: ReduceGroup) -> None:
        """Full gradients of ``group`` -> rank-major reduce-scatter input (padding rows zero)."""
        flat_2d = []
        for i in group.members:
            sp, g = self.params[i], grads[i]
            if g is None:
                g = torch.zeros(sp.shape, dtype=out.dtype, device=out.device)
            flat_2d.append(sp.user(g.to(out.dtype)).reshape(sp.rows_shape[0], -1))
        w = self.wp_size
        torch._chunk_cat(flat_2d, dim=0, num_chunks=w, out=out[: group.gathered_numel].view(w, -1))

    def param_major_slices(self, buf: torch.Tensor, layout: Layout) -> list[tuple[torch.Tensor, slice]]:
        """Per parameter of ``layout``: its padded full region of a param-major buffer,
        and the slice of the flat shard-like buffer it gathers from / reduces into
        (``comm_granularity="module"``: an all-gather of that slice of every rank
        lands exactly on the region)."""
        w = self.wp_size
        return [(buf[w * o : w * (o + n)], slice(o, o + n)) for o, n in zip(layout.offsets, layout.sizes)]

    def pack_grads_param_major(
        self, grads: tuple[torch.Tensor | None, ...], out: torch.Tensor, group: ReduceGroup
    ) -> None:
        """Full gradients of ``group`` -> param-major reduce-scatter input (padding rows zero)."""
        for (region, _), i in zip(self.param_major_slices(out, group.layout), group.members):
            sp, g = self.params[i], grads[i]
            rows = region.view(self.wp_size * sp.chunk_rows, -1)
            n = sp.rows_shape[0]
            if g is None:
                rows.zero_()
                continue
            rows[:n].copy_(sp.user(g).reshape(n, -1))
            rows[n:].zero_()
