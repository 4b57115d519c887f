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

[Note: pieces]
With ``state_sharding="world"`` the optimizer's parameters are smaller than a WP
shard: each rank's WP rows of ``p`` are split again over its replica group (the ranks
holding the same WP shard), as DTensor splits a tensor ``Shard``-ed on two mesh dims,
WP first: with ``v`` valid rows in the WP shard, replica ``r`` holds rows
``[r * c, min((r + 1) * c, v))`` of it, ``c = ceil(v / replicas)`` (``torch.chunk``'s
sizes, so the piece is exactly the local tensor DCP writes for that DTensor). Every
rank of a replica group has the same ``v``, so its pieces share one padded size ``c``
per parameter and a replica collective moves equal chunks: *replica-major*
``[replica 0's pieces | replica 1's | ...]``, each rank's pieces packed like a flat
shard (``c`` rows per parameter, padding last). Packing a WP shard's rows into that
order is one ``_chunk_cat``; the way back is a copy per parameter
(:func:`unpack_replicas`). Without replicas, a piece is the WP shard itself.
"""

from __future__ import annotations

import dataclasses
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
    start: int = 0  # the first row this rank holds, in the full parameter's rows

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

    def rows(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a full tensor shaped like the parameter, in its own shape."""
        return full.narrow(self.dim, self.start, self.valid_rows)

    def piece(self, replicas: int, replica_rank: int) -> ShardedParam:
        """The part of these rows that replica ``replica_rank`` of ``replicas`` holds
        (see [Note: pieces]); its offset is left for the caller's layout to set."""
        c = -(-self.valid_rows // replicas)
        lo = min(replica_rank * c, self.valid_rows)
        return dataclasses.replace(
            self, chunk_rows=c, valid_rows=min(c, self.valid_rows - lo), offset=0, start=self.start + lo
        )


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
    """Parameters whose gradients are reduce-scattered together, in ``dtype``: over
    WP into ``layout`` (the members' WP rows), then, with replicas, over the replica
    group into ``piece`` (the members' pieces, see [Note: pieces])."""

    dtype: torch.dtype
    members: tuple[int, ...]  # indices into the unit's params
    layout: Layout  # elements of ``dtype``, over the members only
    wp_size: int
    piece: Layout  # elements of ``dtype``, the members' pieces (``layout`` without replicas)
    replicas: int = 1
    piece_bound: int = 0
    """Elements of the largest ``piece`` any rank has (``ceil(chunk_rows / replicas)``
    rows per member): what buffers sized alike on every rank are sized by."""

    @property
    def shard_numel(self) -> int:
        return self.layout.numel

    @property
    def gathered_numel(self) -> int:
        return self.wp_size * self.layout.numel

    @property
    def scattered_numel(self) -> int:
        """The replica reduce-scatter's input: every replica's pieces, replica-major."""
        return self.replicas * self.piece.numel

    @property
    def pair_numels(self) -> tuple[int, int]:
        """Elements of a reduce-scatter buffer pair (input, output) that both stages
        fit in: the WP stage reads ``gathered_numel`` from the input into
        ``shard_numel`` of the output; with replicas, the pair's two buffers take
        turns (see ``GradientReducer._to_replicas``): the one the WP stage did not
        leave the shard in takes ``scattered_numel``, the other the piece."""
        if self.replicas == 1:
            return self.gathered_numel, self.shard_numel
        if self.wp_size == 1:  # the WP stage leaves the shard in the input: the output takes the pieces' input
            return max(self.gathered_numel, self.piece.numel), max(self.shard_numel, self.scattered_numel)
        return max(self.gathered_numel, self.scattered_numel), max(self.shard_numel, self.piece.numel)

    @property
    def scattered_bound(self) -> int:
        """``scattered_numel`` at its largest on any rank (what buffers are sized by)."""
        return self.replicas * self.piece_bound


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


def pack_replicas(rows: list[torch.Tensor], out: torch.Tensor, replicas: int) -> None:
    """Each parameter's WP rows (2-D ``[v, width]`` tensors, in the members' order) ->
    replica-major pieces in ``out`` (see [Note: pieces]; padding rows zero): one
    ``_chunk_cat``, which splits every tensor as ``torch.chunk`` does."""
    rows = [t for t in rows if t.shape[0] > 0]  # an empty member has empty pieces
    if rows:
        torch._chunk_cat(rows, dim=0, num_chunks=replicas, out=out.view(replicas, -1))
    else:
        out.zero_()


def unpack_replicas(
    landing: torch.Tensor,
    src: Layout,
    dst: torch.Tensor,
    dst_offsets: tuple[int, ...],
    rows: list[tuple[int, int]],
    replicas: int,
) -> None:
    """Replica-major pieces in ``landing`` (one replica's laid out as ``src``) -> each
    parameter's WP rows in ``dst``, starting at ``dst_offsets``; ``rows``: per
    parameter, its pieces' padded rows ``c`` and its WP rows ``v``. Replica ``r``'s
    piece is rows ``[r * c, (r + 1) * c)`` of the WP rows, so the pieces in replica
    order *are* the rows, padding last: one copy for the whole pieces, one for the
    last, short one."""
    by_replica = landing[: replicas * src.numel].view(replicas, src.numel)
    for (c, v), off, size, at in zip(rows, src.offsets, src.sizes, dst_offsets):
        if v == 0:
            continue
        width = size // c
        pieces = by_replica[:, off : off + size].view(replicas, c, width)
        out = dst[at : at + v * width].view(v, width)
        whole = v // c
        out[: whole * c].view(whole, c, width).copy_(pieces[:whole])
        if v > whole * c:
            out[whole * c :].copy_(pieces[whole, : v - whole * c])


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
        replicas: int = 1,
        replica_rank: int = 0,
    ) -> None:
        self.wp_size, self.wp_rank, self.replicas = wp_size, wp_rank, replicas
        dtypes = {sp.dtype for sp in found}
        self.mixed = len(dtypes) > 1
        # mixed: widest elements first, so every typed view of the raw bytes is aligned
        self.order = sorted(range(len(found)), key=lambda i: -found[i].dtype.itemsize) if self.mixed else None
        if self.order is not None:
            found = [found[i] for i in self.order]
        own = Layout.packed(found, raw=self.mixed)  # the parameters' own bytes
        params = tuple(dataclasses.replace(sp, offset=off) for sp, off in zip(found, own.offsets))
        own_dtype = torch.uint8 if self.mixed else dtypes.pop()
        self.gather_dtype = param_dtype or own_dtype
        self.gather = own if self.gather_dtype == own_dtype else Layout.packed(list(params), raw=False)
        self.shard_numel = self.gather.numel  # what one rank sends in an all-gather
        self.master_dtype = own_dtype
        if replicas == 1:  # the flat shard is the masters' memory
            self.params = self.pieces = params
            self.store, self.master_store, self.dtype = own, own, own_dtype
        else:  # see [Note: pieces]: the flat shard in the gather dtype, the masters apart
            self.params = tuple(dataclasses.replace(sp, offset=o) for sp, o in zip(params, self.gather.offsets))
            self.store, self.dtype = self.gather, self.gather_dtype
            pieces = [sp.piece(replicas, replica_rank) for sp in params]
            self.master_store = Layout.packed(pieces, raw=self.mixed)
            self.pieces = tuple(dataclasses.replace(pc, offset=o) for pc, o in zip(pieces, self.master_store.offsets))
        self.piece_gather = Layout.packed(list(self.pieces), raw=self.gather.raw)
        """One rank's pieces in the gather dtype: what a replica all-gather sends."""
        self._reduce_dtype = reduce_dtype or param_dtype
        self.full_groups = self.reduce_groups(None)  # every parameter: what buffers are sized for

    def reduce_groups(self, trainable: tuple[bool, ...] | None) -> tuple[ReduceGroup, ...]:
        """The parameters whose gradients are reduced (``trainable``, else all), in one
        group in the reduce dtype when it is set, else one group per parameter dtype."""
        by: dict[torch.dtype, list[int]] = {}
        for i, sp in enumerate(self.params):
            if trainable is None or trainable[i]:
                by.setdefault(self._reduce_dtype or sp.dtype, []).append(i)
        groups = []
        for dt, ix in by.items():
            layout = Layout.packed([self.params[i] for i in ix], raw=False)
            piece = Layout.packed([self.pieces[i] for i in ix], raw=False)
            bound = self._piece_rows_bound([self.params[i] for i in ix], raw=False)
            groups.append(ReduceGroup(dt, tuple(ix), layout, self.wp_size, piece, self.replicas, bound))
        return tuple(groups)

    def _piece_rows_bound(self, params: list[ShardedParam], raw: bool) -> int:
        """Elements (bytes when ``raw``) of the largest pieces of ``params`` on any rank:
        ``ceil(chunk_rows / replicas)`` rows each, the same on every rank."""
        r = self.replicas
        return sum(-(-sp.chunk_rows // r) * sp.inner * (sp.dtype.itemsize if raw else 1) for sp in params)

    @property
    def piece_bound(self) -> int:
        """Elements of the gather dtype (bytes when raw) of the largest ``piece_gather``
        any rank of the unit has: what a replica all-gather's buffers are sized by."""
        return self._piece_rows_bound(list(self.params), self.gather.raw)

    # ---- replicas (see [Note: pieces]) -------------------------------------------------
    def pack_pieces(self, shard: torch.Tensor, group: ReduceGroup, out: torch.Tensor) -> None:
        """``group``'s reduced WP rows (laid out as ``group.layout`` in ``shard``) ->
        the replica reduce-scatter's input in ``out`` (replica-major)."""
        params = [self.params[i] for i in group.members]
        rows = [
            shard[off : off + sp.valid_rows * sp.inner].view(sp.valid_rows, sp.inner)
            for sp, off in zip(params, group.layout.offsets)
        ]
        pack_replicas(rows, out[: group.scattered_numel], self.replicas)

    def pack_piece_grads(self, grads: tuple[torch.Tensor | None, ...], group: ReduceGroup, out: torch.Tensor) -> None:
        """Gradients of ``group``'s WP rows (in the parameters' own shapes, e.g. what
        autograd gives a shard computed on directly) -> replica-major pieces in ``out``."""
        rows = []
        for i in group.members:
            sp, g = self.params[i], grads[i]
            g = torch.zeros(sp.shard_shape, dtype=out.dtype, device=out.device) if g is None else sp.user(g)
            rows.append(g.reshape(sp.valid_rows, sp.inner).to(out.dtype))
        pack_replicas(rows, out[: group.scattered_numel], self.replicas)

    def unpack_shard(self, landing: torch.Tensor, flat_shard: torch.Tensor) -> None:
        """A replica all-gather's output (every replica's ``piece_gather``) -> the WP
        rows of ``flat_shard`` (laid out as ``store``; padding rows left as they are)."""
        rows = [(pc.chunk_rows, sp.valid_rows) for pc, sp in zip(self.pieces, self.params)]
        unpack_replicas(landing, self.piece_gather, flat_shard, self.store.offsets, rows, self.replicas)

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


def replica_collectives(units: list[BlockLayout]) -> list[tuple[str, list[int]]]:
    """The replica group's collectives of ``units`` as (kind, per-rank input bytes of
    each, at their largest on any rank): every reduce group's all-reduce, or, with
    pieces, its reduce-scatter into them and each unit's all-gather back."""
    if not any(u.replicas > 1 for u in units):
        return [("all_reduce", [g.shard_numel * g.dtype.itemsize for u in units for g in u.full_groups])]
    return [
        ("reduce_scatter", [g.scattered_bound * g.dtype.itemsize for u in units for g in u.full_groups]),
        ("all_gather", [u.piece_bound * u.gather_dtype.itemsize for u in units]),
    ]


def replica_largest(units: list[BlockLayout]) -> int:
    """Bytes per rank of the largest buffer a replica collective of ``units`` fills
    (an all-reduce's, a reduce-scatter's input, an all-gather's output)."""
    ways = max(u.replicas for u in units)
    return max(
        (n * (ways if kind == "all_gather" else 1) for kind, sizes in replica_collectives(units) for n in sizes),
        default=0,
    )
