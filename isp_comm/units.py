"""What binds a layout to modules: a unit's shard parameters, swapped for gathered
views during compute, and their gradients.

See :mod:`isp_comm.layout` for where each parameter's bytes live ([Note: layouts]).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from isp_comm.layout import BlockLayout, Layout, ReduceGroup, ShardedParam


@dataclass(frozen=True)
class ReplicatedParam:
    """A parameter inside a block that stays whole on every rank (e.g. a norm weight),
    named by its module and attribute: the parameter object itself may be replaced
    later (materialising a meta-built module gives it a new one), so none is kept."""

    module: nn.Module
    name: str


def find_sharded(
    owners: list[tuple[str, nn.Module]],
    names: tuple[str, ...] | None,
    dim1: frozenset[int],
    wp_size: int,
    wp_rank: int,
) -> tuple[list[ShardedParam], list[tuple[nn.Module, str, int, str]]]:
    """The parameters of ``owners`` that one unit shards, each with its rows on
    ``wp_rank`` (offsets not yet set), and the aliases of tied ones: ``(module, name,
    index in found, fqn)``. See :class:`BlockUnit` for the arguments."""
    found: list[ShardedParam] = []
    alias_of: list[tuple[nn.Module, str, int, str]] = []
    seen: dict[int, int] = {}
    for fqn, module, name, p in owned_params(owners, names):
        if id(p) in seen:
            alias_of.append((module, name, seen[id(p)], fqn))
            continue
        if p.dim() == 0:
            raise ValueError(f"{fqn}: a 0-dim parameter cannot be sharded")
        dim = 1 if id(p) in dim1 else 0
        assert dim == 0 or p.dim() == 2, "only 2-D parameters are split along dim 1"
        out = p.shape[dim]
        chunk = -(-out // wp_size)
        start = min(wp_rank * chunk, out)
        seen[id(p)] = len(found)
        found.append(ShardedParam(module, name, fqn, p.shape, chunk, min(chunk, out - start), 0, dim, p.dtype, start))
    return found, alias_of


def owned_params(
    owners: list[tuple[str, nn.Module]], names: tuple[str, ...] | None
) -> Iterator[tuple[str, nn.Module, str, nn.Parameter]]:
    """``(fqn, module, name, parameter)`` for each direct parameter of ``owners``
    called ``names`` (any, for ``None``): what one unit shards, tied ones each time."""
    for fqn_prefix, module in owners:
        for name, p in list(module._parameters.items()):
            if p is not None and (names is None or name in names):
                yield (f"{fqn_prefix}.{name}" if fqn_prefix else name), module, name, p


class BlockUnit(BlockLayout):
    """One transformer block's sharded parameters: the unit of gather and reduce-scatter.

    ``flat_shard`` is the WP shard every gather reads; ``master`` what the shard
    parameters (``shards``) are views of: the flat shard, or, with pieces, a buffer
    of this rank's pieces apart from it (see [Note: pieces])."""

    def __init__(
        self,
        index: int,
        block: nn.Module,
        owners: list[tuple[str, nn.Module]],
        replicated: list[ReplicatedParam],
        wp_size: int,
        wp_rank: int,
        device: torch.device,
        materialize: Callable[[nn.Module, str], None],
        names: tuple[str, ...] | None = ("weight", "bias"),
        dim1: frozenset[int] = frozenset(),
        param_dtype: torch.dtype | None = None,
        reduce_dtype: torch.dtype | None = None,
        replicas: tuple[int, int] = (1, 0),
    ) -> None:
        """``owners``: (fqn prefix, module) whose direct parameters called ``names``
        (all of them when ``None``) are sharded. ``materialize(module, fqn)`` turns a
        module still on the meta device into a real, initialised one. A parameter
        owned by several modules (tied weights) is sharded once and appears in every
        owner. Parameters whose ``id`` is in ``dim1`` are split along dim 1, the rest
        along dim 0. ``param_dtype`` / ``reduce_dtype``: the dtypes of gathering and of
        gradient reduction (``None``: the parameters' own). ``replicas``: (size, rank)
        of the replica group the parameters are split over again (see [Note: pieces])."""
        self.index, self.block, self.replicated = index, block, replicated
        found, alias_of = find_sharded(owners, names, dim1, wp_size, wp_rank)
        super().__init__(found, wp_size, wp_rank, param_dtype, reduce_dtype, *replicas)
        if self.order is not None:
            position = {old: new for new, old in enumerate(self.order)}
            alias_of = [(m, n, position[i], f) for m, n, i, f in alias_of]
        self.aliases = alias_of
        self.device = device
        self._install_shards(materialize)
        self._trainable: tuple[bool, ...] = ()
        self.groups: tuple[ReduceGroup, ...] = ()
        self.whole_group: ReduceGroup | None = None
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
            self.groups = self.reduce_groups(now)
            self.whole_group = self._whole_group(self.groups)

    # ---- construction -------------------------------------------------------------
    def _install_shards(self, materialize: Callable[[nn.Module, str], None]) -> None:
        """Copy this rank's rows into the flat shard (and its pieces into the masters)
        and register shard parameters: views of ``master``, which is the flat shard
        itself unless the unit has pieces (see [Note: pieces]).

        A module still on the meta device is materialised alone just before its rows
        are taken, so at most one full module exists at a time."""
        self.flat_shard = torch.zeros(self.store.numel, dtype=self.dtype, device=self.device)
        self.master = self.flat_shard
        if self.replicas > 1:
            self.master = torch.zeros(self.master_store.numel, dtype=self.master_dtype, device=self.device)
        shards = []
        for sp, pc in zip(self.params, self.pieces):
            p = sp.module._parameters[sp.name]  # a meta bias is real once its weight was
            if p.device.type == "meta":
                materialize(sp.module, sp.fqn[: -len(sp.name)].rstrip("."))
                p = sp.module._parameters[sp.name]
            view = self.shard_view(self.master, pc)
            with torch.no_grad():
                view.copy_(pc.rows(p.detach()))
                if self.master is not self.flat_shard:  # the WP rows too, in the gather dtype
                    self.shard_view(self.flat_shard, sp).copy_(sp.rows(p.detach()))
            shard = nn.Parameter(view, requires_grad=p.requires_grad)
            sp.module._parameters[sp.name] = shard
            shards.append(shard)
        self.shards = tuple(shards)
        self._homes = self._offsets()
        for module, name, i, _ in self.aliases:
            module._parameters[name] = shards[i]

    def _offsets(self) -> tuple[int, ...]:
        """Where each shard parameter starts in the master, in bytes (see ``reclaim``)."""
        return tuple(s.data_ptr() - self.master.data_ptr() for s in self.shards)

    def reclaim(self) -> list[nn.Parameter]:
        """The shard parameters re-pointed since the last look, each copied back into
        its place and pointed at it again.

        [Note: re-pointed parameters] The gathers read the master (or the flat shard
        built from it), which the shard parameters are views of. ``p.data = t`` (as
        ``torch.nn.utils.vector_to_parameters`` and peft's safe merge do) points a
        parameter elsewhere: the optimizer and the state dicts would follow it while
        the gathers kept the old bytes. The engine looks at each forward: same shape,
        dtype and device, ``t``'s values are copied home; anything else (``model.to(
        torch.bfloat16)`` after wrapping) is refused, since the shard's layout is fixed
        at wrap. One pointer compared per shard when nothing moved, as an offset into
        the master, whose storage may itself move in place (``share_memory_()``)."""
        moved = []
        for i, (pc, shard) in enumerate(zip(self.pieces, self.shards)):
            if shard.data_ptr() - self.master.data_ptr() == self._homes[i]:
                continue
            home = self.shard_view(self.master, pc)
            new = shard.data
            if (new.shape, new.dtype, new.device) != (home.shape, home.dtype, home.device):
                raise ValueError(
                    f"parameter {self.params[i].fqn} was re-pointed after wrapping to a {new.dtype} tensor of "
                    f"shape {tuple(new.shape)} on {new.device}; its shard is {home.dtype} {tuple(home.shape)} on "
                    f"{home.device}: write into it instead (under no_grad: p.copy_(t)), or convert the model "
                    "before wrapping"
                )
            with torch.no_grad():
                home.copy_(new)
            shard.data = home
            moved.append(shard)
        return moved

    def move_shard(self, buffer: torch.Tensor) -> None:
        """Keep the flat shard in ``buffer`` (its numel and dtype; e.g. a symmetric one
        that a gather reads without a copy): the same shard parameters, now views of
        it. Before the optimizer is made (it keeps the parameters, not their storage)."""
        with torch.no_grad():
            buffer.copy_(self.flat_shard)
        if self.master is self.flat_shard:
            for pc, shard in zip(self.pieces, self.shards):
                shard.data = self.shard_view(buffer, pc)
            self.master = buffer
            self._homes = self._offsets()
        self.flat_shard = buffer

    def fill_send(self, send: torch.Tensor) -> None:
        """This rank's shard, in the gather dtype and layout (when it is not the flat
        shard itself); padding rows stay zero."""
        self._cast_into(send, self.gather, self.flat_shard, self.params)

    def fill_piece_send(self, send: torch.Tensor) -> None:
        """This rank's pieces (the masters), in the gather dtype and ``piece_gather``
        layout: what a replica all-gather sends (see [Note: pieces])."""
        self._cast_into(send, self.piece_gather, self.master, self.pieces)

    def _cast_into(
        self, dst: torch.Tensor, layout: Layout, src: torch.Tensor, params: tuple[ShardedParam, ...]
    ) -> None:
        if not self.mixed or dst.dtype == src.dtype:  # one copy (a cast when dtypes differ)
            dst.copy_(src)
            return
        for sp, off, size in zip(params, layout.offsets, layout.sizes):
            nbytes = sp.shard_numel * sp.dtype.itemsize
            dst[off : off + size].copy_(src[sp.offset : sp.offset + nbytes].view(sp.dtype))

    # ---- module attributes ------------------------------------------------------------
    def swap_in(self, tensors: list[torch.Tensor]) -> None:
        for sp, t in zip(self.params, tensors):
            if sp.name not in sp.module._parameters:
                _moved(sp)
            sp.module._parameters[sp.name] = t
        for module, name, i, _ in self.aliases:
            module._parameters[name] = tensors[i]

    def swap_out(self) -> None:
        for sp, shard in zip(self.params, self.shards):
            sp.module._parameters[sp.name] = shard
        for module, name, i, _ in self.aliases:
            module._parameters[name] = self.shards[i]

    def _whole_group(self, groups: tuple[ReduceGroup, ...]) -> ReduceGroup | None:
        """The reduce group laid out exactly like the flat shard (every parameter
        trainable, in the shard's own dtype), if there is one: its ``.grad`` of all shards
        is then one buffer, written by one copy or add. Decided when the groups are."""
        if self.mixed or len(groups) != 1:
            return None
        (group,) = groups
        same = group.dtype == self.master_dtype and group.piece.offsets == self.master_store.offsets
        return group if same and len(group.members) == len(self.params) else None

    def accumulate_grad(self, reduced: torch.Tensor, group: ReduceGroup) -> None:
        """Add ``group``'s reduced gradient shard into the shard parameters' ``.grad``.

        [Note: grad aliasing] A shard's ``.grad`` is a view of one flat buffer per block,
        laid out like the flat shard, so the whole block's gradient is written by one
        copy and the optimizer reads it in place. The unit keeps no reference to that
        buffer: the ``.grad`` views do. ``zero_grad(set_to_none=True)`` therefore frees
        it, as it frees FSDP2's sharded gradients, and the next backward allocates a new
        one as the block's gradient arrives; a gradient shard costs memory only from its
        block's backward to ``zero_grad``, never during the forward.
        """
        flat = self._grad_buffer()
        if group is self.whole_group and all(s.requires_grad for s in self.shards):  # one kernel for the block
            fresh = [s for s in self.shards if s.grad is None]
            if len(fresh) == len(self.shards):
                for pc, shard in zip(self.pieces, self.shards):
                    shard.grad = self.shard_view(flat, pc)
                flat.copy_(reduced[: flat.numel()])
                return
            if not fresh and all(s.grad._base is flat for s in self.shards):  # still our views
                flat.add_(reduced[: flat.numel()])
                return
        for i, off in zip(group.members, group.piece.offsets):
            sp, shard = self.pieces[i], self.shards[i]
            if not shard.requires_grad:
                continue
            piece = sp.user(reduced[off : off + sp.valid_rows * sp.inner].view(sp.shard_shape))
            if shard.grad is None:
                shard.grad = self.shard_view(flat, sp)
                shard.grad.copy_(piece)
            else:
                shard.grad.add_(piece)

    def _grad_buffer(self) -> torch.Tensor:
        """The flat buffer the shards' ``.grad`` are views of (see [Note: grad
        aliasing]): the one a shard's ``.grad`` still views, else a new one (not
        zeroed: every piece is written before its ``.grad`` view is set)."""
        for s in self.shards:
            base = None if s.grad is None else s.grad._base
            if base is not None and base.shape == self.master.shape and base.dtype == self.master.dtype:
                return base
        return torch.empty_like(self.master)


def _moved(sp: ShardedParam) -> None:
    """A block's parameter that is no longer its module's: ``torch.nn.utils.parametrize``
    (weight norm, spectral norm) moved it into the parametrization after wrapping, which
    then computes from the shard (a shape error deep in the block, or at wp 1 a
    gradient no reduction sees)."""
    raise RuntimeError(
        f"isp-comm: {sp.fqn} is no longer a parameter of its module: a parametrization (torch.nn.utils."
        "parametrize, weight_norm, spectral_norm) registered after wrapping moved it, and would compute from "
        "this rank's shard; register it before wrapping (its original tensor then stays whole) or not at all"
    )
