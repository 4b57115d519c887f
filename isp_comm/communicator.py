"""ISPCommunicator: WHAT is wrapped. Finds the blocks, shards their linears, wires the rest."""

from __future__ import annotations

import contextlib
import functools
import sys
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils.checkpoint import checkpoint

from isp_comm.backends import Backend, make_backend
from isp_comm.buffers import make_buffers
from isp_comm.collectives import StepCollectives
from isp_comm.config import ISPConfig
from isp_comm.consistency import WeightsCheck, broadcast_weights, check_same_weights, repeated_rows, rows_alike
from isp_comm.context import CommContext
from isp_comm.discovery import (
    CLOSED_SHARDS,
    MATRIX_OPTIMIZERS,
    ReplacedParameters,
    build_units,
    find_blocks,
    outer_replicated,
    refuse_added_parameters,
    refuse_assign,
    refuse_data_parallel_outside,
    refuse_deepcopy,
    refuse_matrix_optimizer,
    refuse_replaced_parameters,
    refuse_save_pretrained,
    target_device,
    validate,
)
from isp_comm.embedding import HiddenSplitEmbedding
from isp_comm.flight.diagnosis import attach
from isp_comm.full_state import FullState
from isp_comm.generate import flag_set, patch, wrap_generate
from isp_comm.groups import ParallelGroups
from isp_comm.hooks.compiled import BlockCompute
from isp_comm.hooks.engine import BlockEngine, Phase
from isp_comm.hooks.refresh import WeightRefresh
from isp_comm.hooks.scheduler import SchedulerHook
from isp_comm.hooks.unused import UnusedGradients
from isp_comm.layout import ShardedParam
from isp_comm.loss import cross_entropy
from isp_comm.memory_pool import MemoryPlan, releases_reduce_buffers
from isp_comm.sequence_parallel.apply import SequenceCheck, apply_sequence_parallel, without_peft
from isp_comm.sequence_parallel.router import experts_of, load_balancing_loss
from isp_comm.state import ShardedState
from isp_comm.trace import clock_for
from isp_comm.units import BlockUnit
from isp_comm.virtual import is_virtual
from isp_comm.vocab_parallel import VocabParallelHead, WPComm, refuse_labels, vocab_parallel_cross_entropy


