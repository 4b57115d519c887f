"""What a step computes, operator by operator: one forward and backward of the meta
model at a rank's local shape, under a dispatch mode that records each aten operator.

Nothing is computed (meta tensors). Each operator is kept as what its cost depends
on: a matrix product's FLOPs, an attention's FLOPs, or the bytes an element-wise
operator reads and writes; every operator also costs one dispatch on the host. The
operators are attributed to the block running (forward: between its pre- and
post-hooks; backward: between its full backward pre-hook and hook) or to the outside
(embedding, final norm, head, loss). As in the memory forecast's trace, a block of the
same type and parameters as an earlier one is not run again: it does what that one did.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from isp_comm.memory_forecast.activations import (
    _default_forward,
    _no_value_reads,
    _twins,
    compiled_forward,
    meta_copy,
    meta_kernels,
)
from isp_comm.planner.fusion import StorageLog

GEMMS = {"mm", "addmm", "bmm", "baddbmm"}
ATTENTION_FWD = {"_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention"}
ATTENTION_BWD = {"_scaled_dot_product_flash_attention_for_cpu_backward", "_scaled_dot_product_flash_attention_backward"}
CUTS = GEMMS | ATTENTION_FWD | ATTENTION_BWD | {"_grouped_mm"}
"""What inductor calls a library for and fuses nothing into (the regions' cuts)."""
FREE = {  # views and metadata: a dispatch, no bytes moved
    "view",
    "_unsafe_view",
    "reshape",
    "t",
    "transpose",
    "permute",
    "expand",
    "slice",
    "select",
    "unsqueeze",
    "squeeze",
    "as_strided",
    "detach",
    "alias",
    "split",
    "split_with_sizes",
    "unbind",
    "chunk",
    "empty",
    "empty_like",
    "new_empty",
    "new_empty_strided",
    "empty_strided",
    "lift_fresh",
    "_to_copy_view",
    "set_",
    "view_as_real",
    "view_as_complex",
    "unflatten",
    "flatten",
    "is_same_size",
    "_has_compatible_shallow_copy_type",
}


@dataclasses.dataclass
class Ops:
    """One piece of a step (a block's forward, its backward, or the outside's)."""

    gemm: list[tuple[float, bool]] = dataclasses.field(default_factory=list)
    """Each matrix product: (FLOPs, low precision)."""
    attention: list[tuple[float, bool, bool, float, int]] = dataclasses.field(default_factory=list)
    """Each fused attention: (FLOPs, low precision, backward, heads, head dim); heads:
    the independent problems of the call (batch x query heads)."""
    moved: list[float] = dataclasses.field(default_factory=list)
    """Each element-wise operator: bytes read and written."""
    dispatches: int = 0
    """Operators dispatched (each costs the host a dispatch)."""

    def scaled_attention(self, factor: float) -> Ops:
        """The same with attention FLOPs multiplied (Ulysses SP: the rank attends over
        the whole sequence with 1/sp of the heads, sp times what the local trace saw)."""
        attention = [(f * factor, lp, b, h / factor, d) for f, lp, b, h, d in self.attention]
        return Ops(self.gemm, attention, self.moved, self.dispatches)


@dataclasses.dataclass
class StepOps:
    """Per block: forward and backward operators; and the outside's."""

    block_fwd: list[Ops]
    block_bwd: list[Ops]
    outer_fwd: Ops
    outer_bwd: Ops

    @property
    def flops(self) -> float:
        every = [*self.block_fwd, *self.block_bwd, self.outer_fwd, self.outer_bwd]
        return sum(f for o in every for f, _ in o.gemm) + sum(a[0] for o in every for a in o.attention)


def _nbytes(x: object) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(y) for y in x)
    return 0


def _low(t: object) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype in (torch.bfloat16, torch.float16)


