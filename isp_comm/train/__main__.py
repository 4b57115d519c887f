"""``torchrun --nproc-per-node N -m isp_comm.train``: train the reference llama, or a
transformers model (``--model DIR``), with ISP.

Writes ``OUT/metrics.jsonl`` (one object per optimizer step), ``OUT/trace.json`` and
``OUT/timeline.png`` (the last steps' compute and communication per rank),
``OUT/run.json`` (the flags and rank 0's parameter shard shapes), DCP checkpoints
under ``OUT/checkpoints`` and, with ``--model``, ``OUT/hf_model`` (the model's
config.json and the tokenizer, for ``isp-export --hf``); ``--resume`` continues from the latest one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import math
import os
import signal
import sys
import time
from dataclasses import asdict
from typing import NoReturn

import torch
import torch.distributed as dist
from tqdm import tqdm

from isp_comm import ISPCommunicator, ISPConfig, ParallelGroups, hf_checkpoint
from isp_comm.discovery import find_blocks
from isp_comm.groups import first_error
from isp_comm.memory_forecast import KNOBS, forecast
from isp_comm.train import checkpoint, hf_model, lora, run_folder, survive
from isp_comm.train import metrics as metrics_mod
from isp_comm.train.config import TrainConfig, check_layout, fail, parse_config, resolve_device
from isp_comm.train.data import Slicing, TrainData, document_offsets, load_tokens, unigram_entropy
from isp_comm.train.evaluate import eval_note, evaluate, logits_of, micro_loss
from isp_comm.train.launch import launch, worker_argv
from isp_comm.train.plan import plan
from isp_comm.train.store import is_pretokenized, prepare_store
from isp_comm.train.timeline import draw, write_trace
from models.llama import LlamaConfig, build, llama_ffn_hidden


def lr_at(cfg: TrainConfig, step: int) -> float:
    if step <= cfg.warmup:
        return cfg.lr * step / max(cfg.warmup, 1)
    frac = (step - cfg.warmup) / max(cfg.steps - cfg.warmup, 1)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))


def _on_rank0_first(fn, *args):
    """``fn(*args)`` on rank 0 (which may write a cache the others then read), then on
    the others; an error on rank 0 is raised on every rank, never a hang."""
    error = out = None
    if dist.get_rank() == 0:
        try:
            out = fn(*args)
        except ValueError as exc:
            error = str(exc)
    first = first_error(error)
    if first:
        raise ValueError(first)
    return out if dist.get_rank() == 0 else fn(*args)


def load_data(cfg: TrainConfig) -> tuple[torch.Tensor, int, str, object]:
    """The tokens, their vocabulary size, the tokenizer folder used ("" for none), and
    the document offsets when the data is a token store (else None)."""
    tok_dir = cfg.tokenizer
    if not tok_dir and cfg.model and cfg.data and not is_pretokenized(cfg.data):
        tok_dir = cfg.model if hf_model.has_tokenizer(cfg.model) else ""
    offsets = None
    if tok_dir and cfg.data.endswith(".txt") and not cfg.data_cache:
        tokens, vocab = _on_rank0_first(hf_model.tokenize, tok_dir, cfg.data)
    elif tok_dir:  # prepared once by rank 0 (a progress bar there), then opened by the others
        store = _on_rank0_first(prepare_text, cfg.data, tok_dir, cfg.data_cache, dist.get_rank() == 0)
        tokens, vocab, offsets = store.tokens, store.vocab, store.offsets
    else:
        tokens, vocab = load_tokens(cfg.data)
        offsets = document_offsets(cfg.data)
    return tokens, vocab, tok_dir, offsets


def train_data(cfg: TrainConfig, tokens, offsets, vocab: int, world: int, rank: int) -> TrainData:
    """The packed rows or windows this rank trains on, and the held-out batches."""
    cut = Slicing(cfg.batch, cfg.grad_accum, cfg.seq, world // cfg.sp, rank // cfg.sp, cfg.sp, rank % cfg.sp)
    eval_source = None
    if cfg.eval_data:  # tokenized like --data
        ev_tokens, ev_vocab, _, ev_offsets = load_data(dataclasses.replace(cfg, data=cfg.eval_data))
        if ev_vocab > vocab:
            raise ValueError(f"--eval-data {cfg.eval_data}: token ids up to {ev_vocab - 1}, the vocabulary is {vocab}")
        eval_source = (ev_tokens, ev_offsets)
    return TrainData(tokens, offsets, cut, cfg.pack_boundaries, cfg.seed, cfg.eval_split, eval_source, cfg.eval_batches)


def prepare_text(data: str, tok_dir: str, cache: str, progress: bool):
    return prepare_store(data, tok_dir, cache, progress=progress)


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
    meter: metrics_mod.StepMeter
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
    metrics: object = None  # rank 0's open metrics.jsonl


def run(cfg: TrainConfig, device: torch.device, closing: contextlib.ExitStack) -> None:
    """The job on this rank; what it opens that holds threads or groups (the
    communicator, the checkpointer, the data thread) is closed by ``closing``, also
    after an error."""
    job = setup(cfg, device, closing)
    start = open_outputs(job, closing)
    last = train(job, start, closing)
    finish(job, start, last)


def setup(cfg: TrainConfig, device: torch.device, closing: contextlib.ExitStack) -> Job:
    """Check the flags against the data and the world, then build the data, the
    sharded model and its optimizer."""
    rank, world = dist.get_rank(), dist.get_world_size()
    bf16 = use_bf16(cfg, device)
    signals = Signals(cfg.save_on_signal)
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        survive.remove_stale_segments()
    resume_from = run_folder.prepare(cfg, closing)  # one line, on every rank, for a folder in the way
    previous = run_folder.previous_run(cfg.out) if rank == 0 else {}
    tokens, vocab, tok_dir, offsets = load_data(cfg)
    if len(tokens) < cfg.seq + 2:
        raise ValueError(f"--seq {cfg.seq} is longer than the data ({len(tokens)} tokens)")
    check_layout(cfg, world)  # also checked before the launch; here for a world torchrun chose
    dp = world // cfg.sp
    if cfg.batch % dp:
        raise ValueError(f"--batch {cfg.batch} must be divisible by world / sp = {dp}")
    if cfg.seq % cfg.sp:
        raise ValueError(f"--seq {cfg.seq} must be divisible by --sp {cfg.sp}")
    data = train_data(cfg, tokens, offsets, vocab, world, rank)
    model, mcfg = build_meta_model(cfg, vocab, tok_dir)
    n_params = sum(p.numel() for p in model.parameters())  # before sharding: the whole model's
    flops_per_token = metrics_mod.flops_per_token(model, cfg.seq)
    icfg = isp_config(cfg, bf16)
    if rank == 0:
        for line in memory_warnings(cfg, model, icfg, world, device):
            print(f"isp-train: warning: {line}", file=sys.stderr, flush=True)
    comm = wrap(cfg, model, icfg, world, resume_from, closing)
    if rank == 0:
        for line in start_warnings(cfg):
            print(f"isp-train: warning: {line}", file=sys.stderr, flush=True)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=cfg.lr, weight_decay=cfg.weight_decay)
    return Job(
        cfg=cfg, device=device, rank=rank, world=world, bf16=bf16, signals=signals,
        meter=metrics_mod.StepMeter(device, cfg.peak_tflops), data=data, tokens=tokens, vocab=vocab,
        tok_dir=tok_dir, model=model, mcfg=mcfg, comm=comm, opt=opt,
        n_params=n_params, flops_per_token=flops_per_token, resume_from=resume_from, previous=previous,
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
    comm = ISPCommunicator(model, groups, icfg)
    closing.callback(comm.close)
    if cfg.model and resume_from is None and hf_checkpoint.has_hf_weights(cfg.model):
        comm.load_hf_checkpoint(cfg.model)  # each rank reads its own rows
    if cfg.init_from and resume_from is None:
        lora.init_from(comm, cfg.init_from)
    if cfg.lora_rank:
        lora.zero_lora_b(model)
    return comm


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
        start = checkpoint.load(job.resume_from, job.comm, job.opt, saved_order)
        job.data.resume(saved_order, start)
        if rank == 0:
            print(run_folder.resume_line(job.resume_from, job.previous), flush=True)
            stretched = run_folder.stretch_line(job.previous, cfg, start, lr_at)
            if stretched:
                print(stretched, flush=True)
            run_folder.cut_metrics(cfg.out, start)
    job.saver = checkpoint.Checkpointer(cfg.out, async_save=cfg.async_save, pinned=job.device.type == "cuda")
    closing.callback(job.saver.close)
    if rank == 0:
        job.metrics = open(os.path.join(cfg.out, "metrics.jsonl"), "a" if start else "w")
        write_run_files(job, start)
    return start


def write_run_files(job: Job, start: int) -> None:
    """What ran (the flags and rank 0's shard of every parameter), and its first line."""
    cfg, model = job.cfg, job.model
    shards = {k: list(v.shape) for k, v in model.state_dict().items()}
    run_folder.write_run(cfg.out, cfg, job.world, shards, job.previous, start, {} if cfg.model else asdict(job.mcfg))
    run_folder.write_config(cfg.out, cfg)
    if cfg.model:
        hf_model.save_run_files(model, job.tok_dir, cfg.out)
    n_train = sum(p.numel() for p in model.parameters() if p.requires_grad)
    groups, comm = job.comm.groups, job.comm
    tqdm.write(
        f"isp-train: {job.device.type}{' bf16' if job.bf16 else ''}{' compiled' if cfg.compile else ''}, "
        f"world {job.world}, wp {groups.wp_size}, sp {groups.sp_size}, backend {comm.backend.name}, "
        f"{job.n_params / 1e6:.2f}M params ({n_train / 1e6:.3f}M trainable in rank 0's shards), "
        f"data {len(job.tokens)} tokens ({job.data.describe()}), vocabulary {job.vocab}, "
        f"unigram entropy {unigram_entropy(job.tokens, job.vocab):.3f} nats"
    )


def train(job: Job, start: int, closing: contextlib.ExitStack) -> dict:
    """Steps ``start + 1`` to ``--steps``: each one's row goes to metrics.jsonl, the
    bar and the log; checkpoints at --save-every and on a signal. Returns the last row."""
    cfg, comm = job.cfg, job.comm
    # a bar on a terminal; in a file or CI, only the plain line every --log-every steps
    interactive = sys.stderr.isatty()
    bar = tqdm(
        total=cfg.steps, initial=start, disable=job.rank != 0 or not interactive, unit="step", dynamic_ncols=True
    )
    feed = job.data.start(start + 1, cfg.steps, pin=job.device.type == "cuda")  # batches read ahead, in a thread
    closing.callback(feed.close)
    hook = comm.scheduler_hook()
    t_start, tokens_done, last = time.perf_counter(), 0, {}
    step_tokens = cfg.batch * cfg.grad_accum * cfg.seq
    for step in range(start + 1, cfg.steps + 1):
        if cfg.trace and step == max(start + 1, cfg.steps - 2):
            comm.start_trace()
        t0, c0 = time.perf_counter(), comm.stats()["exposed_comm_s"]
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
            "exposed_comm_pct": 100 * (s["exposed_comm_s"] - c0) / dt,
            "pool_bytes": s["pool_bytes"],
            **job.meter.read(rate / job.world * job.flops_per_token),
        }
        if job.data.eval is not None and step % cfg.eval_every == 0:  # not in the step's time or tokens/s
            t_eval = time.perf_counter()
            last.update(evaluate(job.model, comm, job.data.eval, job.device, bool(cfg.model)))
            t_start += time.perf_counter() - t_eval
        report(job, bar, last, first_step_s if step == start + 1 else None)
        if interrupted and job.signals.armed and step != cfg.steps:
            job.saver.save(step, comm, job.opt, job.data.state_dict())
            job.saver.close()
            comm.close()
            raise Interrupted(step, job.signals.got or signal.SIGTERM)
        if cfg.save_every and step % cfg.save_every == 0 and step != cfg.steps:
            job.saver.save(step, comm, job.opt, job.data.state_dict())
    bar.close()
    return last


