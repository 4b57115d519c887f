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

* The all-gather output is *rank-major*: ``[rank 0's flat shard | rank 1's | ...]``.
* A gathered *slot* is *param-major*: parameter ``p`` occupies
  ``[wp * off_p, wp * (off_p + n_p))`` as its padded full tensor, so the module's
  weight is a plain contiguous view of the slot. Rank-major to param-major is one
  ``split_with_sizes_copy``; gradients go the other way with one ``_chunk_cat``.
"""

from __future__ import annotations

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
    offset: int  # start in the flat shard
    dim: int = 0  # the dim split over ranks (0, or 1 for a 2-D parameter)

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
    ) -> None:
        """``owners``: (fqn prefix, module) whose direct parameters called ``names``
        (all of them when ``None``) are sharded. A parameter owned by several modules
        (tied weights) is sharded once and appears in every owner. Parameters whose
        ``id`` is in ``dim1`` are split along dim 1, the rest along dim 0."""
        self.index = index
        self.block = block
        self.wp_size = wp_size
        self.wp_rank = wp_rank
        self.replicated = replicated
        layouts: list[ShardedParam] = []
        full: list[torch.Tensor] = []
        self.aliases: list[tuple[nn.Module, str, int, str]] = []  # (module, name, index in params, fqn)
        seen: dict[int, int] = {}
        offset = 0
        for fqn_prefix, module in owners:
            for name, p in list(module._parameters.items()):
                if p is None or (names is not None and name not in names):
                    continue
                if id(p) in seen:
                    fqn = f"{fqn_prefix}.{name}" if fqn_prefix else name
                    self.aliases.append((module, name, seen[id(p)], fqn))
                    continue
                if p.dim() == 0:
                    raise ValueError(f"{fqn_prefix}.{name}: a 0-dim parameter cannot be sharded")
                dim = 1 if id(p) in dim1 else 0
                assert dim == 0 or p.dim() == 2, "only 2-D parameters are split along dim 1"
                out = p.shape[dim]
                chunk = -(-out // wp_size)
                valid = max(0, min(chunk, out - wp_rank * chunk))
                fqn = f"{fqn_prefix}.{name}" if fqn_prefix else name
                sp = ShardedParam(module, name, fqn, p.shape, chunk, valid, offset, dim)
                seen[id(p)] = len(layouts)
                layouts.append(sp)
                full.append(p)
                offset += sp.shard_numel
        self.params = tuple(layouts)
        self.shard_numel = offset
        dtypes = {p.dtype for p in full}
        if len(dtypes) != 1:
            raise ValueError(f"block {index} mixes parameter dtypes {sorted(map(str, dtypes))}")
        self.dtype = dtypes.pop()
        self.device = device
        self.requires_grad = any(p.requires_grad for p in full)
        self.flat_shard = torch.zeros(offset, dtype=self.dtype, device=self.device)
        self.shards: tuple[nn.Parameter, ...] = ()
        self._install_shards()
        self.grad_flat: torch.Tensor | None = None

    # ---- construction -------------------------------------------------------------
    def _install_shards(self) -> None:
        """Copy this rank's rows into the flat shard and register shard parameters.

        A linear still on the meta device is materialised alone (``reset_parameters``)
        just before its rows are taken, so at most one full linear exists at a time."""
        shards = []
        for sp in self.params:
            p = sp.module._parameters[sp.name]  # a meta bias is real once its weight was
            if p.device.type == "meta":
                sp.module.to_empty(device=self.device, recurse=False)
                if hasattr(sp.module, "reset_parameters"):
                    sp.module.reset_parameters()
                else:  # no initialiser: zeros until load_full_state_dict
                    with torch.no_grad():
                        for q in sp.module.parameters(recurse=False):
                            q.zero_()
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
        """``sp``'s piece of a flat shard, in the parameter's own shape."""
        return sp.user(flat[sp.offset : sp.offset + sp.valid_rows * sp.inner].view(sp.shard_shape))

    # ---- gathered layout ------------------------------------------------------------
    @property
    def gathered_numel(self) -> int:
        return self.wp_size * self.shard_numel

    def copy_out(self, rank_major: torch.Tensor, slot: torch.Tensor) -> None:
        """Rank-major all-gather output -> param-major slot (see the layouts note)."""
        w = self.wp_size
        outs = [slot[w * sp.offset : w * (sp.offset + sp.shard_numel)].view(w, -1) for sp in self.params]
        torch.split_with_sizes_copy(
            rank_major[: self.gathered_numel].view(w, self.shard_numel),
            [sp.shard_numel for sp in self.params],
            dim=1,
            out=outs,
        )

    def full_views(self, slot: torch.Tensor) -> list[torch.Tensor]:
        """The unpadded full parameters as views of a param-major slot."""
        w = self.wp_size
        return [sp.user(slot[w * sp.offset : w * sp.offset + sp.full_numel].view(sp.rows_shape)) for sp in self.params]

    def pack_grads(self, grads: tuple[torch.Tensor | None, ...], out: torch.Tensor) -> None:
        """Full gradients -> rank-major reduce-scatter input (padding rows zero)."""
        filled = [
            g if g is not None else torch.zeros(sp.shape, dtype=out.dtype, device=out.device)
            for g, sp in zip(grads, self.params)
        ]
        flat_2d = [sp.user(g).reshape(sp.rows_shape[0], -1) for g, sp in zip(filled, self.params)]
        torch._chunk_cat(flat_2d, dim=0, num_chunks=self.wp_size, out=out[: self.gathered_numel].view(self.wp_size, -1))

    def param_major_slices(self, buf: torch.Tensor) -> list[tuple[torch.Tensor, slice]]:
        """Per parameter: its padded full region of a param-major buffer, and the slice
        of the flat shard it gathers from / reduces into (``comm_granularity="module"``:
        an all-gather of that slice of every rank lands exactly on the region)."""
        w = self.wp_size
        return [
            (buf[w * sp.offset : w * (sp.offset + sp.shard_numel)], slice(sp.offset, sp.offset + sp.shard_numel))
            for sp in self.params
        ]

    def pack_grads_param_major(self, grads: tuple[torch.Tensor | None, ...], out: torch.Tensor) -> None:
        """Full gradients -> param-major reduce-scatter input (padding rows zero)."""
        for (region, _), g, sp in zip(self.param_major_slices(out), grads, self.params):
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

    def accumulate_grad(self, reduced: torch.Tensor) -> None:
        """Add a reduced flat gradient shard into the shard parameters' ``.grad``.

        [Note: grad aliasing] A shard's ``.grad`` is a view of ``grad_flat`` (one
        buffer per block, allocated once), so after ``zero_grad(set_to_none=True)`` the
        next step writes into the same memory.
        """
        if self.grad_flat is None:
            self.grad_flat = torch.zeros_like(self.flat_shard)
        for sp, shard in zip(self.params, self.shards):
            if not shard.requires_grad:
                continue
            piece = self.shard_view(reduced, sp)
            if shard.grad is None:
                shard.grad = self.shard_view(self.grad_flat, sp)
                shard.grad.copy_(piece)
            else:
                shard.grad.add_(piece)
