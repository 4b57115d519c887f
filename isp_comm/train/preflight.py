"""What rank 0 warns about before the first step: a memory forecast over what the rank
can have (the phase, its biggest part, the knob that shrinks it), and flags that may
not mean what they say."""

from __future__ import annotations

import os

import torch

from isp_comm import ISPConfig
from isp_comm.memory_forecast import KNOBS, MemoryForecast, forecast
from isp_comm.train.config import TrainConfig
from isp_comm.train.metrics import proc_status_bytes


def local_ranks(cfg: TrainConfig, world: int) -> int:
    """Ranks on this host: torchrun's count, else what the flags launch here (one
    in a virtual world)."""
    if cfg.virtual_world:
        return 1
    return int(os.environ.get("LOCAL_WORLD_SIZE", 0)) or cfg.nproc_per_node or world


def memory_forecast(cfg: TrainConfig, model: torch.nn.Module, icfg: ISPConfig, world: int, device: torch.device):
    """The forecast for this run's flags (see isp_comm/memory_forecast/)."""
    wp = cfg.wp or world  # as ParallelGroups.create gets it
    return forecast(
        model,
        icfg,
        world,
        wp,
        cfg.sp,
        cfg.batch,
        cfg.seq,
        device=device.type,
        local_world=local_ranks(cfg, world),
        evaluate=bool(cfg.eval_every),
        compiled=cfg.compile,
        grad_accum=cfg.grad_accum,
        deferred_replica_sync=cfg.replica_sync == "step",
    )


def memory_warnings(
    cfg: TrainConfig, model: torch.nn.Module, icfg: ISPConfig, world: int, device: torch.device
) -> tuple[list[str], MemoryForecast | None]:
    """One line when the forecast's highest phase exceeds what this rank can have (the
    phase, its biggest part and the knob that shrinks it), and the forecast itself,
    which ``--memory-breakdown`` reports beside its measurement (``None``, and a line
    saying why, for a model the forecast's meta trace cannot run)."""
    try:
        fc = memory_forecast(cfg, model, icfg, world, device)
    except Exception as exc:  # a model the meta trace cannot run: train anyway, say so
        return [f"no memory forecast for this model ({type(exc).__name__}: {exc})"], None
    free = free_memory_per_rank(device, local_ranks(cfg, world))
    phase = max(run_phases(cfg, fc.names()), key=fc.peak)
    need = fc.peak(phase) + (0 if device.type == "cuda" else proc_status_bytes("VmRSS"))
    if need <= free:
        return [], fc
    line = (
        f"the memory forecast for the {phase} phase is {need / 2**20:.0f} MiB per rank, more than the "
        f"{free / 2**20:.0f} MiB free; {advice(fc, phase)}"
    )
    return [line], fc


def advice(fc: MemoryForecast, phase: str) -> str:
    """The forecast's biggest part of ``phase`` and the knob that shrinks it."""
    part, size = fc.biggest(phase)
    knob = KNOBS.get(part.split(" (")[0], "a larger --wp")
    return f"its biggest part is {part} ({size / 2**20:.0f} MiB): try {knob} (isp-train --plan prints the table)"


def run_phases(cfg: TrainConfig, names: list[str]) -> list[str]:
    """The forecast's phases this run goes through: no checkpoint save without one
    (``--no-final-save`` and ``--save-every 0``, or a virtual run, which saves nothing),
    no background one without ``--async-save`` (a warning once blamed a 7B run's async
    save it never made), no load without weights to read (``--resume``,
    ``--init-from``, ``--model``'s)."""
    skip = set() if cfg.async_save else {"async_save"}
    if cfg.virtual_world or not (cfg.final_save or cfg.save_every > 0):
        skip |= {"save", "async_save"}
    if not (cfg.resume or cfg.init_from or cfg.model):
        skip.add("load")
    return [ph for ph in names if ph not in skip]


def free_memory_per_rank(device: torch.device, local_ranks: int) -> int:
    """Free bytes this rank can count on: the GPU's free memory, or the host's
    available memory shared by its ranks."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    with open("/proc/meminfo") as f:
        avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    return avail // max(local_ranks, 1)


def start_warnings(cfg: TrainConfig) -> list[str]:
    """What a run does that its flags may not have meant (one line each, rank 0)."""
    out = []
    if cfg.model and not cfg.data:
        out.append(
            "--model without --data trains on the built-in corpus (a synthetic Markov chain over 256 "
            "byte tokens), not text: give --data FILE"
        )
    if cfg.lora_rank and not cfg.model and not cfg.init_from and not cfg.resume:
        out.append(
            "--lora-rank adapts the reference llama's random initialisation: give --init-from MODEL.pt "
            "(isp-export of a trained run) to adapt trained weights"
        )
    return out