def one_step(job: Job, hook, batch, step: int) -> tuple[float, bool, float]:
    """One optimizer step on the global batch: the mean loss over ranks, whether any
    rank got a signal, and the global gradient norm."""
    cfg, device = job.cfg, job.device
    for g in job.opt.param_groups:
        g["lr"] = lr_at(cfg, step)
    step_loss = torch.zeros((), device=device)
    for micro in batch.micros:  # reduce-scatters of each micro-step overlap its backward
        micro = micro.to(device)
        hook.before_forward()
        logits = logits_of(job.model, micro, bool(cfg.model))
        loss = micro_loss(job.comm, logits, micro, batch, job.world)
        hook.before_backward()
        loss.backward()
        hook.after_backward()
        step_loss += loss.detach()
        del logits, loss
    norm = job.comm.clip_grad_norm_(cfg.clip if cfg.clip > 0 else math.inf)
    job.opt.step()
    job.opt.zero_grad()
    job.data.taken(batch)
    # the loss and whether any rank got a signal: one all-reduce; then one host read
    # (a fill, not a host-to-device copy, so the step is issued whole before it)
    both = torch.stack([step_loss, torch.full((), float(job.signals.got), device=device)])
    dist.all_reduce(both)
    total, flagged, grad_norm = torch.cat([both, norm.reshape(1).to(both.dtype)]).tolist()
    return total / job.world, flagged > 0, grad_norm