def _check_types(model: nn.Module, groups: ParallelGroups, config: ISPConfig) -> None:
    """The communicator's arguments are of the types it takes (a ``TypeError`` names the one that is not)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if not isinstance(groups, ParallelGroups):
        raise TypeError(f"groups must be a ParallelGroups, got {type(groups).__name__}")
    if not isinstance(config, ISPConfig):
        raise TypeError(f"config must be an ISPConfig, got {type(config).__name__}")


def _step_hook_of(comm: ISPCommunicator, before: bool = False) -> Callable[..., None]:
    """An optimizer step hook (torch's registries of them are global) calling
    ``comm._after_step``, or with ``before`` ``comm._before_step``, holding the
    communicator weakly: one dropped unclosed is not kept alive by it."""
    ref = weakref.ref(comm)

    def hook(opt: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
        alive = ref()
        if alive is not None and not alive.closed:
            alive._before_step(opt) if before else alive._after_step(opt)

    return hook


def _closed_block(*_args: Any, **_kwargs: Any) -> None:
    """A block's forward after ``close()`` at wp > 1, where its parameters are this
    rank's shards: a forward, or a second wrap, says so."""
    raise RuntimeError(CLOSED_SHARDS)


_closed_block._isp_comm_wrapped = "closed"  # type: ignore[attr-defined]


class ISPCommunicator:
    """Wraps a llama-class model in place for ISP weight parallelism.

    Every ``nn.Linear`` weight and bias inside the blocks becomes this rank's dim-0
    shard (a parameter of the same name), or with ``state_sharding="world"`` its piece
    of that shard (docs/sharding.md); everything else stays replicated. Create the
    optimizer *after* wrapping, on ``model.parameters()``. ``backend``: one the
    caller made (a virtual world's, :func:`isp_comm.virtual.virtual_backend`) in
    place of ``config.backend``'s; the communicator closes it.
    """

    def __init__(
        self,
        model: nn.Module,
        groups: ParallelGroups,
        config: ISPConfig | None = None,
        *,
        blocks: Sequence[nn.Module] | None = None,
        head: nn.Module | None = None,
        backend: Backend | None = None,
    ) -> None:
        config = config or ISPConfig()
        _check_types(model, groups, config)
        self.model, self.groups, self.config = model, groups, config
        block_list = list(find_blocks(model) if blocks is None else blocks)
        validate(model, block_list)
        device = target_device(model)
        if config.sync_module_states:
            broadcast_weights(model)
        else:
            check_same_weights(model, device)
        self.backend = backend if backend is not None else make_backend(config.backend, device, config.timeout_s)
        self.ctx = CommContext(groups.rank, config.timeout_s, config.debug_delay_s, clock_for(device))
        try:  # before anything is sharded: a refusal leaves the model as it was
            symmetric = self.backend.symmetric_buffers
            self._release_pairs = releases_reduce_buffers(config.release_reduce_buffers, device.type, symmetric)
            self._undo_sp = self._apply_sequence_parallel() if groups.sp_size > 1 else None
        except Exception:
            self.backend.close()
            raise
        self._replaced = ReplacedParameters(model)  # kept weakly; refused at a step ([Note] in discovery.py)
        built = self._built = build_units(model, block_list, groups, config, device, head)
        self.units, self.vocab_unit, self.embed_unit, self.root = built.blocks, built.vocab, built.embed, built.root
        replicated_all = self._index_shards(device)
        buffers = self._buffers = make_buffers(built, replicated_all, groups, config, self.backend, self._release_pairs)
        self._plan, self.pool, self.rs_buffers = buffers.plan, buffers.pool, buffers.rs_buffers
        self.engine = self._make_engine(replicated_all)
        self.engine.outer = outer_replicated(model, block_list, self.sharded_units)
        self._install_forwards(config.checkpointed_blocks(len(block_list)))
        self._closed = False
        self._flight = attach(self.ctx, groups.world_size, config.diagnosis_dir)  # see isp_comm/flight

    def _make_engine(self, replicated: list[nn.Parameter]) -> BlockEngine:
        """The engine; with pieces (``state_sharding="world"`` and replicas), the
        refresh of the WP shards it drives and the optimizer hook that marks them stale;
        with ``find_unused_parameters``, the record of what the backwards used."""
        g, units = self.groups, self.sharded_units
        pieces = any(u.replicas > 1 for u in units)
        refresh = WeightRefresh(self.ctx, self.backend, g.replica_group, units) if pieces else None
        self._step_hook = register_optimizer_step_post_hook(_step_hook_of(self)) if pieces else None
        self._pre_step_hook = register_optimizer_step_pre_hook(_step_hook_of(self, before=True))
        engine = BlockEngine(
            self.ctx, self.units, g, self.backend, self.config, self.pool, self.rs_buffers, replicated, self.root,
            refresh,
        )  # fmt: skip
        if self.config.find_unused_parameters:  # the shards are the model's parameters by now
            params = list(self.model.parameters())
            engine.unused = UnusedGradients(params, self.collectives, g.world_group, g.world_size)
        return engine

    def _index_shards(self, device: torch.device) -> list[nn.Parameter]:
        """Every sharded parameter's FQN (tied aliases included) mapped to its unit, the
        state-dict faces built on that map; returns the parameters left replicated."""
        self._sharded = {pc.fqn: (unit, pc) for unit in self.sharded_units for pc in unit.pieces}
        for unit in self.sharded_units:  # tied weights: every owner's key maps to the one shard
            self._sharded.update({fqn: (unit, unit.pieces[i]) for _, _, i, fqn in unit.aliases})
        self.collectives = StepCollectives(self.backend, self.ctx, device)
        self._state = ShardedState(self.model, self.groups, self._sharded, self.sharded_units, device, self.collectives)
        self._full = FullState(self.model, self.groups, self._sharded, self.sharded_units, self.backend, self.ctx)
        in_units = {id(s) for unit in self.sharded_units for s in unit.shards}
        return [p for p in self.model.parameters() if id(p) not in in_units]

    def _install_forwards(self, n_ckpt: int) -> None:
        """The vocab-parallel head's and hidden-split embedding's forwards, every
        block's wrapped forward (the first ``n_ckpt`` checkpointed), the model's root
        hooks and, under SP, the chunk check."""
        g, model = self.groups, self.model
        self._head_forward = self._embed_forward = self._vocab_head = self._embed_lookup = None
        wp_comm = self._wp_comm = WPComm(g.wp_group, g.wp_size, g.wp_rank, self.backend, self.ctx)
        if self.vocab_unit is not None:
            vu = self.vocab_unit
            self._add_summed(vu)
            rows = vu.params[0].chunk_rows
            self._head_forward = vu.block.__dict__.get("forward")
            self._vocab_head = VocabParallelHead(vu.block, g.wp_rank * rows, rows, vu.params[0].shape[0], wp_comm)
            vu.block.forward = self._vocab_head
        if self.embed_unit is not None:
            eu = self.embed_unit
            self._add_summed(eu)
            self._embed_forward = eu.block.__dict__.get("forward")
            self._embed_lookup = eu.block.forward = HiddenSplitEmbedding(
                eu.block, eu.params[0].shape[1], eu.params[0].chunk_rows, wp_comm, self.config.param_dtype
            )
        self._orig_forwards: list[tuple[nn.Module, Any]] = []
        for unit in self.units:
            self._wrap_forward(unit, checkpointed=unit.index < n_ckpt)
        # kept out of dynamo's tracing, as the blocks' forwards are, so torch.compile(model) runs them eagerly
        # (traced, the prefetch's collective failed inside dynamo; [Note: compiled blocks] in hooks/compiled.py)
        self._root_handle = model.register_forward_pre_hook(
            torch._disable_dynamo(lambda _m, _a: self._root_pre_forward())
        )
        self._root_post_handle = model.register_forward_hook(  # [Note: a forward that raised]
            torch._disable_dynamo(
                lambda _m, _a, out: self.engine.root_post_forward(raised=out is None and sys.exc_info()[1] is not None)
            ),
            always_call=True,
        )
        self._wrapper_check = model.register_forward_pre_hook(refuse_data_parallel_outside, prepend=True)
        self._assign_checks = [m.register_load_state_dict_pre_hook(refuse_assign) for m in model.modules()]
        self._labels_check = (
            None
            if self._vocab_head is None
            else model.register_forward_pre_hook(functools.partial(refuse_labels, self._vocab_head), with_kwargs=True)
        )
        self._undo_generate = self._wrap_generate()
        self._watch_parameters()
        self._chunk_check = self._sequence_check = None
        if g.sp_size > 1:
            check = self._sequence_check = SequenceCheck(g.sp_group, g.sp_size, self.backend, self.ctx, model)
            self._chunk_check = model.register_forward_pre_hook(check, with_kwargs=True, prepend=True)

    def _watch_parameters(self) -> None:
        """What the step pre-hook checks (:meth:`_before_step`): the parameters wrapping
        left (any added later is refused), those of which this rank holds part (a
        matrix-aware optimizer on them is refused; their rows checked at the first
        training forward, :meth:`_check_rows`); no deep copy of the model or a block
        (:func:`~isp_comm.discovery.refuse_deepcopy`); no ``save_pretrained`` of the
        shards (:func:`~isp_comm.discovery.refuse_save_pretrained`); the model's own
        state dict sharded (:meth:`_sharded_entries`); the weights compared across
        ranks now and then (:meth:`_watch_weights`)."""
        named = dict(self.model.named_parameters(remove_duplicate=False))
        self._wrapped_ids = frozenset(id(p) for p in named.values())
        self._replaced.keep_replaced(self._wrapped_ids)
        self._partial_ids = frozenset(id(named[fqn]) for fqn, (unit, pc) in self._sharded.items() if _split(unit, pc))
        self._no_copies = [self.model, *(u.block for u in (*self.units, self.vocab_unit, self.embed_unit) if u)]
        for module in self._no_copies:
            module.__deepcopy__ = refuse_deepcopy  # an instance's own: copy.deepcopy looks there
        self._undo_save = [  # the model's, and an inner transformers model's (model.model, peft's base model)
            patch(m, "save_pretrained", refuse_save_pretrained(m.save_pretrained))
            for m in self.model.modules()
            if callable(getattr(m, "save_pretrained", None)) and any(id(p) in self._partial_ids for p in m.parameters())
        ]
        self._rows_unchecked = bool(self._partial_ids) and not is_virtual()  # [Note: rows initialised after wrapping]
        self._state_dict_hooks = self._shard_state_dict_hooks()
        self._watch_weights()

    def _watch_weights(self) -> None:
        """The check at the end of backward 2, 4, 8, ... ([Note: replicas that drift
        apart] in ``isp_comm/consistency.py``): the replicated parameters alike on every
        rank (where the backend's sums are), the partial ones not alike over the ranks
        that hold their parts (the WP groups, contiguous as ``ParallelGroups.create``
        makes them; the world, for pieces)."""
        self._weights_check: WeightsCheck | None = None
        g, shards = self.groups, {id(s) for u in self.sharded_units for s in u.shards}
        named = list(self.model.named_parameters())
        replicas = [(n, p) for n, p in named if id(p) not in shards] if self.backend.identical_sums else []
        partial = [(n, p) for n, p in named if id(p) in self._partial_ids]
        if self._state.pieces:
            rows_groups = [list(range(g.world_size))]
        elif g.wp_ranks == tuple(range(g.wp_ranks[0], g.wp_ranks[0] + g.wp_size)) and g.wp_ranks[0] % g.wp_size == 0:
            rows_groups = [list(range(k, k + g.wp_size)) for k in range(0, g.world_size, g.wp_size)]
        else:
            rows_groups = []
        if (replicas or partial) and g.world_size > 1 and not is_virtual():
            gather = self._gather(g.world_group, g.world_size, "the weights' check")
            check = self._weights_check = WeightsCheck(replicas, partial, rows_groups, gather, self._state.device)
            self.engine.after_backward = check
            # the weights leave the run through the model's state dict (ours, DCP's, an export's):
            # the check no backward has read yet is read there first
            self._state_dict_hooks.append(self.model.register_state_dict_post_hook(lambda *_: check.flush()))

    def _gather(self, group: Any, size: int, what: str) -> Callable[[torch.Tensor], torch.Tensor]:
        """An all-gather over ``group`` on the backend, waited under the deadline (the checks' own)."""
        return functools.partial(self.collectives.all_gather, group=group, size=size, what=what)

    def _root_pre_forward(self) -> None:
        if self._rows_unchecked and torch.is_grad_enabled() and not torch.compiler.is_compiling():
            self._check_rows()
        self.engine.root_pre_forward()

    def _check_rows(self) -> None:
        """[Note: rows initialised after wrapping] torchtitan initialises a model after
        ``fully_shard``, each DTensor shard drawing its own part of the whole. Here the
        parameters are plain shards: an ``nn.init`` after wrapping draws from one
        generator state on every rank, so every rank's rows are the whole's first rows
        and the weight is them repeated, and it trains on, worse, without a word. The
        first forward with grad (a training one: every rank of the group runs it, where
        one replica may generate alone) compares a checksum of each sharded parameter
        over the WP group (the world, for pieces; one small all-gather of torch's, once)
        and refuses rows alike on every rank but not constant (zeros and ones are a
        real initialisation). Until a forward passes it; not while torch.compile traces
        the model (an eager forward checks). An init later in the run is found by the
        check at backward 2, 4, 8, ... (:meth:`_watch_weights`)."""
        g = self.groups
        named = [(n, p) for n, p in self.model.named_parameters() if id(p) in self._partial_ids]
        group, size = (g.world_group, g.world_size) if self._state.pieces else (g.wp_group, g.wp_size)
        same = repeated_rows(named, self._gather(group, size, "the check of rows alike"), self._state.device)
        if same:
            raise ValueError(rows_alike(same))
        self._rows_unchecked = False

    def _shard_state_dict_hooks(self) -> list[Any]:
        """[Note: the model's own state dict] ``model.state_dict()`` (a parent module's,
        a sub-module's, and torch's ``get_model_state_dict``) holds the sharded
        parameters as DTensors on the live shards, as under FSDP2, so that
        ``dcp.save({"model": model.state_dict()})`` saves every rank's rows: as plain
        tensors DCP took them for replicated ones and kept one rank's, without a word.
        ``load_state_dict`` takes them back (and full tensors) through
        ``ShardedState.as_local``. The hooks sit on each module that owns a sharded
        parameter, which every state dict and every load of a module above it passes
        through, so a block's own ``state_dict()`` is sharded as the model's is; the
        model's load pre-hook makes another system's DTensors of whole tensors full.
        With pieces, what a caller writes into the entries is seen, as through
        :meth:`state_dict` (they are watched), and a load marks the owner's pieces
        written."""
        state, sharded = self._state, self._state.sharded
        hooks = [
            self.model.register_load_state_dict_pre_hook(lambda _m, sd, prefix, *_: state.whole_entries(sd, prefix))
        ]
        for name, module in self.model.named_modules():
            own = ((n, f"{name}.{n}" if name else n) for n, _ in module.named_parameters(recurse=False))
            names = tuple((n, fqn) for n, fqn in own if fqn in sharded)
            if not names:
                continue
            ids = {id(self.model.get_parameter(fqn)) for _, fqn in names}
            hooks += [
                module.register_state_dict_post_hook(
                    lambda _m, sd, prefix, _meta, n=names: self._sharded_entries(sd, prefix, n)
                ),
                module.register_load_state_dict_pre_hook(
                    lambda _m, sd, prefix, *_, n=names: state.as_local(sd, prefix, n)
                ),
                module.register_load_state_dict_post_hook(lambda _m, _keys, ids=ids: self._loaded(ids)),
            ]
        return hooks

    def _sharded_entries(self, state_dict: dict, prefix: str, names: tuple[tuple[str, str], ...]) -> None:
        """A state dict passed a module owning sharded parameters ``names``: their
        entries as DTensors (see :meth:`_shard_state_dict_hooks`), watched with pieces."""
        with torch.no_grad():  # the DTensors' own local tensors (with grad: a view made for the call)
            handed = self._state.as_dtensors(state_dict, prefix, names)
            if self.engine.refresh is not None and handed and not torch.is_inference_mode_enabled():
                self.engine.refresh.watch(handed)  # inference tensors keep no version: see docs/state.md

    def _loaded(self, ids: set[int]) -> None:
        """A load passed a module owning the sharded parameters ``ids``: with pieces, the
        units holding them rebuild their WP shards before their next gathers."""
        if self.engine.refresh is not None:
            self.engine.refresh.mark_stale(ids)

    def _add_summed(self, unit: BlockUnit) -> None:
        """A unit whose backward sums its shard's gradient over WP itself: averaged over
        the replicas in the whole-gradient buckets, or, with pieces, reduce-scattered
        into them by the engine."""
        if unit.replicas > 1:
            self.engine.summed.append(unit)
        else:
            self.engine.reducer.wp_summed += list(unit.shards)

    @property
    def sharded_units(self) -> list[BlockUnit]:
        """The blocks, then the outer parameters' unit, the vocab-parallel head's and the
        hidden-split embedding's, when they exist."""
        return self._built.sharded()

    # ---- construction helpers ----------------------------------------------------------
    def _apply_sequence_parallel(self) -> Callable[[], None]:
        g = self.groups
        return apply_sequence_parallel(self.model, g.sp_group, g.sp_size, self.backend, self.ctx)

    def cross_entropy(
        self, logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100, reduction: str = "mean"
    ) -> torch.Tensor:
        """This rank's cross-entropy over its own tokens (their mean, ``"sum"``, or
        ``"none"``: each token's, shaped like ``labels``, 0 where ignored, as
        ``F.cross_entropy`` gives; DPO's and RL's log-likelihoods are their negatives), in
        fp32 whatever the logits' dtype (see ISPConfig.param_dtype): on ordinary logits
        a chunked loss that never holds them in fp32 whole (:mod:`isp_comm.loss`: pass
        the logits as the model gave them, not ``.float()``), the vocab-parallel loss on
        the head's vocab-sharded logits when ``ISPConfig(vocab_parallel=True)``."""
        head = self._vocab_head
        if head is None:
            return cross_entropy(logits, labels, ignore_index, reduction)  # type: ignore[arg-type]
        return vocab_parallel_cross_entropy(
            logits.float(), labels, head.comm, head.vocab_start, ignore_index, reduction
        )

    def router_aux_loss(self, router_logits: Sequence[torch.Tensor]) -> torch.Tensor:
        """An MoE's router load-balancing loss (what transformers' Mixtral, Qwen2/3-MoE,
        OLMoE and GPT-OSS return as ``aux_loss`` given ``output_router_logits=True``;
        pass the output's ``router_logits``), over the sequences whole: under sequence
        parallelism transformers' ``aux_loss`` is its rank's chunk's, which is not that
        chunk's share of the sequence's (a product of two means over tokens). Every rank
        gets the sequences' loss as its value and its chunk's part of the gradient,
        scaled as the chunk's cross entropy is (gradients are averaged over the ranks);
        one all-reduce of two numbers per expert over the SP group. Without SP it equals
        ``aux_loss``. Add ``router_aux_loss_coef`` times it to the loss, as transformers
        does given ``labels``. See [Note: the router loss over the SP group]."""
        g = self.groups
        experts, top_k = experts_of(without_peft(self.model))
        return load_balancing_loss(
            router_logits,
            experts,
            top_k,
            lambda t: self.collectives.all_reduce(t, g.sp_group, g.sp_size, "the router loss's sums over the SP group"),
            g.sp_size,
        )

    @contextlib.contextmanager
    def whole_logits(self) -> Iterator[None]:
        """Under ``ISPConfig(vocab_parallel=True)``, the logits are whole rows of this
        rank's own tokens inside this block, as the unwrapped model's, instead of the
        vocab-sharded ones ``comm.cross_entropy`` takes: for inference (under
        ``torch.no_grad()``) and evaluation by other code. A wrapped model's
        ``generate`` runs inside it. Without ``vocab_parallel`` the logits are whole
        already and it does nothing. See [Note: whole logits] in
        ``isp_comm/vocab_parallel.py`` for what it costs."""
        with flag_set(self._vocab_head, "whole"):
            yield

    @contextlib.contextmanager
    def _whole_sequences(self) -> Iterator[None]:
        """Under sequence parallelism, attention is the model's own inside, and each
        rank runs whole sequences of its own: for ``generate``, which feeds every rank
        its prompts whole, not a chunk of a sequence shared with the SP group (the
        blocks' weights are still gathered over WP). Outside, as before."""
        if self._undo_sp is None:
            yield
            return
        self._undo_sp()
        self._undo_sp = None
        try:
            with flag_set(self._sequence_check, "paused"):
                yield
        finally:
            self._undo_sp = self._apply_sequence_parallel()

    def _wrap_generate(self) -> Callable[[], None] | None:
        """The model's ``generate`` made to work as on a model FSDP shards
        (:func:`isp_comm.generate.wrap_generate`), where it needs to: at wp > 1 in a
        job of several ranks (the ranks go on together), under ``vocab_parallel`` (in
        :meth:`whole_logits`, so that it sees the logits it expects) and under sequence
        parallelism (in :meth:`_whole_sequences`: each rank generates from prompts of
        its own, their shapes compared where the WP group computes on each other's
        tokens). Returns what puts the instance back as it was, for ``close``."""
        g = self.groups
        synced = g.wp_size > 1 and dist.is_initialized() and dist.get_world_size() > 1
        if self._vocab_head is None and g.sp_size == 1 and not synced:
            return None

        def contexts() -> list[contextlib.AbstractContextManager[Any]]:
            return [self._whole_sequences(), self.whole_logits(), flag_set(self._embed_lookup, "checking")]

        return wrap_generate(self.model, self._wp_comm, synced=synced, contexts=contexts)

    def _wrap_forward(self, unit: BlockUnit, checkpointed: bool) -> None:
        block = unit.block
        compute = BlockCompute(block, block.forward)  # see [Note: compiled blocks]
        engine = self.engine

        def isp_forward(*args: Any, **kwargs: Any) -> Any:
            return engine.block_forward(unit, compute, args, kwargs)

        if checkpointed:

            def forward(*args: Any, **kwargs: Any) -> Any:
                if not torch.is_grad_enabled():
                    return isp_forward(*args, **kwargs)
                return checkpoint(isp_forward, *args, use_reentrant=False, **kwargs)
        else:
            forward = isp_forward
        forward = compute.guard(forward)
        forward._isp_comm_wrapped = True  # type: ignore[attr-defined]
        self._orig_forwards.append((block, block.__dict__.get("forward")))
        block.forward = forward

    # ---- pieces (state_sharding="world"; see [Note: refreshing the WP shards]) --------------
    def _before_step(self, opt: torch.optim.Optimizer) -> None:
        """Before the step of an optimizer of this model's replicated parameters (another
        model's, stepped between this one's forward and backward, leaves it alone): a
        step that did not go as planned is settled ([Note: steps that did not go as
        planned] in ``isp_comm/hooks/engine.py``). With ``find_unused_parameters``, the
        gradients no rank produced go back to ``None`` ([Note: unused parameters]),
        except in the step that makes a fresh optimizer's states, whose zeros are its own.
        An optimizer of sharded parameters gets its state-dict hooks here, at its first
        step ([Note: the optimizer's own state dict] in ``isp_comm/state.py``)."""
        held = [p for g in opt.param_groups for p in g["params"]]
        if any(id(p) in self._partial_ids for p in held):
            if isinstance(opt, MATRIX_OPTIMIZERS):
                refuse_matrix_optimizer(opt)
            self._state.hook_optimizer(opt)  # [Note: the optimizer's own state dict]
        if any(id(p) not in self._wrapped_ids for p in held):  # not all this model's: another's, added, replaced
            replaced = self._replaced.held_by(held)
            if replaced:
                refuse_replaced_parameters(replaced)
            added = {id(p) for p in held}
            names = [
                n
                for n, p in self.model.named_parameters()
                if id(p) in added and id(p) not in self._wrapped_ids and (p.requires_grad or p.grad is not None)
            ]
            if names:
                refuse_added_parameters(names)
        r = self.engine.reducer
        if r.user_hooks.running:  # a step from a gradient hook: [Note: post-accumulate-grad hooks]
            return
        if self.engine.phase is not Phase.IDLE:  # a step that did not go as planned: settled first
            mine = {id(p) for p in (*r.replicated, *r.wp_summed)}  # whose .grad a forward stashes
            if any(id(p) in mine for g in opt.param_groups for p in g["params"]):
                self.engine.settle()
        if r.deferred_backwards and not self._state.making_states:  # gradients that wait: refused
            mine = {id(p) for p in self.model.parameters()}
            if any(id(p) in mine for g in opt.param_groups for p in g["params"]):
                self._refuse_deferred("an optimizer step")
        unused = self.engine.unused
        if unused is not None and not self._state.making_states and unused.steps(opt):
            unused.settle()

    def _after_step(self, opt: torch.optim.Optimizer) -> None:
        """After any optimizer's step: the WP shards of the units whose pieces it may
        have stepped are stale: the trainable ones and any holding a gradient (an
        optimizer steps every parameter with a ``.grad``, a frozen one that kept its
        zeros included, which momentum and weight decay still move). A frozen piece
        without a gradient is not written: a unit of those alone is not gathered over
        the replicas again."""
        params = (p for g in opt.param_groups for p in g["params"])
        self.engine.refresh.mark_stale({id(p) for p in params if p.requires_grad or p.grad is not None})

    def params_updated(self) -> None:
        """Say that the parameters were written where the communicator cannot see it
        (through ``.data``, or into a state dict's tensors without
        :meth:`load_state_dict`): with ``state_sharding="world"``, the WP shards that
        gathers read are rebuilt from them before the next forward. Optimizer steps,
        the ``load_*`` calls and in-place writes that bump a version counter are seen
        without it. Call it on every rank, as the writes were made (the ranks must
        agree on which shards to rebuild). Nothing to do otherwise (the parameters are
        the WP shards)."""
        if self.engine.refresh is not None:
            self.engine.refresh.mark_stale()

    # ---- public API ---------------------------------------------------------------------
    def set_requires_replica_sync(self, requires: bool) -> None:
        """Whether the backwards of the forwards from now on reduce their gradients over
        the replica group (default ``True``). ``False`` for every micro-step of an
        accumulation but the last: those stop after the WP reduce-scatter and keep the
        sum of their gradient shards, and the last micro-step's replica collective
        carries the whole step's (one crossing of the slow links per optimizer step, not
        one per micro-step), as FSDP2's ``set_requires_all_reduce(False)`` and DDP's
        ``no_sync()``. The flag is read by the forward that arms a backward's
        reductions (the first with grad since a backward, or the next one when the flag
        changed): set it before the micro-step's forward. The sums are a gradient WP shard
        of every block in the reduce dtype, held in place of the gradient shards the
        earlier micro-steps would leave in ``.grad`` (the same bytes with the state over
        WP and an fp32 reduce; ``world / wp`` times them with the state over the world,
        whose pieces are smaller). ``.grad`` holds the
        step's gradients only after the syncing backward; an optimizer step or a clip
        before it is refused. Nothing changes without replicas (``wp`` = world).
        See [Note: replica reductions deferred] in ``isp_comm/hooks/reductions.py``."""
        if not isinstance(requires, bool):
            raise TypeError(f"set_requires_replica_sync takes a bool, got {type(requires).__name__}")
        self.engine.reducer.replica_sync = requires

    def _refuse_deferred(self, what: str) -> None:
        raise RuntimeError(
            f"isp-comm: {what} while the gradients of {self.engine.reducer.deferred_backwards} backward(s) wait for "
            "their replica reduction: run the accumulation's last micro-step after set_requires_replica_sync(True) "
            "(its backward reduces them all), then step"
        )

    def scheduler_hook(self) -> SchedulerHook:
        """Hooks for a training loop: before/after forward, before/after backward."""
        return SchedulerHook(self.engine)

    def memory_plan(self) -> MemoryPlan:
        """Slot sizes per dtype, which block sets them, and the pool's total bytes."""
        return self._plan

    def record_events(self, enabled: bool = True) -> list[tuple[str, int, str]]:
        """Start (or stop) recording (kind, block, phase) events: gathers, computes, reduces."""
        return self.ctx.record_events(enabled)

    def start_trace(self) -> None:
        """Record compute and communication spans from now on (see ``trace_spans``)."""
        self.ctx.start_trace()

    def stop_trace(self) -> list[tuple[str, str, float, float]]:
        """Stop recording; the (lane, name, start_s, end_s) spans since ``start_trace``."""
        return self.ctx.stop_trace()

    def _pool_bytes(self) -> int:
        """What the pool holds now: slots, landing and cast buffers, and the reduce-scatter
        pairs alive (none between backwards when they are given back: [Note:
        reduce-scatter pairs between backwards])."""
        if not self.config.memory_pool:
            return 0
        return self._plan.pool_bytes - self._plan.rs_bytes + self.rs_buffers.held_bytes()

    def stats(self) -> dict[str, float | int]:
        """Counters of communication and memory since wrapping. On CUDA,
        ``exposed_comm_s`` counts the waits whose events have completed by now (all of
        them once the host has waited for the step, e.g. for its loss)."""
        self.ctx.settle_waits()
        c = self.ctx.counters
        return {
            "all_gathers": c.all_gathers,
            "direct_all_gathers": self.backend.direct_all_gathers,  # written by peers into the pool
            "direct_reduce_scatters": self.backend.direct_reduce_scatters,  # read from peers' pool
            "staged_bytes": self.backend.staged_bytes,  # copied into or out of the backend's scratch
            "reduce_scatters": c.reduce_scatters,
            "all_reduces": c.all_reduces,
            "bytes_gathered": c.bytes_gathered,
            "bytes_reduced": c.bytes_reduced,
            "bytes_moved": c.bytes_gathered + c.bytes_reduced,
            "exposed_comm_s": c.exposed_comm_s,
            "comm_s": self.backend.modelled_comm_s,  # modelled time issued (a virtual backend), else 0
            "comm_late_s": self.backend.late_s,  # a virtual backend's copies past the modelled ends
            "outstanding_handles": self.engine.outstanding(),
            "pool_bytes": self._pool_bytes(),
            "device_heap_bytes": self.backend.device_heap_bytes,  # NVSHMEM's heap: max_memory_allocated misses it
            "live_gathered_bytes": self.pool.live_bytes,
            "peak_live_gathered_bytes": self.pool.peak_live_bytes,
            "slots_held": self.pool.held(),
            "slot_fallbacks": self.pool.fallbacks,
            "rs_buffers_in_use": self.rs_buffers.in_use,
            "rs_buffers_peak": self.rs_buffers.peak_in_use,
        }

    def _check_idle(self, what: str) -> None:
        if self._closed:
            raise RuntimeError(f"{what}: the communicator is closed")
        self.engine.settle(forward=True)  # a backward an exception escaped is ended (no stash is touched)
        if self.engine.phase is Phase.BACKWARD:
            raise RuntimeError(f"{what} must not be called during backward")

    def gather_full(self, unit: BlockUnit, shards: list[torch.Tensor]) -> list[torch.Tensor]:
        """Full tensors from per-parameter shard-shaped tensors of ``unit`` (e.g. the
        shards themselves, or optimizer states shaped like them). Collective over WP:
        one all-gather per dtype among ``shards``; with ``state_sharding="world"``,
        over the replicas first."""
        return self._full.gather_full(unit, shards)

    def shard_of(self, fqn: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's piece of a full tensor shaped like sharded parameter ``fqn``."""
        return self._full.shard_of(fqn, full)

    def is_sharded(self, fqn: str) -> bool:
        return fqn in self._sharded

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has run."""
        return self._closed

    def set_step(self, step: int | None) -> None:
        """The training loop's step number, stamped on every collective of the flight
        record from now on, so that a hang's diagnosis says at which step each rank was."""
        self.ctx.flight.step = step
        self._flight.heartbeat.wake.set()  # the new step's position, published by its thread

    # ---- collectives outside the block schedule (see isp_comm/collectives.py) ---------------
    def all_reduce(self, tensor: torch.Tensor, *, what: str = "an all-reduce") -> torch.Tensor:
        """Sum ``tensor`` in place over the world, through the communicator's backend and
        under its deadline (a step's loss, a metric, a validation total); returns it.
        Collective over the world. ``what`` names it in a timeout's message."""
        self._check_idle("all_reduce()")
        return self.collectives.all_reduce(tensor, self.groups.world_group, self.groups.world_size, what)

    def all_gather_object(self, obj: Any, *, what: str = "an object gather") -> list[Any]:
        """Every rank's picklable ``obj``, in rank order, through the communicator's
        backend and under its deadline. Collective over the world; reads the host, so
        never call it inside a step."""
        self._check_idle("all_gather_object()")
        return self.collectives.all_gather_object(obj, self.groups.world_group, self.groups.world_size, what)

    # ---- full state (see isp_comm/full_state.py) --------------------------------------------
    def full_state_dict(self, cpu: bool = False, rank0_only: bool = False) -> dict[str, torch.Tensor]:
        """The full, unpadded state dict with the original keys and shapes (collective
        over the world: every rank must call it).

        ``cpu``: each full tensor is moved to host memory as soon as its unit is
        gathered, so the device holds one unit's full tensors at a time (as DCP's
        ``StateDictOptions(full_state_dict=True, cpu_offload=True)``). ``rank0_only``:
        the other ranks gather too but keep nothing and return ``{}`` (for exporting
        from rank 0 without every rank holding the whole model)."""
        self._check_idle("full_state_dict()")
        return self._full.full_state_dict(cpu, rank0_only)

    def load_full_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load full (unsharded) weights, e.g. pretrained ones, into the shards."""
        self._check_idle("load_full_state_dict()")
        self._full.load_full_state_dict(state_dict)
        self.params_updated()

    # ---- sharded state (see isp_comm/state.py) ---------------------------------------------
    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
    ) -> torch.Tensor:
        """Clip every gradient by the global norm over the whole model (collective over
        the WP group, or the world with ``state_sharding="world"``); returns the norm
        before clipping, identical on every rank. Call
        it after backward, before ``optimizer.step()``. The stock
        ``torch.nn.utils.clip_grad_norm_`` would see only this rank's shards."""
        self._check_idle("clip_grad_norm_()")  # (a backward that raised: settled there, nothing waits)
        if self.engine.reducer.deferred_backwards:
            self._refuse_deferred("clip_grad_norm_()")
        self.engine.settle()  # an accuracy forward since the backward: its stash goes back
        return self._state.clip_grad_norm_(max_norm, norm_type, error_if_nonfinite)

    def state_dict(self) -> dict[str, Any]:
        """The sharded model state dict: original FQNs; every sharded parameter a DTensor
        of its global shape whose local tensor is this rank's live shard; replicated
        parameters and persistent buffers plain tensors. Nothing is gathered: pass it
        to ``torch.distributed.checkpoint.save`` / ``load``. With
        ``state_sharding="world"`` a sharded parameter's local tensor is this rank's
        piece (see docs/sharding.md), and ``dcp.load``'s writes into it make the WP
        shards be rebuilt before the next forward ([Note: refreshing the WP shards])."""
        self._check_idle("state_dict()")
        return self._state.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict from :meth:`state_dict` (this run's, or another WP size's
        after ``dcp.load``); full tensors are accepted too, each rank keeping its rows.
        Missing or unexpected keys and shape mismatches are a ``ValueError``."""
        self._check_idle("load_state_dict()")
        self._state.load_state_dict(state_dict)
        self.params_updated()

    def optimizer_state_dict(self, opt: torch.optim.Optimizer) -> dict[str, Any]:
        """``opt``'s state keyed by parameter FQN, for any ``torch.optim`` optimizer:
        states shaped like a sharded parameter are DTensors like it (sharing memory).
        A fresh optimizer gets its states first (one step at lr 0 on zero gradients:
        parameters untouched) so that ``dcp.load`` can fill them."""
        self._check_idle("optimizer_state_dict()")
        refresh = self.engine.refresh
        with refresh.unwritten() if refresh is not None else contextlib.nullcontext():  # the step at lr 0
            return self._state.optimizer_state_dict(opt)

    def load_optimizer_state_dict(self, opt: torch.optim.Optimizer, osd: dict[str, Any]) -> None:
        """Load an optimizer state dict from :meth:`optimizer_state_dict` (any WP size)."""
        self._check_idle("load_optimizer_state_dict()")
        self._state.load_optimizer_state_dict(opt, osd)

    # ---- Hugging Face checkpoints (see isp_comm/hf_checkpoint.py) ----------------------------
    def load_hf_checkpoint(self, path: str) -> None:
        """Load a transformers checkpoint folder (``model.safetensors``, or shards with
        ``model.safetensors.index.json``) into the wrapped model: each rank reads only
        its own rows of every sharded tensor (an MoE's, published one tensor per expert,
        the tensors of its own experts: isp_comm/hf_layouts.py). Missing or unexpected
        keys and shape mismatches are a ``ValueError`` naming them. Collective over the
        world."""
        self._check_idle("load_hf_checkpoint()")
        from isp_comm import hf_checkpoint  # DCP's import, only where it is used

        hf_checkpoint.load_hf_checkpoint(self.model, self._state.state_dict(), path)
        self.params_updated()

    def save_hf_checkpoint(self, path: str, max_shard_bytes: int = 5 * 2**30) -> None:
        """Write the model to the folder ``path`` as transformers' ``save_pretrained``
        does (safetensors files of at most ``max_shard_bytes``, an index when there are
        several, ``config.json`` when the model has a transformers config; tied
        weights once; an MoE's experts one tensor each, as ``save_pretrained`` writes
        them). Every rank writes its own rows straight into the final files: no tensor
        is assembled whole. Collective over the world."""
        self._check_idle("save_hf_checkpoint()")
        from isp_comm import hf_checkpoint

        hf_checkpoint.save_hf_checkpoint(self.model, self._state.state_dict(), path, max_shard_bytes)

    def close(self, abandon: bool = False, failed: bool = False) -> None:
        """Drain communication, restore the blocks' forwards and free the pool. At wp > 1
        the parameters stay this rank's shards: a block's forward, or a second wrap,
        then raises saying so (take ``full_state_dict()`` before closing).
        ``abandon``: the step was cut short where peers may not join the collectives in
        flight (a run stopped by a signal in its forward): none is waited for, and their
        buffers are kept ([Note: buffers of a failed step]). A failed wait or an
        unfinished backward abandons them too. ``failed``: the run ends on an error or
        a stop, not done: this rank's last record is not published as a finished run's,
        so a peer's hang diagnosis does not say it finished."""
        if self._closed:
            return
        self._closed = True
        if self._step_hook is not None:
            self._step_hook.remove()
        self._pre_step_hook.remove()
        self._flight.close(failed=self.ctx.failed or failed)
        cut_short = abandon or self.ctx.failed or self.engine.phase is Phase.BACKWARD  # peers may be gone
        if cut_short:
            self.backend.abandon()
        self.engine.close(abandon=abandon)
        self._root_handle.remove()
        self._root_post_handle.remove()
        for handle in (self._chunk_check, self._labels_check, self._wrapper_check, *self._assign_checks):
            if handle is not None:
                handle.remove()
        for module in self._no_copies:
            module.__dict__.pop("__deepcopy__", None)
        for handle in self._state_dict_hooks:
            handle.remove()
        self._state.unhook_optimizers()
        for undo in (self._undo_generate, *self._undo_save):
            if undo is not None:
                undo()
        for unit, fwd in ((self.vocab_unit, self._head_forward), (self.embed_unit, self._embed_forward)):
            if unit is None:
                continue
            if fwd is None:
                del unit.block.forward
            else:
                unit.block.forward = fwd
        if self._undo_sp is not None:
            self._undo_sp()
        for block, fwd in self._orig_forwards:
            if self.groups.wp_size > 1:  # its parameters stay this rank's shards: say so, not a shape error
                block.forward = _closed_block
            elif fwd is None:
                del block.forward
            else:
                block.forward = fwd
            block.__dict__.pop("compile", None)  # BlockCompute's, see [Note: compiled blocks]
        self._buffers.close(cut_short)
        self.backend.close()
        if self._weights_check is not None and not (cut_short or failed) and sys.exc_info()[1] is None:
            self._weights_check.flush()  # after the release, not over an error on its way: the last steps' replicas


def _split(unit: BlockUnit, piece: ShardedParam) -> bool:
    """Whether no rank holds the sharded parameter of ``piece`` whole: the most rows
    any rank holds (the WP chunk, cut again over the replicas with pieces) are fewer
    than the parameter's. The same answer on every rank, as the checks that gather
    over the parameters it picks need (:meth:`ISPCommunicator._check_rows`, the
    weights' check): judged by this rank's own rows, a parameter of one row
    (Qwen2-MoE's ``shared_expert_gate``) was whole on the rank holding that row and
    part on the others, their all-gathers differed in size, and the first training
    forward stopped with "collectives out of step" (a hang on other backends)."""
    whole = next(sp for sp in unit.params if sp.fqn == piece.fqn)  # the WP rows, the same size on every rank
    return -(-whole.chunk_rows // unit.replicas) < whole.rows_shape[0]
