"""What a run writes: on the way in, the resumed checkpoint's step, the checkpointer,
metrics.jsonl, the run's files and the --report-to trackers; each step's row
(metrics.jsonl, the trackers, the bar, the log line); at the end, the final
checkpoint, the trace and timeline, the trackers closed, the closing line."""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
from dataclasses import asdict

from tqdm import tqdm

from isp_comm.groups import first_error
from isp_comm.trace import aligned
from isp_comm.train import checkpoint, hf_model, run_folder, virtual
from isp_comm.train.config import as_dict, saved_flags
from isp_comm.train.data import unigram_entropy
from isp_comm.train.evaluate import eval_note
from isp_comm.train.job import Job, lr_at
from isp_comm.train.reporting import Reporters, parse_report_to
from isp_comm.train.timeline import draw, write_trace


def _close_saver(saver: checkpoint.Checkpointer, world: int, kind: type[BaseException] | None, *_: object) -> None:
    """The saver's close on the way out of a run: a run that ends on an error of its
    steps (a ``RuntimeError``: a lost or stalled peer, an out-of-memory) in a job of
    several ranks leaves the save in flight uncommitted, since its commit is a
    collective that peers which stopped never join (its error replaced the run's one
    line). Alone, the commit waits on no one: the save is kept."""
    saver.close(failed=world > 1 and kind is not None and issubclass(kind, RuntimeError))


def open_outputs(job: Job, closing: contextlib.ExitStack) -> int:
    """Resume from the checkpoint (returning its step, else 0), open the checkpointer
    and metrics.jsonl, and write the run's files and first line (rank 0)."""
    cfg, rank = job.cfg, job.rank
    try:
        os.makedirs(cfg.out, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"--out {cfg.out}: cannot create it ({exc.strerror or exc})") from exc
    start, saved_order = 0, {}
    if job.resume_from is not None:
        try:
            start = checkpoint.load(job.resume_from, job.comm, job.opt, saved_order)
        except checkpoint.CheckpointError as exc:
            changed = run_folder.model_flags_changed(job.resume_from, cfg)
            if changed is None:
                raise
            raise checkpoint.CheckpointError(f"{exc}; {changed}") from exc
        job.data.resume(saved_order, start)
        if virtual.leads(rank):
            print(run_folder.resume_line(job.resume_from, job.previous), flush=True)
            stretched = run_folder.stretch_line(job.previous, cfg, start, lr_at)
            if stretched:
                print(stretched, flush=True)
            run_folder.cut_metrics(cfg.out, start)
    if not cfg.virtual_world:  # one rank's shards are no checkpoint: no saver, no checkpoints/ folder
        job.saver = checkpoint.Checkpointer(
            cfg.out, cfg.async_save, job.device.type == "cuda", keep=cfg.keep_checkpoints, flags=saved_flags(cfg)
        )
        closing.push(functools.partial(_close_saver, job.saver, job.world))
    if virtual.leads(rank):
        job.metrics = open(os.path.join(cfg.out, "metrics.jsonl"), "a" if start else "w")
        write_run_files(job, start)
    open_reporters(job, start, closing)
    return start


def open_reporters(job: Job, start: int, closing: contextlib.ExitStack) -> None:
    """--report-to's trackers, on the process that writes metrics.jsonl; a tracker that
    cannot start stops every rank with its one line (no collective without the flag)."""
    cfg = job.cfg
    if not parse_report_to(cfg.report_to):
        return
    error = None
    if virtual.leads(job.rank):
        config = {**as_dict(cfg), "world": job.world}
        try:
            job.reporters = closing.enter_context(
                Reporters(
                    cfg.report_to, cfg.out, start=start, config=config, log_every=cfg.log_every, last_step=cfg.steps
                )
            )
        except ValueError as exc:
            error = str(exc)
    if not cfg.virtual_world:  # one process in a virtual world: nobody to agree with
        error = first_error(error)
    if error:
        raise ValueError(error)