def report(job: Job, bar, last: dict, first_step_s: float | None) -> None:
    """A step's row: to metrics.jsonl, the progress bar, and (rank 0) the plain log
    line every --log-every steps, after the first step and with an evaluation."""
    if job.metrics is not None:
        job.metrics.write(json.dumps(last) + "\n")
        job.metrics.flush()
    bar.update(1)
    bar.set_postfix(
        loss=f"{last['loss']:.3f}",
        gnorm=f"{last['grad_norm']:.2f}",
        tok_s=f"{last['tokens_per_s']:.0f}",
        comm=f"{last['exposed_comm_pct']:.0f}%",
        pool=f"{last['pool_bytes'] / 2**20:.1f}MiB",
        **job.meter.postfix(last),
    )
    if job.rank != 0:
        return
    step = last["step"]
    if first_step_s is not None:
        tqdm.write(f"first step (compilation and warm-up included): {first_step_s:.2f} s")
    if step % job.cfg.log_every == 0 or first_step_s is not None or "eval_loss" in last:
        tqdm.write(
            f"step {step:4d}  loss {last['loss']:.4f}  {last['tokens_per_s']:8.0f} tok/s  "
            f"exposed comm {last['exposed_comm_pct']:4.1f}%  {job.meter.line(last)}{eval_note(last)}"
        )


