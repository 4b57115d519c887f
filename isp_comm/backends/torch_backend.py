"""Collectives on ``torch.distributed`` (NCCL on CUDA, gloo on CPU)."""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from isp_comm.backends.base import Backend, CompletedHandle, Handle, HandleGroup
from isp_comm.errors import ISPCommTimeout

# torch 2.13 names these ``*_single`` and warns (FutureWarning) on the old names, which
# torch 2.11 alone has: the same collectives, the same arguments.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class TorchHandle(Handle):
    """Wraps a ``dist.Work`` so that waiting has a deadline and a useful error.

    [Note: waiting without stalling the host]
    On NCCL, ``Work.wait()`` only makes the current CUDA stream wait for the
    collective's stream, while ``Work.wait(timeout)`` blocks the host until the
    collective has finished (it polls), which would keep the host from running ahead
    of the GPU. So a NCCL handle waits without a timeout; its deadline is the process
    group's own timeout (``init_process_group(timeout=...)``), after which NCCL's
    watchdog aborts the communicator and the next collective, or the
    ``torch.cuda.synchronize()`` that ends a step, raises naming the collective. Gloo
    (CPU, or CUDA tensors on one GPU) waits on the host with the deadline.

    Two caveats. (1) Gloo's ``reduce_scatter_tensor`` (``_reduce_scatter_base``)
    returns a ``LambdaWork`` whose ``wait`` ignores its timeout and runs the lambda
    that copies the result into ``out``: the result exists only after ``wait``, the
    deadline does not bound it, and ``is_completed()`` never turns true, so after a
    failure :class:`~isp_comm.hooks.reductions.InflightReduce` counts it in flight
    for good and its buffers are leaked rather than reused (safe; it only affects
    gloo with CUDA tensors or CPU runs that use this backend). (2) Tracing on NCCL:
    :meth:`completion_event` calls ``Work.wait()`` at issue time, under the observer
    stream. That only orders the observer, but with ``TORCH_NCCL_BLOCKING_WAIT=1`` it
    blocks the host at every traced issue, and it lets NCCL drop its hold on the
    tensors early (the ``TORCH_NCCL_AVOID_RECORD_STREAMS`` path); harmless here,
    since the engine keeps every buffer until its own wait."""

    __slots__ = ("_work", "_what", "_group", "_host_wait")

    def __init__(self, work: dist.Work, what: str, group: ProcessGroup, host_wait: bool) -> None:
        self._work, self._what, self._group, self._host_wait = work, what, group, host_wait

    def is_completed(self) -> bool:
        return self._work.is_completed()

    def completion_event(self, observer: torch.cuda.Stream) -> torch.cuda.Event | None:
        """NCCL: an event at the collective's end, recorded on ``observer``, a stream
        that does nothing else, after making it wait for the collective (timelines; see
        [Note: two clocks] in ``isp_comm/trace.py``). Gloo waits on the host: None."""
        if self._host_wait:
            return None
        event = torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(observer):
            self._work.wait()  # orders the current stream, here the observer, after the collective
            event.record(observer)
        return event

    def wait(self, timeout_s: float) -> None:
        try:
            if self._host_wait:
                self._work.wait(timeout=timedelta(seconds=timeout_s))
            else:
                self._work.wait()
        except RuntimeError as exc:  # gloo/NCCL report timeouts and dead peers this way
            ranks = dist.get_process_group_ranks(self._group)
            raise ISPCommTimeout(
                f"{self._what} over ranks {ranks} failed or passed its {timeout_s:.1f}s deadline "
                f"(a peer died or stalled): {exc}"
            ) from exc


def _single(group: ProcessGroup) -> bool:
    return dist.get_world_size(group) == 1


_FITS = {
    "all-gather": lambda size, out, inp: out == size * inp,
    "reduce-scatter": lambda size, out, inp: inp == size * out,
    "all-to-all": lambda size, out, inp: out == inp and inp % size == 0,
}
"""Whether an output and an input of these element counts fit, per kind."""


