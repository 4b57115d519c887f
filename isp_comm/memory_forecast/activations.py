"""Activations, from one forward of the meta model: what autograd saves per block.

The model is copied and run on meta tensors at the rank's local shape; a
``saved_tensors_hooks`` pair counts each saved storage once (parameters never:
gathered weights live in the pool) and attributes it to the block running when it
was saved. Nothing is computed. The loss is modelled from the traced logits.

[Note: what a compiled block saves]
A block compiled with ``torch.compile`` (inductor) does not save what eager autograd
does: AOTAutograd traces its forward and backward as one graph, and inductor's
partitioner (min-cut rematerialisation) chooses the tensors to keep, recomputing
cheap pointwise ones in backward. On the reference llama it keeps 24% less than eager in
fp32 and 37% less in bf16, and on one H200 a compiled Llama-3-8B step peaked 25% below
the eager one. So a compiled block is traced through the same machinery: AOTAutograd
with inductor's decompositions and its partitioner (called as inductor calls it,
without the joint-graph pattern passes, which do not run on meta), the forward graph
then run on meta under the same hooks. What it keeps equals, storage for storage,
what the real compiled block saves on CPU (tests/test_memory_forecast_compiled.py).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import sys
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from isp_comm.loss import CHUNK_BYTES


@dataclasses.dataclass
class Traced:
    """What one traced forward keeps, per block and outside them."""

    saved: list[int]  # per block: bytes kept for backward
    inputs: list[int]  # per block: bytes of its hidden-state input
    largest: list[int]  # per block: its largest saved tensor
    input_saved: list[bool]  # per block: its own input is among what it saved (counted in ``saved``)
    outer_saved: int  # outside the blocks (embedding, final norm, head)
    logits: tuple[int, torch.dtype]  # numel and dtype of the model's output


def _flash_sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """SDPA on meta as a fused kernel keeps it: q, k, v, the output and the log-sum-exp
    (meta's own dispatch would take the math path and keep the seq x seq scores). With
    ``enable_gqa`` the grouped KV heads go in as they are: the flash kernels (CPU and
    CUDA) read each KV head for its group of query heads and keep no repeated copy;
    without, they are repeated as the caller would have to."""
    if k.shape[-3] != q.shape[-3] and not (enable_gqa and q.shape[-3] % k.shape[-3] == 0):
        rep = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(rep, dim=-3), v.repeat_interleave(rep, dim=-3)
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    return op(q, k, v, dropout_p, is_causal or attn_mask is None, scale=scale)[0]


def _meta_grouped_mm(grouped_mm: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``grouped_mm`` (an MoE's experts, transformers 5) that runs on meta in any dtype
    and at any width: torch's meta kernel checks for bf16 and for rows of a multiple of
    16 bytes, as the CUDA kernel wants, where the CPU kernel takes fp32 and any width,
    so a meta trace of an fp32 MoE, or of one whose widths are no multiple of 8 (a
    tiny model's intermediate size of 100), stopped there. An fp32 product goes
    through as bf16 and comes back in its dtype: its shapes and FLOPs are the same; the
    inputs its backward keeps are counted at bf16's size (the CPU runs' fp32 MoE only).
    A product of unaligned widths (tokens by experts) is one expert's matrix product
    instead: the same output, FLOPs and gradient shapes, which is all a trace reads."""

    def product(a: torch.Tensor, b: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        if a.device.type != "meta":
            return grouped_mm(a, b, *args, **kwargs)
        low_a, low_b = a.to(torch.bfloat16), b.to(torch.bfloat16)
        if a.dim() == 2 and b.dim() == 3 and (a.shape[-1] % 8 or b.shape[-1] % 8):  # 16 bytes of bf16
            return (low_a @ low_b[0]).to(a.dtype)
        return grouped_mm(low_a, low_b, *args, **kwargs).to(a.dtype)

    return product


@contextlib.contextmanager
def meta_kernels() -> Iterator[None]:
    """What a meta trace runs in place of torch's own: SDPA as a fused kernel keeps it
    (:func:`_flash_sdpa`), and grouped_mm in any dtype (:func:`_meta_grouped_mm`)."""
    sdpa, grouped = F.scaled_dot_product_attention, getattr(F, "grouped_mm", None)
    F.scaled_dot_product_attention = _flash_sdpa
    if grouped is not None:
        F.grouped_mm = _meta_grouped_mm(grouped)
    try:
        yield
    finally:
        F.scaled_dot_product_attention = sdpa
        if grouped is not None:
            F.grouped_mm = grouped


def _default_forward(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The logits of ``model`` on ``ids``. An MoE whose config asks for its router's
    auxiliary loss (``output_router_logits``) is traced without it: a few values, and
    with compiled blocks the router logits they returned reached that loss outside the
    compiled trace, where torch stopped on them (isp-train --plan --compile: a traceback)."""
    config = getattr(model, "config", None)
    if hasattr(config, "use_cache"):  # transformers
        routed = {"output_router_logits": False} if getattr(config, "output_router_logits", False) else {}
        return model(input_ids=ids, use_cache=False, **routed).logits
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


def _storage(t: torch.Tensor) -> int:
    """An identity of ``t``'s storage, shared by its views and by the aliases
    AOTAutograd makes of a compiled block's inputs (valid while the storage lives)."""
    return t.untyped_storage()._cdata


class _SavedCounter:
    """Bytes autograd saves, each storage once and parameters never, attributed to the
    block running (``current[0]``; -1: outside the blocks); ``params``: the
    parameters' storages (:func:`_storage`)."""

    def __init__(self, params: set[int], n_blocks: int) -> None:
        self.params = params
        self.saved, self.largest = [0] * n_blocks, [0] * n_blocks
        self.outer = 0
        self.current = [-1]
        self.seen: dict[int, torch.Tensor] = {}
        self.input_base: list[int | None] = [None] * n_blocks  # id of each block's input storage
        self.input_saved = [False] * n_blocks

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        key = _storage(t)
        if key in self.params or key in self.seen:
            return t
        self.seen[key] = t  # kept alive: storage identities stay unique
        nbytes = t.untyped_storage().nbytes()
        i = self.current[0]
        if i < 0:
            self.outer += nbytes
        else:
            self.saved[i] += nbytes
            self.largest[i] = max(self.largest[i], nbytes)
            self.input_saved[i] |= key == self.input_base[i]
        return t


def _as_is(gm: torch.fx.GraphModule, _example_inputs: object) -> torch.fx.GraphModule:
    return gm


def compiled_forward(
    block: nn.Module, inside: list[bool], compiler: Callable[..., Callable[..., object]] = _as_is
) -> Callable[..., object]:
    """``block``'s forward as a compiled block runs it, for the trace ([Note: what a
    compiled block saves]): each call traces AOTAutograd's joint graph at the call's
    shapes, splits it with inductor's partitioner and runs the forward part (nothing
    is compiled to code). While it traces, ``inside[0]`` is set and the returned
    function calls the original forward (the tracer calls the block again).
    ``compiler``: what AOTAutograd makes of the forward and backward graphs (the
    planner's step logs their runs); by default they run as they are."""
    import torch.utils._pytree as pytree
    from torch._functorch.aot_autograd import aot_function
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._inductor.decomposition import select_decomp_table

    original = block.forward
    state = dict(block.named_parameters(remove_duplicate=False))
    state.update(block.named_buffers(remove_duplicate=False))
    partition = functools.partial(min_cut_rematerialization_partition, compiler="inductor")

    def forward(*args: object, **kwargs: object) -> object:
        if inside[0]:
            return original(*args, **kwargs)
        leaves, spec = pytree.tree_flatten((args, kwargs))
        where = [i for i, v in enumerate(leaves) if isinstance(v, torch.Tensor)]

        def call(weights: dict[str, torch.Tensor], *tensors: torch.Tensor) -> object:
            full = list(leaves)
            for i, t in zip(where, tensors):
                full[i] = t
            a, k = pytree.tree_unflatten(full, spec)
            # as dynamo does while it traces: a model may take another path when
            # compiled (torch.compiler.is_compiling(), e.g. isp_comm/models/llama.py's rotary)
            inside[0], compiling = True, torch.compiler._is_compiling_flag
            torch.compiler._is_compiling_flag = True
            try:
                return torch.func.functional_call(block, weights, a, k)
            finally:
                inside[0], torch.compiler._is_compiling_flag = False, compiling

        run = aot_function(
            call, fw_compiler=compiler, bw_compiler=compiler, partition_fn=partition,
            decompositions=select_decomp_table(), num_params_buffers=len(state),
        )  # fmt: skip
        return run(state, *(leaves[i] for i in where))

    return forward


def _twins(blocks: list[nn.Module]) -> dict[int, int]:
    """Block index -> the earlier block of the same type and parameters (not traced again)."""
    twin_of: dict[int, int] = {}
    first: dict[tuple, int] = {}
    for i, b in enumerate(blocks):
        key = (type(b), tuple((name, p.shape, p.dtype, p.requires_grad) for name, p in b.named_parameters()))
        if key in first:
            twin_of[i] = first[key]
        else:
            first[key] = i
    return twin_of


def loss_bytes(traced: Traced, vocab_parallel: bool = False) -> tuple[int, int, int]:
    """Modelled, not traced: the loss's bytes in forward and in backward, and the
    logits alone.

    [Note: the loss's backward]
    ``ISPCommunicator.cross_entropy`` on ordinary logits is the chunked loss of
    :mod:`isp_comm.loss` ([Note: the loss's memory]), given the logits in their own
    dtype as isp-train does: its forward holds the logits, a chunk's fp32 copy (none
    when the logits are fp32: ``float()`` returns them) and the log-sum-exp's
    scratch of a chunk (inside ``aten.logsumexp``, where a dispatch-level tracker
    does not see it: the breakdown's forward line is one chunk short of this one);
    its backward, the held logits, their gradient in their own dtype and two fp32
    chunks at a time (a chunk's copy and its difference from the log-sum-exp, then
    that and its softmax). Nothing of the model's backward has run then: no weight
    gradient of this step exists yet. The
    vocab-parallel loss (``isp_comm/vocab_parallel.py``, on this rank's vocabulary
    shard, in fp32) saves its softmax and writes the gradient from it: the held
    logits, their fp32 copy in forward, and two fp32 shard-sized tensors in backward
    (measured by the breakdown to the byte, tests/test_memory_breakdown.py)."""
    numel, dtype = traced.logits
    logits, logits_f32 = numel * dtype.itemsize, numel * 4
    if vocab_parallel:
        loss_fwd = logits + (logits_f32 if dtype != torch.float32 else 0) + logits_f32
        return loss_fwd, logits + 2 * logits_f32, logits
    chunk = min(logits_f32, CHUNK_BYTES)
    copy = chunk if dtype != torch.float32 else 0
    return logits + copy + chunk, 2 * logits + 2 * chunk, logits


def meta_copy(
    model: nn.Module, block_list: list[nn.Module], param_dtype: torch.dtype | None, copies: dict | None = None
) -> tuple[nn.Module, list[nn.Module]]:
    """A copy of the meta model to trace (in ``param_dtype``), and its blocks; kept in
    ``copies`` by dtype when given (a 70B takes a third of a second to copy)."""
    key = ("meta copy", param_dtype)
    if copies is not None and key in copies:
        return copies[key]
    clone = copy.deepcopy(model)
    twin = {id(m): c for m, c in zip(model.modules(), clone.modules())}
    blocks = [twin[id(b)] for b in block_list]
    if param_dtype is not None:
        clone.to(param_dtype)
    if copies is not None:
        copies[key] = (clone, blocks)
    return clone, blocks


def trace(
    model: nn.Module,
    block_list: list[nn.Module],
    batch: int,
    seq: int,
    param_dtype: torch.dtype | None,
    forward: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None,
    copies: dict | None = None,
    compiled: bool = False,
) -> Traced:
    """One forward of a copy of the meta model at the rank's local shape, counting what
    autograd saves (each storage once, parameters never: gathered weights live in the
    pool), attributed to the block running when it was saved. A block with the same
    type and parameters as an earlier one keeps what that one kept: it is not run
    (its forward passes the hidden state through), as tracing on meta is slow.
    ``compiled``: the blocks run as ``torch.compile`` runs them ([Note: what a
    compiled block saves])."""
    clone, blocks = meta_copy(model, block_list, param_dtype, copies)
    n = len(block_list)
    count = _SavedCounter({_storage(p) for p in clone.parameters()}, n)
    saved, inputs, largest, current = count.saved, [0] * n, count.largest, count.current
    outputs: dict[int, object] = {}
    twin_of = _twins(blocks)
    inside = [False]  # a compiled block's tracer is calling it again: not a block's call

    def pre(i: int):
        def hook(_m, args, kwargs):
            if inside[0]:
                return
            current[0] = i
            x = args[0] if args else kwargs.get("hidden_states")
            inputs[i] = x.numel() * x.element_size() if isinstance(x, torch.Tensor) else 0
            count.input_base[i] = _storage(x) if isinstance(x, torch.Tensor) else None

        return hook

    def post(i: int):
        def hook(_m, _a, out):
            if inside[0]:
                return
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
    own = [b.__dict__.get("forward") for b in blocks]  # a forward set on the instance (accelerate's hooks)
    for i, b in enumerate(blocks):
        handles.append(b.register_forward_pre_hook(pre(i), with_kwargs=True))
        handles.append(b.register_forward_hook(post(i)))
        if i in twin_of:
            b.forward = same_as(i)
        elif compiled:
            b.forward = compiled_forward(b, inside)
    ids = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    try:
        with meta_kernels(), _no_value_reads(), torch.autograd.graph.saved_tensors_hooks(count.pack, lambda t: t):
            logits = (forward or _default_forward)(clone, ids)
    finally:
        for h in handles:
            h.remove()
        for b, forward_ in zip(blocks, own):  # the copy may be traced again (``copies``)
            if forward_ is None:
                b.__dict__.pop("forward", None)
            else:
                b.forward = forward_
    for i, j in twin_of.items():
        saved[i], largest[i], count.input_saved[i] = saved[j], largest[j], count.input_saved[j]
    return Traced(saved, inputs, largest, count.input_saved, count.outer, (logits.numel(), logits.dtype))