def finish(job: Job, start: int, last: dict) -> None:
    """The final checkpoint, the trace and timeline, and rank 0's closing line."""
    cfg, comm = job.cfg, job.comm
    local_spans = comm.stop_trace()
    if start < cfg.steps:
        job.saver.save(cfg.steps, comm, job.opt, job.data.state_dict())
    job.saver.close()
    spans: list = [None] * job.world
    dist.all_gather_object(spans, local_spans)
    comm.close()
    if job.rank != 0:
        return
    if cfg.trace and any(spans):
        write_trace(os.path.join(cfg.out, "trace.json"), spans)
        draw(os.path.join(cfg.out, "trace.json"), os.path.join(cfg.out, "timeline.png"))
    job.metrics.close()
    if last:
        print(
            f"isp-train: done: step {last['step']}, loss {last['loss']:.4f}, {last['tokens_per_s']:.0f} tok/s, "
            f"{job.meter.summary(last)}; outputs in {cfg.out}"
        )


def build_meta_model(cfg: TrainConfig, vocab: int, tok_dir: str) -> tuple[torch.nn.Module, LlamaConfig | None]:
    """The model to train, on meta (never the whole model: each module is made real
    alone while sharded), with its LoRA adapters; and the reference llama's config."""
    mcfg = None
    if cfg.model:  # on meta too (see isp_comm/train/hf_model.py)
        model = hf_model.build_model(cfg.model)
        what = f"--tokenizer {tok_dir}" if tok_dir else f"--data {cfg.data or '(the embedded corpus)'}"
        hf_model.check_vocab(what, vocab, model.config.vocab_size, cfg.model)
    else:
        mcfg = LlamaConfig(
            vocab_size=vocab,
            hidden=cfg.hidden,
            ffn_hidden=llama_ffn_hidden(cfg.hidden),
            n_layers=cfg.layers,
            n_heads=cfg.heads,
            n_kv_heads=cfg.kv_heads,
            max_seq_len=cfg.seq,
        )
        with torch.device("meta"):
            model = build(mcfg)
    if cfg.lora_rank:  # peft adapters on the meta model; the base is frozen and never reduce-scattered
        with torch.device("meta"):
            model = lora.apply_lora(model, cfg.lora_rank, [t for t in cfg.lora_targets.split(",") if t])
    return model, mcfg


