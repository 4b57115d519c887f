"""Checkpoints with torch.distributed.checkpoint: full (unsharded) tensors, so a run
can resume on a different weight-parallel size.

A checkpoint holds the model's full state dict, AdamW's state per parameter (full
tensors), the step and the RNG state. Every rank holds the same full tensors when
saving (DCP writes replicated tensors once); on load each rank takes its own rows.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from isp_comm import ISPCommunicator

LATEST = "latest"


def _step_dir(out: str, step: int) -> str:
    return os.path.join(out, "checkpoints", f"step_{step:06d}")


def full_optimizer_state(comm: ISPCommunicator, opt: torch.optim.Optimizer) -> dict[str, dict[str, torch.Tensor]]:
    """Parameter name -> {state key: full tensor} (collective over the WP group)."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    names = {p: n for n, p in comm.model.named_parameters()}
    for unit in comm.sharded_units:
        first = opt.state.get(unit.shards[0], {})
        for key in sorted(first):
            if torch.is_tensor(first[key]) and first[key].dim() > 0:
                fulls = comm.gather_full(unit, [opt.state[p][key] for p in unit.shards])
            else:
                fulls = [opt.state[p][key].clone() for p in unit.shards]
            for p, full in zip(unit.shards, fulls):
                out.setdefault(names[p], {})[key] = full
    for p, name in names.items():
        if not comm.is_sharded(name) and p in opt.state:
            out[name] = {k: v.clone() for k, v in opt.state[p].items()}
    return out


def save(out: str, step: int, comm: ISPCommunicator, opt: torch.optim.Optimizer) -> str:
    path = _step_dir(out, step)
    state = {
        "model": comm.full_state_dict(),
        "optim": full_optimizer_state(comm, opt),
        "meta": {"step": torch.tensor(step)},
        "rng": torch.get_rng_state(),
    }
    dcp.save(state, checkpoint_id=path)
    dist.barrier()
    if dist.get_rank() == 0:
        with open(os.path.join(out, "checkpoints", LATEST), "w") as f:
            f.write(os.path.basename(path))
    return path


def latest(out: str) -> str | None:
    try:
        with open(os.path.join(out, "checkpoints", LATEST)) as f:
            return os.path.join(out, "checkpoints", f.read().strip())
    except FileNotFoundError:
        return None


def load(path: str, comm: ISPCommunicator, opt: torch.optim.AdamW) -> int:
    """Load ``path`` into the wrapped model and its AdamW; returns the saved step."""
    model_sd = comm.full_state_dict()
    optim_sd = {
        name: {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(t), "exp_avg_sq": torch.zeros_like(t)}
        for name, t in model_sd.items()
        if name in dict(comm.model.named_parameters())
    }
    state = {"model": model_sd, "optim": optim_sd, "meta": {"step": torch.tensor(0)}, "rng": torch.get_rng_state()}
    dcp.load(state, checkpoint_id=path)
    comm.load_full_state_dict(state["model"])
    for name, p in comm.model.named_parameters():
        full = state["optim"][name]
        opt.state[p] = {
            k: (comm.shard_of(name, v).clone() if comm.is_sharded(name) and v.dim() > 0 else v.clone())
            for k, v in full.items()
        }
    torch.set_rng_state(state["rng"])
    return int(state["meta"]["step"])
