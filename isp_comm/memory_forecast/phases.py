"""The phases: what each adds to the persistent parts, and :func:`forecast`, which
puts the weights, the activations and the pool together (see the package note)."""

from __future__ import annotations

import dataclasses
import itertools
from collections import Counter, deque
from collections.abc import Callable, Sequence
from typing import Literal

import torch
from torch import nn

from isp_comm.backends import backend_class
from isp_comm.config import ISPConfig
from isp_comm.discovery import find_blocks
from isp_comm.memory_forecast.activations import Traced, loss_bytes, trace
from isp_comm.memory_forecast.pool import host_shared_memory, nvshmem_heap, pool_plan, shared_pages
from isp_comm.memory_forecast.result import MemoryForecast, Optimizer
from isp_comm.memory_forecast.weights import Weights, cpu_runtime, cuda_runtime, master_bytes, unit_layouts, weights
from isp_comm.memory_pool import MemoryPlan, releases_reduce_buffers


def _validate(model: nn.Module, world: int, wp: int, sp: int, batch: int, seq: int, optimizer: str, memo: dict) -> None:
    if world < 1 or sp < 1 or world % sp or world % wp or wp < 1:
        raise ValueError(f"world {world} must be a multiple of wp {wp} and of sp {sp}")
    dp = world // sp
    if batch % dp:
        raise ValueError(f"batch {batch} must be a multiple of world / sp = {dp} (sequences per rank)")
    if seq % sp:
        raise ValueError(f"seq {seq} must be a multiple of sp {sp}")
    if optimizer not in ("adamw", "sgd", "sgd_momentum"):
        raise ValueError(f"optimizer must be 'adamw', 'sgd' or 'sgd_momentum', got {optimizer!r}")
    if "on meta" not in memo and any(p.device.type != "meta" for p in model.parameters()):
        raise ValueError("forecast() needs a model built under torch.device('meta')")


def forecast(
    model: nn.Module,
    config: ISPConfig | None,
    world: int,
    wp: int | None,
    sp: int,
    batch: int,
    seq: int,
    optimizer: Optimizer = "adamw",
    *,
    device: Literal["cpu", "cuda"] = "cpu",
    local_world: int | None = None,
    blocks: Sequence[nn.Module] | None = None,
    head: nn.Module | None = None,
    forward: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None = None,
    memo: dict | None = None,
    evaluate: bool = False,
    cuda_workspace: int | None = None,
    compiled: bool | None = None,
    grad_accum: int = 1,
    deferred_replica_sync: bool = False,
) -> MemoryForecast:
    """The memory of every rank of an ISP run, phase by phase (see the package note).

    ``model``: built under ``torch.device("meta")`` (never touched: a copy is traced);
    ``config``: the communicator's (``None``: the defaults); ``world``/``wp``/``sp``:
    the run's sizes (``wp=None``: ``world // sp``);
    ``batch``: sequences per optimizer micro-step over the whole job, ``seq`` their
    length (each rank gets ``batch / (world / sp)`` sequences of ``seq / sp`` tokens,
    as isp-train splits them); ``optimizer``: what holds state per parameter;
    ``device``: where the parameters live; ``local_world``: ranks per host (for the
    shared memory; default all); ``forward(model, input_ids) -> logits``: how to call
    the model (default: transformers models with ``use_cache=False``, else
    ``model(input_ids)``); ``memo``: a dict kept across calls on the same model, which
    reuses its layouts and traces (the planner's search forecasts many layouts);
    ``evaluate``: the run validates (``--eval-every``): an ``evaluate`` phase;
    ``cuda_workspace``: on CUDA, the bytes of one cuBLAS workspace (default: as torch
    sizes it on this machine's GPU, :func:`.weights.cublas_workspace_bytes`);
    ``compiled``: the blocks run compiled (``isp-train --compile``; ``None``: where a
    block was given ``block.compile()``; [Note: what a compiled block saves]);
    ``grad_accum``: micro-steps per optimizer step (the later ones hold the earlier
    ones' gradients: [Note: what an accumulation holds]);
    ``deferred_replica_sync``: the micro-steps of an accumulation but the last defer
    their replica reductions (``ISPCommunicator.set_requires_replica_sync``; nothing
    without replicas or accumulation): the sums they keep instead of gradient shards."""
    config = config or ISPConfig()
    wp = wp or world // sp
    memo = {} if memo is None else memo
    _validate(model, world, wp, sp, batch, seq, optimizer, memo)
    memo["on meta"] = True
    block_list = list(find_blocks(model) if blocks is None else blocks)
    layouts, w = _layouts_and_weights(model, block_list, config, head, world, wp, optimizer, memo)
    plan = pool_plan(layouts, config, wp)
    shm = host_shared_memory(plan, layouts, config, device, (world, wp), w.replicated, local_world)
    n_ckpt = config.checkpointed_blocks(len(block_list))
    traced = _traced(model, block_list, config, (world, wp, sp, batch, seq), forward, memo, compiled)
    acts = [traced.inputs[i] if i < n_ckpt else traced.saved[i] for i in range(len(block_list))]
    heap, in_heap = nvshmem_heap(plan, layouts, config, device, (world, wp), w.replicated)
    release = (_releases_pairs(config, device) or not config.memory_pool) and not in_heap  # pairs in backward only
    persistent = _persistent(plan, w, in_heap, release, config.memory_pool)
    steady = _steady(persistent, w, (plan, layouts, config), device, (world, wp), cuda_workspace)
    phases = {"wrap": _wrap(persistent, w, device)}
    grads = {i: master_bytes(lay) for i, lay, tr in layouts if any(tr)}  # each unit's gradient shard
    blocks = [(lay, tr, grads.get(i, 0)) for i, lay, tr in layouts if i >= 0]
    made = _made_in_backward(plan, blocks, config, release, persistent["pool slots and landing"])
    acc = _accumulation(layouts, grad_accum, world > wp and deferred_replica_sync)
    phases.update(_step(steady, w, traced, acts, n_ckpt, blocks, grads.get(-2, 0), config.vocab_parallel, made, acc))
    phases["optimizer"] = _optimizer(steady, w, optimizer, device)
    phases.update({"evaluate": _evaluate(steady, w, traced)} if evaluate else {})
    staging = _checkpoints(phases, steady, w, device)
    return MemoryForecast(
        phases={ph: {k: v for k, v in parts.items() if v} for ph, parts in phases.items()},
        shm_bytes=shm,
        host_staging=staging if device == "cuda" else {},
        activations_by_block=acts,
        device_heap_bytes=heap,
    )


