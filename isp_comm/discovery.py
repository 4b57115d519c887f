"""What gets wrapped: the blocks, the checks on the model, and the units built from them.

Plain functions the communicator's constructor calls in order (compare FSDP2's
``_fsdp_init.py``): :func:`validate` the model, find its :func:`target_device`, then
:func:`build_units` shards every block's linears (and, when configured, the head
along the vocab, the embedding along its hidden dim and the other outer
parameters), materialising whatever is still on the meta device module by module.
"""

from __future__ import annotations

import functools
import gc
import sys
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from isp_comm.config import FLOAT_DTYPES, ISPConfig
from isp_comm.embedding import supports_hidden_split
from isp_comm.errors import few_names
from isp_comm.groups import ParallelGroups
from isp_comm.hooks.grad_hooks import refuse_gradient_hooks
from isp_comm.materialize import materialize_module, materialize_rest, model_initializer
from isp_comm.units import BlockUnit, ReplicatedParam, owned_params
from isp_comm.vocab_parallel import find_output_head


def find_blocks(model: nn.Module) -> nn.ModuleList:
    """The transformer blocks: the ``ModuleList`` whose every entry holds linear layers
    (types may differ, e.g. alternating attention and MLP blocks) with the most
    parameters in all."""
    best, best_params = None, -1
    for mod in model.modules():
        if not isinstance(mod, nn.ModuleList) or len(mod) == 0:
            continue
        if not all(not isinstance(b, nn.Linear) and any(isinstance(m, nn.Linear) for m in b.modules()) for b in mod):
            continue
        n = sum(p.numel() for p in mod.parameters())
        if n > best_params:
            best, best_params = mod, n
    if best is None:
        raise ValueError(
            f"could not find the transformer blocks of {type(model).__name__}: no nn.ModuleList "
            "whose entries contain nn.Linear layers; pass blocks= explicitly"
        )
    return best


CLOSED_SHARDS = (
    "isp-comm: this model's blocks hold the shards a closed ISPCommunicator left (wp > 1), not the full weights: "
    "take comm.full_state_dict() before close() and load it into a new model to use or wrap again"
)


def wrapped_marker(fn: Any) -> bool | str:
    """Whether ``fn`` is a block forward installed by an ISPCommunicator (``"closed"``:
    one a closed communicator left on a block whose parameters are shards)."""
    return getattr(fn, "_isp_comm_wrapped", False)


def _refuse_stale_optimizers(model: nn.Module) -> None:
    """An optimizer built before wrapping holds the full parameters that wrapping
    replaces by shards: it would silently train nothing. Refuse it now."""
    params = {id(p) for p in model.parameters()}
    for obj in gc.get_objects():
        if issubclass(type(obj), torch.optim.Optimizer) and any(
            id(p) in params for g in obj.param_groups for p in g["params"]
        ):
            raise ValueError(
                f"a {type(obj).__name__} optimizer already holds this model's parameters; wrapping replaces "
                "them by shards, so create the optimizer after wrapping, on model.parameters()"
            )


def _data_parallel(module: nn.Module) -> str | None:
    """The name of the data-parallel wrapper ``module`` is, if any. FSDP is looked up
    only if something imported it (a module cannot be FSDP's otherwise): importing it
    at wrap cost a rank tens of MiB of RSS, which the forecast's baseline does not hold."""
    from torch.nn.parallel import DistributedDataParallel  # imported with torch.nn

    if isinstance(module, DistributedDataParallel):
        return "DistributedDataParallel"
    fsdp = sys.modules.get("torch.distributed.fsdp")
    if fsdp is not None and isinstance(module, fsdp.FSDPModule):
        return "fully_shard (FSDP2)"
    return None