def use_bf16(cfg: TrainConfig, device: torch.device) -> bool:
    """--bf16 / --no-bf16, else bf16 on a GPU."""
    return cfg.bf16 if cfg.bf16 is not None else device.type == "cuda"


def local_ranks(cfg: TrainConfig, world: int) -> int:
    """Ranks on this host: torchrun's count, else what the flags launch here."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", 0)) or cfg.nproc_per_node or world


def isp_config(cfg: TrainConfig, bf16: bool) -> ISPConfig:
    return ISPConfig(
        overlap=cfg.overlap,
        memory_pool=cfg.memory_pool,
        activation_checkpointing=cfg.ckpt,
        shard_outer_params=cfg.shard_outer,
        vocab_parallel=cfg.vocab_parallel,
        backend=cfg.backend,
        param_dtype=torch.bfloat16 if bf16 else None,
        reduce_dtype=torch.float32 if bf16 else None,
        init_seed=cfg.seed,  # the same initial weights on every WP size
    )


def memory_forecast(cfg: TrainConfig, model: torch.nn.Module, icfg: ISPConfig, world: int, device: torch.device):
    """The forecast for this run's flags (see isp_comm/memory_forecast.py)."""
    wp = cfg.wp or world  # as ParallelGroups.create gets it
    return forecast(
        model, icfg, world, wp, cfg.sp, cfg.batch, cfg.seq, device=device.type, local_world=local_ranks(cfg, world)
    )


def memory_warnings(
    cfg: TrainConfig, model: torch.nn.Module, icfg: ISPConfig, world: int, device: torch.device
) -> list[str]:
    """One line when the forecast's highest phase exceeds what this rank can have:
    the phase, its biggest part and the knob that shrinks it."""
    try:
        fc = memory_forecast(cfg, model, icfg, world, device)
    except Exception as exc:  # a model the meta trace cannot run: train anyway, say so
        return [f"no memory forecast for this model ({type(exc).__name__}: {exc})"]
    free = free_memory_per_rank(device, local_ranks(cfg, world))
    phase = fc.worst()
    need = fc.peak(phase) + (0 if device.type == "cuda" else metrics_mod.proc_status_bytes("VmRSS"))
    if need <= free:
        return []
    part, size = fc.biggest(phase)
    knob = KNOBS.get(part.split(" (")[0], "a larger --wp")
    return [
        f"the memory forecast for the {phase} phase is {need / 2**20:.0f} MiB per rank, more than the "
        f"{free / 2**20:.0f} MiB free; its biggest part is {part} ({size / 2**20:.0f} MiB): try {knob} "
        "(isp-train --plan prints the table)"
    ]


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


class Interrupted(Exception):
    """A signal arrived and a checkpoint was saved at the step boundary."""

    def __init__(self, step: int, signum: int) -> None:
        super().__init__(f"interrupted at step {step}; checkpoint step_{step:06d}")
        self.step, self.signum = step, int(signum)


