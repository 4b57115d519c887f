"""Sharded state: parameters and optimizer states as DTensors, and the global gradient norm.

The engine trains on plain tensors: every sharded parameter is this rank's rows, a
view of its block's flat shard (see :mod:`isp_comm.units`). Around training (clipping,
checkpoints, resume) the rest of PyTorch wants to know what those rows are *of*. This
module answers with DTensors built on the same memory, never with the full tensors.

[Note: the mesh]
The world is laid out as a 2-D ``DeviceMesh`` ``("replica", "wp")`` of shape
``(world / wp, wp)``: row ``k`` is WP group ``k`` (ranks ``k*wp ... k*wp + wp - 1``)
and column ``j`` the replica group of WP rank ``j``, so the mesh is built from the
:class:`~isp_comm.groups.ParallelGroups`' own process groups (no new groups). A
sharded parameter is ``[Replicate(), Shard(d)]`` with ``d`` its split dim (0, or 1 for
an embedding split along its hidden dim). The engine's chunks (``ceil(n / wp)`` rows
per rank, the last ones short or empty) are exactly DTensor's uneven ``Shard``
chunks, so the local tensor is the shard itself: no copy, no padding rows.
With ``state_sharding="world"`` a parameter is its rank's piece (see [Note: pieces]
in ``isp_comm/layout.py``): ``[Shard(d), Shard(d)]`` on the same groups laid out
``("wp", "replica")`` (the transpose), so that DTensor splits over WP first and then
each WP shard over its replicas, exactly as the pieces are cut.

[Note: aliasing]
``state_dict()`` and ``optimizer_state_dict()`` hand out DTensors whose local tensors
*are* the parameters' shards and the optimizer's state tensors. ``dcp.load`` into
them writes straight into the live model and optimizer; the ``load_*`` calls then
copy each tensor onto itself, which is harmless, and are what makes loading from any
other dict (full tensors, another run's DTensors) work.
"""

from __future__ import annotations

import math
import sys
import weakref
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from isp_comm.collectives import StepCollectives
from isp_comm.groups import ParallelGroups
from isp_comm.layout import ShardedParam
from isp_comm.units import BlockUnit

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor

# DTensor is imported where a state dict is asked for, not with the package: the import
# costs every process about 0.7 s of CPU (sympy among others), and training needs none.


Names = tuple[tuple[str, str], ...]
"""A module's own names of its sharded parameters, each with its FQN in the model."""


def own_storage(t: torch.Tensor) -> torch.Tensor:
    """``t``'s memory under a storage of its own (DLPack: no copy, ``t``'s buffer kept
    alive).

    [Note: one storage per state-dict tensor] A shard is a view of its block's flat
    buffer, and every shard of a block shares that buffer's storage. DCP's stager
    (``dcp.async_save``) copies whole storages and caches them by storage object,
    which fails on such views ("invalid python storage") and would copy the whole
    flat buffer for each of them. Handed out with storages of their own, the state
    dict's tensors stage like FSDP2's: only their bytes, and ``dcp.load`` still
    writes straight into the live shards."""
    return torch.from_dlpack(t.detach())


def _never_stepped(state: Mapping[str, Any]) -> bool:
    """Whether an optimizer state's count says it has taken no step (SGD's has none)."""
    step = state.get("step")
    return step is not None and float(step) == 0


