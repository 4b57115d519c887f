"""The training loop of one rank: ``run`` (setup, the steps, the end) and each
optimizer step over its micro-steps."""

from __future__ import annotations

import contextlib
import math
import signal
import sys
import time

import torch
import torch.distributed as dist
from tqdm import tqdm

from isp_comm.errors import ISPCommTimeout
from isp_comm.train import survive, virtual
from isp_comm.train.config import TrainConfig
from isp_comm.train.evaluate import evaluate, logits_of, micro_loss, router_loss
from isp_comm.train.hang import inject_fault, quiet_after_hang, raise_if_peer_lost
from isp_comm.train.job import Job, lr_at, setup
from isp_comm.train.memory import RunBreakdown, oom
from isp_comm.train.outputs import finish, open_outputs, report
from isp_comm.train.signals import Interrupted


def run(cfg: TrainConfig, device: torch.device, closing: contextlib.ExitStack) -> None:
    """The job on this rank; what it opens that holds threads or groups (the
    communicator, the checkpointer, the data thread) is closed by ``closing``, also
    after an error."""
    try:
        job = setup(cfg, device, closing)
        start = open_outputs(job, closing)
    except ValueError:  # the flags, the model, the data, the checkpoint: a restart meets it again
        survive.no_restart()
        raise
    except RuntimeError as exc:  # torch.OutOfMemoryError is one
        oom.raise_if_out_of_memory(exc, dist.get_rank(), oom.Where(), None)
        set_up = "the set-up before the first step (making the groups, wrapping the model)"
        raise_if_peer_lost(exc, dist.get_rank(), set_up, cfg.comm_timeout)
        raise
    try:
        last = train(job, start, closing)
        job.where.phase = "save"
        finish(job, start, last)
    except ISPCommTimeout:
        quiet_after_hang()  # before ``closing`` closes the communicator
        raise
    except RuntimeError as exc:
        oom.raise_if_out_of_memory(exc, job.rank, job.where, job.forecast)
        raise_if_peer_lost(exc, job.rank, f"the {job.where.phase} of step {job.where.step}", cfg.comm_timeout)
        raise


def train(job: Job, start: int, closing: contextlib.ExitStack) -> dict:
    """Steps ``start + 1`` to ``--steps``: each one's row goes to metrics.jsonl, the
    bar and the log; checkpoints at --save-every and on a signal. Returns the last row."""
    cfg, comm = job.cfg, job.comm
    # a bar on a terminal; in a file or CI, only the plain line every --log-every steps
    interactive = sys.stderr.isatty()
    bar = tqdm(
        total=cfg.steps,
        initial=start,
        disable=not virtual.leads(job.rank) or not interactive,
        unit="step",
        dynamic_ncols=True,
    )
    feed = job.data.start(start + 1, cfg.steps, pin=job.device.type == "cuda")  # batches read ahead, in a thread
    closing.callback(feed.close)
    hook = comm.scheduler_hook()
    t_start, tokens_done, last = time.perf_counter(), 0, {}
    step_tokens = cfg.batch * cfg.grad_accum * cfg.seq
    watch = job.breakdown = RunBreakdown(job, job.forecast) if cfg.memory_breakdown else None
    quiet = watch.untracked if watch is not None else contextlib.nullcontext
    stopped = 0  # the step a signal stopped the run at (--save-on-signal)
    with watch.tracking() if watch is not None else contextlib.nullcontext():
        for step in range(start + 1, cfg.steps + 1):
            if cfg.trace and step == max(start + 1, cfg.steps - 2):
                comm.start_trace()
            job.where.step, t0, s0 = step, time.perf_counter(), comm.stats()
            t_data = time.perf_counter()
            batch = feed.get(step)  # the step's global batch: cfg.batch x cfg.grad_accum sequences
            data_wait = time.perf_counter() - t_data  # > 0 only when the data thread fell behind
            loss_value, interrupted, grad_norm = one_step(job, hook, batch, step)
            dt = time.perf_counter() - t0
            if step == start + 1:  # compilation and warm-up: reported apart, not in tokens/s
                first_step_s, t_start = dt, time.perf_counter()
            else:
                tokens_done += step_tokens
            s = comm.stats()
            rate = tokens_done / (time.perf_counter() - t_start) if tokens_done else step_tokens / dt
            last = {
                "step": step,
                "loss": loss_value,
                "lr": lr_at(cfg, step),
                "grad_norm": grad_norm,
                "tokens_per_s": rate,
                "step_s": dt,
                "data_wait_s": data_wait,
                "exposed_comm_pct": 100 * (s["exposed_comm_s"] - s0["exposed_comm_s"]) / dt,
                "pool_bytes": s["pool_bytes"],
                **job.meter.read(rate / job.world * job.flops_per_token),
                **(virtual.row(s, s0) if cfg.virtual_world else {}),
            }
            if job.data.eval is not None and step % cfg.eval_every == 0:  # not in the step's time or tokens/s
                t_eval, job.where.phase = time.perf_counter(), "evaluate"
                with watch.evaluating() if watch is not None else contextlib.nullcontext():
                    last.update(evaluate(job.model, comm, job.data.eval, job.device, bool(cfg.model)))
                t_start += time.perf_counter() - t_eval
            report(job, bar, last, first_step_s if step == start + 1 else None)
            if watch is not None:
                watch.step_done(step, first=step == start + 1)
            if interrupted and job.signals.armed and step != cfg.steps:  # every rank: the flag is all-reduced
                stopped = step
                break
            if cfg.save_every and step % cfg.save_every == 0 and step != cfg.steps:
                t_save, job.where.phase = time.perf_counter(), "save"
                with quiet():
                    job.saver.save(step, comm, job.opt, job.data.state_dict())
                t_start += time.perf_counter() - t_save  # as an evaluation: not in tokens/s
    bar.close()
    if stopped:
        interrupt(job, stopped)
    return last


