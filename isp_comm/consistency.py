"""Every rank must start from the same weights: a fingerprint check, or rank 0's broadcast.

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
"""

from __future__ import annotations

import zlib

import torch
import torch.distributed as dist
from torch import nn

from isp_comm.virtual import is_virtual

_CHUNK = 1 << 24  # elements per step of the device-side checksum


def fingerprint(t: torch.Tensor) -> tuple[int, int]:
    """A checksum of ``t``'s bytes: CRC-32 on CPU (no copy), two chunked integer sums
    of its 32-bit words elsewhere (no copy to the host)."""
    t = t.detach().contiguous()
    raw = t.view(-1).view(torch.uint8)
    if t.device.type == "cpu":
        return zlib.crc32(raw.numpy()), raw.numel()
    words = raw.view(torch.int32) if raw.numel() % 4 == 0 else raw
    a = b = torch.zeros((), dtype=torch.int64, device=t.device)
    for start in range(0, words.numel(), _CHUNK):
        w = words[start : start + _CHUNK].to(torch.int64)
        a = a + w.sum()
        b = b + (w * (torch.arange(w.numel(), device=t.device) % 65521 + 1)).sum()
    return int(a), int(b)


@torch.no_grad()
def check_same_weights(model: nn.Module, device: torch.device) -> None:
    """``ValueError`` naming the first parameter whose values differ across ranks."""
    named = [(n, p) for n, p in model.named_parameters() if p.device.type != "meta"]
    if dist.get_world_size() == 1 or not named or is_virtual():  # a virtual world: no peer to differ
        return
    mine = torch.tensor([fingerprint(p) for _, p in named], dtype=torch.int64, device=device).view(-1, 2)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    for i, (name, _) in enumerate(named):
        differ = [r for r, f in enumerate(every) if not torch.equal(f[i], every[0][i])]
        if differ:
            raise ValueError(
                f"parameter {name} differs across ranks (rank 0 and ranks {differ} hold different values): "
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
def repeated_rows(named: list[tuple[str, torch.Tensor]], group: dist.ProcessGroup, device: torch.device) -> list[str]:
    """The parameters among ``named`` (this rank's rows of each) that hold the same,
    not constant, values on every rank of ``group`` (the ranks that hold the other
    rows): rows initialised after wrapping from one generator state on every rank
    (each drew the parameter's first rows), never a shard of real weights. One
    all-gather of torch's, as :func:`check_same_weights` (outside any step's count of
    the backend's collectives)."""
    if not named:
        return []
    mine = torch.tensor([fingerprint(p) for _, p in named], dtype=torch.int64, device=device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    same = [all(torch.equal(f[i], every[0][i]) for f in every) for i in range(len(named))]
    varied = [p.numel() > 1 and bool((p.reshape(-1) != p.reshape(-1)[0]).any()) for _, p in named]
    return [n for (n, _), s, v in zip(named, same, varied) if s and v]
