"""ISPCommunicator: WHAT is wrapped. Finds the blocks, shards their linears, wires the rest."""

from __future__ import annotations

import dataclasses
import functools
import gc
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from isp_comm import hf_checkpoint
from isp_comm.backends import make_backend
from isp_comm.config import ISPConfig
from isp_comm.consistency import broadcast_weights, check_same_weights
from isp_comm.embedding import HiddenSplitEmbedding, supports_hidden_split
from isp_comm.groups import ParallelGroups
from isp_comm.hooks.engine import BlockEngine, Phase
from isp_comm.hooks.scheduler import SchedulerHook
from isp_comm.hooks.trace import Tracer
from isp_comm.materialize import materialize_module, materialize_rest, model_initializer
from isp_comm.memory_pool import MemoryPlan, ReduceScatterBuffers, SlotPool, make_plan
from isp_comm.sequence_parallel.apply import apply_sequence_parallel, check_sequence_chunks
from isp_comm.state import ShardedState
from isp_comm.units import BlockUnit, Layout, ReplicatedParam
from isp_comm.vocab_parallel import VocabParallelHead, WPComm, find_output_head, vocab_parallel_cross_entropy

log = logging.getLogger("isp_comm")

_SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


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


def _wrapped_marker(fn: Any) -> bool:
    return getattr(fn, "_isp_comm_wrapped", False)