def _traced(
    model: nn.Module,
    block_list: list[nn.Module],
    config: ISPConfig,
    shape: tuple[int, int, int, int, int],
    forward: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None,
    memo: dict,
    compiled: bool | None,
) -> Traced:
    """The meta trace at a rank's local shape (``shape``: world, wp, sp, batch, seq),
    kept in ``memo``, with the vocab-parallel head's input; ``compiled=None``:
    compiled where a block was given ``block.compile()``."""
    world, wp, sp, batch, seq = shape
    if compiled is None:
        compiled = any(getattr(b, "_compiled_call_impl", None) is not None for b in block_list)
    local = (batch // (world // sp), seq // sp)
    key = ("trace", *local, config.param_dtype, compiled)
    if key not in memo:
        memo[key] = trace(model, block_list, *local, config.param_dtype, forward, memo, compiled=compiled)
    return _vocab_parallel_input(memo[key], config, wp)


def _vocab_parallel_input(traced: Traced, config: ISPConfig, wp: int) -> Traced:
    """The vocab-parallel head's input is the WP group's hidden states, gathered, which
    its linear saves for backward: ``wp - 1`` more of them than the traced (unsharded)
    head's this rank's alone (a hidden state is the size of a block's input)."""
    if not (config.vocab_parallel and wp > 1 and traced.inputs):
        return traced
    return dataclasses.replace(traced, outer_saved=traced.outer_saved + (wp - 1) * traced.inputs[-1])


def _layouts_and_weights(
    model: nn.Module,
    block_list: list,
    config: ISPConfig,
    head: nn.Module | None,
    world: int,
    wp: int,
    optimizer: str,
    memo: dict,
) -> tuple[list, Weights]:
    """Every unit's layout on rank 0 (with pieces when the state is sharded over the
    world) and the weights' parts, kept in ``memo``."""
    replicas = world // wp if config.state_sharding == "world" else 1
    key = ("layouts", wp, replicas, config.shard_outer_params, config.vocab_parallel, config.param_dtype)
    key += (config.reduce_dtype,)
    if key not in memo:
        memo[key] = unit_layouts(model, block_list, config, head, wp, replicas)
    layouts, replicated = memo[key]
    wkey = (*key, "weights", optimizer)
    if wkey not in memo:
        memo[wkey] = weights(layouts, replicated, optimizer, config.param_dtype)
    return layouts, memo[wkey]


def _checkpoints(phases: dict, steady: dict[str, int], w: Weights, device: str) -> dict[str, int]:
    """The save, async save and load phases (into ``phases``), and DCP's staging per
    phase: on CUDA it is host memory (pinned for async saves), not the device's."""
    staging = {"save": w.largest_item, "async_save": w.master + w.replicated + w.opt_state, "load": 2 * w.largest_item}
    for ph, nbytes in staging.items():
        phases[ph] = {**steady, **({} if device == "cuda" else {"checkpoint staging": nbytes})}
    return staging


def _releases_pairs(config: ISPConfig, device: str) -> bool:
    """Whether the run gives its reduce-scatter pairs back between backwards: as the
    communicator decides it, from the class of the backend ``config`` names."""
    symmetric = backend_class(config.backend, device).symmetric_buffers
    return releases_reduce_buffers(config.release_reduce_buffers, device, symmetric)


def _pairs_made(plan: MemoryPlan, blocks: list[tuple[object, list[bool], int]], config: ISPConfig) -> list[int]:
    """With the pairs given back between backwards ([Note: reduce-scatter pairs between
    backwards] in ``isp_comm/memory_pool/slots.py``): the bytes of the pairs alive when
    block i reduces, its own included, replaying the engine's bound of
    ``max_inflight_reduce_scatter`` reduces in flight (one without ``overlap``: each is
    completed as it is issued; a pair is made when a reduce finds none of its dtype
    free), from the last block back. Without the pool (``memory_pool=False``) a pair is
    made for each reduce, as large as its group, and freed when it completes: the
    pairs alive are those in flight."""
    k = config.max_inflight_reduce_scatter if config.overlap else 1
    inflight: deque = deque()
    free: Counter = Counter()
    made: Counter = Counter()
    alive = []
    for lay, tr, _ in reversed(blocks):
        for g in [g for g in lay.full_groups if any(tr[i] for i in g.members)]:  # the groups it reduces
            while len(inflight) >= k:
                free[inflight.popleft()[0]] += 1
            if free[g.dtype]:
                free[g.dtype] -= 1
            else:
                made[g.dtype] += 1
            inflight.append((g.dtype, sum(g.pair_numels) * g.dtype.itemsize))  # what the engine makes for it
        if config.memory_pool:
            alive.append(sum(n * plan.rs_pair_bytes(dt) for dt, n in made.items()))
        else:
            alive.append(sum(nbytes for _, nbytes in inflight))
    return alive[::-1]


def _made_in_backward(
    plan: MemoryPlan, blocks: list[tuple[object, list[bool], int]], config: ISPConfig, release: bool, kept: int
) -> tuple[list[int], list[int]]:
    """Per block, what its backward's moment holds beyond the persistent parts: the
    reduce-scatter pairs alive (when they are not kept all run) and, without the pool,
    the slots alive with the cast send buffer kept (``kept``); zeros where persistent."""
    pairs = _pairs_made(plan, blocks, config) if release else [0] * len(blocks)
    slots = [0] * len(blocks) if config.memory_pool else [kept + s for s in _slots_made(blocks, config.n_slots)]
    return pairs, slots


def _slots_made(blocks: list[tuple[object, list[bool], int]], n_slots: int) -> list[int]:
    """Without the pool (``memory_pool=False``, [Note: slot lifetime] in
    ``isp_comm/memory_pool/slots.py``), a slot is made when a block is gathered and
    freed when it is released: while block i's backward computes, its own slot and
    those of the ``n_slots - 1`` blocks before it, prefetched, are alive (none at the
    loss, after the forward has released every block)."""
    own = [lay.gathered_numel * lay.gather_dtype.itemsize for lay, _, _ in blocks]
    return [sum(own[max(0, i - n_slots + 1) : i + 1]) for i in range(len(own))]


def _persistent(plan: MemoryPlan, w: Weights, in_heap: int, release: bool, pooled: bool) -> dict[str, int]:
    """What every phase holds; ``in_heap``: the bytes of the pool and of the master
    shards that NVSHMEM's heap holds, which the allocator does not see (0: none);
    ``release``: the reduce-scatter pairs live only in a backward's blocks;
    ``pooled=False`` (``memory_pool=False``): of the pool, only the cast send buffer
    the gathers keep (the slots live only in the blocks' backward, :func:`_slots_made`)."""
    moved = in_heap - plan.pool_bytes if in_heap else 0
    gathered = plan.pool_bytes - plan.rs_bytes if pooled else sum(n * dt.itemsize for dt, n in plan.send_numel.items())
    return {
        "master shards": w.master - moved,
        "WP shards (gather dtype)": w.wp_shards,
        "replicated params": w.replicated,
        "pool slots and landing": 0 if in_heap else gathered,
        "reduce-scatter buffers": 0 if in_heap or release else plan.rs_bytes,
    }


def _wrap(persistent: dict[str, int], w: Weights, device: str) -> dict[str, int]:
    """Wrapping: the persistent parts and one sharded module made real whole. The pool
    and reduce-scatter buffers are allocated but not written: on CPU their pages are
    not resident until used. The sharded modules are made real one by one (each whole
    until its rows are taken), before the replicated ones: the peak is the larger of
    the two moments."""
    untouched = ("pool slots and landing", "reduce-scatter buffers") if device == "cpu" else ()
    wrap = {k: v for k, v in persistent.items() if k not in untouched}
    return {**wrap, "one module materialised": max(0, w.largest_module - w.replicated)}


def _steady(
    persistent: dict[str, int], w: Weights, run: tuple, device: str, sizes: tuple[int, int], cuda_workspace: int | None
) -> dict[str, int]:
    """What every phase of a step holds: the persistent parts, the optimizer state, the
    flat buffers of the gradients autograd leaves whole, all-reduced (kept across steps;
    the WP-summed shards' only with replicas: without, they are divided where they are),
    the replica gathers' buffers and the runtimes' own."""
    (plan, layouts, config), (world, wp) = run, sizes
    allreduce = sum(w.replicated_trainable) + (w.wp_summed if world > wp else 0) if world > 1 else 0
    return {
        **persistent,
        "optimizer state": w.opt_state,
        "all-reduce buffers": allreduce,
        "replica gather buffers": w.refresh,
        **cuda_runtime(device, cuda_workspace),
        **cpu_runtime(device, world, config.param_dtype),
        **shared_pages(plan, layouts, config, device, (world, wp), sum(w.replicated_trainable)),
    }


@dataclasses.dataclass(frozen=True)
class _Accumulation:
    """[Note: what an accumulation holds]
    A micro-step after an accumulation's first holds what the ones before it left: every
    unit's gradient shard and the replicated parameters' gradients, through its forward
    and backward (in whose backward the replicated ones and the whole gradients of the
    WP-summed rows without pieces, the vocab-parallel head's, are set aside while this
    backward's arrive: two of them at once, see [Note: bucketed whole gradients]). With
    the replica reductions deferred ([Note: replica reductions deferred] in
    ``isp_comm/hooks/reductions.py``), the deferred sums instead of the gradient
    shards, and the whole gradients summed by autograd in ``.grad`` (in a backward, a
    new one beside the sum it is added into, one parameter's at a time). The syncing
    backward then takes the head's sum first and writes its piece; at block i it holds
    the sums of blocks 0..i+1 (block i+1's is taken when block i's reduce-scatter is
    issued) and the shards of blocks i+2 on (block i+1's is written when its reduce
    completes), and the outer unit's and the embedding's sums to its end. The first
    micro-step holds a subset of this. Every backward ends with all the shards written
    and the activations gone: a moment of its own."""

    micro_steps: int = 1
    deferred: tuple[int, ...] = ()
    """Per block, the bytes of its deferred sums (empty: not deferred)."""
    head_sum: int = 0
    """The vocab-parallel head's deferred sum (pieces), taken before the blocks' backward."""
    outer_sums: int = 0
    """The outer unit's and the hidden-split embedding's deferred sums, held to the backward's end."""
    head_whole: int = 0
    """The vocab-parallel head's gradient when it is whole (no pieces): autograd's, summed in ``.grad``."""
    embed_whole: int = 0
    """The hidden-split embedding's, likewise (its gradient comes last in a backward)."""


def _accumulation(layouts: list, micro_steps: int, deferred: bool) -> _Accumulation:
    """The accumulation's parts (see :class:`_Accumulation`). A deferred sum is each
    trainable reduce group's WP shard in its reduce dtype, replica-major (the pieces'
    input) for the WP-summed rows with pieces; none for the WP-summed rows without
    pieces, whose gradients autograd leaves whole and sums in ``.grad``."""
    if micro_steps < 1:
        raise ValueError(f"grad_accum must be >= 1, got {micro_steps}")
    per_unit, whole = {}, {}
    for i, lay, tr in layouts if micro_steps > 1 else ():
        summed = i in (-2, -3)
        if summed and lay.replicas == 1:
            whole[i] = master_bytes(lay) if any(tr) else 0
            continue
        groups = lay.reduce_groups(tuple(tr)) if deferred and any(tr) else ()
        per_unit[i] = sum((g.scattered_numel if summed else g.shard_numel) * g.dtype.itemsize for g in groups)
    blocks = tuple(per_unit.get(i, 0) for i, _, _ in layouts if i >= 0) if deferred else ()
    outer = per_unit.get(-1, 0) + per_unit.get(-3, 0)
    return _Accumulation(micro_steps, blocks, per_unit.get(-2, 0), outer, whole.get(-2, 0), whole.get(-3, 0))


def _accumulated(acc: _Accumulation, w: Weights, later: list[int], at: int | None) -> list[dict[str, int]]:
    """The gradient parts at a moment of a step's backward (``at``: block ``at``'s;
    ``len(later) - 1``: the end, every shard written; ``None``: its forward, or its
    loss's backward, before any block), one dict per kind of micro-step it may be
    ([Note: what an accumulation holds]); ``later[j]``: the gradient shards of blocks j
    on and the head's."""
    repl, n = sum(w.replicated_trainable), len(later) - 1  # repl: upper bound, the embedding's comes last
    if acc.micro_steps > 1 and acc.deferred:
        sums = sum(acc.deferred) + acc.head_sum + acc.outer_sums
        held = {"gradient shards": acc.head_whole + acc.embed_whole, "deferred gradient sums": sums}
        if at is None:
            return [{**held, "replicated grads": repl}]
        syncing = {  # the syncing backward's
            "gradient shards": later[min(at + 2, n)] + acc.embed_whole if at < n else w.grad_shards,
            "deferred gradient sums": sum(acc.deferred[: at + 2]) * (at < n) + acc.outer_sums,
        }
        adding = repl + max(w.replicated_trainable, default=0)  # autograd's new one beside the sum it joins
        return [{**held, "replicated grads": adding}, {**syncing, "replicated grads": adding}]
    if acc.micro_steps > 1:  # every unit's shard from the earlier micro-steps (the head's whole one set aside too)
        if at is None:
            return [{"gradient shards": w.grad_shards, "replicated grads": repl}]
        return [{"gradient shards": w.grad_shards + acc.head_whole, "replicated grads": 2 * repl}]
    if at is None:
        return [{}]
    return [{"gradient shards": later[at + 1] if at < n else w.grad_shards, "replicated grads": repl}]


def _step(
    steady: dict[str, int],
    w: Weights,
    traced: Traced,
    acts: list[int],
    n_ckpt: int,
    blocks: list[tuple[object, list[bool], int]],
    head_grad: int,
    vocab_parallel: bool,
    made: tuple[list[int], list[int]],
    acc: _Accumulation = _Accumulation(),
) -> dict[str, dict[str, int]]:
    """Forward and backward. Outer parameters are cast to param_dtype for a step (as
    FSDP2's policy on the root) and the root unit gathered once per step. Backward's
    peak is the largest moment of the walk from the loss back to the embedding: the
    loss's own backward ([Note: the loss's backward]; the vocab-parallel one with
    ``vocab_parallel``), then at block i the gradient shards of the blocks after i
    (``blocks``: each block's layout, trainable flags and gradient shard bytes) and of
    the vocab-parallel head (``head_grad``), whose backward comes first (the gathered
    outer region is gone by then), and, per block (``made``), the reduce-scatter pairs
    alive then when they are given back between backwards or made per reduce, and the
    slots alive then without the pool (0 when they are kept, counted in ``steady``);
    then its end, every shard written. ``acc``: what a later micro-step of an
    accumulation holds of the earlier ones' ([Note: what an accumulation holds])."""
    pairs, slots = made
    step_parts = {**steady, "cast copies": w.casts}
    loss_fwd, loss_bwd, logits = loss_bytes(traced, vocab_parallel)
    n = len(acts)
    act_label = f"activations ({n_ckpt}/{n} blocks checkpointed)" if n_ckpt else "activations"
    # the gathered outer region lives until the head's backward ([Note: the outer region's
    # lifetime] in isp_comm/hooks/engine.py)
    outer = {"outer gather": w.outer_gather}
    hidden = max(traced.inputs, default=0)
    kept = list(itertools.accumulate(acts))  # activations of blocks 0..i, still to be used at block i
    later = list(itertools.accumulate([g for *_, g in reversed(blocks)], initial=head_grad))[::-1]
    before = max(_accumulated(acc, w, later, None), key=lambda m: sum(m.values()))
    forward = {**step_parts, **outer, act_label: sum(acts) + traced.outer_saved, "logits and loss": loss_fwd, **before}
    moments = [{**outer, act_label: kept[-1] + traced.outer_saved, "logits and loss": loss_bwd, **before}]

    def recomputed(i: int) -> int:
        """A checkpointed block's recomputation, beside the input its checkpoint kept
        (in ``kept``): what the block saves, less that input where the block saves it
        itself (the recomputation runs on the kept tensor, so its storage is shared)."""
        return traced.saved[i] - (traced.inputs[i] if traced.input_saved[i] else 0)

    for i, (lay, tr, _) in enumerate(blocks):
        block = {
            act_label: kept[i] + traced.outer_saved,
            "block gradients (unsharded)": sum(sp_.full_numel for sp_, t in zip(lay.params, tr) if t)
            * lay.gather_dtype.itemsize,
            "activation gradients": 2 * hidden + traced.largest[i] + (recomputed(i) if i < n_ckpt else 0),
            "logits and loss": logits,
            **({"reduce-scatter buffers": pairs[i]} if pairs[i] else {}),
            **({"pool slots and landing": slots[i]} if slots[i] else {}),
        }
        moments += [{**block, **grads} for grads in _accumulated(acc, w, later, i)]
    moments.append(max(_accumulated(acc, w, later, n), key=lambda m: sum(m.values())))  # its end
    return {"forward": forward, "backward": {**step_parts, **max(moments, key=lambda m: sum(m.values()))}}


def _evaluate(steady: dict[str, int], w: Weights, traced: Traced) -> dict[str, int]:
    """A validation pass (isp_comm/train/evaluate.py): after a step's ``zero_grad``
    (no gradient shard left), under ``no_grad``, over held-out micro-batches of the
    training micro-batch's shape on each rank. Autograd keeps nothing, so a block's
    intermediates live only while it runs: its largest moment is bounded by what that
    block would save for backward, plus its input and output hidden states. Then the
    logits, their fp32 copy and log-softmax, as in a training forward (after the
    blocks: the larger of the two moments counts). The optimizer
    state, the pool (the gathered weights) and the casts stay."""
    loss_fwd, _, _ = loss_bytes(traced)
    one_block = max(traced.saved, default=0) + 2 * max(traced.inputs, default=0)
    moments = [{"no_grad activations (one block)": one_block}, {"logits and loss": loss_fwd}]  # not at once
    return {
        **steady,
        "cast copies": w.casts,
        "outer gather": w.outer_gather,
        **max(moments, key=lambda m: sum(m.values())),
    }


def _optimizer(steady: dict[str, int], w: Weights, optimizer: str, device: str) -> dict[str, int]:
    """The step: gradients of everything plus the optimizer's temporaries (for-each
    AdamW on CUDA: one sqrt of every second moment at once; per parameter on CPU: the
    largest one's sqrt and its quotient, torch/optim/adam.py)."""
    temporaries = 0
    if optimizer == "adamw":
        temporaries = sum(w.all_trainable) if device == "cuda" else 2 * max(w.all_trainable, default=0)
    return {
        **steady,
        "gradient shards": w.grad_shards,
        "replicated grads": sum(w.replicated_trainable),
        "optimizer temporaries": temporaries,
    }
