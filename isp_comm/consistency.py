"""Every rank must hold the same weights: a fingerprint check, or rank 0's broadcast.

A forgotten ``torch.manual_seed`` gives each rank its own initial weights. Wrapping
would accept them and training would run: the replicated parameters would differ
across ranks forever and the sharded ones would be a patchwork. Before anything is
sharded, :func:`check_same_weights` compares a checksum of every parameter over the
world (one small all-gather) and names the first that differs;
``ISPConfig(sync_module_states=True)`` instead broadcasts rank 0's weights, as FSDP1's
option of that name does. Parameters still on the meta device are skipped: they are
materialised identically later (see :mod:`isp_comm.materialize`). After wrapping, the
opposite mistake, :func:`repeated_rows`: shards alike on every rank that holds part of
a weight ([Note: rows initialised after wrapping] in ``isp_comm/communicator.py``).
While training, :class:`WeightsCheck`: replicated parameters that part across ranks,
and shards alike again (an init after the first step).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from isp_comm.errors import few_names
from isp_comm.virtual import is_virtual

_CHUNK = 1 << 20  # elements per step of the device-side checksum: 3 int64 temporaries of 8 MiB at most


def _device_sums(t: torch.Tensor) -> torch.Tensor:
    """Two chunked integer sums of ``t``'s 32-bit words (the second weighted by
    position), as a tensor on ``t``'s device: nothing read on the host."""
    raw = t.detach().contiguous().view(-1).view(torch.uint8)
    words = raw.view(torch.int32) if raw.numel() % 4 == 0 else raw
    sums = torch.zeros(2, dtype=torch.int64, device=t.device)
    for start in range(0, words.numel(), _CHUNK):
        w = words[start : start + _CHUNK].to(torch.int64)
        sums[0] += w.sum()
        sums[1] += (w * (torch.arange(w.numel(), device=t.device) % 65521 + 1)).sum()
    return sums


def _varied(t: torch.Tensor) -> torch.Tensor:
    """1 where ``t`` holds more than one value, as an int64 scalar on its device."""
    flat = t.detach().reshape(-1)
    return (flat != flat[0]).any().to(torch.int64) if flat.numel() > 1 else flat.new_zeros((), dtype=torch.int64)