def _attention(q: torch.Tensor, k: torch.Tensor, causal: bool, scale: float, back: bool) -> tuple:
    """An :attr:`Ops.attention` entry: QK^T and PV over [b, h, s, d] are 4 b h s_q s_k d
    FLOPs, halved under a causal mask (``scale`` times that: the backward's 2.5)."""
    b, h, sq, d = q.shape
    return (scale * 4.0 * b * h * sq * k.shape[-2] * d * (0.5 if causal else 1.0), _low(q), back, float(b * h), d)


class _Recorder(TorchDispatchMode):
    """Each operator, into the piece running. With ``log`` (compiled blocks) every
    operator's storages are also logged, and the element-wise operators of a compiled
    graph's run are left to :meth:`fuse` ([Note: fused regions]); while AOTAutograd
    traces a block (``tracing``), nothing runs and nothing is recorded."""

    def __init__(self, n_blocks: int, log: StorageLog | None = None) -> None:
        super().__init__()
        self.current = [-1]
        self.backward = [False]
        self.fwd = [Ops() for _ in range(n_blocks)]
        self.bwd = [Ops() for _ in range(n_blocks)]
        self.outer_fwd, self.outer_bwd = Ops(), Ops()
        self.log, self.tracing = log, 0
        self.inside = [False]  # a compiled block's tracer is calling it again: not a block's call
        self.outputs: dict[int, object] = {}  # each block's first forward output

    def enter(self, i: int, back: bool) -> Callable[..., None]:
        """A hook: block ``i``'s forward (or, ``back``, its backward) begins."""

        def hook(*_a: object, **_k: object) -> None:
            if not (self.inside[0] or self.tracing):  # AOTAutograd's joint trace runs the hooks too
                self.current[0], self.backward[0] = i, back

        return hook

    def leave(self, i: int, back: bool) -> Callable[..., None]:
        """A hook: block ``i``'s forward (or backward) ends; its first output is kept."""

        def hook(_m: nn.Module, _a: object, out: object) -> None:
            if self.inside[0] or self.tracing:
                return
            self.current[0], self.backward[0] = -1, back
            if not back:
                self.outputs.setdefault(i, out)

        return hook

    def _ops(self) -> Ops:
        i, back = self.current[0], self.backward[0]
        if i < 0:
            return self.outer_bwd if back else self.outer_fwd
        return (self.bwd if back else self.fwd)[i]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.tracing:
            return out
        name = func.overloadpacket.__name__
        ops = self._ops()
        if self.log is not None:
            in_graph = self.log.running is not None
            if name in FREE:
                if in_graph:
                    return out  # a view inside generated code: no dispatch
            else:
                self.log.record([args, kwargs], out, name in CUTS)
                if in_graph and name not in CUTS:
                    return out  # fused: costed and launched by its region (fuse)
        ops.dispatches += 1
        if name in GEMMS:
            a, b = (args[1], args[2]) if name in ("addmm", "baddbmm") else (args[0], args[1])
            batch = a.shape[0] if a.dim() == 3 else 1
            ops.gemm.append((2.0 * batch * a.shape[-2] * a.shape[-1] * b.shape[-1], _low(a)))
        elif name == "_grouped_mm":  # an MoE's experts: (tokens x k, in) by (experts, in, out), or a weight gradient
            a, b = args[0], args[1]
            rows = a.shape[0] * a.shape[1] if a.dim() == 2 else a.numel()
            ops.gemm.append((2.0 * rows * b.shape[-1], _low(a)))
        elif name in ATTENTION_FWD:
            causal = bool(args[4]) if len(args) > 4 else bool(kwargs.get("is_causal", False))
            ops.attention.append(_attention(args[0], args[1], causal, 1.0, False))
        elif name in ATTENTION_BWD:  # (grad_out, q, k, v, out, lse, dropout, is_causal, ...)
            causal = bool(args[7]) if len(args) > 7 else bool(kwargs.get("is_causal", False))
            ops.attention.append(_attention(args[1], args[2], causal, 2.5, True))
        elif name not in FREE:
            ops.moved.append(float(_nbytes(list(args)) + _nbytes(out)))
        return out

    def compiler(self, gm: Callable[..., object], _example_inputs: object) -> Callable[..., object]:
        """AOTAutograd's compiler for a block's forward and backward graphs: the graph
        run as it is, its run logged as one compiled graph of the piece running."""

        def run(args: list) -> object:  # boxed: AOTAutograd passes the list of inputs
            paused, self.tracing = self.tracing, 0
            self.log.begin(self._ops())
            try:
                out = gm(*args)
            finally:
                self.tracing = paused
            self.log.end(out)
            return out

        run._boxed_call = True  # type: ignore[attr-defined]
        return run

    def fuse(self) -> None:
        """Each compiled graph run's fused regions into its piece: one kernel each, of
        its external bytes, and one host dispatch for the graph itself."""
        for ops, regions in self.log.regions():
            ops.moved.extend(regions)
            ops.dispatches += len(regions) + 1


