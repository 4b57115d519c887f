"""A block's linear parameters as one flat shard: layout, padding, views into a slot.

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

import functools
import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from isp_comm.materialize import materialize_module


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


@dataclass(frozen=True)
class ReplicatedParam:
    """A parameter inside a block that stays whole on every rank (e.g. a norm weight)."""

    module: nn.Module
    name: str
    param: nn.Parameter


class BlockUnit:
    """One transformer block's sharded parameters: the unit of gather and reduce-scatter."""

    def __init__(
        self,
        index: int,
        block: nn.Module,
        owners: list[tuple[str, nn.Module]],
        replicated: list[ReplicatedParam],
        wp_size: int,
        wp_rank: int,
        device: torch.device,
        names: tuple[str, ...] | None = ("weight", "bias"),
        dim1: frozenset[int] = frozenset(),
        param_dtype: torch.dtype | None = None,
        reduce_dtype: torch.dtype | None = None,
        materialize: Callable[[nn.Module, str], None] | None = None,
    ) -> None:
        """``owners``: (fqn prefix, module) whose direct parameters called ``names``
        (all of them when ``None``) are sharded. ``materialize(module, fqn)`` turns a
        module still on the meta device into a real, initialised one. A parameter
        owned by several modules (tied weights) is sharded once and appears in every
        owner. Parameters whose
        ``id`` is in ``dim1`` are split along dim 1, the rest along dim 0.
        ``param_dtype`` / ``reduce_dtype``: the dtypes of gathering and of gradient
        reduction (``None``: the parameters' own)."""
        self.index = index
        self.block = block
        self.wp_size = wp_size
        self.wp_rank = wp_rank
        self.replicated = replicated
        found: list[tuple[ShardedParam, nn.Parameter]] = []
        alias_of: list[tuple[nn.Module, str, int, str]] = []  # (module, name, index in found, fqn)
        seen: dict[int, int] = {}
        for fqn_prefix, module in owners:
            for name, p in list(module._parameters.items()):
                if p is None or (names is not None and name not in names):
                    continue
                fqn = f"{fqn_prefix}.{name}" if fqn_prefix else name
                if id(p) in seen:
                    alias_of.append((module, name, seen[id(p)], fqn))
                    continue
                if p.dim() == 0:
                    raise ValueError(f"{fqn_prefix}.{name}: a 0-dim parameter cannot be sharded")
                dim = 1 if id(p) in dim1 else 0
                assert dim == 0 or p.dim() == 2, "only 2-D parameters are split along dim 1"
                out = p.shape[dim]
                chunk = -(-out // wp_size)
                valid = max(0, min(chunk, out - wp_rank * chunk))
                seen[id(p)] = len(found)
                found.append((ShardedParam(module, name, fqn, p.shape, chunk, valid, 0, dim, p.dtype), p))
        dtypes = {sp.dtype for sp, _ in found}
        self.mixed = len(dtypes) > 1
        # mixed: widest elements first, so every typed view of the raw bytes is aligned
        order = sorted(range(len(found)), key=lambda i: -found[i][0].dtype.itemsize) if self.mixed else None
        if order is not None:
            position = {old: new for new, old in enumerate(order)}
            found = [found[i] for i in order]
            alias_of = [(m, n, position[i], f) for m, n, i, f in alias_of]
        self.aliases = alias_of
        store = Layout.packed([sp for sp, _ in found], raw=self.mixed)
        self.params = tuple(
            ShardedParam(sp.module, sp.name, sp.fqn, sp.shape, sp.chunk_rows, sp.valid_rows, off, sp.dim, sp.dtype)
            for (sp, _), off in zip(found, store.offsets)
        )
        self.store = store
        self.dtype = torch.uint8 if self.mixed else dtypes.pop()  # of the flat shard
        self.gather_dtype = param_dtype or self.dtype
        self.gather = store if self.gather_dtype == self.dtype else Layout.packed(list(self.params), raw=False)
        self.shard_numel = self.gather.numel  # what one rank sends in an all-gather
        self._reduce_dtype = reduce_dtype or param_dtype
        self.full_groups = self._reduce_groups(None)  # every parameter: what buffers are sized for
        self.device = device
        self.flat_shard = torch.zeros(store.numel, dtype=self.dtype, device=self.device)
        self.shards: tuple[nn.Parameter, ...] = ()
        self._install_shards(materialize or functools.partial(materialize_module, device=device, seed=None))
        self.grad_flat: torch.Tensor | None = None
        self._trainable: tuple[bool, ...] = ()
        self.groups: tuple[ReduceGroup, ...] = ()
        self.refresh_trainable()

    # ---- frozen parameters ----------------------------------------------------------
    # [Note: frozen parameters] Only trainable shards are reduce-scattered: ``groups``
    # packs the trainable parameters alone (no group at all for a frozen block), the
    # gathered views of frozen parameters leave ``UnshardBlock`` non-differentiable so
    # autograd computes no gradient for them, and they never get a ``.grad``.
    # ``requires_grad`` may change between steps: the engine calls
    # ``refresh_trainable()`` at each forward, never between a forward and its backward.
    @property
    def trainable(self) -> tuple[bool, ...]:
        """Per shard, whether it was trainable at the last ``refresh_trainable()``."""
        return self._trainable

    @property
    def requires_grad(self) -> bool:
        return any(self._trainable)

    @property
    def anchor(self) -> nn.Parameter:
        """A trainable shard: the input that puts ``UnshardBlock`` in the graph."""
        return next(s for s, t in zip(self.shards, self._trainable) if t)

    def refresh_trainable(self) -> None:
        """Follow the shards' ``requires_grad`` (rebuilding the reduce groups on a change)."""
        now = tuple(s.requires_grad for s in self.shards)
        if now != self._trainable:
            self._trainable = now
            self.groups = self._reduce_groups(now)

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

    # ---- construction -------------------------------------------------------------
    def _install_shards(self, materialize: Callable[[nn.Module, str], None]) -> None:
        """Copy this rank's rows into the flat shard and register shard parameters.

        A module still on the meta device is materialised alone just before its rows
        are taken, so at most one full module exists at a time."""
        shards = []
        for sp in self.params:
            p = sp.module._parameters[sp.name]  # a meta bias is real once its weight was
            if p.device.type == "meta":
                materialize(sp.module, sp.fqn[: -len(sp.name)].rstrip("."))
                p = sp.module._parameters[sp.name]
            view = self.shard_view(self.flat_shard, sp)
            with torch.no_grad():
                view.copy_(sp.rows_of(p.detach(), self.wp_rank))
            shard = nn.Parameter(view, requires_grad=p.requires_grad)
            sp.module._parameters[sp.name] = shard
            shards.append(shard)
        self.shards = tuple(shards)
        for module, name, i, _ in self.aliases:
            module._parameters[name] = shards[i]

    @staticmethod
    def shard_view(flat: torch.Tensor, sp: ShardedParam) -> torch.Tensor:
        """``sp``'s piece of a flat shard (or of a buffer laid out like it), in the
        parameter's own shape."""
        if flat.dtype == torch.uint8:  # raw bytes of a block mixing dtypes
            n = sp.valid_rows * sp.inner * sp.dtype.itemsize
            return sp.user(flat[sp.offset : sp.offset + n].view(sp.dtype).view(sp.shard_shape))
        return sp.user(flat[sp.offset : sp.offset + sp.valid_rows * sp.inner].view(sp.shard_shape))

    def fill_send(self, send: torch.Tensor) -> None:
        """This rank's shard, in the gather dtype and layout (when it is not the flat
        shard itself); padding rows stay zero."""
        if not self.mixed:
            send.copy_(self.flat_shard)
            return
        for sp, off, size in zip(self.params, self.gather.offsets, self.gather.sizes):
            nbytes = sp.shard_numel * sp.dtype.itemsize
            send[off : off + size].copy_(self.flat_shard[sp.offset : sp.offset + nbytes].view(sp.dtype))

    # ---- gathered layout ------------------------------------------------------------
    @property
    def gathered_numel(self) -> int:
        return self.wp_size * self.shard_numel

    def copy_out(self, rank_major: torch.Tensor, slot: torch.Tensor) -> None:
        """Rank-major all-gather output -> param-major slot (see the layouts note)."""
        w, g = self.wp_size, self.gather
        outs = [slot[w * off : w * (off + size)].view(w, -1) for off, size in zip(g.offsets, g.sizes)]
        torch.split_with_sizes_copy(
            rank_major[: self.gathered_numel].view(w, self.shard_numel), list(g.sizes), dim=1, out=outs
        )

    def full_views(self, slot: torch.Tensor) -> list[torch.Tensor]:
        """The unpadded full parameters as views of a param-major slot."""
        w, g = self.wp_size, self.gather
        views = []
        for sp, off in zip(self.params, g.offsets):
            if g.raw:
                region = slot[w * off : w * off + sp.full_numel * sp.dtype.itemsize].view(sp.dtype)
            else:
                region = slot[w * off : w * off + sp.full_numel]
            views.append(sp.user(region.view(sp.rows_shape)))
        return views

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

    # ---- module attributes ------------------------------------------------------------
    def swap_in(self, tensors: list[torch.Tensor]) -> None:
        for sp, t in zip(self.params, tensors):
            sp.module._parameters[sp.name] = t
        for module, name, i, _ in self.aliases:
            module._parameters[name] = tensors[i]

    def swap_out(self) -> None:
        for sp, shard in zip(self.params, self.shards):
            sp.module._parameters[sp.name] = shard
        for module, name, i, _ in self.aliases:
            module._parameters[name] = self.shards[i]

    def accumulate_grad(self, reduced: torch.Tensor, group: ReduceGroup) -> None:
        """Add ``group``'s reduced gradient shard into the shard parameters' ``.grad``.

        [Note: grad aliasing] A shard's ``.grad`` is a view of ``grad_flat`` (one
        buffer per block, laid out like the flat shard, allocated once), so after
        ``zero_grad(set_to_none=True)`` the next step writes into the same memory.
        """
        if self.grad_flat is None:
            self.grad_flat = torch.zeros_like(self.flat_shard)
        for i, off in zip(group.members, group.layout.offsets):
            sp, shard = self.params[i], self.shards[i]
            if not shard.requires_grad:
                continue
            piece = sp.user(reduced[off : off + sp.valid_rows * sp.inner].view(sp.shard_shape))
            if shard.grad is None:
                shard.grad = self.shard_view(self.grad_flat, sp)
                shard.grad.copy_(piece)
            else:
                shard.grad.add_(piece)
