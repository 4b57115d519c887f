"""What one rank's run holds (``Job``) and how ``setup`` builds it: the flags checked
against the data and the world, the batches, the sharded model and its optimizer."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import sys

import torch
import torch.distributed as dist

from isp_comm import ISPCommunicator, ISPConfig, ParallelGroups, hf_checkpoint, model_flops
from isp_comm.discovery import find_blocks
from isp_comm.models.llama import LlamaConfig
from isp_comm.train import checkpoint, hf_model, lora, run_folder, survive, virtual
from isp_comm.train.batching import TrainData
from isp_comm.train.config import TrainConfig, as_eval_data_error, check_layout, resolve_device
from isp_comm.train.data import Slicing
from isp_comm.train.memory.oom import Where
from isp_comm.train.metrics import StepMeter
from isp_comm.train.model import build_meta_model, isp_config, use_bf16
from isp_comm.train.preflight import memory_warnings, start_warnings
from isp_comm.train.reporting import Reporters
from isp_comm.train.signals import Signals, Stopped
from isp_comm.train.sources import load_data


def lr_at(cfg: TrainConfig, step: int) -> float:
    """The learning rate at ``step``: linear warm-up over --warmup steps, then cosine
    decay to lr / 10 at --steps."""
    if step <= cfg.warmup:
        return cfg.lr * step / max(cfg.warmup, 1)
    frac = (step - cfg.warmup) / max(cfg.steps - cfg.warmup, 1)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))


@dataclasses.dataclass(kw_only=True)
class Job:
    """What one rank's run holds from setup to the last step: built by ``setup``,
    then read by the steps, the log lines and ``finish``."""

    cfg: TrainConfig
    device: torch.device
    rank: int
    world: int
    bf16: bool
    signals: Signals
    meter: StepMeter
    data: TrainData
    tokens: torch.Tensor
    vocab: int
    tok_dir: str
    model: torch.nn.Module
    mcfg: LlamaConfig | None
    comm: ISPCommunicator
    opt: torch.optim.Optimizer
    n_params: int  # the whole model's
    flops_per_token: float
    resume_from: str | None
    previous: dict
    saver: checkpoint.Checkpointer | None = None
    forecast: object = None  # on the rank that reports: the flags' forecast (--memory-breakdown, an OOM's line)
    where: Where = dataclasses.field(default_factory=Where)  # the step and phase the loop is in (an OOM's line)
    breakdown: object = None  # with --memory-breakdown: the run's RunBreakdown, reported by finish
    metrics: object = None  # rank 0's open metrics.jsonl
    reporters: Reporters | None = None  # rank 0's --report-to trackers
    first_nonfinite: int | None = None  # the first step whose loss was NaN or infinite (said once, and at the end)


def setup(cfg: TrainConfig, device: torch.device, closing: contextlib.ExitStack) -> Job:
    """Check the flags against the data and the world, then build the data, the
    sharded model and its optimizer."""
    rank, world = dist.get_rank(), dist.get_world_size()
    bf16 = use_bf16(cfg, device)
    survive.say_armed()  # the launcher's word: from here a signal's line is rank 0's
    signals = Signals(cfg.save_on_signal)
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        survive.remove_stale_segments()
    resume_from = run_folder.prepare(cfg, closing)  # one line, on every rank, for a folder in the way
    previous = run_folder.previous_run(cfg.out) if rank == 0 else {}
    tokens, vocab, tok_dir, offsets = load_data(cfg)
    if len(tokens) < cfg.seq + 2:
        raise ValueError(f"--seq {cfg.seq} is longer than the data ({len(tokens)} tokens)")
    check_layout(cfg, world)  # also checked before the launch; here for a world torchrun chose
    data = train_data(cfg, tokens, offsets, vocab, world, rank)
    model, mcfg = build_meta_model(cfg, vocab, tok_dir)
    n_params = sum(p.numel() for p in model.parameters())  # before sharding: the whole model's
    flops_per_token = model_flops.flops_per_token(model, cfg.seq)
    icfg = isp_config(cfg, bf16)
    lines, fc = memory_warnings(cfg, model, icfg, world, device) if virtual.leads(rank) else ([], None)
    if fc is not None:  # before the wrap allocates
        warn(lines)
    # after the forecast, whose trace on meta takes the grouped product (the eager loop reads which experts are hit)
    experts_note = hf_model.eager_experts_for(model, bf16) if cfg.model else None
    if experts_note and virtual.leads(rank):
        warn([experts_note])
    comm = wrap(cfg, model, icfg, world, resume_from, closing)
    if virtual.leads(rank):  # why there is no forecast: after the wrap, which refuses a mistake on its own line
        warn(lines if fc is None else [])
        warn(start_warnings(cfg))
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=cfg.lr, weight_decay=cfg.weight_decay)
    return Job(
        cfg=cfg, device=device, rank=rank, world=world, bf16=bf16, signals=signals,
        meter=StepMeter(device, cfg.peak_tflops), data=data, tokens=tokens, vocab=vocab,
        tok_dir=tok_dir, model=model, mcfg=mcfg, comm=comm, opt=opt,
        n_params=n_params, flops_per_token=flops_per_token, resume_from=resume_from, previous=previous,
        forecast=fc,
    )  # fmt: skip


def warn(lines: list[str]) -> None:
    for line in lines:
        print(f"isp-train: warning: {line}", file=sys.stderr, flush=True)


def train_data(cfg: TrainConfig, tokens, offsets, vocab: int, world: int, rank: int) -> TrainData:
    """The packed rows or windows this rank trains on, and the held-out batches."""
    cut = Slicing(cfg.batch, cfg.grad_accum, cfg.seq, world // cfg.sp, rank // cfg.sp, cfg.sp, rank % cfg.sp)
    eval_source = None
    if cfg.eval_data:  # tokenized like --data
        try:
            ev_tokens, ev_vocab, _, ev_offsets = load_data(dataclasses.replace(cfg, data=cfg.eval_data))
        except ValueError as exc:
            raise as_eval_data_error(exc) from exc
        if ev_vocab > vocab:
            raise ValueError(f"--eval-data {cfg.eval_data}: token ids up to {ev_vocab - 1}, the vocabulary is {vocab}")
        eval_source = (ev_tokens, ev_offsets)
    return TrainData(
        tokens, offsets, cut, cfg.pack_boundaries, cfg.seed, cfg.eval_split, eval_source, cfg.eval_batches,
        data_name=f"--data {cfg.data}",
    )  # fmt: skip


def wrap(
    cfg: TrainConfig, model: torch.nn.Module, icfg: ISPConfig, world: int, resume_from: str | None, closing
) -> ISPCommunicator:
    """Shard the meta model (compiled first with --compile) and load the weights a new
    run starts from: the Hugging Face folder's, or --init-from's."""
    if cfg.compile:  # the torchtitan recipe: every block compiled, then wrapped
        for block in find_blocks(model):
            block.compile()
    groups = ParallelGroups.create(wp_size=cfg.wp or world, sp_size=cfg.sp)
    comm = ISPCommunicator(model, groups, icfg, backend=virtual.backend(cfg, resolve_device(cfg), icfg.timeout_s))
    # a run stopped by a signal mid-step (--no-save-on-signal) waits for no collective its
    # peers, leaving too, may never join
    closing.push(lambda kind, _exc, _tb: comm.close(abandon=kind is Stopped, failed=kind is not None))
    if cfg.model and resume_from is None and hf_checkpoint.has_hf_weights(cfg.model):
        comm.load_hf_checkpoint(cfg.model)  # each rank reads its own rows
    if cfg.init_from and resume_from is None:
        lora.init_from(comm, cfg.init_from)
    return comm
