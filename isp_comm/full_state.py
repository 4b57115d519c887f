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
from isp_comm.layout import Layout, ShardedParam, full_views, to_param_major
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
        one all-gather per dtype among ``shards``."""
        fulls: list[torch.Tensor | None] = [None] * len(shards)
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i, t in enumerate(shards):
            by_dtype.setdefault(t.dtype, []).append(i)
        w = unit.wp_size
        for dt, members in by_dtype.items():
            params = tuple(unit.params[i] for i in members)
            layout = Layout.packed(list(params), raw=False)
            flat = torch.zeros(layout.numel, dtype=dt, device=unit.device)
            for sp, off, i in zip(params, layout.offsets, members):
                sp.user(flat[off : off + sp.valid_rows * sp.inner].view(sp.shard_shape)).copy_(shards[i])
            rank_major = torch.empty(w * layout.numel, dtype=dt, device=unit.device)
            handle = self.backend.all_gather(rank_major, flat, self.groups.wp_group)
            self.ctx.record(handle, "all-gather", self.groups.wp_group, flat, unit.index, "outer")
            self.ctx.wait(handle, f"gather of block {unit.index}")
            slot = torch.empty_like(rank_major)
            to_param_major(rank_major, slot, layout, w)
            for view, i in zip(full_views(slot, params, layout, w), members):
                fulls[i] = view.contiguous()
        return fulls  # type: ignore[return-value]

    def shard_of(self, fqn: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's piece of a full tensor shaped like sharded parameter ``fqn``."""
        unit, sp = self.sharded[fqn]
        return sp.rows_of(full, unit.wp_rank)

    @torch.no_grad()
    def full_state_dict(self, cpu: bool = False, rank0_only: bool = False) -> dict[str, torch.Tensor]:
        """See :meth:`isp_comm.ISPCommunicator.full_state_dict`."""
        keep = not rank0_only or self.groups.rank == 0

        def out(t: torch.Tensor) -> torch.Tensor:
            return t.to("cpu") if cpu and t.device.type != "cpu" else t

        own = self.model.state_dict()
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
                unit.shard_view(unit.flat_shard, sp).copy_(self.shard_of(key, src))
            else:
                if src.shape != target.shape:
                    raise ValueError(f"{key}: expected shape {tuple(target.shape)}, got {tuple(src.shape)}")
                target.copy_(src)
