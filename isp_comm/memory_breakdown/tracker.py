"""The tracker: every tensor storage created while it is active, the part each belongs
to, and each phase's peak with what was alive at that moment.

[Note: how a storage gets its part]
A ``TorchDispatchMode`` sees the outputs of every operator, so every storage made by
one (factories, kernels, autograd's gradients, the engine's buffers) is noted once, with
its bytes (on CUDA rounded up to the caching allocator's 512-byte blocks), and dropped
from the running total when it is freed (a weak reference). Three sources name its
part, the stronger replacing the weaker:

1. the moment it was made (weakest): in a forward inside the model, an activation; in
   a forward outside it, or in backward before the model's output has its gradient, the
   loss (``logits and loss``); in backward after it, an activation gradient (a
   checkpointed block's recomputation included, as the forecast counts it); in the
   optimizer phase, an optimizer temporary;
2. a hook: the model's output and its gradient are the logits; the gradient of a block's
   gathered weight (a hook on the gathered view while the block computes), and what
   the engine makes of it while the node that receives it runs (its casts and packing
   for the reduce-scatter), is a block's unsharded gradient;
3. its owner (strongest, and final): the communicator's, the model's and the
   optimizer's tensors, read from those objects (:mod:`.owners`) when the breakdown
   attaches, when a forward begins and ends, when autograd has finished a backward
   (just before the engine's own end of backward, which may drop the reduce-scatter
   pairs it made, and again after it) and around the optimizer's step, while they
   are alive.

[Note: shared segments count their resident pages]
A segment of the CPU shared-memory backend is one storage over a whole mapping, but a
rank holds only the pages it has touched: its own scratch up to the largest payload
(the segment is the next power of two, at least 64 KiB), its chunk of each peer's
landing buffer and reduce-scatter inputs, nothing of a peer's slots or outputs. The
worker thread that touches them is not seen by this mode, and ``torch.from_numpy``
over a mapping is an operator, so every segment mapped inside the tracker was noted
whole, touched or not. So a segment its owners name (``shared memory: ...``,
:data:`.owners.SHARED`) counts the pages this process has mapped, read from
``/proc/self/pagemap`` (the present bit, as RSS counts them) each time the owners are
read: a page once touched stays mapped, so from the second step on the figure is the
step's. Where pagemap cannot be read, the whole segment.

A phase's peak keeps the storages alive at that moment, not their parts: a gradient
shard made in backward is named by its owner when the backward ends, and the peak
inside that backward counts it under that name.

[Note: phases]
They follow the step by themselves: ``forward`` from the model's forward (with
gradients; ``evaluate`` without) until a backward begins, ``backward`` until autograd
has finished it (the engine's closing work included), ``optimizer`` while an
optimizer's step runs, ``idle`` between them (clipping, ``zero_grad``, what the loop
does); the forecast's phases are the same (its optimizer phase holds the gradients
and the step's temporaries, not the loss the loop may still hold). ``wrap`` is the phase from
entering the tracker to :meth:`MemoryBreakdown.attach`. ``with tracker.phase(name):``
names any other stretch (``save``, ``load``).

[Note: storages FSDP2 resizes]
FSDP2 frees a unit's gathered parameters after its forward and brings them back for
its backward by resizing their storages in place (to 0 bytes and back), which is no
operator: a dispatch mode sees neither (isp-comm's slots without the pool,
``memory_pool=False``, do the same). The tracker keeps those storages apart (the
``unsharded params`` its owners name, [Note: what the breakdown reads of FSDP2] in
``fsdp2.py``, and the pool's slots) and reads their sizes again before the totals it
compares: after each operator those that hold bytes (a free can only shrink them),
and all of them after each of FSDP2's own operators (its copy into the gathered
parameters follows their allocation) and each ``set_`` (isp-comm's view of a slot it
has just resized), in FSDP2's hooks and when a phase begins. The size
counted at a peak is the size of that moment. A resize between two of those points
(FSDP2 at world 1 copies without an operator of its own) is counted at the next. Parameters, gradients
and optimizer state that are DTensors are counted by their local tensors: a rank
holds its shard, not the tensor's global size.
"""