def fingerprints(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """A checksum of each tensor's bytes, and whether it holds more than one value, as
    an ``(n, 3)`` int64 tensor on ``device``: CRC-32 and the size on CPU (no copy),
    :func:`_device_sums` elsewhere (no copy to the host, so one read of the gathered
    result is the only sync)."""
    if not tensors:
        return torch.zeros(0, 3, dtype=torch.int64, device=device)
    if all(t.device.type == "cpu" for t in tensors):
        rows = [
            (zlib.crc32(t.detach().contiguous().view(-1).view(torch.uint8).numpy()), t.nbytes, int(_varied(t)))
            for t in tensors
        ]
        return torch.tensor(rows, dtype=torch.int64, device=device)
    return torch.stack([torch.cat([_device_sums(t), _varied(t).view(1)]).to(device) for t in tensors])


Gather = Callable[[torch.Tensor], torch.Tensor]
"""Every rank's copy of this rank's tensor, stacked rank-major: one all-gather over a
group. The communicator's go through its backend and wait under its deadline
(:meth:`~isp_comm.collectives.StepCollectives.all_gather`); :func:`torch_gather`'s
before there is one."""


def torch_gather(group: dist.ProcessGroup | None) -> Gather:
    """A :data:`Gather` of ``torch.distributed``'s over ``group`` (under the process
    group's own timeout): for the checks made before the communicator's backend exists."""

    def gather(t: torch.Tensor) -> torch.Tensor:
        every = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
        dist.all_gather(every, t, group=group)
        return torch.stack(every)

    return gather


def gathered_fingerprints(tensors: list[torch.Tensor], gather: Gather, device: torch.device) -> torch.Tensor:
    """Every rank's :func:`fingerprints` of its ``tensors``, as a ``(ranks, n, 3)``
    tensor on ``device``: one all-gather, nothing read on the host."""
    return gather(fingerprints(tensors, device))


def differing_in(every: torch.Tensor, names: list[str]) -> dict[str, list[int]]:
    """The ``names`` whose fingerprints in ``every`` (:func:`gathered_fingerprints`)
    differ across ranks, each with the ranks whose copy differs from the first's."""
    every = every.cpu()
    apart = (every != every[:1]).any(dim=-1)  # (ranks, n)
    return {name: apart[:, i].nonzero().flatten().tolist() for i, name in enumerate(names) if apart[:, i].any()}


def alike_in(every: torch.Tensor, names: list[str], groups: list[list[int]]) -> list[str]:
    """The ``names`` whose fingerprints in ``every`` are the same on every rank of one
    of ``groups`` (ranks that each hold other rows of it), and not constant there."""
    every = every.cpu()
    out = []
    for i, name in enumerate(names):
        for g in (g for g in groups if len(g) > 1):
            rows = every[g, i]
            if bool((rows == rows[:1]).all()) and bool(rows[0, 2]):
                out.append(name)
                break
    return out


def rows_alike(names: list[str]) -> str:
    """What a user is told of weights whose rows are alike on every rank (:func:`alike_in`)."""
    return (
        f"{few_names(names)}: every rank holding part of the weight holds "
        "the same values, where each holds its own rows: initialised after wrapping, from one generator "
        "state on every rank (the weight is its first rows repeated)? Initialise before wrapping, build on the "
        "meta device with ISPConfig(init_seed=...), or load the weights (comm.load_full_state_dict)"
    )


def differing(named: list[tuple[str, torch.Tensor]], gather: Gather, device: torch.device) -> dict[str, list[int]]:
    """The tensors among ``named`` whose bytes differ across the ranks ``gather``
    reaches (see :func:`differing_in`): one all-gather and one read on the host."""
    return differing_in(gathered_fingerprints([t for _, t in named], gather, device), [n for n, _ in named])


@torch.no_grad()
def check_same_weights(model: nn.Module, device: torch.device) -> None:
    """``ValueError`` naming the first parameter whose values differ across ranks."""
    named = [(n, p) for n, p in model.named_parameters() if p.device.type != "meta"]
    if dist.get_world_size() == 1 or not named or is_virtual():  # a virtual world: no peer to differ
        return
    for name, ranks in differing(named, torch_gather(None), device).items():
        raise ValueError(
            f"parameter {name} differs across ranks (rank 0 and ranks {ranks} hold different values): "
            "build the model with the same seed on every rank (torch.manual_seed before building it), "
            "or pass ISPConfig(sync_module_states=True) to start every rank from rank 0's weights"
        )


@torch.no_grad()
def broadcast_weights(model: nn.Module) -> None:
    """Rank 0's parameters and buffers onto every rank, tensor by tensor (in a virtual
    world, nothing: rank 0 is no process there)."""
    if is_virtual():
        return
    for t in [*model.parameters(), *model.buffers()]:
        if t.device.type != "meta":
            dist.broadcast(t.data, src=0)


@torch.no_grad()
def repeated_rows(named: list[tuple[str, torch.Tensor]], gather: Gather, device: torch.device) -> list[str]:
    """The parameters among ``named`` (this rank's rows of each) that hold the same,
    not constant, values on every rank ``gather`` reaches (the ranks that hold the
    other rows): rows initialised after wrapping from one generator state on every
    rank (each drew the parameter's first rows), never a shard of real weights. One
    all-gather and one read on the host."""
    if not named:
        return []
    every = gathered_fingerprints([p for _, p in named], gather, device)
    return alike_in(every, [n for n, _ in named], [list(range(every.shape[0]))])


class WeightsCheck:
    """[Note: replicas that drift apart] Every rank steps its copy of a replicated
    parameter on the same averaged gradient, so the copies stay bitwise alike, unless
    something changes a gradient by a figure of one rank's own before the step:
    ``torch.nn.utils.clip_grad_norm_`` on the wrapped model (the norm of this rank's
    shards), ``torch.amp.GradScaler`` (one rank finds an inf in its shards and skips
    the step its peer takes), an update of the user's that depends on the rank. The
    replicas would part for good, and a checkpoint keep rank 0's, without a word.

    So at the end of backward 2, 4, 8, ... (a point every rank reaches together, where
    a forward need not be: one rank may evaluate alone) a checksum of each replicated
    parameter is gathered over the world (``gather``: the communicator's, under its
    deadline), log2 of the backwards in all; copies that
    differ stop the run on every rank, naming them. Only where the backend's sums are
    the same on every rank (``Backend.identical_sums``), which the communicator
    decides. The same gather carries a checksum of each parameter this rank holds
    part of: rows alike on every rank of a group that holds its parts (``rows_groups``)
    mean an initialisation after wrapping from one generator state on every rank, made
    after the first forward's look ([Note: rows initialised after wrapping]), which
    stops the run too. On the CPU the check reads the result at once; on CUDA it is
    copied to the host behind the step and read at the next backward's end, long done
    by then, so no step waits on the device for it. A check no backward followed is
    read where the weights leave the run (:meth:`flush`: a state dict, the close), so
    the last steps' replicas are not saved or exported unchecked."""

    def __init__(
        self,
        replicas: list[tuple[str, torch.Tensor]],
        partial: list[tuple[str, torch.Tensor]],
        rows_groups: list[list[int]],
        gather: Gather,
        device: torch.device,
    ) -> None:
        self.replicas, self.partial, self.rows_groups = replicas, partial, rows_groups
        self.gather, self.device = gather, device
        self._pending: tuple[int, torch.Tensor, torch.cuda.Event | None] | None = None
        """The last gather not read yet: its backward, its host copy, the copy's event."""
        self.read_later = device.type == "cuda"
        """Read a gather at the next backward's end (or :meth:`flush`), not at once."""

    def __call__(self, ended: int) -> None:
        """The ``ended``-th backward has ended: read the last gather, and gather anew at a power of two."""
        if self._pending is not None:
            self._read()
        if ended < 2 or ended & (ended - 1):
            return
        tensors = [t for _, t in (*self.replicas, *self.partial)]
        every = gathered_fingerprints(tensors, self.gather, self.device)
        if every.device.type != "cuda":
            self._pending = (ended, every, None)
        else:
            host = torch.empty(every.shape, dtype=every.dtype, pin_memory=True)
            host.copy_(every, non_blocking=True)
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(every.device))  # the copy's stream, not the current device's
            self._pending = (ended, host, done)
        if not self.read_later:
            self._read()

    def flush(self) -> None:
        """Read the last gather if no backward has read it (a state dict or the close
        after the last step); the same verdict on every rank, as the gather is."""
        if self._pending is not None:
            self._read()

    def _read(self) -> None:
        assert self._pending is not None
        ended, every, done = self._pending
        self._pending = None
        if done is not None and not done.query():
            done.synchronize()  # a whole backward later: not expected to wait
        n = len(self.replicas)
        apart = differing_in(every[:, :n], [name for name, _ in self.replicas])
        if apart:
            names = list(apart)
            raise RuntimeError(
                f"isp-comm: the replicated parameters {few_names(names)} "
                f"differ across ranks (ranks {apart[names[0]]} from rank 0) at backward {ended}: every rank steps "
                "them on the same averaged gradient, so a gradient or a step was changed by a figure of one rank's "
                "own. torch.nn.utils.clip_grad_norm_ on the wrapped model scales by this rank's norm (use "
                "comm.clip_grad_norm_); torch.amp.GradScaler lets one rank skip a step its peer takes (use "
                "torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler); a learning rate or a skipped step "
                "decided from this rank's own loss (ReduceLROnPlateau fed it, a NaN check) parts them too "
                "(all-reduce the figure first)"
            )
        alike = alike_in(every[:, n:], [name for name, _ in self.partial], self.rows_groups)
        if alike:
            raise RuntimeError(f"isp-comm: at backward {ended}, {rows_alike(alike)}")