class MadeStates:
    """States an optimizer was given for a checkpoint, until its first step.

    [Note: states made for a checkpoint]
    torch's optimizers make each state in their first step, from that step's gradient
    and the group's settings, and update it in the same step. A checkpoint needs the
    states before that: as what ``dcp.load`` fills, or to save before the first step,
    or for a parameter that has had no gradient yet in a stepped optimizer (a block a
    forward skipped, a head not trained yet), whose state a fresh optimizer's load asks
    for. One step at learning rate 0 on zero gradients of those parameters alone makes
    them (what ``torch.distributed.checkpoint.state_dict`` does for a fresh
    optimizer, and leaves out for the others), but what that step wrote is not
    a fresh optimizer's state: NAdam's ``mu_product`` has moved, ASGD's ``eta`` and
    Rprop's step sizes were taken from lr 0, SGD's momentum buffer exists (so its
    dampening applies to the first step) and, like Adam's moments under L2 decay,
    holds weight decay's term. So such states live only until the optimizer's first
    step: a pre-hook then drops them, and the step makes them as a fresh optimizer
    would. A state that ``dcp.load`` has written into since is kept (its tensors'
    version counters moved: nothing is read from the device in the step). After
    ``load_optimizer_state_dict`` the states are a checkpoint's; those whose count is 0
    (saved before any step) are dropped too, which the load reads off (outside a
    step). SGD's momentum has no count: loaded from a checkpoint saved before the first
    step, it stays (docs/state.md)."""

    def __init__(self, opt: torch.optim.Optimizer, marks: dict[int, list[tuple[weakref.ref, int]] | None]) -> None:
        self._marks = marks
        """Per parameter id: ``None`` (drop it), or the made tensors and their versions
        (drop it if they are still those, unwritten)."""
        self._handle = opt.register_step_pre_hook(self._first_step)

    @staticmethod
    def marks(
        opt: torch.optim.Optimizer, loaded: bool, made: list[torch.Tensor] | None
    ) -> dict[int, list[tuple[weakref.ref, int]] | None]:
        """What to drop at the first step: the states loaded that never stepped, or
        the states made for the parameters ``made``, unless written since."""
        if loaded:
            return {id(p): None for p, st in opt.state.items() if _never_stepped(st)}
        return {id(p): [(weakref.ref(t), t._version) for t in _tensors(opt.state[p])] for p in made or ()}

    def pending(self) -> dict[int, list[tuple[weakref.ref, int]] | None]:
        """The marks still awaiting the first step (none once it was taken)."""
        return dict(self._marks)

    def cancel(self) -> None:
        self._handle.remove()

    def _first_step(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self._handle.remove()
        marks_of, self._marks = self._marks, {}
        for p, st in list(opt.state.items()):
            marks = marks_of.get(id(p), [])
            now = _tensors(st)
            made = marks is not None and len(marks) == len(now) > 0
            if marks is None or (made and _unwritten(now, marks)):
                del opt.state[p]


def _tensors(state: Mapping[str, Any]) -> list[torch.Tensor]:
    return [v for v in state.values() if torch.is_tensor(v)]


def _unwritten(now: list[torch.Tensor], marks: list[tuple[weakref.ref, int]]) -> bool:
    """Whether ``now`` are still the tensors made, none written since."""
    return all(r() is t and t._version == v for t, (r, v) in zip(now, marks))


def _contiguous_stride(shape: torch.Size) -> tuple[int, ...]:
    stride, acc = [], 1
    for n in reversed(shape):
        stride.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(stride))