from __future__ import annotations

import contextlib
import os
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

from isp_comm.memory_breakdown.cuda import allocator_now
from isp_comm.memory_breakdown.fsdp2 import OPERATOR_PARTS, UNSHARDED, fsdp2_parts, fsdp_modules, unsharded_params
from isp_comm.memory_breakdown.owners import SHARED, owned_parts
from isp_comm.memory_breakdown.parts import OTHER
from isp_comm.memory_breakdown.result import Breakdown, PhasePeak

CONTEXT, HOOK, OWNER = 0, 1, 2
"""How sure a storage's part is (see [Note: how a storage gets its part])."""
GATHERED_NODE = "UnshardBlock"
"""The autograd node whose backward receives a block's unsharded weight gradients and
packs them for their reduce-scatter (``isp_comm/hooks/autograd.py``)."""
RESIZED = (UNSHARDED, "pool slots and landing")
"""Parts whose storages may be resized in place (see [Note: storages FSDP2 resizes]):
FSDP2's gathered parameters, and isp-comm's slots with ``memory_pool=False``."""
CUDA_BLOCK = 512
"""The CUDA caching allocator's smallest block and rounding (c10/cuda/CUDACachingAllocator.cpp)."""


class _Storage:
    """One tracked storage: its bytes and its part (see [Note: how a storage gets its part])."""

    __slots__ = ("nbytes", "part", "ptr", "source")

    def __init__(self, nbytes: int, part: str, source: int, ptr: int = 0) -> None:
        self.nbytes, self.part, self.source, self.ptr = nbytes, part, source, ptr