def refuse_unfit(kind: str, size: int, out: torch.Tensor, inp: torch.Tensor) -> None:
    """Refuse, at issue and before anything is sent, a collective whose output and
    input do not fit: sizes (see [Note: what gloo does not check]; the CUDA backends'
    copies and reads take their counts from one side only) or dtypes (converted).
    ``size``: the group's."""
    if out.dtype != inp.dtype:
        raise ValueError(f"{kind}: an output of {out.dtype} and an input of {inp.dtype}: the dtypes differ")
    if not _FITS[kind](size, out.numel(), inp.numel()):
        raise ValueError(
            f"{kind} over {size} ranks: an output of {out.numel()} elements and an input of "
            f"{inp.numel()} do not fit each other"
        )


def refuse_strided(kind: str, size: int, out: torch.Tensor) -> None:
    """Refuse, at issue, a non-contiguous output (or all-reduced tensor) of a
    collective over several ranks, which NCCL refuses and gloo runs wrong.

    [Note: what gloo does not check]
    Gloo moves ``numel`` elements from a tensor's first one, whatever its strides: a
    non-contiguous output (or all-reduced tensor) got sums or peers' data written
    over the elements between the view's and missed its own, on every rank (torch
    2.13). It compares no sizes either: an all-to-all of an input not divisible by
    the group left uninitialised memory in the output, and the broadcasts and reduces
    that make the gather and the reduce-scatter on CPU (see [Note: gloo's gather and
    reduce-scatter on CPU]) copied a one-element input or chunk over a longer output
    (``copy_`` broadcasts). An output of another dtype than the input was converted.
    Each is refused (here and by :func:`refuse_unfit`) on the rank that issues it,
    before anything is sent: its peers then stop at their deadline."""
    if size > 1 and not out.is_contiguous():
        what = "output" if kind != "all-reduce" else "tensor"
        raise ValueError(
            f"{kind} over {size} ranks: its {what} (shape {list(out.shape)}, strides {list(out.stride())}) "
            "is not contiguous; gloo would write the elements from its first on, not the view's"
        )


def backend_for(config: str, device_type: str) -> str | None:
    """The backend that serves ``device_type`` in a group's backend config:
    ``"nccl"`` and ``"gloo"`` serve every device, ``"cpu:gloo,cuda:nccl"`` (what
    ``init_process_group()`` without a backend makes on a CUDA build) one each."""
    if ":" not in config:
        return config
    pairs = dict(part.split(":", 1) for part in config.split(","))
    return pairs.get(device_type)


def runs_on_nccl(group: ProcessGroup, device: torch.device) -> bool:
    """Whether a collective of ``group`` on ``device`` tensors runs on NCCL (on CUDA
    streams, asynchronous). Asked of the group's per-device config, not of
    ``dist.get_backend``, which says ``"undefined"`` for a group of several backends."""
    if device.type != "cuda":
        return False
    try:
        return backend_for(dist.get_backend_config(group), "cuda") == "nccl"
    except (RuntimeError, ValueError):
        return False