def _traced_quietly(forward: Callable[..., object], rec: _Recorder) -> Callable[..., object]:
    """``forward`` (a compiled block's) with the recorder deaf while AOTAutograd traces
    it: only its graphs' runs are operators of the step (:meth:`_Recorder.compiler`)."""

    def quiet(*args: object, **kwargs: object) -> object:
        rec.tracing += 1
        try:
            return forward(*args, **kwargs)
        finally:
            rec.tracing -= 1

    return quiet


def trace_ops(
    model: nn.Module,
    block_list: list[nn.Module],
    batch: int,
    seq: int,
    param_dtype: torch.dtype | None,
    forward: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None = None,
    copies: dict | None = None,
    compiled: bool = False,
) -> StepOps:
    """The operators of one micro-step of a rank (``batch`` sequences of ``seq``
    tokens), forward and backward, with the loss (fp32 cross-entropy of the logits).
    ``copies``: where the meta copy of the model is kept between calls (see
    :func:`~isp_comm.memory_forecast.activations.meta_copy`); ``compiled``: the blocks
    run as ``torch.compile`` runs them (isp-train ``--compile``: the blocks alone),
    their graphs' element-wise operators fused ([Note: fused regions])."""
    clone, blocks = meta_copy(model, block_list, param_dtype, copies)
    n = len(blocks)
    rec = _Recorder(n, StorageLog() if compiled else None)
    twin_of = _twins(blocks)
    outputs, inside, handles = rec.outputs, rec.inside, []
    enter, leave = rec.enter, rec.leave

    def same_as(i: int):
        def fwd(*args, **kwargs):
            x = args[0] if args else kwargs["hidden_states"]
            out = outputs[twin_of[i]]
            return x if isinstance(out, torch.Tensor) else (x, *out[1:])  # type: ignore[index]

        return fwd

    own = [b.__dict__.get("forward") for b in blocks]  # a forward set on the instance (accelerate's hooks)
    for i, b in enumerate(blocks):
        if i in twin_of:
            b.forward = same_as(i)
            continue
        handles.append(b.register_forward_pre_hook(enter(i, False), with_kwargs=True))
        handles.append(b.register_forward_hook(leave(i, False)))
        handles.append(b.register_full_backward_pre_hook(enter(i, True)))
        handles.append(b.register_full_backward_hook(leave(i, True)))
        if compiled:
            b.forward = _traced_quietly(compiled_forward(b, inside, rec.compiler), rec)
    ids = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    try:
        with meta_kernels(), _no_value_reads():
            with rec:
                logits = (forward or _default_forward)(clone, ids)
                loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), ids.reshape(-1))
                rec.backward[0] = True
                loss.backward()
    finally:
        for h in handles:
            h.remove()
        for b, own_forward in zip(blocks, own):  # the copy is traced again (``copies``)
            if own_forward is None:
                b.__dict__.pop("forward", None)
            else:
                b.forward = own_forward
        for p in clone.parameters():
            p.grad = None
    if compiled:
        rec.fuse()
    for i, j in twin_of.items():
        rec.fwd[i], rec.bwd[i] = rec.fwd[j], rec.bwd[j]
    return StepOps(rec.fwd, rec.bwd, rec.outer_fwd, rec.outer_bwd)