def _flat_tensors(obj: Any) -> list[torch.Tensor]:
    """The tensors of a (possibly nested, possibly ``ModelOutput``) structure."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _flat_tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _flat_tensors(v)]
    return []


PAGE = os.sysconf("SC_PAGE_SIZE")


def resident_bytes(st: torch.UntypedStorage) -> int | None:
    """The bytes of the pages of ``st`` (a mapped host storage) that this process has
    mapped now, as its RSS counts them (``/proc/self/pagemap``'s present bit); None
    where pagemap cannot be read. See [Note: shared segments count their resident pages]."""
    nbytes, base = st.nbytes(), st.data_ptr()
    if nbytes == 0:
        return 0
    first, last = base // PAGE, (base + nbytes - 1) // PAGE
    try:
        with open("/proc/self/pagemap", "rb") as f:
            f.seek(first * 8)
            entries = np.frombuffer(f.read((last - first + 1) * 8), dtype=np.uint64)
    except OSError:
        return None
    if len(entries) != last - first + 1:
        return None
    return int((entries >> np.uint64(63)).sum()) * PAGE


def _size(st: torch.UntypedStorage, cuda: bool) -> tuple[int, int]:
    """A storage's bytes (on CUDA as the caching allocator's blocks hold them) and its
    address on the GPU (0 on the host, or when it holds nothing)."""
    nbytes = st.nbytes()
    if not cuda or nbytes == 0:
        return nbytes, 0
    return -(-nbytes // CUDA_BLOCK) * CUDA_BLOCK, st.data_ptr()


class MemoryBreakdown(TorchDispatchMode):
    """Where every byte of a training step's peak goes, by the memory forecast's parts.

    Usable around any loop that trains an ``ISPCommunicator``-wrapped model::

        tracker = MemoryBreakdown()
        with tracker:
            comm = ISPCommunicator(model, groups, config)   # the wrap phase
            optim = torch.optim.AdamW(model.parameters())
            tracker.attach(comm, optim)
            for batch in batches:
                loss = comm.cross_entropy(model(batch.x), batch.y)
                loss.backward()
                optim.step()
                optim.zero_grad()
        print(tracker.result().table("backward"))

    Entered after wrapping, :meth:`attach` counts what exists already. Each phase's peak
    is the highest total of the tracked storages in it over every step tracked (call
    :meth:`reset_peaks` after a warm-up step for the steady state); with it, what the
    device held at that moment: CUDA's allocated and reserved bytes, or the process's
    resident anonymous memory on CPU (see :class:`~.result.PhasePeak`). It slows eager
    PyTorch (a Python call per operator); ``torch.compile``'d code is not seen inside."""

    def __init__(self) -> None:
        super().__init__()
        self._known: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._refs: dict[int, weakref.ref] = {}
        self.current = 0
        self.current_cuda = 0  # of which on a GPU (the allocator's figures are compared with it)
        self.phase_name = "wrap"
        self._peaks: dict[str, PhasePeak] = {}
        self._live: dict[int, _Storage] = {}  # id of the weak reference -> storage
        self._comm: Any = None
        self._model: torch.nn.Module | None = None
        self._optimizers: list[torch.optim.Optimizer] = []
        self._depth = 0  # the model's forward calls in progress
        self._model_grad = False  # the backward reached the model's output
        self._handles: list[Any] = []
        self._baseline: tuple[int, dict[str, int]] = (0, {})
        self._hooked: WeakIdKeyDictionary = WeakIdKeyDictionary()  # tensors with our hook (by identity)
        self._fsdp: list[torch.nn.Module] = []  # the model's fully_shard-ed modules
        self._elastic: dict[int, tuple[weakref.ref, _Storage]] = {}  # [Note: storages FSDP2 resizes]
        self._holding: dict[int, tuple[weakref.ref, _Storage]] = {}  # of those, the ones not empty now
        self._grad_hooked: list[torch.Tensor] = []  # tensors with our gradient hook while entered
        self._lent: list = []  # without the pool: the reduce-scatter pairs in flight (made and freed in a backward)
        self._entered = False
        self._untracked = 0  # untracked() blocks in progress
        # a storage can be freed on another thread (a collective's worker dropping the
        # last reference): its weak reference's callback then runs there, beside a peak
        # being taken here; the running totals and the live set change under this lock
        self._lock = threading.RLock()

    # ---- entering and attaching ------------------------------------------------------
    def __enter__(self) -> MemoryBreakdown:
        self._entered = True
        self._handles += [
            register_optimizer_step_pre_hook(self._before_step),
            register_optimizer_step_post_hook(self._after_step),
        ]
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for p in self._grad_hooked:  # their hooks are gone: a later attach hooks them again
            self._hooked.pop(p, None)
        self._grad_hooked.clear()
        self._entered = False
        return super().__exit__(*exc)

    def attach(
        self, comm: Any = None, *optimizers: torch.optim.Optimizer, model: torch.nn.Module | None = None
    ) -> None:
        """Name the owners: ``comm`` (an ``ISPCommunicator``; its model is ``model``'s
        default) and the optimizers. What they hold now is counted from here; the wrap
        phase ends."""
        self._comm, self._optimizers = comm, list(optimizers)
        self._model = model if model is not None else getattr(comm, "model", None)
        if self._model is not None:
            self._handles += [
                self._model.register_forward_pre_hook(self._model_pre),
                self._model.register_forward_hook(self._model_post),
            ]
        for unit in getattr(comm, "units", []):
            for module in {id(sp.module): sp.module for sp in unit.params}.values():
                self._handles.append(module.register_forward_pre_hook(self._gathered_pre))
        lent = getattr(getattr(comm, "rs_buffers", None), "_lent", None)
        self._lent = lent if lent is not None else []  # the engine's own list (empty now): read while they live
        self._fsdp = fsdp_modules(self._model)
        for module in self._fsdp:  # after FSDP2's own pre-forward (prepended): the unit is gathered
            self._handles.append(module.register_forward_pre_hook(self._fsdp_pre))
        self.classify()
        self._enter_phase("idle")
        self._baseline = (self.current, self._device_now())

    def classify(self) -> None:
        """Name the owners' tensors alive now (see [Note: how a storage gets its part])."""
        self._classify(owned_parts(self._comm, self._optimizers, self._model, self._fsdp))

    def _classify(self, parts: Iterator[tuple[str, torch.Tensor]]) -> None:
        """Name the storages of ``parts`` by their owners (the first owner of a storage
        names it)."""
        for part, t in parts:
            if t.device.type == "meta":
                continue
            if not part.startswith(SHARED):
                self._tag(t, part, OWNER)
                continue
            if t.dtype == torch.uint8:  # a segment: its resident pages ([Note: shared segments count ...])
                self._count_resident(t, part)
                continue
            info = self._known.get(t.untyped_storage())  # the accumulator of bf16 reductions: named when touched
            if info is not None and info.source < OWNER:
                info.part, info.source = part, OWNER

    def _count_resident(self, t: torch.Tensor, part: str) -> None:
        """Name the shared segment ``t`` (a byte tensor over the whole mapping) ``part``
        and count the pages of it this process holds now (see [Note: shared segments
        count their resident pages]); the whole segment where pagemap cannot be read."""
        info = self._note(t, part, OWNER)
        if info is None:
            return
        info.part, info.source = part, OWNER
        resident = resident_bytes(t.untyped_storage())
        if resident is not None and resident != info.nbytes:
            with self._lock:
                self.current += resident - info.nbytes
                info.nbytes = resident

    # ---- storages ---------------------------------------------------------------------
    def _note(self, t: torch.Tensor, part: str, source: int) -> _Storage | None:
        """The storage of ``t`` (a DTensor's: its local tensor's), tracked from now if it
        was not (with ``part``)."""
        t = getattr(t, "_local_tensor", t)
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # a tensor without storage (sparse, ...)
            return None
        info = self._known.get(st)
        if info is not None:
            return info
        nbytes, ptr = _size(st, t.device.type == "cuda")
        info = _Storage(nbytes, part, source, ptr)
        with self._lock:
            self._known[st] = info
            ref = weakref.ref(st, self._freed)
            self._refs[id(ref)] = ref
            self._live[id(ref)] = info
            self.current += nbytes
            self.current_cuda += nbytes if ptr else 0
        return info

    def _resize_elastic(self, everything: bool = True) -> bool:
        """Read the sizes of the storages resized in place again (see [Note: storages
        FSDP2 resizes]): all of them, or (``everything=False``, after any operator) only
        those holding bytes, the ones a free can shrink; whether the total grew."""
        grew = False
        with self._lock:
            for key, (ref, info) in list((self._elastic if everything else self._holding).items()):
                st = ref()
                if st is None:
                    self._elastic.pop(key, None)
                    self._holding.pop(key, None)
                    continue
                nbytes, ptr = _size(st, st.device.type == "cuda")
                if nbytes:
                    self._holding[key] = (ref, info)
                else:
                    self._holding.pop(key, None)
                if (nbytes, ptr) != (info.nbytes, info.ptr):
                    grew |= nbytes > info.nbytes
                    self.current += nbytes - info.nbytes
                    if st.device.type == "cuda":
                        self.current_cuda += nbytes - info.nbytes
                    info.nbytes, info.ptr = nbytes, ptr
        return grew

    def _freed(self, ref: weakref.ref) -> None:
        with self._lock:
            info = self._live.pop(id(ref), None)
            self._refs.pop(id(ref), None)
            if info is not None:
                self.current -= info.nbytes
                self.current_cuda -= info.nbytes if info.ptr else 0

    def _context(self) -> str:
        """The part of a storage made now (see [Note: how a storage gets its part])."""
        ph = self.phase_name
        if ph == "backward":
            node = torch._C._current_autograd_node()
            if node is not None and node.name().startswith(GATHERED_NODE):
                return "block gradients (unsharded)"  # packed, cast, reduced: the engine's
            return "activation gradients" if self._model_grad else "logits and loss"
        if ph in ("forward", "evaluate"):
            if self._depth == 0:
                return "logits and loss"
            return "activations" if ph == "forward" else "no_grad activations (one block)"
        if ph == "optimizer":
            return "optimizer temporaries"
        if ph == "wrap":
            return "one module materialised"
        return OTHER

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self._untracked:
            return out
        if self.phase_name != "backward" and torch._C._current_graph_task_id() != -1:
            self._enter_backward()
        if getattr(func, "overloadpacket", None) is torch.ops.aten.set_:  # isp-comm's slot without the pool
            grew = self._resize_elastic()
        else:
            grew = self._resize_elastic(everything=False) if self._holding else False
        part = None
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                before = self.current
                self._note(t, part or (part := self._context()), CONTEXT)
                grew |= self.current > before
        if getattr(func, "namespace", None) == "fsdp":  # FSDP2's: its gathered parameters were just allocated
            grew |= self._resize_elastic()
            for t in tree_flatten((out, (kwargs or {}).get("out")))[0]:
                if func.name() in OPERATOR_PARTS and isinstance(t, torch.Tensor) and t.device.type != "meta":
                    before = self.current
                    self._tag(t, OPERATOR_PARTS[func.name()])
                    grew |= self.current > before
        if grew:
            self._bump()
        return out

    # ---- phases ------------------------------------------------------------------------
    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Count what happens inside as phase ``name`` (see [Note: phases])."""
        before = self.phase_name
        self._enter_phase(name)
        try:
            yield
        finally:
            self._enter_phase(before)

    @contextlib.contextmanager
    def untracked(self) -> Iterator[None]:
        """What runs inside is not counted: the storages it makes are never tracked,
        also when they outlive it (a checkpoint's save: an asynchronous one keeps its
        staged copies while it writes them). What it frees is still subtracted."""
        self._untracked += 1
        try:
            yield
        finally:
            self._untracked -= 1

    def _enter_phase(self, name: str) -> None:
        self.phase_name = name
        self._resize_elastic()
        self._bump()

    def _bump(self) -> None:
        """A new peak of this phase (or of its moment, ``backward/loss`` before the
        model's output has its gradient, ``backward/model`` after): keep what is alive,
        and the device's figures."""
        for pair in self._lent:  # named at any peak they are in: they die before the owners are read again
            for t in pair:
                self._tag(t, "reduce-scatter buffers", OWNER)
        names = [self.phase_name]
        if self.phase_name == "backward":
            names.append("backward/model" if self._model_grad else "backward/loss")
        alive = None
        with self._lock:  # the total and the storages alive, of one moment
            current = self.current
            for name in names:
                peak = self._peaks.get(name)
                if peak is None or current > peak.tracked:
                    if alive is None:
                        alive = ([(info, info.nbytes) for info in self._live.values()], self._device_now())
                    self._peaks[name] = PhasePeak(current, *alive)

    def _device_now(self) -> dict[str, int]:
        """What the device holds now: CUDA's allocated and reserved bytes and the tracked
        storages on the GPU (when CUDA is in use), else this process's resident anonymous
        memory (RSS less file pages)."""
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
            return {"allocated": allocated, "reserved": reserved, "tracked": self.current_cuda}
        fields: dict[str, int] = {}
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(("VmRSS:", "RssFile:")):
                    fields[line.split(":")[0]] = int(line.split()[1]) * 1024
        return {"rss": fields.get("VmRSS", 0) - fields.get("RssFile", 0)}

    def reset_peaks(self) -> None:
        """Forget the peaks so far (after a warm-up step: the steady state's, as the
        forecast's); the current phase's peak starts from now."""
        self._peaks.clear()
        self._bump()

    # ---- hooks -----------------------------------------------------------------------
    def _model_pre(self, _module: torch.nn.Module, _args: Any) -> None:
        if torch._C._current_graph_task_id() != -1:
            return
        if self._depth == 0:
            self._enter_phase("forward" if torch.is_grad_enabled() else "evaluate")
            self.classify()  # the outer parameters' casts and gathered region
        self._depth += 1

    def _model_post(self, _module: torch.nn.Module, _args: Any, out: Any) -> None:
        if torch._C._current_graph_task_id() != -1:
            return
        self._depth -= 1
        for t in _flat_tensors(out):
            info = self._note(t, "logits and loss", HOOK)
            if info is not None and info.source < HOOK:
                info.part, info.source = "logits and loss", HOOK
            if t.requires_grad:
                self._handles.append(t.register_hook(self._logits_grad))
        if self._depth == 0:
            self.classify()

    def _logits_grad(self, grad: torch.Tensor) -> None:
        self._tag(grad, "logits and loss")
        self._model_grad = True

    def _gathered_pre(self, module: torch.nn.Module, _args: Any) -> None:
        """A module of a block computes with its gathered weights: their gradients are
        the block's unsharded ones."""
        for p in module._parameters.values():
            if p is not None and p.requires_grad and p.grad_fn is not None and p not in self._hooked:
                self._hooked[p] = True  # a view the engine keeps across steps takes one hook
                self._grad_hooked.append(p)
                self._handles.append(p.register_hook(lambda g: self._tag(g, "block gradients (unsharded)")))

    def _fsdp_pre(self, module: torch.nn.Module, _args: Any) -> None:
        """An FSDP2 unit has gathered its parameters: name its buffers, and have the
        gradients of the parameters it computes with named when they accumulate (with
        the unit's buffers again: a backward's gathers and reduce-scatters)."""
        self._classify(fsdp2_parts([module]))
        for p in unsharded_params([module]):
            if p not in self._hooked:
                self._hooked[p] = True
                self._grad_hooked.append(p)
                self._handles.append(p.register_post_accumulate_grad_hook(lambda p, m=module: self._fsdp_grad(p, m)))
        if self._resize_elastic():  # gathered since the last operator: a moment of its own
            self._bump()

    def _fsdp_grad(self, p: torch.Tensor, module: torch.nn.Module) -> None:
        if p.grad is not None:
            self._tag(p.grad, "block gradients (unsharded)")
        self._classify(fsdp2_parts([module]))
        if self._resize_elastic():
            self._bump()

    def _tag(self, t: torch.Tensor, part: str, source: int = HOOK) -> None:
        """Name ``t``'s storage ``part`` unless a stronger source named it; follow its
        size from now when FSDP2 resizes it ([Note: storages FSDP2 resizes])."""
        info = self._note(t, part, source)
        if info is None:
            return
        if info.source < source:
            info.part, info.source = part, source
        if part in RESIZED and id(info) not in self._elastic:  # (the dict holds info: its id is not reused)
            with self._lock:  # held from now; the next operator's read drops it while it is empty
                entry = (weakref.ref(getattr(t, "_local_tensor", t).untyped_storage()), info)
                self._elastic[id(info)] = self._holding[id(info)] = entry

    def _enter_backward(self) -> None:
        self._model_grad = False
        self._enter_phase("backward")
        engine = torch.autograd.Variable._execution_engine
        # queued now, it runs before the engine's own end-of-backward callback (queued
        # later, when the first block's backward begins): it names what the engine may
        # drop there, and queues the real one
        engine.queue_callback(lambda: (self.classify(), engine.queue_callback(self._end_backward)))

    def _end_backward(self) -> None:
        self.classify()
        self._enter_phase("idle")

    def _before_step(self, opt: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
        if opt not in self._optimizers:
            self._optimizers.append(opt)
        self.classify()
        self._enter_phase("optimizer")

    def _after_step(self, _opt: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
        self.classify()
        self._enter_phase("idle")

    # ---- the result ------------------------------------------------------------------
    def result(self) -> Breakdown:
        """Each phase's peak by part (parts as they are named now), with the device's
        figures at that moment and when the breakdown attached; on CUDA, what the
        allocator holds now beyond the tracked tensors, by kind ([Note: untracked
        blocks]: a snapshot of the allocator, taken here)."""
        self.classify()
        self._resize_elastic()
        with self._lock:  # the comm thread may free a storage meanwhile
            pointers = {info.ptr for info in self._live.values() if info.ptr}
        untracked = allocator_now(pointers)
        return Breakdown.of(self._peaks, self._baseline, untracked)
