"""Know before you launch: every rank's memory, phase by phase, from a meta-built model.

``isp_comm.forecast(model_on_meta, config, world, wp, sp, batch, seq)`` needs no
process group and no real memory. What the engine would allocate is read from the
engine's own decisions, not re-derived: :func:`~isp_comm.discovery.unit_specs` says
what each unit shards, :class:`~isp_comm.layout.BlockLayout` how large its flat
shard, gathered slot and reduce buffers are, and :func:`~isp_comm.memory_pool.make_plan`
sizes the pool exactly as wrapping does. Activations come from one forward of the
meta model at the rank's local shape, with ``saved_tensors_hooks`` counting what
autograd keeps for backward (meta tensors: nothing is computed).

[Note: what the forecast counts]
All figures are bytes on one rank (rank 0, whose shards are the largest), above the
process's baseline (torch imported, process groups made, model built on meta). The
steady state of a step is counted: from the second step on, the gradient shards
(one flat buffer per unit, kept across ``zero_grad``) and the optimizer state exist
in every phase. The phases and what each adds to the persistent parts (master
shards, replicated parameters, pool):

* ``wrap``: one module's full weights, materialised before its rows are taken;
* ``forward``: cast copies and the outer gather, the saved activations of every
  block (only the input of a checkpointed one), then the logits and the loss;
* ``backward``: the largest moment of the walk from the loss back to the
  embedding: the activations still to be used, the block's full (unsharded) weight
  gradients before they are packed, a checkpointed block's recomputation, and the
  replicated parameters' gradients (full size, master dtype);
* ``optimizer``: gradients of everything plus the optimizer's temporaries;
* ``save`` / ``async_save`` / ``load``: DCP's per-item copies; the async save's
  staging holds a whole copy of the model and optimizer shards (on CUDA these are
  host memory, ``host_staging``, not the GPU's).

Modelled, not traced: the loss (logits held by the loop, their fp32 copy and
log-softmax, and two fp32 logits-sized tensors in its backward), the activation
gradients inside a block's backward (two hidden states and the block's largest saved
tensor), and the optimizer's temporaries (torch's for-each AdamW on CUDA: one
``sqrt`` of every second moment; the per-parameter one on CPU: the largest one's
sqrt and quotient).
On CPU, two parts are measured constants rather than counts: what gloo and the bf16
kernels keep outside tensors (``_cpu_runtime``). ``bench/forecast.py`` measures how
close this comes.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import itertools
import json
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from isp_comm.backends.symm_cpu import scratch_bytes
from isp_comm.config import ISPConfig
from isp_comm.discovery import find_blocks, unit_specs
from isp_comm.layout import BlockLayout
from isp_comm.memory_pool import gather_landing, make_plan, shared_memory_need
from isp_comm.units import find_sharded

Optimizer = Literal["adamw", "sgd", "sgd_momentum"]
PHASES = ("wrap", "forward", "backward", "optimizer", "save", "async_save", "load")
MIB = 2**20


@dataclasses.dataclass(frozen=True)
class MemoryForecast:
    """Per-rank bytes above the process baseline, for each phase and named part."""

    phases: dict[str, dict[str, int]]
    """phase -> part -> bytes (the device's: CUDA allocated, or CPU RSS)."""
    shm_bytes: int
    """The host's shared memory (``/dev/shm``) for the CPU symmetric-memory backend,
    all of the host's ranks together (0: not used)."""
    host_staging: dict[str, int]
    """On CUDA: the host memory (pinned for async saves) that DCP stages a checkpoint
    in, per phase (save, async_save, load); on CPU that is the device's, in ``phases``."""
    activations_by_block: list[int]
    """Bytes each block keeps for backward (a checkpointed one: its input only)."""

    def peak(self, phase: str) -> int:
        return sum(self.phases[phase].values())

    def biggest(self, phase: str) -> tuple[str, int]:
        """The largest part of ``phase``: (name, bytes)."""
        return max(self.phases[phase].items(), key=lambda kv: kv[1])

    def worst(self) -> str:
        """The phase with the highest peak."""
        return max(PHASES, key=self.peak)

    def as_mib(self, baseline_bytes: int = 0) -> dict[str, float]:
        """phase -> MiB, absolute (``baseline_bytes`` added): comparable with a run's
        logged peak (``peak_rss_mib`` on CPU, ``peak_alloc_mib`` on CUDA)."""
        return {ph: round((self.peak(ph) + baseline_bytes) / MIB, 1) for ph in PHASES}

    def table(self, baseline_bytes: int = 0) -> str:
        """A markdown table: parts down, phases across, MiB; then the peaks."""
        parts: list[str] = []
        for ph in PHASES:
            parts += [p for p in self.phases[ph] if p not in parts]
        head = "| part | " + " | ".join(PHASES) + " |"
        rows = [head, "|---|" + "---:|" * len(PHASES)]
        for part in parts:
            cells = [self.phases[ph].get(part) for ph in PHASES]
            rows.append(f"| {part} | " + " | ".join("" if c is None else f"{c / MIB:.1f}" for c in cells) + " |")
        if baseline_bytes:
            rows.append("| process baseline | " + " | ".join(f"{baseline_bytes / MIB:.1f}" for _ in PHASES) + " |")
        rows.append("| **peak** | " + " | ".join(f"**{v:.1f}**" for v in self.as_mib(baseline_bytes).values()) + " |")
        return "\n".join(rows)

    def json_line(self, baseline_bytes: int = 0) -> str:
        return json.dumps(self.as_mib(baseline_bytes))


KNOBS = {
    "activations": "--ckpt (activation checkpointing)",
    "logits and loss": "--vocab-parallel, or a smaller --batch",
    "replicated params": "--shard-outer",
    "replicated grads": "--shard-outer",
    "optimizer state": "a larger --wp",
    "master shards": "a larger --wp",
    "gradient shards": "a larger --wp",
    "reduce-scatter buffers": "ISPConfig.max_inflight_reduce_scatter",
    "block gradients (unsharded)": "a larger --wp, or smaller blocks",
    "checkpoint staging": "a synchronous save (no --async-save)",
}
"""The knob that shrinks each part (isp-train's flags)."""


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
) -> MemoryForecast:
    """The memory of every rank of an ISP run, phase by phase (see the module note).

    ``model``: built under ``torch.device("meta")`` (never touched: a copy is traced);
    ``config``: the communicator's (``None``: the defaults); ``world``/``wp``/``sp``:
    the run's sizes (``wp=None``: ``world // sp``);
    ``batch``: sequences per optimizer micro-step over the whole job, ``seq`` their
    length (each rank gets ``batch / (world / sp)`` sequences of ``seq / sp`` tokens,
    as isp-train splits them); ``optimizer``: what holds state per parameter;
    ``device``: where the parameters live; ``local_world``: ranks per host (for the
    shared memory; default all); ``forward(model, input_ids) -> logits``: how to call
    the model (default: transformers models with ``use_cache=False``, else
    ``model(input_ids)``)."""
    config = config or ISPConfig()
    wp = wp or world // sp
    if world < 1 or sp < 1 or world % sp or world % wp or wp < 1:
        raise ValueError(f"world {world} must be a multiple of wp {wp} and of sp {sp}")
    dp = world // sp
    if batch % dp:
        raise ValueError(f"batch {batch} must be a multiple of world / sp = {dp} (sequences per rank)")
    if seq % sp:
        raise ValueError(f"seq {seq} must be a multiple of sp {sp}")
    if optimizer not in ("adamw", "sgd", "sgd_momentum"):
        raise ValueError(f"optimizer must be 'adamw', 'sgd' or 'sgd_momentum', got {optimizer!r}")
    if any(p.device.type != "meta" for p in model.parameters()):
        raise ValueError("forecast() needs a model built under torch.device('meta')")
    block_list = list(find_blocks(model) if blocks is None else blocks)
    specs = unit_specs(model, block_list, config, head)
    pd, rd = config.param_dtype, config.reduce_dtype

    layouts: list[tuple[int, BlockLayout, list[bool]]] = []
    for s in specs:
        found, _ = find_sharded(s.owners, s.names, s.dim1, wp, 0)
        layout = BlockLayout(found, wp, 0, pd if s.cast else None, rd if s.cast else None)
        trainable = [sp_.module._parameters[sp_.name].requires_grad for sp_ in layout.params]
        layouts.append((s.index, layout, trainable))
    in_units = {id(sp_.module._parameters[sp_.name]) for _, lay, _ in layouts for sp_ in lay.params}
    replicated = [p for p in model.parameters() if id(p) not in in_units]  # each tied one once

    def flat_bytes(lay: BlockLayout) -> int:
        return lay.store.numel * lay.dtype.itemsize

    master = sum(flat_bytes(lay) for _, lay, _ in layouts)
    grad_shards = sum(flat_bytes(lay) for _, lay, tr in layouts if any(tr))
    trainable_shards = [b for _, lay, tr in layouts for b in _trainable_bytes(lay, tr)]
    repl_bytes = sum(p.numel() * p.element_size() for p in replicated)
    repl_trainable = [p.numel() * p.element_size() for p in replicated if p.requires_grad]
    per_param_state = {"adamw": 2, "sgd": 0, "sgd_momentum": 1}[optimizer]
    opt_state = per_param_state * (sum(trainable_shards) + sum(repl_trainable))

    block_layouts = [(lay, tr) for i, lay, tr in layouts if i >= 0]
    plan = make_plan(
        [(lay.gather_dtype, lay.gathered_numel) for lay, _ in block_layouts],
        [(g.dtype, g.gathered_numel) for lay, _ in block_layouts for g in lay.full_groups],
        config.n_slots,
        config.max_inflight_reduce_scatter,
        wp,
        gather_landing(wp, config.comm_granularity),
    )
    rs_bytes, pool_bytes = plan.rs_bytes, plan.pool_bytes - plan.rs_bytes

    shm = 0
    if device == "cpu" and config.backend in ("auto", "symm") and world > 1:
        gathered = [lay for i, lay, _ in layouts if i >= -1]  # the blocks and the outer unit
        buffers, largest = shared_memory_need(
            plan.pool_bytes,
            config.memory_pool,
            (wp, world // wp, world),
            max(lay.gathered_numel * lay.dtype.itemsize for lay in gathered),
            max(flat_bytes(lay) for lay in gathered),
            repl_bytes,
        )
        shm = (buffers + sum(scratch_bytes(n) for n in largest)) * (local_world or world)

    # outer parameters in param_dtype for a step (as FSDP2's policy on the root), and the
    # root unit's gathered copy (shard_outer_params: gathered once per step, outside the pool)
    casts = 0
    if pd is not None:
        casts = sum(p.numel() * pd.itemsize for p in replicated if p.dtype != pd)
    root = next((lay for i, lay, _ in layouts if i == -1), None)
    outer_gather = root.gathered_numel * root.gather_dtype.itemsize if root is not None else 0

    n_ckpt = round(config.activation_checkpointing * len(block_list))
    traced = _trace(model, block_list, batch // dp, seq // sp, pd, forward)
    acts = [traced.inputs[i] if i < n_ckpt else traced.saved[i] for i in range(len(block_list))]
    numel, dtype = traced.logits
    logits, logits_f32 = numel * dtype.itemsize, numel * 4
    loss_fwd = logits + (logits_f32 if dtype != torch.float32 else 0) + logits_f32
    loss_bwd = logits + 2 * logits_f32  # held logits, then log-softmax's output and its gradient

    persistent = {
        "master shards": master,
        "replicated params": repl_bytes,
        "pool slots and landing": pool_bytes,
        "reduce-scatter buffers": rs_bytes,
    }
    # the flat buffers of the gradients autograd leaves whole, all-reduced (kept across steps)
    wp_summed = sum(b for (i, lay, tr) in layouts if i in (-2, -3) for b in _trainable_bytes(lay, tr))
    allreduce = sum(repl_trainable) + wp_summed if world > 1 else 0
    steady = {
        **persistent,
        "gradient shards": grad_shards,
        "optimizer state": opt_state,
        "all-reduce buffers": allreduce,
        **_cpu_runtime(device, world, pd),
    }
    step_parts = {**steady, "cast copies": casts, "outer gather": outer_gather}

    # a sharded module is made real whole, then its rows are taken (the replicated ones stay)
    module_bytes: dict[int, int] = {}
    for _, lay, _ in layouts:
        for sp_ in lay.params:
            module_bytes[id(sp_.module)] = module_bytes.get(id(sp_.module), 0) + sp_.full_numel * sp_.dtype.itemsize
    largest_module = max(module_bytes.values(), default=0)
    # allocated at wrap but not written: on CPU their pages are not resident until used.
    # The sharded modules are made real one by one (each whole until its rows are
    # taken), before the replicated ones: the peak is the larger of the two moments.
    untouched = ("pool slots and landing", "reduce-scatter buffers") if device == "cpu" else ()
    wrap = {k: v for k, v in persistent.items() if k not in untouched}
    phases: dict[str, dict[str, int]] = {
        "wrap": {**wrap, "one module materialised": max(0, largest_module - repl_bytes)}
    }

    act_label = f"activations ({n_ckpt}/{len(block_list)} blocks checkpointed)" if n_ckpt else "activations"
    phases["forward"] = {
        **step_parts,
        act_label: sum(acts) + traced.outer_saved,
        "logits and loss": loss_fwd,
    }

    # backward: from the loss back to the embedding, block by block; its peak is the
    # largest of these moments
    head_grads = sum(repl_trainable)  # upper bound: the embedding's comes last, the head's first
    hidden = max(traced.inputs, default=0)
    kept = list(itertools.accumulate(acts))  # activations of blocks 0..i, still to be used at block i
    moments = [{act_label: kept[-1] + traced.outer_saved, "logits and loss": loss_bwd, "replicated grads": head_grads}]
    for i, (lay, tr) in enumerate(block_layouts):
        moments.append(
            {
                act_label: kept[i] + traced.outer_saved,
                "block gradients (unsharded)": sum(sp_.full_numel for sp_, t in zip(lay.params, tr) if t)
                * lay.gather_dtype.itemsize,
                "activation gradients": 2 * hidden + traced.largest[i] + (traced.saved[i] if i < n_ckpt else 0),
                "replicated grads": head_grads,
                "logits and loss": logits,
            }
        )
    phases["backward"] = {**step_parts, **max(moments, key=lambda m: sum(m.values()))}

    all_trainable = trainable_shards + repl_trainable
    temporaries = 0
    if optimizer == "adamw":  # for-each on CUDA: one sqrt of every second moment at once; per
        # parameter on CPU: the largest one's sqrt and its quotient (torch/optim/adam.py)
        temporaries = sum(all_trainable) if device == "cuda" else 2 * max(all_trainable, default=0)
    phases["optimizer"] = {**steady, "replicated grads": sum(repl_trainable), "optimizer temporaries": temporaries}

    largest_item = max([flat_bytes(lay) for _, lay, _ in layouts] + all_trainable, default=0)
    state_bytes = master + repl_bytes + opt_state
    staging = {"save": largest_item, "async_save": state_bytes, "load": 2 * largest_item}
    for ph, nbytes in staging.items():  # on CUDA, DCP stages in host memory (pinned for async saves)
        phases[ph] = {**steady, **({} if device == "cuda" else {"checkpoint staging": nbytes})}
    return MemoryForecast(
        phases={ph: {k: v for k, v in parts.items() if v} for ph, parts in phases.items()},
        shm_bytes=shm,
        host_staging=staging if device == "cuda" else {},
        activations_by_block=acts,
    )


GLOO_RUNTIME = 6 * MIB
"""Memory that gloo's collectives keep outside tensors once a step has run (world > 1)."""
CPU_LOW_PRECISION_RUNTIME = {"AVX2": 0, "default": int(7.5 * MIB)}
"""Memory the CPU kernels of bf16/fp16 compute keep outside tensors (code and buffers),
by torch's CPU capability: 7.5 MiB on the machine the forecast was first fitted on
(capability not recorded); none measurable on an AVX2-only one, where the forecast
with 7.5 MiB read 8 to 12 MiB above every measured phase of a bf16 run."""


def _cpu_runtime(device: str, world: int, param_dtype: torch.dtype | None) -> dict[str, int]:
    """Memory outside tensors that a CPU rank holds from its first step on: measured, not
    derived (bench/forecast.py: the difference between a run's anonymous memory and its
    live tensors on the 2-core CPU machine, torch 2.13). On CUDA no such part counts in
    the allocator's figure."""
    if device != "cpu":
        return {}
    parts = {"runtime: gloo": GLOO_RUNTIME if world > 1 else 0}
    if param_dtype in (torch.bfloat16, torch.float16):
        table, isa = CPU_LOW_PRECISION_RUNTIME, torch.backends.cpu.get_cpu_capability()
        parts["runtime: low-precision CPU kernels"] = table.get(isa, table["default"])
    return parts


def _trainable_bytes(layout: BlockLayout, trainable: list[bool]) -> list[int]:
    """Bytes of each trainable shard parameter (its valid rows) of a unit on rank 0."""
    return [sp.valid_rows * sp.inner * sp.dtype.itemsize for sp, t in zip(layout.params, trainable) if t]


@dataclasses.dataclass
class _Traced:
    saved: list[int]  # per block: bytes kept for backward
    inputs: list[int]  # per block: bytes of its hidden-state input
    largest: list[int]  # per block: its largest saved tensor
    outer_saved: int  # outside the blocks (embedding, final norm, head)
    logits: tuple[int, torch.dtype]  # numel and dtype of the model's output


def _flash_sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """SDPA on meta as a fused kernel keeps it: q, k, v, the output and the log-sum-exp
    (meta's own dispatch would take the math path and keep the seq x seq scores)."""
    if k.shape[-3] != q.shape[-3]:
        rep = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(rep, dim=-3), v.repeat_interleave(rep, dim=-3)
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    return op(q, k, v, dropout_p, is_causal or attn_mask is None, scale=scale)[0]


@contextlib.contextmanager
def _fused_attention() -> Iterator[None]:
    orig = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = _flash_sdpa
    try:
        yield
    finally:
        F.scaled_dot_product_attention = orig


def _default_forward(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    if hasattr(getattr(model, "config", None), "use_cache"):  # transformers
        return model(input_ids=ids, use_cache=False).logits
    return model(ids)


@contextlib.contextmanager
def _no_value_reads() -> Iterator[None]:
    """transformers looks for packed sequences in the position ids by reading their
    values, which meta tensors do not have; packing changes no tensor's size, so the
    search is skipped while tracing."""
    masking = sys.modules.get("transformers.masking_utils")
    found = getattr(masking, "find_packed_sequence_indices", None)
    if found is None:
        yield
        return
    masking.find_packed_sequence_indices = lambda *_a, **_k: None  # type: ignore[union-attr]
    try:
        yield
    finally:
        masking.find_packed_sequence_indices = found  # type: ignore[union-attr]


def _trace(
    model: nn.Module,
    block_list: list[nn.Module],
    batch: int,
    seq: int,
    param_dtype: torch.dtype | None,
    forward: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None,
) -> _Traced:
    """One forward of a copy of the meta model at the rank's local shape, counting what
    autograd saves (each storage once, parameters never: gathered weights live in the
    pool), attributed to the block running when it was saved. A block with the same
    type and parameters as an earlier one keeps what that one kept: it is not run
    (its forward passes the hidden state through), as tracing on meta is slow."""
    clone = copy.deepcopy(model)
    twin = {id(m): c for m, c in zip(model.modules(), clone.modules())}
    blocks = [twin[id(b)] for b in block_list]
    if param_dtype is not None:
        clone.to(param_dtype)
    params = {id(p) for p in clone.parameters()}
    n = len(block_list)
    saved, inputs, largest = [0] * n, [0] * n, [0] * n
    outer = [0]
    seen: dict[int, torch.Tensor] = {}
    current = [-1]

    def base(t: torch.Tensor) -> torch.Tensor:
        while t._base is not None:
            t = t._base
        return t

    def pack(t: torch.Tensor) -> torch.Tensor:
        b = base(t)
        if id(b) in params or id(b) in seen:
            return t
        seen[id(b)] = b  # kept alive: ids stay unique
        nbytes = b.numel() * b.element_size()
        i = current[0]
        if i < 0:
            outer[0] += nbytes
        else:
            saved[i] += nbytes
            largest[i] = max(largest[i], nbytes)
        return t

    outputs: dict[int, object] = {}
    twin_of: dict[int, int] = {}  # a block shaped like an earlier one is not traced again
    first: dict[tuple, int] = {}
    for i, b in enumerate(blocks):
        key = (type(b), tuple((name, p.shape, p.dtype, p.requires_grad) for name, p in b.named_parameters()))
        if key in first:
            twin_of[i] = first[key]
        else:
            first[key] = i

    def pre(i: int):
        def hook(_m, args, kwargs):
            current[0] = i
            x = args[0] if args else kwargs.get("hidden_states")
            inputs[i] = x.numel() * x.element_size() if isinstance(x, torch.Tensor) else 0

        return hook

    def post(i: int):
        def hook(_m, _a, out):
            current[0] = -1
            outputs.setdefault(i, out)

        return hook

    def same_as(i: int):
        def forward(*args, **kwargs):
            x = args[0] if args else kwargs["hidden_states"]
            out = outputs[twin_of[i]]
            return x if isinstance(out, torch.Tensor) else (x, *out[1:])  # type: ignore[index]

        return forward

    handles = []
    for i, b in enumerate(blocks):
        handles.append(b.register_forward_pre_hook(pre(i), with_kwargs=True))
        handles.append(b.register_forward_hook(post(i)))
        if i in twin_of:
            b.forward = same_as(i)
    ids = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    try:
        with _fused_attention(), _no_value_reads(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            logits = (forward or _default_forward)(clone, ids)
    finally:
        for h in handles:
            h.remove()
    for i, j in twin_of.items():
        saved[i], largest[i] = saved[j], largest[j]
    return _Traced(saved, inputs, largest, outer[0], (logits.numel(), logits.dtype))