def refuse_data_parallel_outside(model: nn.Module, _args: tuple) -> None:
    """The model's forward pre-hook: a ``ValueError`` when it runs as (part of) the
    module of the ``DistributedDataParallel`` whose forward is running, or was itself
    given to ``fully_shard`` after wrapping. Both would act on the shards as if they
    were whole parameters: DDP's constructor has already broadcast rank 0's shard over
    every rank's, and it would average the gradients a second time. Another DDP
    model's forward that calls ours (a teacher) is not refused: torch keeps one
    active DDP module for the process, so only one that holds ours counts."""
    from torch.nn.parallel import DistributedDataParallel

    active = getattr(DistributedDataParallel, "_active_ddp_module", None)
    inside = isinstance(active, DistributedDataParallel) and any(m is model for m in active.module.modules())
    what = "DistributedDataParallel" if inside else _data_parallel(model)
    if what:
        raise ValueError(
            f"this model is wrapped by an ISPCommunicator, which shards its weights and averages its gradients "
            f"itself: do not also wrap it in {what} (its parameters are this rank's shards, which {what} would "
            "treat as whole ones); call the model itself"
        )


def refuse_assign(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: dict, *_: Any) -> None:
    """A load-state-dict pre-hook on each module of the wrapped model:
    ``load_state_dict(..., assign=True)`` would replace parameter objects that the
    communicator (and the optimizer) hold, and the blocks' would be swapped back out by
    the next forward, the loaded values never used, without a word. Said by the first
    module the load visits (the one it was called on), before anything is assigned. A
    state dict that names none of the module's parameters (buffers only) may assign."""
    if local_metadata.get("assign_to_params_buffers") and any(
        prefix + name in state_dict for name, _ in module.named_parameters()
    ):
        raise ValueError(
            "load_state_dict(assign=True) on a model wrapped by an ISPCommunicator would replace the parameters "
            "it and the optimizer hold (this rank's shards), and the loaded values would go unused: load without "
            "assign=True (it copies into the shards, of the shard's shape), or with comm.load_state_dict(sd) or "
            "comm.load_full_state_dict(sd)"
        )


def refuse_deepcopy(memo: dict) -> None:
    """``__deepcopy__`` of the wrapped model and of its blocks, set on each instance
    (``copy.deepcopy`` looks it up there): a copy would keep the blocks' forwards,
    which gather this communicator's shards, so it would compute with the original's
    weights whatever its own hold (an EMA's ``AveragedModel`` among others)."""
    raise ValueError(
        "a model wrapped by an ISPCommunicator cannot be deep-copied: its blocks' forwards gather this "
        "communicator's shards, so the copy would compute with the original's weights, not its own. Copy it "
        "before wrapping and wrap the copy with an ISPCommunicator of its own (an EMA: AveragedModel(model) "
        "before wrapping, then wrap model and ema.module alike; its update then averages shard with shard)"
    )