class TorchBackend(Backend):
    """``torch.distributed`` collectives, always asynchronous.

    The all-gather and reduce-scatter are torch 2.13's ``all_gather_single`` and
    ``reduce_scatter_single``, or on torch 2.11 the same calls under their old names
    (``all_gather_into_tensor``, ``reduce_scatter_tensor``); on CPU tensors (gloo)
    they are broadcasts and reduces instead.

    [Note: gloo's gather and reduce-scatter on CPU]
    Gloo runs ``all_gather_single`` and ``reduce_scatter_single`` through temporaries of
    several times their bytes: with 12 MB fp32 tensors at 2 ranks (torch 2.13, 1
    thread, 10 calls after 2), the gather raised a rank's peak RSS by 73 MiB and took
    9.5 ms, the reduce-scatter 86 MiB and 15 ms. A gather made of one broadcast per
    rank into the output's chunks raised it by 0.7 MiB in 3.6 ms, and a
    reduce-scatter made of one reduce per rank (each rank's own chunk reduced into
    ``out``) by 2 MiB in 8 ms; at 4 ranks the same held (37 vs 0.6 MiB, 15 vs 8 ms;
    112 vs 1 MiB, 29 vs 18 ms). Gloo's reduce writes partial sums into a non-root's
    tensor, so the chunks this rank sends are copied first ((n-1)/n of the input):
    ``inp`` is left as it was, as the contract and NCCL have it. Each collective is
    several ``dist.Work``; every rank issues them in the same order, and the handle
    waits for all of them under one deadline. On CUDA tensors nothing changes (NCCL,
    or gloo's CUDA path on one GPU, where ``reduce`` is CPU-only)."""

    name = "torch"

    def __init__(self, device: torch.device | None = None) -> None:
        self._device = device if device is not None else torch.device("cpu")
        self._nccl: dict[tuple[str, str], bool] = {}  # (group, device type) -> runs on NCCL

    def _handle(self, work: dist.Work, what: str, group: ProcessGroup, device: torch.device) -> TorchHandle:
        key = (group.group_name, device.type)
        nccl = self._nccl.get(key)
        if nccl is None:
            nccl = self._nccl[key] = runs_on_nccl(group, device)
        return TorchHandle(work, what, group, host_wait=not nccl)

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, group: ProcessGroup) -> Handle:
        size = dist.get_world_size(group)
        refuse_unfit("all-gather", size, out, inp)  # see [Note: what gloo does not check]
        refuse_strided("all-gather", size, out)
        if size == 1:
            out.copy_(inp.view_as(out))
            return CompletedHandle()
        if inp.device.type == "cpu":  # gloo: see [Note: gloo's gather and reduce-scatter on CPU]
            chunks = out.view(size, -1)
            chunks[dist.get_rank(group)].copy_(inp.view(-1))
            works = [dist.broadcast(c, group=group, async_op=True, group_src=i) for i, c in enumerate(chunks)]
            return HandleGroup([self._handle(w, "all-gather (broadcasts)", group, inp.device) for w in works])
        work = _all_gather_single(out, inp, group=group, async_op=True)
        return self._handle(work, "all-gather", group, inp.device)

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, group: ProcessGroup) -> Handle:
        size = dist.get_world_size(group)
        refuse_unfit("reduce-scatter", size, out, inp)
        refuse_strided("reduce-scatter", size, out)
        if size == 1:
            out.copy_(inp.view_as(out))
            return CompletedHandle()
        if inp.device.type == "cpu":  # gloo: see [Note: gloo's gather and reduce-scatter on CPU]
            me = dist.get_rank(group)
            chunks = inp.view(size, -1)
            # what goes to the other ranks, copied (gloo's reduce writes into a non-root's
            # tensor) before ``out`` is written: ``out`` may overlap another chunk of ``inp``
            sent = list(torch.cat([chunks[:me], chunks[me + 1 :]]).unbind())
            out.view(-1).copy_(chunks[me])
            sent.insert(me, out.view(-1))
            works = [dist.reduce(t, group=group, async_op=True, group_dst=i) for i, t in enumerate(sent)]
            return HandleGroup([self._handle(w, "reduce-scatter (reduces)", group, inp.device) for w in works])
        work = _reduce_scatter_single(out, inp, group=group, async_op=True)
        return self._handle(work, "reduce-scatter", group, inp.device)

    def all_reduce(self, tensor: torch.Tensor, group: ProcessGroup) -> Handle:
        size = dist.get_world_size(group)
        if size == 1:
            return CompletedHandle()
        refuse_strided("all-reduce", size, tensor)
        work = dist.all_reduce(tensor, group=group, async_op=True)
        return self._handle(work, "all-reduce", group, tensor.device)

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, group: ProcessGroup) -> Handle:
        size = dist.get_world_size(group)
        refuse_unfit("all-to-all", size, out, inp)
        refuse_strided("all-to-all", size, out)
        if size == 1:
            out.copy_(inp)
            return CompletedHandle()
        work = dist.all_to_all_single(out, inp, group=group, async_op=True)
        return self._handle(work, "all-to-all", group, inp.device)

    def barrier(self, group: ProcessGroup, timeout_s: float) -> None:
        if not _single(group):
            # on the parameters' device: NCCL refuses a CPU tensor
            self.all_reduce(torch.zeros(1, device=self._device), group).wait(timeout_s)
            if self._device.type == "cuda":  # a barrier is a host meeting (never in a step)
                torch.cuda.current_stream(self._device).synchronize()

    def empty(
        self, numel: int, dtype: torch.dtype, device: torch.device, group: ProcessGroup | None = None
    ) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, device=device)

    def close(self) -> None:
        return None