class ShardedState:
    """The sharded view of a wrapped model: state dicts, optimizer state dicts, norms.

    ``sharded`` maps every sharded parameter's FQN (tied aliases included) to its unit
    and layout; ``units`` are the units owning shards (each shard once)."""

    def __init__(
        self,
        model: nn.Module,
        groups: ParallelGroups,
        sharded: Mapping[str, tuple[BlockUnit, ShardedParam]],
        units: list[BlockUnit],
        device: torch.device,
        collectives: StepCollectives,
    ) -> None:
        self.model, self.groups, self.sharded, self.units = model, groups, sharded, units
        self.device, self.collectives = device, collectives
        self._mesh: DeviceMesh | None = None
        self._piece_mesh: DeviceMesh | None = None
        self.pieces = any(u.replicas > 1 for u in units)
        """Whether the parameters are pieces (``state_sharding="world"`` with replicas)."""
        self._made: weakref.WeakKeyDictionary[torch.optim.Optimizer, MadeStates] = weakref.WeakKeyDictionary()
        """Optimizers whose states await their first step ([Note: states made for a checkpoint])."""
        self.making_states = False
        """Inside the step at learning rate 0 that makes a fresh optimizer's states: not a
        training step (its zero gradients are no backward's)."""
        self._hooked: weakref.WeakKeyDictionary[torch.optim.Optimizer, list] = weakref.WeakKeyDictionary()
        """Optimizers whose own state dict is sharded, and their hooks' handles
        ([Note: the optimizer's own state dict])."""

    # ---- DTensor views -----------------------------------------------------------------
    @property
    def mesh(self) -> DeviceMesh:
        """The ``("replica", "wp")`` mesh of the note above, made on first use."""
        from torch.distributed.device_mesh import DeviceMesh

        if self._mesh is None:
            g = self.groups
            layout = torch.arange(g.world_size).view(g.replica_size, g.wp_size)
            self._mesh = DeviceMesh.from_group(
                [g.replica_group, g.wp_group], self.device.type, mesh=layout, mesh_dim_names=("replica", "wp")
            )
        return self._mesh

    @property
    def piece_mesh(self) -> DeviceMesh:
        """The ``("wp", "replica")`` mesh of the note above, made on first use."""
        from torch.distributed.device_mesh import DeviceMesh

        if self._piece_mesh is None:
            g = self.groups
            layout = torch.arange(g.world_size).view(g.replica_size, g.wp_size).t().contiguous()
            self._piece_mesh = DeviceMesh.from_group(
                [g.wp_group, g.replica_group], self.device.type, mesh=layout, mesh_dim_names=("wp", "replica")
            )
        return self._piece_mesh

    def placement(self, fqn: str) -> tuple[DeviceMesh, tuple]:
        """The mesh and placements of sharded parameter ``fqn``'s DTensors."""
        from torch.distributed.tensor import Replicate, Shard

        unit, sp = self.sharded[fqn]
        if unit.replicas > 1:
            return self.piece_mesh, (Shard(sp.dim), Shard(sp.dim))
        return self.mesh, (Replicate(), Shard(sp.dim))

    def as_dtensor(self, fqn: str, local: torch.Tensor) -> DTensor:
        """``local`` (this rank's rows of sharded parameter ``fqn``, or a tensor shaped
        like them) as a DTensor of the parameter's global shape, sharing memory."""
        from torch.distributed.tensor import DTensor

        _, sp = self.sharded[fqn]
        mesh, placements = self.placement(fqn)
        return DTensor.from_local(
            local, mesh, list(placements), run_check=False, shape=sp.shape, stride=_contiguous_stride(sp.shape)
        )

    def local_of(self, fqn: str, value: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """This rank's rows of ``value`` for sharded ``fqn``: the local tensor of a
        DTensor laid out like ours, else the rows of a full tensor (a DTensor laid out
        otherwise is made full first: one parameter at a time)."""
        from torch.distributed.tensor import DTensor

        _, sp = self.sharded[fqn]
        if isinstance(value, DTensor):
            if tuple(value.shape) != tuple(sp.shape):
                raise ValueError(f"{fqn}: expected global shape {tuple(sp.shape)}, got {tuple(value.shape)}")
            mine = (value.device_mesh, tuple(value.placements)) == self.placement(fqn)
            if mine and value.to_local().shape == like.shape:
                return value.to_local()
            value = value.full_tensor()
        if tuple(value.shape) == tuple(sp.shape):
            return sp.rows(value)
        raise ValueError(f"{fqn}: expected shape {tuple(sp.shape)} (or its shard), got {tuple(value.shape)}")

    # ---- model state ---------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Original FQNs; sharded parameters as DTensors on the live shards, everything
        else (replicated parameters, persistent buffers) as plain tensors: the model's
        own ``state_dict()``, whose post-hook is :meth:`as_dtensors` while wrapped."""
        return self.model.state_dict()

    def as_dtensors(self, state_dict: dict[str, Any], prefix: str, names: Names) -> list[torch.Tensor]:
        """A ``state_dict`` post-hook's work, on a module that owns sharded parameters
        (``names``: its own names of them, with their FQNs in the model): each one's
        entry (under ``prefix``, the module's place in the module asked) becomes a
        DTensor on this rank's live shard, as FSDP2's parameters are, so that DCP and
        torch's ``get_model_state_dict`` see what is sharded ([Note: the model's own
        state dict]); returns their local tensors. An entry that is the parameter itself
        (``keep_vars=True``) stays: the caller asked for the live objects."""
        from torch.distributed.tensor import DTensor

        handed = []
        for local, fqn in names:
            t = state_dict.get(prefix + local)
            if t is None or isinstance(t, nn.Parameter | DTensor):
                continue
            d = state_dict[prefix + local] = self.as_dtensor(fqn, own_storage(t))
            handed.append(d.to_local())
        return handed

    def as_local(self, state_dict: dict[str, Any], prefix: str, names: Names) -> None:
        """A ``load_state_dict`` pre-hook's work on such a module, the inverse of
        :meth:`as_dtensors`: each sharded parameter's DTensor, or full tensor, becomes
        this rank's rows, so that ``Module.load_state_dict`` copies into the shards as
        it copies into any parameter. A plain tensor of the shard's shape (a state dict
        of an earlier version's, which held the shards so) is this rank's rows already."""
        from torch.distributed.tensor import DTensor

        for local, fqn in names:
            value = state_dict.get(prefix + local)
            if value is None:
                continue
            shard = self.model.get_parameter(fqn)
            if isinstance(value, DTensor) or value.shape != shard.shape:
                state_dict[prefix + local] = self.local_of(fqn, value, shard)

    def whole_entries(self, state_dict: dict[str, Any], prefix: str) -> None:
        """The model's ``load_state_dict`` pre-hook: a DTensor given for a parameter or
        buffer that is not sharded here (another system's checkpoint) is made full."""
        from torch.distributed.tensor import DTensor

        for key, value in list(state_dict.items()):
            if isinstance(value, DTensor) and key.startswith(prefix) and key[len(prefix) :] not in self.sharded:
                state_dict[key] = value.full_tensor()

    @torch.no_grad()
    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Copy ``state_dict`` (ours, another run's after ``dcp.load``, or full tensors)
        into the shards and replicated tensors. Keys must match exactly."""
        from torch.distributed.tensor import DTensor

        own = self.model.state_dict(keep_vars=True)
        missing = sorted(own.keys() - state_dict.keys())
        unexpected = sorted(state_dict.keys() - own.keys())
        if missing or unexpected:
            raise ValueError(f"state dict mismatch: missing keys {missing}, unexpected keys {unexpected}")
        for fqn, target in own.items():
            value = state_dict[fqn]
            if fqn in self.sharded:
                value = self.local_of(fqn, value, target)
            elif isinstance(value, DTensor):
                value = value.full_tensor()
            if tuple(value.shape) != tuple(target.shape):
                raise ValueError(f"{fqn}: expected shape {tuple(target.shape)}, got {tuple(value.shape)}")
            target.detach().copy_(value)

    # ---- optimizer state -------------------------------------------------------------------
    def _names(self) -> dict[int, str]:
        """id(parameter) -> its FQN (the first, for tied parameters)."""
        return {id(p): n for n, p in reversed(list(self.model.named_parameters(remove_duplicate=False)))}

    @torch.no_grad()
    def _init_states(self, opt: torch.optim.Optimizer) -> None:
        """Give each parameter of ``opt`` that has no state yet (all of a fresh
        optimizer's; those a stepped one never had a gradient for) its states, with one
        step at learning rate 0 on zero gradients for them alone, so that ``dcp.load``
        finds every tensor to fill ([Note: states made for a checkpoint]). With lr 0 the
        step leaves the parameters bitwise as they were (weight decay too is scaled by
        lr), and the counts it made are put back to 0, as a checkpoint saved now must
        say; the other parameters' gradients are set aside for it."""
        params = [p for g in opt.param_groups for p in g["params"] if p.requires_grad]
        missing = [p for p in params if not opt.state.get(p)]
        if not missing:
            return
        fresh = len(missing) == len(params)
        if fresh and any(p.grad is not None for p in params):
            raise ValueError("optimizer_state_dict(): a fresh optimizer with gradients pending; call zero_grad() first")
        lrs = [g.get("lr") for g in opt.param_groups]
        grads = [p.grad for p in params]
        for g in opt.param_groups:
            if "lr" in g:
                g["lr"] = torch.zeros_like(g["lr"]) if torch.is_tensor(g["lr"]) else 0.0  # its dtype and device kept
        for p in params:
            p.grad = None
        for p in missing:
            p.grad = torch.zeros_like(p)
        try:
            self.making_states = True
            opt.step()
            for p in missing:
                if "step" in opt.state[p]:
                    step = opt.state[p]["step"]
                    opt.state[p]["step"] = step.zero_() if torch.is_tensor(step) else 0
            self._await_first_step(opt, loaded=False, made=missing)  # after it: for the first real one
        finally:
            self.making_states = False
            for g, lr in zip(opt.param_groups, lrs):
                if lr is not None:
                    g["lr"] = lr
            for p, grad in zip(params, grads):
                p.grad = grad

    def optimizer_state_dict(self, opt: torch.optim.Optimizer) -> dict[str, Any]:
        """``{"state": {fqn: {key: value}}, "param_groups": [{..., "params": [fqn]}]}``;
        a state tensor shaped like its sharded parameter is a DTensor like it."""
        self._init_states(opt)
        names = self._names()
        for g in opt.param_groups:
            unknown = [p for p in g["params"] if id(p) not in names]
            if unknown:
                raise ValueError(
                    f"the optimizer holds {len(unknown)} tensors that are not parameters of the wrapped model "
                    "(create it after wrapping, on model.parameters())"
                )
        state: dict[str, dict[str, Any]] = {}
        for p, st in opt.state.items():
            fqn = names[id(p)]
            state[fqn] = {k: self._state_value(fqn, k, p, v) for k, v in st.items()}
        groups = [
            {**{k: v for k, v in g.items() if k != "params"}, "params": [names[id(p)] for p in g["params"]]}
            for g in opt.param_groups
        ]
        return {"state": state, "param_groups": groups}

    def _state_value(self, fqn: str, key: str, p: torch.Tensor, v: Any) -> Any:
        if fqn not in self.sharded or not torch.is_tensor(v) or v.dim() == 0:
            return v
        if v.shape != p.shape:  # DCP would keep one rank's as everyone's, and loading would fail
            raise ValueError(
                f"optimizer state {key!r} of {fqn} has shape {tuple(v.shape)}, not its parameter's "
                f"{tuple(p.shape)} (this rank's shard): a state of another shape, as a factored "
                "optimizer's (Adafactor's row and column statistics), cannot be split with the shard"
            )
        return self.as_dtensor(fqn, v)

    def load_optimizer_state_dict(self, opt: torch.optim.Optimizer, osd: Mapping[str, Any]) -> None:
        """Load ``osd`` (from :meth:`optimizer_state_dict`, here or in a run of another
        WP size after ``dcp.load``) into ``opt``: each state tensor of a sharded
        parameter becomes this rank's rows."""
        names = self._names()
        params = {n: p for n, p in self.model.named_parameters(remove_duplicate=False)}
        if len(osd["param_groups"]) != len(opt.param_groups):
            raise ValueError(
                f"optimizer has {len(opt.param_groups)} param groups, the state dict {len(osd['param_groups'])}"
            )
        index: dict[str, int] = {}
        groups = []
        for i, (g, saved) in enumerate(zip(opt.param_groups, osd["param_groups"])):
            mine = [names[id(p)] for p in g["params"]]
            if list(saved["params"]) != mine:
                raise ValueError(f"param group {i}: {_differ(list(saved['params']), mine)}")
            index.update({n: len(index) + j for j, n in enumerate(mine)})
            groups.append({**saved, "params": [index[n] for n in mine]})
        state = {}
        for fqn, st in osd["state"].items():
            if fqn not in index:
                raise ValueError(f"optimizer state for {fqn!r}, which the optimizer does not hold")
            p = params[fqn]
            state[index[fqn]] = {k: self._local_state(fqn, p, v) for k, v in st.items()}
        opt.load_state_dict({"state": state, "param_groups": groups})
        self._await_first_step(opt, loaded=True)

    # ---- the optimizer's own state dict ---------------------------------------------------
    def hook_optimizer(self, opt: torch.optim.Optimizer) -> None:
        """Make ``opt.state_dict()`` and ``opt.load_state_dict()`` speak DTensors for the
        states of sharded parameters, once per optimizer (at its first step).

        [Note: the optimizer's own state dict]
        Under FSDP2 the parameters are DTensors, so their optimizer states are too, and
        torch's ``get_optimizer_state_dict`` / ``get_state_dict(model, opt)`` (what
        torchtitan's checkpointer saves) and ``set_*`` work on them unchanged. Here the
        states are plain tensors of this rank's rows, which DCP would take for
        replicated ones: it kept one rank's rows as everyone's, and a resumed run went on
        from them without a word. So a post-hook on the optimizer's ``state_dict()``
        hands each such state out as a DTensor on the live state tensor (laid out like
        its parameter, :meth:`placement`; ``dcp.load`` writes into it in place), and a
        pre-hook on ``load_state_dict()`` turns DTensors, and full tensors, back into
        this rank's rows. States already in the optimizer as DTensors when it is hooked
        (a ``load_state_dict`` before its first step) are made rows then. torch's API
        makes a fresh optimizer's states by a step at learning rate 0 first, which
        hooks it; :meth:`optimizer_state_dict` reads ``opt.state`` itself and is not
        affected. As in :meth:`optimizer_state_dict`, a stepped optimizer's state dict
        holds the states of the parameters it has not stepped yet, made for it, and a
        load drops at the first step those that never stepped ([Note: states made for
        a checkpoint])."""
        if opt in self._hooked:
            return
        ref = weakref.ref(self)

        def dtensors(o: torch.optim.Optimizer, sd: dict[str, Any]) -> dict[str, Any] | None:
            alive = ref()
            return None if alive is None else alive._dtensor_states(o, sd)

        def complete(o: torch.optim.Optimizer) -> None:
            alive = ref()
            if alive is not None and o.state:  # a fresh one's are torch's API's to make
                alive._init_states(o)

        def rows(o: torch.optim.Optimizer, sd: dict[str, Any]) -> dict[str, Any] | None:
            alive = ref()
            return None if alive is None else alive._row_states(o, sd)

        def loaded(o: torch.optim.Optimizer) -> None:
            alive = ref()
            if alive is not None:
                alive._await_first_step(o, loaded=True)

        self._hooked[opt] = [
            opt.register_state_dict_pre_hook(complete),
            opt.register_state_dict_post_hook(dtensors),
            opt.register_load_state_dict_pre_hook(rows),
            opt.register_load_state_dict_post_hook(loaded),
        ]
        dtensor = sys.modules.get("torch.distributed.tensor")  # not imported: no DTensor was made
        names = self._names()
        for p, st in opt.state.items() if dtensor is not None else ():
            if id(p) in names and any(isinstance(v, dtensor.DTensor) for v in st.values()):
                opt.state[p] = {k: self._loaded_state(names[id(p)], p, v) for k, v in st.items()}

    def unhook_optimizers(self) -> None:
        """Remove :meth:`hook_optimizer`'s hooks (the communicator closes)."""
        for handles in self._hooked.values():
            for handle in handles:
                handle.remove()
        self._hooked.clear()

    def _dtensor_states(self, opt: torch.optim.Optimizer, sd: dict[str, Any]) -> dict[str, Any]:
        """``opt.state_dict()``'s post-hook: its states of sharded parameters as DTensors
        (the optimizer's own state dicts are not touched: new ones replace them)."""
        names, params = self._names(), [p for g in opt.param_groups for p in g["params"]]
        for pid, st in sd["state"].items():
            p = params[pid] if isinstance(pid, int) and pid < len(params) else None
            fqn = names.get(id(p))
            if fqn in self.sharded:
                sd["state"][pid] = {k: self._state_value(fqn, k, p, v) for k, v in st.items()}
        return sd

    def _row_states(self, opt: torch.optim.Optimizer, sd: dict[str, Any]) -> dict[str, Any]:
        """``opt.load_state_dict()``'s pre-hook: states of sharded parameters as this
        rank's rows, matched to the parameters by position as the load matches them."""
        names = self._names()
        saved = [i for g in sd["param_groups"] for i in g["params"]]
        by_index = dict(zip(saved, (p for g in opt.param_groups for p in g["params"])))
        state = {}
        for pid, st in sd["state"].items():
            p = by_index.get(pid)
            fqn = names.get(id(p))
            state[pid] = st if fqn is None else {k: self._loaded_state(fqn, p, v) for k, v in st.items()}
        return {**sd, "state": state}

    def _loaded_state(self, fqn: str, p: torch.Tensor, v: Any) -> Any:
        """A loaded state value as the optimizer keeps it: a sharded parameter's DTensor
        or full tensor as this rank's rows; a plain tensor of the shard's shape (what
        ``opt.state_dict()`` held before it was hooked) as it is."""
        from torch.distributed.tensor import DTensor

        if isinstance(v, DTensor) or (fqn in self.sharded and torch.is_tensor(v) and v.dim() and v.shape != p.shape):
            return self._local_state(fqn, p, v)
        return v

    def _await_first_step(
        self, opt: torch.optim.Optimizer, loaded: bool, made: list[torch.Tensor] | None = None
    ) -> None:
        """Drop at ``opt``'s next step the states made here for the parameters ``made``
        (kept with those made earlier that still await it), or, ``loaded``, those
        loaded that never stepped (read now, outside a step): [Note: states made for a
        checkpoint]."""
        earlier = self._made.pop(opt, None)
        marks = MadeStates.marks(opt, loaded, made)
        if earlier is not None:
            earlier.cancel()
            if made is not None:
                marks = {**earlier.pending(), **marks}
        if marks:
            self._made[opt] = MadeStates(opt, marks)

    def _local_state(self, fqn: str, p: torch.Tensor, v: Any) -> Any:
        from torch.distributed.tensor import DTensor

        if not torch.is_tensor(v):
            return v
        if fqn in self.sharded and v.dim() > 0:
            local = self.local_of(fqn, v, p)
            # a slice of someone else's tensor must not be aliased by the optimizer
            return local if isinstance(v, DTensor) and local.data_ptr() == v.to_local().data_ptr() else local.clone()
        return v.full_tensor() if isinstance(v, DTensor) else v

    # ---- gradient norm -----------------------------------------------------------------------
    def _grads(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(sharded gradients: this rank's rows, each shard once; replicated ones, each
        parameter once). Padding rows are never part of a shard."""
        shard_ids: set[int] = set()
        sharded = []
        for unit in self.units:
            for s in unit.shards:
                shard_ids.add(id(s))
                if s.grad is not None:
                    sharded.append(s.grad)
        replicated = [p.grad for p in self.model.parameters() if id(p) not in shard_ids and p.grad is not None]
        return sharded, replicated

    @torch.no_grad()
    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
    ) -> torch.Tensor:
        """The global gradient norm over every parameter (each once), then every
        gradient scaled by ``min(1, max_norm / (norm + 1e-6))`` as torch does; returns
        the norm before clipping, the same on every rank.

        Sharded gradients differ across a WP group and are equal across replicas, so
        their contribution is reduced over the WP group only (over the world when they
        are pieces, each rank's its own); replicated gradients are equal on every rank
        (already averaged) and counted once, locally."""
        norm_type = float(norm_type)
        sharded, replicated = self._grads()
        inf = math.isinf(norm_type)
        part = torch.zeros(2, dtype=torch.float64, device=self.device)  # [sharded, replicated]
        for i, grads in enumerate((sharded, replicated)):
            norms = [n.double() for n in _norms(grads, norm_type)]
            if norms:
                stacked = torch.stack(norms)
                part[i] = stacked.max() if inf else stacked.pow(norm_type).sum()
        g, reduce = self.groups, self.collectives.all_max if inf else self.collectives.all_reduce
        group, size = (g.world_group, g.world_size) if self.pieces else (g.wp_group, g.wp_size)
        reduce(part[:1], group, size, "the clip's norm all-reduce")  # the sharded part, in place
        total = part.max() if inf else part.sum().pow(1.0 / norm_type)
        total = total.float()
        if error_if_nonfinite and not torch.isfinite(total):
            raise RuntimeError(f"the total norm of order {norm_type} of the gradients is non-finite")
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for dtype_grads in _by_dtype([*sharded, *replicated]).values():
            torch._foreach_mul_(dtype_grads, coef.to(dtype_grads[0].dtype))
        return total


def _by_dtype(grads: Iterable[torch.Tensor]) -> dict[tuple[torch.device, torch.dtype], list[torch.Tensor]]:
    out: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for g in grads:
        out.setdefault((g.device, g.dtype), []).append(g)
    return out


def _norms(grads: list[torch.Tensor], norm_type: float) -> list[torch.Tensor]:
    """Per-tensor norms; an empty shard (a rank past the last row) contributes nothing."""
    out = []
    for group in _by_dtype(g for g in grads if g.numel() > 0).values():
        out.extend(torch._foreach_norm(group, norm_type))
    return out


def _differ(saved: list[str], mine: list[str]) -> str:
    """How a state dict's parameter names differ from the optimizer's, by example."""
    theirs, ours = set(saved), set(mine)
    only_saved, only_mine = [n for n in saved if n not in ours], [n for n in mine if n not in theirs]
    parts = [f"{len(only_mine)} of the model's are not in it (such as {only_mine[0]})"] if only_mine else []
    parts += [f"{len(only_saved)} of its are not in the model (such as {only_saved[0]})"] if only_saved else []
    what = "; ".join(parts) or "the same names in another order"
    return f"the state dict's parameters differ from the optimizer's: {what} (a state of another model?)"