def refuse_save_pretrained(save: Any) -> Any:
    """``save`` (transformers' or peft's ``save_pretrained`` of the wrapped model), made
    to refuse a call without ``state_dict=``: it would take the model's own state dict,
    this rank's shards as DTensors, which safetensors cannot write ("invalid python
    storage") or, where it can, would write one rank's rows. With the full state dict
    given it writes that, as it does for an FSDP2 model."""

    @functools.wraps(save)
    def save_pretrained(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("state_dict") is None:
            raise ValueError(
                "save_pretrained() of a model wrapped by an ISPCommunicator would save this rank's shards: call "
                "comm.save_hf_checkpoint(path) on every rank (a transformers model; streamed, so no rank holds the "
                "whole model), or gather sd = comm.full_state_dict(cpu=True, rank0_only=True) on every rank and call "
                "save_pretrained(path, state_dict=sd) on rank 0 (peft's adapter too; rank 0 then holds the whole "
                "model in host memory)"
            )
        return save(*args, **kwargs)

    return save_pretrained


def refuse_added_parameters(names: list[str]) -> None:
    """Parameters of the wrapped model that wrapping never saw, stepped by an optimizer."""
    raise ValueError(
        f"parameters were added to the model after it was wrapped ({few_names(names)}): an ISPCommunicator "
        "averages over the ranks only the gradients of the parameters it wrapped, so each rank would step these "
        "with its own. Add them before wrapping (with peft: wrap after get_peft_model)"
    )


class ReplacedParameters:
    """The parameters wrapping replaced by shards, held weakly by FQN.

    An optimizer made after wrapping from parameter lists collected before it (param
    groups built from ``named_parameters()`` ahead of the wrap) holds these originals:
    no forward reads them and no gradient reaches them, so the sharded weights never
    train, without a word (an outside review: 7 of 21 tensors moved). The optimizer's
    step pre-hook refuses them (:meth:`held_by`). Weak references, so an original no
    one keeps is freed as before, and an id reused since is not taken for it."""

    def __init__(self, model: nn.Module) -> None:
        self._before = {id(p): (weakref.ref(p), n) for n, p in model.named_parameters(remove_duplicate=False)}

    def keep_replaced(self, wrapped_ids: frozenset[int]) -> None:
        """Keep only those no longer the model's (after wrapping: the replaced ones)."""
        self._before = {i: e for i, e in self._before.items() if i not in wrapped_ids}

    def held_by(self, params: list[torch.Tensor]) -> list[str]:
        """The FQNs of the replaced parameters among ``params``."""
        return [e[1] for p in params if (e := self._before.get(id(p))) is not None and e[0]() is p]


def refuse_replaced_parameters(names: list[str]) -> None:
    """An optimizer stepping parameters as they were before wrapping."""
    raise ValueError(
        f"the optimizer holds parameters as they were before wrapping ({few_names(names)}), which wrapping "
        "replaced by this rank's shards: it would step tensors no forward reads, and the model would not train. "
        "Collect the parameters (param groups too) from model.parameters() or model.named_parameters() after "
        "wrapping"
    )


MATRIX_OPTIMIZERS = tuple(getattr(torch.optim, n) for n in ("Adafactor", "Muon") if hasattr(torch.optim, n))
"""torch's optimizers whose update of a matrix reads the whole matrix (Adafactor's row
and column statistics, Muon's orthogonalisation): on a rank's rows they compute another
update than on the parameter, and train on without a word."""


def refuse_matrix_optimizer(opt: torch.optim.Optimizer) -> None:
    raise ValueError(
        f"{type(opt).__name__} computes each matrix's update from the whole matrix (factored statistics, or "
        "its orthogonalisation), and this rank holds only its rows of the blocks' weights: it would train "
        "another model than on one process. Use an elementwise optimizer (AdamW, Adam, SGD, ...) for the "
        "sharded parameters"
    )


def validate(model: nn.Module, blocks: list[nn.Module]) -> None:
    """A ``ValueError`` (``TypeError`` for a non-module block) for what cannot be wrapped."""
    if not blocks:
        raise ValueError("the block list is empty: ISP needs at least one transformer block")
    wrapper = next((w for w in map(_data_parallel, model.modules()) if w), None)
    if wrapper:
        raise ValueError(
            f"the model is already wrapped in {wrapper}, and an ISPCommunicator averages the gradients itself: "
            "wrap the plain model"
        )
    for i, b in enumerate(blocks):
        if not isinstance(b, nn.Module):
            raise TypeError(f"block {i} is a {type(b).__name__}, not an nn.Module")
        marker = wrapped_marker(b.__dict__.get("forward"))
        if marker == "closed":
            raise ValueError(CLOSED_SHARDS)
        if marker:
            raise ValueError("this model is already wrapped by an ISPCommunicator (close() it first)")
        if not any(isinstance(m, nn.Linear) for m in b.modules()):
            raise ValueError(f"block {i} ({type(b).__name__}) has no nn.Linear layers to shard")
    _refuse_stale_optimizers(model)
    devices = {p.device for p in model.parameters() if p.device.type != "meta"}
    if len(devices) > 1:
        raise ValueError(f"model parameters are on several devices {sorted(map(str, devices))}")
    for name, p in model.named_parameters():
        if p.dtype not in FLOAT_DTYPES:
            raise ValueError(f"parameter {name} has unsupported dtype {p.dtype} (use {FLOAT_DTYPES})")


def target_device(model: nn.Module) -> torch.device:
    """The model's device; for a model wholly on meta, the current CUDA device or CPU."""
    real = {p.device for p in model.parameters() if p.device.type != "meta"}
    if real:
        return real.pop()
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def hidden_split_embedding(model: nn.Module, inside: set[int]) -> nn.Embedding | None:
    """The input embedding to split along hidden and look up without gathering: an
    ``nn.Embedding`` outside the blocks whose weight is not tied to anything."""
    counts: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        counts[id(p)] = counts.get(id(p), 0) + 1
    found = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    candidates = [found] if isinstance(found, nn.Embedding) else []
    candidates += [m for m in model.modules() if isinstance(m, nn.Embedding) and m is not found]
    for m in candidates:
        if id(m) not in inside and counts.get(id(m.weight)) == 1 and supports_hidden_split(m):
            return m
    return None


@dataclass
class Units:
    """Every unit of a wrapped model: the blocks, then (when configured) the
    vocab-parallel head, the hidden-split embedding and the other outer parameters."""

    blocks: list[BlockUnit]
    vocab: BlockUnit | None = None
    embed: BlockUnit | None = None
    root: BlockUnit | None = None

    def sharded(self) -> list[BlockUnit]:
        """The blocks, then the outer parameters' unit, the vocab-parallel head's and the
        hidden-split embedding's, when they exist."""
        return [*self.blocks, *(u for u in (self.root, self.vocab, self.embed) if u is not None)]


@dataclass
class UnitSpec:
    """What one unit shards, decided from the model alone (no memory, no group): the
    one source of truth for :func:`build_units` and for the memory forecast."""

    index: int
    """Block index; -1 the other outer parameters, -2 the vocab-parallel head, -3 the
    hidden-split embedding."""
    block: nn.Module
    owners: list[tuple[str, nn.Module]]
    replicated: list[ReplicatedParam] = field(default_factory=list)
    names: tuple[str, ...] | None = ("weight", "bias")
    dim1: frozenset[int] = frozenset()
    cast: bool = True
    """Gathered and reduced in ``param_dtype`` / ``reduce_dtype`` (the vocab-parallel
    head and the hidden-split embedding are never gathered)."""


def shards_in_block(module: nn.Module) -> bool:
    """Whether a block's ``module`` has its own parameters sharded along dim 0 (all of
    them): an ``nn.Linear``, or any other module holding a matrix of its own, such as
    an MoE's experts fused into one 3-D tensor per projection (transformers 5) or a
    router's weight. Left whole on every rank, with their optimizer state, the experts
    would be most of an MoE's parameters unsharded, without a word. A module with a
    0-dim parameter stays whole (a scalar has no rows to split), as do the norms, whose
    vectors are all they hold."""
    own = list(module.parameters(recurse=False))
    if not own or any(p.dim() == 0 for p in own):
        return False
    return isinstance(module, nn.Linear) or any(p.dim() >= 2 for p in own)


def unit_specs(
    model: nn.Module, block_list: list[nn.Module], config: ISPConfig, head: nn.Module | None = None
) -> list[UnitSpec]:
    """Each block's linears and other matrix holders (:func:`shards_in_block`) along
    dim 0; with ``vocab_parallel``
    the head along the vocab; with ``shard_outer_params`` an untied embedding along its
    hidden dim and every other outer parameter along dim 0 (a weight tied to a linear
    follows the linear). In that order: blocks, vocab head, embedding, root."""
    names = {m: n for n, m in model.named_modules()}
    specs = []
    for i, block in enumerate(block_list):
        owners = [(names[m], m) for m in block.modules() if shards_in_block(m)]
        sharded = {id(p) for _, m in owners for p in m.parameters(recurse=False)}
        replicated = [
            ReplicatedParam(m, pn)
            for m in block.modules()
            for pn, p in m.named_parameters(recurse=False)
            if id(p) not in sharded
        ]
        specs.append(UnitSpec(i, block, owners, replicated, names=None))
    vocab = None
    if config.vocab_parallel:
        vocab = find_output_head(model, head, block_list)
        specs.append(UnitSpec(-2, vocab, [(names[vocab], vocab)], names=("weight",), cast=False))
    if config.shard_outer_params:
        inside = {id(m) for b in block_list for m in b.modules()}
        if vocab is not None:
            inside.add(id(vocab))
        emb = hidden_split_embedding(model, inside)
        if emb is not None:  # split along hidden and never gathered (isp_comm/embedding.py)
            dim1 = frozenset({id(emb.weight)})
            specs.append(UnitSpec(-3, emb, [(names[emb], emb)], names=("weight",), dim1=dim1, cast=False))
            inside.add(id(emb))
        owners = [(n, m) for n, m in model.named_modules() if id(m) not in inside and m._parameters]
        if owners:
            in_linear = {id(p) for _, m in owners if isinstance(m, nn.Linear) for p in m.parameters(False)}
            dim1 = frozenset(
                id(m.weight) for _, m in owners if isinstance(m, nn.Embedding) and id(m.weight) not in in_linear
            )
            specs.append(UnitSpec(-1, model, owners, names=None, dim1=dim1))  # cast like the blocks
    return specs


def build_units(
    model: nn.Module,
    block_list: list[nn.Module],
    groups: ParallelGroups,
    config: ISPConfig,
    device: torch.device,
    head: nn.Module | None = None,
) -> Units:
    """Shard the model as :func:`unit_specs` says, then materialise what is still on
    meta (see isp_comm/materialize.py)."""
    materialize = functools.partial(
        materialize_module, device=device, seed=config.init_seed, init=model_initializer(model)
    )
    built = Units([])
    world = config.state_sharding == "world"  # a replica group of one: the same as "wp"
    replicas = (groups.replica_size, groups.replica_rank) if world else (1, 0)
    specs = unit_specs(model, block_list, config, head)
    named = ((fqn, p) for s in specs for fqn, _, _, p in owned_params(s.owners, s.names))
    refuse_gradient_hooks(named, wrapping=True)  # before anything is sharded
    for s in specs:
        mp = dict(param_dtype=config.param_dtype, reduce_dtype=config.reduce_dtype) if s.cast else {}
        unit = BlockUnit(
            s.index, s.block, s.owners, s.replicated, groups.wp_size, groups.wp_rank, device, materialize,
            names=s.names, dim1=s.dim1, replicas=replicas, **mp,
        )  # fmt: skip
        if s.index >= 0:
            built.blocks.append(unit)
        else:
            setattr(built, {-1: "root", -2: "vocab", -3: "embed"}[s.index], unit)
    materialize_rest(model, materialize)  # what is still on meta lies outside the units
    return built


def outer_replicated(model: nn.Module, block_list: list[nn.Module], units: list[BlockUnit]) -> list[ReplicatedParam]:
    """The parameters outside the blocks that no unit shards (the embedding, final norm
    and head when ``shard_outer_params`` is off), by module and attribute: what the
    engine casts to ``param_dtype`` for a forward (as FSDP2's policy on the root does)."""
    inside = {id(m) for b in block_list for m in b.modules()}
    sharded = {id(s) for u in units for s in u.shards}
    return [
        ReplicatedParam(m, name)
        for m in model.modules()
        if id(m) not in inside
        for name, p in m._parameters.items()
        if p is not None and id(p) not in sharded
    ]