class Stopped(BaseException):
    """A signal with --no-save-on-signal: the run leaves at once, through every
    ``finally`` (the communicator, its segments), with one line and no checkpoint."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name}; no checkpoint (--no-save-on-signal)")
        self.signum = int(signum)


class Signals:
    """With ``armed``: Ctrl-C and SIGTERM are noted (``got``), not raised, so the step
    in progress finishes, a checkpoint is saved and the run leaves with one line.
    Without: they raise ``Stopped`` (never a KeyboardInterrupt traceback)."""

    def __init__(self, armed: bool) -> None:
        self.armed, self.got = armed, 0
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._note if armed else self._stop)

    def _note(self, signum: int, _frame) -> None:
        self.got = signum

    @staticmethod
    def _stop(signum: int, _frame) -> None:
        raise Stopped(signum)


def dist_backend(device: torch.device) -> str:
    """NCCL for one process per GPU; gloo on CPU, and when several local ranks share a
    GPU (NCCL refuses that: "Duplicate GPU detected"; gloo carries CUDA tensors)."""
    if device.type != "cuda":
        return "gloo"
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if local_world > torch.cuda.device_count():
        if os.environ.get("LOCAL_RANK", "0") == "0":
            print(f"isp-train: {local_world} ranks share {torch.cuda.device_count()} GPU(s): gloo, not NCCL")
        return "gloo"
    return "nccl"


def main(argv: list[str] | None = None) -> NoReturn:
    """Run the job and end the process: exit code 0, or 2 after one line."""
    cfg = parse_config(argv)  # exits 2 with one line on a bad flag
    if cfg.plan:  # no process group, no launch: the forecast for the world the flags describe
        world = int(os.environ.get("WORLD_SIZE", 0)) or (cfg.nproc_per_node or 1) * cfg.nnodes
        try:
            plan(cfg, world)
        except ValueError as exc:
            fail(str(exc))
        sys.exit(0)
    launching = bool(cfg.nproc_per_node) and "LOCAL_RANK" not in os.environ
    world = (cfg.nproc_per_node * cfg.nnodes) if launching else int(os.environ.get("WORLD_SIZE", "1"))
    try:  # before any rank starts: one line, exit 2
        check_layout(cfg, world)
    except ValueError as exc:
        fail(str(exc))
    if launching:  # launch the ranks ourselves
        args = worker_argv(sys.argv[1:] if argv is None else argv)
        sys.exit(launch(cfg.nproc_per_node, cfg.nnodes, cfg.rdzv_endpoint, args, cfg.max_restarts))
    if "LOCAL_RANK" in os.environ:  # a launched rank dies with its launcher
        survive.die_with_parent()
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0 and not cfg.resume:
        cfg = dataclasses.replace(cfg, resume="auto")  # a restarted rank continues the run
    torch.set_num_threads(1)
    device = resolve_device(cfg)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        if "RANK" not in os.environ:
            port = str(survive.free_port())
            os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        store = survive.restart_store()  # None but in a restarted rank: torch's env:// rendezvous
        if store is None:
            dist.init_process_group(dist_backend(device))
        else:
            rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
            dist.init_process_group(dist_backend(device), store=store, rank=rank, world_size=world)
    try:
        with contextlib.ExitStack() as closing:
            run(cfg, device, closing)
    except ValueError as exc:
        dist.destroy_process_group()
        fail(str(exc))
    except Interrupted as exc:
        if dist.get_rank() == 0:
            print(f"isp-train: {exc}", file=sys.stderr, flush=True)
        dist.destroy_process_group()
        sys.exit(128 + exc.signum)
    except Stopped as exc:
        if dist.get_rank() == 0:
            print(f"isp-train: {exc}", file=sys.stderr, flush=True)
        dist.destroy_process_group()
        sys.exit(128 + exc.signum)
    gc.collect()  # process groups held in reference cycles go while torch is whole
    dist.destroy_process_group()
    sys.exit(0)


if __name__ == "__main__":
    sys.exit(main())