class ISPCommunicator:
    """Wraps a llama-class model in place for ISP weight parallelism.

    Every ``nn.Linear`` weight and bias inside the blocks becomes this rank's dim-0
    shard (a parameter of the same name); everything else stays replicated. Create the
    optimizer *after* wrapping, on ``model.parameters()``.
    """

    def __init__(
        self,
        model: nn.Module,
        groups: ParallelGroups,
        config: ISPConfig | None = None,
        *,
        blocks: Sequence[nn.Module] | None = None,
        head: nn.Module | None = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        if not isinstance(groups, ParallelGroups):
            raise TypeError(f"groups must be a ParallelGroups, got {type(groups).__name__}")
        self.config = config = config or ISPConfig()
        if not isinstance(config, ISPConfig):
            raise TypeError(f"config must be an ISPConfig, got {type(config).__name__}")
        self.model, self.groups = model, groups
        block_list = list(find_blocks(model) if blocks is None else blocks)
        self._validate(model, block_list)
        names = {m: n for n, m in model.named_modules()}
        device = self._target_device(model)
        if config.sync_module_states:
            broadcast_weights(model)
        else:
            check_same_weights(model, device)
        self.backend = make_backend(config.backend, device, config.timeout_s)
        try:  # before anything is sharded: a refused SP set-up leaves the model as it was
            self._undo_sp = self._apply_sequence_parallel() if groups.sp_size > 1 else None
        except Exception:
            self.backend.close()
            raise

        n_ckpt = round(config.activation_checkpointing * len(block_list))
        # a module still on meta: real and initialised (see isp_comm/materialize.py)
        init = model_initializer(model)
        materialize = functools.partial(materialize_module, device=device, seed=config.init_seed, init=init)
        units: list[BlockUnit] = []
        in_blocks: set[int] = set()
        for i, block in enumerate(block_list):
            linears = [(names[m], m) for m in block.modules() if isinstance(m, nn.Linear)]
            sharded = {id(p) for _, m in linears for p in m.parameters(recurse=False)}
            replicated = [
                ReplicatedParam(m, pn, p)
                for m in block.modules()
                for pn, p in m.named_parameters(recurse=False)
                if id(p) not in sharded
            ]
            kw = {"param_dtype": config.param_dtype, "reduce_dtype": config.reduce_dtype, "materialize": materialize}
            unit = BlockUnit(i, block, linears, replicated, groups.wp_size, groups.wp_rank, device, **kw)
            units.append(unit)
            in_blocks |= {id(s) for s in unit.shards}
        self.units = units
        self.vocab_unit = None
        if config.vocab_parallel:
            head = find_output_head(model, head, block_list)
            g = groups
            self.vocab_unit = BlockUnit(
                -2, head, [(names[head], head)], [], g.wp_size, g.wp_rank, device, ("weight",), materialize=materialize
            )
            in_blocks |= {id(s) for s in self.vocab_unit.shards}
        self.root = self.embed_unit = None
        if config.shard_outer_params:
            inside = {id(m) for b in block_list for m in b.modules()}
            if self.vocab_unit is not None:
                inside.add(id(self.vocab_unit.block))
            emb = self._hidden_split_embedding(model, inside)
            if emb is not None:  # split along hidden and never gathered (isp_comm/embedding.py)
                g = groups
                self.embed_unit = BlockUnit(
                    -3, emb, [(names[emb], emb)], [], g.wp_size, g.wp_rank, device, ("weight",),
                    dim1=frozenset({id(emb.weight)}), materialize=materialize,
                )  # fmt: skip
                inside.add(id(emb))
                in_blocks |= {id(s) for s in self.embed_unit.shards}
            owners = [(n, m) for n, m in model.named_modules() if id(m) not in inside and m._parameters]
            if owners:
                # embeddings split along the hidden dim, the rest (head: vocab) along dim 0; a
                # weight tied to a linear follows the linear
                in_linear = {id(p) for _, m in owners if isinstance(m, nn.Linear) for p in m.parameters(False)}
                dim1 = frozenset(
                    id(m.weight) for _, m in owners if isinstance(m, nn.Embedding) and id(m.weight) not in in_linear
                )
                wp, rank = groups.wp_size, groups.wp_rank
                self.root = BlockUnit(
                    -1, model, owners, [], wp, rank, device, names=None, dim1=dim1, materialize=materialize
                )
                in_blocks |= {id(s) for s in self.root.shards}
        self._sharded = {sp.fqn: (unit, sp) for unit in self.sharded_units for sp in unit.params}
        for unit in self.sharded_units:  # tied weights: every owner's key maps to the one shard
            self._sharded.update({fqn: (unit, unit.params[i]) for _, _, i, fqn in unit.aliases})
        materialize_rest(model, materialize)  # what is still on meta lies outside the units
        self._state = ShardedState(model, groups, self._sharded, self.sharded_units, device)
        replicated_all = [p for p in model.parameters() if id(p) not in in_blocks]

        alloc = functools.partial(self._alloc, device=units[0].device)
        gdt = [(u.gather_dtype, u.gathered_numel) for u in units]
        rdt = [(g.dtype, g.gathered_numel) for u in units for g in u.full_groups]  # frozen ones may thaw
        landing = config.comm_granularity == "block"
        self._plan = make_plan(gdt, rdt, config.n_slots, config.max_inflight_reduce_scatter, groups.wp_size, landing)
        check = getattr(self.backend, "check_capacity", None)  # shared memory: reserve, or fall back, all alike
        if check is not None:
            shm = check(*self._shared_memory_need(replicated_all))
            if not getattr(self.backend, "disabled", False):
                self._plan = dataclasses.replace(self._plan, shm_bytes=shm)
        self.pool = SlotPool(self._plan, alloc, pooled=config.memory_pool)
        self.rs_buffers = ReduceScatterBuffers(self._plan, alloc, pooled=config.memory_pool)
        self.engine = BlockEngine(
            units, groups, self.backend, config, self.pool, self.rs_buffers, replicated_all, self.root
        )
        if groups.rank == 0:
            log.info(self._plan.describe())
        self._head_forward = self._embed_forward = None
        wp_comm = WPComm(groups.wp_group, groups.wp_size, groups.wp_rank, self.backend, self.engine._wait)
        if self.vocab_unit is not None:
            vu = self.vocab_unit
            self.engine.wp_summed += list(vu.shards)
            self._vocab = (wp_comm, groups.wp_rank * vu.params[0].chunk_rows)
            self._head_forward = vu.block.__dict__.get("forward")
            vu.block.forward = VocabParallelHead(vu.block, self._vocab[1], wp_comm)
        if self.embed_unit is not None:
            eu = self.embed_unit
            self.engine.wp_summed += list(eu.shards)
            self._embed_forward = eu.block.__dict__.get("forward")
            eu.block.forward = HiddenSplitEmbedding(
                eu.block, eu.params[0].shape[1], eu.params[0].chunk_rows, wp_comm, config.param_dtype
            )

        self._orig_forwards: list[tuple[nn.Module, Any]] = []
        for unit in units:
            self._wrap_forward(unit, checkpointed=unit.index < n_ckpt)
        self._root_handle = model.register_forward_pre_hook(lambda _m, _a: self.engine.root_pre_forward())
        self._root_post_handle = model.register_forward_hook(lambda _m, _a, _o: self.engine.root_post_forward())
        self._chunk_check = None
        if groups.sp_size > 1:
            g = groups

            def check(_m: nn.Module, args: tuple, kwargs: dict) -> None:
                check_sequence_chunks(args, kwargs, g.sp_group, g.sp_size, self.backend, self.engine._wait)

            self._chunk_check = model.register_forward_pre_hook(check, with_kwargs=True, prepend=True)
        self._closed = False

    @staticmethod
    def _hidden_split_embedding(model: nn.Module, inside: set[int]) -> nn.Embedding | None:
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

    def _shared_memory_need(self, replicated: list[nn.Parameter]) -> tuple[int, list[int]]:
        """What one rank puts in shared memory: the pool's symmetric buffers (when
        pooled over more than one rank), and the largest collective of each group
        that uses the backend's scratch (WP gathers, replica and world all-reduces)."""
        g = self.groups
        buffers = self._plan.pool_bytes if self.config.memory_pool and g.wp_size > 1 else 0
        units = [u for u in (*self.units, self.root) if u is not None]  # what is ever gathered
        largest = []
        if g.wp_size > 1:
            largest.append(max(u.gathered_numel * u.flat_shard.element_size() for u in units))
        if g.replica_size > 1:
            largest.append(max(u.flat_shard.numel() * u.flat_shard.element_size() for u in units))
        if g.world_size > 1 and replicated:
            largest.append(sum(p.numel() * p.element_size() for p in replicated))
        return buffers, largest

    @property
    def sharded_units(self) -> list[BlockUnit]:
        """The blocks, then the outer parameters' unit and the vocab-parallel head's,
        when they exist."""
        return [*self.units, *(u for u in (self.root, self.vocab_unit, self.embed_unit) if u is not None)]

    # ---- construction helpers ----------------------------------------------------------
    def _apply_sequence_parallel(self) -> Callable[[], None]:
        def trace() -> Tracer | None:
            return self.engine.tracer

        g = self.groups
        return apply_sequence_parallel(self.model, g.sp_group, g.sp_size, self.backend, self.config.timeout_s, trace)

    def cross_entropy(self, logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
        """This rank's mean cross-entropy over its own tokens: ``F.cross_entropy`` on
        ordinary logits, the vocab-parallel loss on the head's vocab-sharded logits
        when ``ISPConfig(vocab_parallel=True)``."""
        if self.vocab_unit is None:
            return F.cross_entropy(logits.flatten(0, -2), labels.flatten(), ignore_index=ignore_index)
        wp_comm, vocab_start = self._vocab
        return vocab_parallel_cross_entropy(logits, labels, wp_comm, vocab_start, ignore_index)

    def _alloc(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        # a fixed pool is allocated once, collectively: symmetric buffers the WP peers
        # write into; per-gather allocations (memory_pool=False) are plain
        group = self.groups.wp_group if self.config.memory_pool else None
        return self.backend.empty(numel, dtype, device, group)

    @staticmethod
    def _target_device(model: nn.Module) -> torch.device:
        real = {p.device for p in model.parameters() if p.device.type != "meta"}
        if real:
            return real.pop()
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")

    @staticmethod
    def _validate(model: nn.Module, blocks: list[nn.Module]) -> None:
        if not blocks:
            raise ValueError("the block list is empty: ISP needs at least one transformer block")
        for i, b in enumerate(blocks):
            if not isinstance(b, nn.Module):
                raise TypeError(f"block {i} is a {type(b).__name__}, not an nn.Module")
            if _wrapped_marker(b.__dict__.get("forward")):
                raise ValueError("this model is already wrapped by an ISPCommunicator (close() it first)")
            if not any(isinstance(m, nn.Linear) for m in b.modules()):
                raise ValueError(f"block {i} ({type(b).__name__}) has no nn.Linear layers to shard")
        _refuse_stale_optimizers(model)
        devices = {p.device for p in model.parameters() if p.device.type != "meta"}
        if len(devices) > 1:
            raise ValueError(f"model parameters are on several devices {sorted(map(str, devices))}")
        for name, p in model.named_parameters():
            if p.dtype not in _SUPPORTED_DTYPES:
                raise ValueError(f"parameter {name} has unsupported dtype {p.dtype} (use {_SUPPORTED_DTYPES})")

    def _wrap_forward(self, unit: BlockUnit, checkpointed: bool) -> None:
        block = unit.block
        orig = block.forward
        engine = self.engine

        def isp_forward(*args: Any, **kwargs: Any) -> Any:
            return engine.block_forward(unit, orig, args, kwargs)

        if checkpointed:

            def forward(*args: Any, **kwargs: Any) -> Any:
                if not torch.is_grad_enabled():
                    return isp_forward(*args, **kwargs)
                return checkpoint(isp_forward, *args, use_reentrant=False, **kwargs)
        else:
            forward = isp_forward
        forward._isp_comm_wrapped = True  # type: ignore[attr-defined]
        self._orig_forwards.append((block, block.__dict__.get("forward")))
        block.forward = forward

    # ---- public API ---------------------------------------------------------------------
    def scheduler_hook(self) -> SchedulerHook:
        """Hooks for a training loop: before/after forward, before/after backward."""
        return SchedulerHook(self.engine)

    def memory_plan(self) -> MemoryPlan:
        """Slot sizes per dtype, which block sets them, and the pool's total bytes."""
        return self._plan

    def record_events(self, enabled: bool = True) -> list[tuple[str, int, str]]:
        """Start (or stop) recording (kind, block, phase) events: gathers, computes, reduces."""
        self.engine.events = [] if enabled else None
        return self.engine.events

    def start_trace(self) -> None:
        """Record compute and communication spans from now on (see ``trace_spans``)."""
        self.engine.tracer = Tracer()

    def stop_trace(self) -> list[tuple[str, str, float, float]]:
        """Stop recording; the (lane, name, start_s, end_s) spans since ``start_trace``."""
        tracer, self.engine.tracer = self.engine.tracer, None
        return list(tracer.spans) if tracer is not None else []

    def stats(self) -> dict[str, float | int]:
        """Counters of communication and memory since wrapping."""
        c = self.engine.counters
        return {
            "all_gathers": c.all_gathers,
            "direct_all_gathers": getattr(self.backend, "direct_all_gathers", 0),  # written by peers into the pool
            "direct_reduce_scatters": getattr(self.backend, "direct_reduce_scatters", 0),  # read from peers' pool
            "reduce_scatters": c.reduce_scatters,
            "all_reduces": c.all_reduces,
            "bytes_gathered": c.bytes_gathered,
            "bytes_reduced": c.bytes_reduced,
            "bytes_moved": c.bytes_gathered + c.bytes_reduced,
            "exposed_comm_s": c.exposed_comm_s,
            "outstanding_handles": self.engine.outstanding(),
            "pool_bytes": self._plan.pool_bytes if self.config.memory_pool else 0,
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
        if self.engine.phase is Phase.BACKWARD:
            raise RuntimeError(f"{what} must not be called during backward")

    @torch.no_grad()
    def gather_full(self, unit: BlockUnit, shards: list[torch.Tensor]) -> list[torch.Tensor]:
        """Full tensors from per-parameter shard-shaped tensors of ``unit`` (e.g. the
        shards themselves, or optimizer states shaped like them). Collective over WP:
        one all-gather per dtype among ``shards``."""
        fulls: list[torch.Tensor | None] = [None] * len(shards)
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i, t in enumerate(shards):
            by_dtype.setdefault(t.dtype, []).append(i)
        for dt, members in by_dtype.items():
            params = [unit.params[i] for i in members]
            layout = Layout.packed(params, raw=False)
            flat = torch.zeros(layout.numel, dtype=dt, device=unit.device)
            for sp, off, i in zip(params, layout.offsets, members):
                sp.user(flat[off : off + sp.valid_rows * sp.inner].view(sp.shard_shape)).copy_(shards[i])
            rank_major = torch.empty(unit.wp_size * layout.numel, dtype=dt, device=unit.device)
            what = f"gather of block {unit.index}"
            self.engine._wait(self.backend.all_gather(rank_major, flat, self.groups.wp_group), what)
            w = unit.wp_size
            per_rank = rank_major.view(w, layout.numel)
            for sp, off, size, i in zip(params, layout.offsets, layout.sizes, members):
                rows = per_rank[:, off : off + size].reshape(w * sp.chunk_rows, *sp.rows_shape[1:])
                fulls[i] = sp.user(rows[: sp.rows_shape[0]]).contiguous()
        return fulls  # type: ignore[return-value]

    def shard_of(self, fqn: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's piece of a full tensor shaped like sharded parameter ``fqn``."""
        unit, sp = self._sharded[fqn]
        return sp.rows_of(full, unit.wp_rank)

    def is_sharded(self, fqn: str) -> bool:
        return fqn in self._sharded

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The full, unpadded state dict with the original keys and shapes (collective)."""
        self._check_idle("full_state_dict()")
        sd = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        for unit in self.sharded_units:
            fulls = self.gather_full(unit, list(unit.shards))
            for sp, full in zip(unit.params, fulls):
                sd[sp.fqn] = full
            for _, _, i, fqn in unit.aliases:
                if fqn in sd:
                    sd[fqn] = fulls[i]
        return sd

    @torch.no_grad()
    def load_full_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load full (unsharded) weights, e.g. pretrained ones, into the shards."""
        self._check_idle("load_full_state_dict()")
        sharded = self._sharded
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

    # ---- sharded state (see isp_comm/state.py) ---------------------------------------------
    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
    ) -> torch.Tensor:
        """Clip every gradient by the global norm over the whole model (collective over
        the WP group); returns the norm before clipping, identical on every rank. Call
        it after backward, before ``optimizer.step()``. The stock
        ``torch.nn.utils.clip_grad_norm_`` would see only this rank's shards."""
        self._check_idle("clip_grad_norm_()")
        return self._state.clip_grad_norm_(max_norm, norm_type, error_if_nonfinite)

    def state_dict(self) -> dict[str, Any]:
        """The sharded model state dict: original FQNs; every sharded parameter a DTensor
        of its global shape whose local tensor is this rank's live shard; replicated
        parameters and persistent buffers plain tensors. Nothing is gathered: pass it
        to ``torch.distributed.checkpoint.save`` / ``load``."""
        self._check_idle("state_dict()")
        return self._state.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict from :meth:`state_dict` (this run's, or another WP size's
        after ``dcp.load``); full tensors are accepted too, each rank keeping its rows.
        Missing or unexpected keys and shape mismatches are a ``ValueError``."""
        self._check_idle("load_state_dict()")
        self._state.load_state_dict(state_dict)

    def optimizer_state_dict(self, opt: torch.optim.Optimizer) -> dict[str, Any]:
        """``opt``'s state keyed by parameter FQN, for any ``torch.optim`` optimizer:
        states shaped like a sharded parameter are DTensors like it (sharing memory).
        A fresh optimizer gets its states first (one step at lr 0 on zero gradients:
        parameters untouched) so that ``dcp.load`` can fill them."""
        self._check_idle("optimizer_state_dict()")
        return self._state.optimizer_state_dict(opt)

    def load_optimizer_state_dict(self, opt: torch.optim.Optimizer, osd: dict[str, Any]) -> None:
        """Load an optimizer state dict from :meth:`optimizer_state_dict` (any WP size)."""
        self._check_idle("load_optimizer_state_dict()")
        self._state.load_optimizer_state_dict(opt, osd)

    # ---- Hugging Face checkpoints (see isp_comm/hf_checkpoint.py) ----------------------------
    def load_hf_checkpoint(self, path: str) -> None:
        """Load a transformers checkpoint folder (``model.safetensors``, or shards with
        ``model.safetensors.index.json``) into the wrapped model: each rank reads only
        its own rows of every sharded tensor. Missing or unexpected keys and shape
        mismatches are a ``ValueError`` naming them. Collective over the world."""
        self._check_idle("load_hf_checkpoint()")
        hf_checkpoint.load_hf_checkpoint(self.model, self._state.state_dict(), path)

    def save_hf_checkpoint(self, path: str, max_shard_bytes: int = 5 * 2**30) -> None:
        """Write the model to the folder ``path`` as transformers' ``save_pretrained``
        does (safetensors files of at most ``max_shard_bytes``, an index when there are
        several, ``config.json`` when the model has a transformers config; tied
        weights once). Streamed: every rank writes its own shards, then the ranks
        assemble the output files one tensor at a time. Collective over the world."""
        self._check_idle("save_hf_checkpoint()")
        hf_checkpoint.save_hf_checkpoint(self.model, self._state.state_dict(), path, max_shard_bytes)

    def close(self) -> None:
        """Drain communication, restore the blocks' forwards and free the pool."""
        if self._closed:
            return
        self._closed = True
        self.engine.close()
        self._root_handle.remove()
        self._root_post_handle.remove()
        if self._chunk_check is not None:
            self._chunk_check.remove()
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
            if fwd is None:
                del block.forward
            else:
                block.forward = fwd
        self.pool.close()
        self.rs_buffers.close()
        self.backend.close()
