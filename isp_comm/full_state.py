"""Full (unsharded) tensors of a wrapped model: gathered for export, scattered on load.

Where :mod:`isp_comm.state` hands out the shards as DTensors and never gathers, this
module is the other face: :meth:`FullState.full_state_dict` all-gathers each unit's
shards over its WP group (the model's original keys and shapes, no padding), and
:meth:`FullState.load_full_state_dict` copies each rank's rows out of full tensors.
The communicator's methods of the same names delegate here.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from isp_comm.backends import Backend
from isp_comm.context import CommContext
from isp_comm.groups import ParallelGroups
from isp_comm.layout import Layout, ShardedParam, full_views, to_param_major, unpack_replicas
from isp_comm.units import BlockUnit


class FullState:
    """Gathers and scatters full tensors of ``model``. ``sharded`` maps every sharded
    parameter's FQN (tied aliases included) to its unit and layout; ``units`` are the
    units owning shards, each shard once."""

    def __init__(
        self,
        model: nn.Module,
        groups: ParallelGroups,
        sharded: Mapping[str, tuple[BlockUnit, ShardedParam]],
        units: list[BlockUnit],
        backend: Backend,
        ctx: CommContext,
    ) -> None:
        self.model, self.groups, self.sharded, self.units = model, groups, sharded, units
        self.backend, self.ctx = backend, ctx

    @torch.no_grad()
    def gather_full(self, unit: BlockUnit, shards: list[torch.Tensor]) -> list[torch.Tensor]:
        """Full tensors from per-parameter shard-shaped tensors of ``unit`` (e.g. the
        shards themselves, or optimizer states shaped like them). Collective over WP:
        one all-gather per dtype among ``shards``; when they are pieces, one over the
        replicas first (see [Note: pieces] in ``isp_comm/layout.py``)."""
        if unit.replicas > 1:
            shards = self._gather_replicas(unit, shards)
        fulls: list[torch.Tensor | None] = [None] * len(shards)
        by_dtype = _by_dtype(shards)
        w = unit.wp_size
        for members in by_dtype.values():
            params = tuple(unit.params[i] for i in members)
            layout, rank_major = self._gather_packed(
                unit, params, [shards[i] for i in members], self.groups.wp_group, w
            )
            slot = torch.empty_like(rank_major)
            to_param_major(rank_major, slot, layout, w)
            for view, i in zip(full_views(slot, params, layout, w), members):
                fulls[i] = view.contiguous()
        return fulls  # type: ignore[return-value]

    def _gather_replicas(self, unit: BlockUnit, pieces: list[torch.Tensor]) -> list[torch.Tensor]:
        """This rank's WP rows of each parameter from every replica's piece-shaped
        tensors: one all-gather over the replica group per dtype among ``pieces``."""
        rows: list[torch.Tensor | None] = [None] * len(pieces)
        r = unit.replicas
        for dt, members in _by_dtype(pieces).items():
            mine = [unit.pieces[i] for i in members]
            wp_rows = [unit.params[i] for i in members]
            src, landing = self._gather_packed(unit, mine, [pieces[i] for i in members], self.groups.replica_group, r)
            dst = Layout.packed(wp_rows, raw=False)
            out = torch.zeros(dst.numel, dtype=dt, device=unit.device)
            sizes = [(pc.chunk_rows, sp.valid_rows) for pc, sp in zip(mine, wp_rows)]
            unpack_replicas(landing, src, out, dst.offsets, sizes, r)
            for sp, off, i in zip(wp_rows, dst.offsets, members):
                rows[i] = sp.user(out[off : off + sp.valid_rows * sp.inner].view(sp.shard_shape))
        return rows  # type: ignore[return-value]

    def _gather_packed(
        self, unit: BlockUnit, params: list[ShardedParam] | tuple[ShardedParam, ...], tensors: list[torch.Tensor],
        group, ways: int,
    ) -> tuple[Layout, torch.Tensor]:  # fmt: skip
        """``tensors`` (each the rows of one of ``params``, all of one dtype) packed as a
        flat shard of ``params`` and all-gathered over ``group`` of ``ways`` ranks:
        the packing's layout and the rank-major output."""
        layout = Layout.packed(list(params), raw=False)
        flat = torch.zeros(layout.numel, dtype=tensors[0].dtype, device=unit.device)
        for sp, off, t in zip(params, layout.offsets, tensors):
            sp.user(flat[off : off + sp.valid_rows * sp.inner].view(sp.shard_shape)).copy_(t)
        out = torch.empty(ways * layout.numel, dtype=flat.dtype, device=unit.device)
        handle = self.backend.all_gather(out, flat, group)
        self.ctx.record(handle, "all-gather", group, flat, unit.index, "full state")
        self.ctx.wait(handle, f"gather of block {unit.index}")
        return layout, out

    def shard_of(self, fqn: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's part (its shard, or its piece) of a full tensor shaped like
        sharded parameter ``fqn``."""
        _, sp = self.sharded[fqn]
        return sp.rows(full)

    @torch.no_grad()
    def full_state_dict(self, cpu: bool = False, rank0_only: bool = False) -> dict[str, torch.Tensor]:
        """See :meth:`isp_comm.ISPCommunicator.full_state_dict`."""
        keep = not rank0_only or self.groups.rank == 0

        def out(t: torch.Tensor) -> torch.Tensor:
            return t.to("cpu") if cpu and t.device.type != "cpu" else t

        own = self.model.state_dict(keep_vars=True)  # the live tensors: the sharded ones stay plain
        sd = {k: out(v).clone() for k, v in own.items() if k not in self.sharded and keep}
        for unit in self.units:
            fulls = self.gather_full(unit, list(unit.shards))
            if not keep:
                continue
            fulls = [out(f) for f in fulls]
            for sp, full in zip(unit.params, fulls):
                sd[sp.fqn] = full
            for _, _, i, fqn in unit.aliases:
                sd[fqn] = fulls[i]
        return {k: sd[k] for k in own if k in sd}

    @torch.no_grad()
    def load_full_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """See :meth:`isp_comm.ISPCommunicator.load_full_state_dict`."""
        sharded = self.sharded
        own = self.model.state_dict(keep_vars=True)
        missing = [k for k in own if k not in state_dict]
        if missing:
            raise ValueError(f"state dict lacks {len(missing)} keys, e.g. {missing[:3]}")
        for key, target in own.items():
            src = state_dict[key]
            if key in sharded:
                unit, sp = sharded[key]
                if tuple(src.shape) != tuple(sp.shape):
                    raise ValueError(f"{key}: expected shape {tuple(sp.shape)}, got {tuple(src.shape)}")
                unit.shard_view(unit.master, sp).copy_(self.shard_of(key, src))
            else:
                if src.shape != target.shape:
                    raise ValueError(f"{key}: expected shape {tuple(target.shape)}, got {tuple(src.shape)}")
                target.copy_(src)


def _by_dtype(tensors: list[torch.Tensor]) -> dict[torch.dtype, list[int]]:
    """Indices of ``tensors`` by dtype, in order."""
    out: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        out.setdefault(t.dtype, []).append(i)
    return out