def interrupt(job: Job, step: int) -> None:
    """A signal's step boundary (``--save-on-signal``): a checkpoint first (what a
    preemption is for), then the memory breakdown measured so far, and the run leaves
    with ``Interrupted``."""
    comm = job.comm
    comm.stop_trace()  # the breakdowns' gather is not a step's
    job.saver.save(step, comm, job.opt, job.data.state_dict())
    if job.breakdown is not None:  # collective: every rank stops at this step
        job.breakdown.report()
    job.saver.close()
    comm.close()
    raise Interrupted(step, job.signals.got or signal.SIGTERM)


def one_step(job: Job, hook, batch, step: int) -> tuple[float, bool, float]:
    """One optimizer step on the global batch: the mean loss over ranks, whether any
    rank got a signal, and the global gradient norm."""
    cfg, device = job.cfg, job.device
    for g in job.opt.param_groups:  # the flags' values, also over a checkpoint's (a resume with other flags)
        g["lr"], g["weight_decay"] = lr_at(cfg, step), cfg.weight_decay
    step_loss = torch.zeros((), device=device)
    job.comm.set_step(step)
    job.where.phase = "forward"
    inject_fault(job.rank, step, lambda: logits_of(job.model, batch.micros[0].to(device), bool(cfg.model)), device)
    last = len(batch.micros) - 1
    for i, micro in enumerate(batch.micros):  # reduce-scatters of each micro-step overlap its backward
        job.comm.set_requires_replica_sync(cfg.replica_sync == "micro" or i == last)
        micro, job.where.phase = micro.to(device), "forward"
        hook.before_forward()
        routed: list = []  # an MoE's router logits, when its config asks for its router loss
        logits = logits_of(job.model, micro, bool(cfg.model), routed)
        loss = micro_loss(job.comm, logits, micro, batch, job.world) + router_loss(
            job.comm, job.model, routed, len(batch.micros)
        )
        hook.before_backward()
        job.where.phase = "backward"
        loss.backward()
        hook.after_backward()
        step_loss += loss.detach()
        del logits, loss
    job.where.phase = "optimizer"
    norm = job.comm.clip_grad_norm_(cfg.clip if cfg.clip > 0 else math.inf)
    job.opt.step()
    job.opt.zero_grad()
    job.data.taken(batch)
    # the loss and whether any rank got a signal: one all-reduce; then one host read
    # (a fill, not a host-to-device copy, so the step is issued whole before it)
    both = torch.stack([step_loss, torch.full((), float(job.signals.got), device=device)])
    job.comm.all_reduce(both, what="the step's loss")
    total, flagged, grad_norm = torch.cat([both, norm.reshape(1).to(both.dtype)]).tolist()
    return total / job.world, flagged > 0, grad_norm