def write_run_files(job: Job, start: int) -> None:
    """What ran (the flags and rank 0's shard of every parameter), and its first line."""
    cfg, model = job.cfg, job.model
    shards = {k: list(v.shape) for k, v in model.state_dict(keep_vars=True).items()}  # the shards themselves
    run_folder.write_run(cfg.out, cfg, job.world, shards, job.previous, start, {} if cfg.model else asdict(job.mcfg))
    run_folder.write_config(cfg.out, cfg)
    if cfg.model:
        hf_model.save_run_files(model, job.tok_dir, cfg.out)
    n_train = sum(p.numel() for p in model.parameters() if p.requires_grad)
    groups, comm = job.comm.groups, job.comm
    if cfg.virtual_world:
        tqdm.write(virtual.first_line(cfg, comm.backend.link))
    replicas = groups.replica_size
    layout = f", {replicas} replicas, state over {comm.config.state_sharding}" if replicas > 1 else ""
    if cfg.ckpt:  # the blocks --ckpt's fraction comes to (0.1 of 4 blocks: none)
        layout += f", {comm.config.checkpointed_blocks(len(comm.units))} of {len(comm.units)} blocks checkpointed"
    tqdm.write(
        f"isp-train: {job.device.type}{' bf16' if job.bf16 else ''}{' compiled' if cfg.compile else ''}, "
        f"world {job.world}, wp {groups.wp_size}, sp {groups.sp_size}{layout}, backend {comm.backend.name}, "
        f"{job.n_params / 1e6:.2f}M params ({n_train / 1e6:.3f}M trainable in rank {job.rank}'s shards), "
        f"data {len(job.tokens)} tokens ({job.data.describe()}), vocabulary {job.vocab}, "
        f"unigram entropy {unigram_entropy(job.tokens, job.vocab):.3f} nats"
    )


def report(job: Job, bar, last: dict, first_step_s: float | None) -> None:
    """A step's row: to metrics.jsonl, the progress bar, and (rank 0) the plain log
    line every --log-every steps, after the first step and with an evaluation."""
    if job.metrics is not None:
        job.metrics.write(json.dumps(last) + "\n")
        job.metrics.flush()
    if job.reporters is not None:
        job.reporters.log(last)
    bar.update(1)
    bar.set_postfix(
        loss=f"{last['loss']:.3f}",
        gnorm=f"{last['grad_norm']:.2f}",
        tok_s=f"{last['tokens_per_s']:.0f}",
        comm=f"{last['exposed_comm_pct']:.0f}%",
        pool=f"{last['pool_bytes'] / 2**20:.1f}MiB",
        **job.meter.postfix(last),
    )
    if not virtual.leads(job.rank):
        return
    step = last["step"]
    if job.first_nonfinite is None and not math.isfinite(last["loss"]):
        job.first_nonfinite = step  # the run goes on, as torch's loop would; said now, and again at the end
        tqdm.write(
            f"warning: step {step}: the loss is {last['loss']} (grad norm {last['grad_norm']:.3g}): the weights "
            "are likely no longer finite; a lower --lr, --clip or a --resume from an earlier checkpoint may help"
        )
    if first_step_s is not None:
        tqdm.write(f"first step (compilation and warm-up included): {first_step_s:.2f} s")
    if step % job.cfg.log_every == 0 or first_step_s is not None or "eval_loss" in last:
        tqdm.write(
            f"step {step:4d}  loss {last['loss']:.4f}  {last['tokens_per_s']:8.0f} tok/s  "
            f"exposed comm {last['exposed_comm_pct']:4.1f}%  {job.meter.line(last)}{eval_note(last)}"
        )


def finish(job: Job, start: int, last: dict) -> None:
    """The memory breakdown (--memory-breakdown), the final checkpoint, the trace and
    timeline, and rank 0's closing line."""
    cfg, comm = job.cfg, job.comm
    tracer = comm.ctx.tracer  # its origin on the wall clock puts the ranks on one time line
    local_spans = (tracer.wall_origin if tracer is not None else 0.0, comm.stop_trace())
    if job.breakdown is not None:  # collective: every rank, before the final save
        job.breakdown.report()
    if job.saver is not None:  # a virtual run has none
        if start < cfg.steps and cfg.final_save:
            job.saver.save(cfg.steps, comm, job.opt, job.data.state_dict())
        job.saver.close()
    if cfg.virtual_world:  # one real rank: keep its lane (a virtual group's gather would only model it)
        spans = [local_spans]
    else:
        spans = comm.all_gather_object(local_spans, what="the trace's spans")
    comm.close()
    if not virtual.leads(job.rank):
        return
    if cfg.trace and any(rank_spans for _, rank_spans in spans):
        write_trace(os.path.join(cfg.out, "trace.json"), aligned(spans))
        draw(os.path.join(cfg.out, "trace.json"), os.path.join(cfg.out, "timeline.png"))
    job.metrics.close()
    if job.reporters is not None:
        job.reporters.close()
    if last:
        print(
            f"isp-train: done: step {last['step']}, loss {last['loss']:.4f}, {last['tokens_per_s']:.0f} tok/s, "
            f"{job.meter.summary(last)}; outputs in {cfg.out}"
            + (f" (the loss first went NaN or infinite at step {job.first_nonfinite})" if job.first_nonfinite else "")
        )
        if cfg.virtual_world:
            print(virtual.summary(cfg, last, comm.backend.link))
