"""isp-train's configuration: one typed dataclass, from a TOML file and/or CLI flags."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import json
import os
import sys
import textwrap
import threading
import time
import tomllib
from dataclasses import dataclass, fields
from typing import Literal, NoReturn, get_args

import torch

from isp_comm.config import BACKENDS, MAX_TIMEOUT_S, BackendName, StateSharding
from isp_comm.processes import leave_on_signals
from isp_comm.train import survive, virtual
from isp_comm.train.reporting.names import parse_report_to

Device = Literal["auto", "cpu", "cuda"]
ReplicaSync = Literal["micro", "step"]
MAX_LR = 1e30
"""--lr must be below this (AdamW keeps the rate as a float): the refusal names the
bound, where it called 1e30, a finite rate, not "a finite number"."""


@dataclass(kw_only=True)
class TrainConfig:
    """Everything the main job can be told; each field is also a ``--flag``."""

    steps: int = 600
    """Optimizer steps to train (with --resume: the total to reach)."""
    out: str = "runs/isp-train"
    """Directory for metrics.jsonl, trace.json, timeline.png and checkpoints."""
    data: str = ""
    """Training data: text (.txt, .jsonl/.json with a "text" field, .parquet, or a folder
    of them) tokenized by --tokenizer into a token store, a prepared store folder, or
    pre-tokenized .npy (any integer dtype) / .bin (uint16), all memory-mapped; a text
    file without a tokenizer is bytes as tokens. Empty = the embedded synthetic corpus."""
    data_cache: str = ""
    """Folder for the token store that --data text is prepared into once (reused while
    the tokenizer and the inputs are unchanged). Empty = next to the data."""
    pack_boundaries: bool = True
    """With a token store (documents known): train on rows packed from whole documents
    in order, attention kept inside each document (cu_seqlens and restarting positions)
    and no target across documents, in a seeded order, each row once per epoch, that
    checkpoints resume. --no-pack-boundaries: random windows of the token stream, as
    for data without a document index."""
    eval_every: int = 0
    """Compute the validation loss every N steps (0: never); needs --eval-split or
    --eval-data."""
    eval_batches: int = 4
    """Batches of --batch sequences in each validation (the same held-out ones each time)."""
    eval_split: float = 0.0
    """Hold out this fraction of the --data documents (the last ones; of the tokens
    for data without documents) for validation; training never sees them."""
    eval_data: str = ""
    """Validation data, in any form --data takes (tokenized like it)."""
    model: str = ""
    """A transformers model folder: config.json of a type that takes sequence parallel
    (llama, mistral, qwen2, qwen3, gemma2, phi3, mixtral, ...: docs/hf.md), and its
    safetensors weights when present (trained from them; otherwise the model gets its
    own initialisation). Empty = the reference llama of isp_comm/models/llama.py,
    shaped by --layers, --hidden, --heads and --kv-heads (ignored with --model)."""
    tokenizer: str = ""
    """A tokenizer folder (what transformers' AutoTokenizer reads, local files only)
    that tokenizes the --data text into a token store (next to the data, or under
    --data-cache). Empty =
    the --model folder's tokenizer when it has one, else bytes as tokens."""
    layers: int = 4
    """Transformer blocks of the reference llama."""
    hidden: int = 128
    """Model width of the reference llama (its MLP is llama's: 8/3 of it, rounded up
    to a multiple of 256, so that GPU GEMMs stay aligned)."""
    heads: int = 8
    """Attention heads of the reference llama."""
    kv_heads: int = 2
    """Key/value heads of the reference llama."""
    seq: int = 64
    """Sequence length."""
    batch: int = 8
    """Sequences per micro-step over all ranks (the global batch is --batch x --grad-accum)."""
    grad_accum: int = 1
    """Micro-steps per optimizer step: gradients accumulate in the shards' .grad, the
    loss of each micro-step is scaled by 1/N, and every micro-step's reduce-scatters
    overlap its backward (gradient memory does not grow with N)."""
    wp: int = 0
    """Weight-parallel size (0: the world size; WP and SP groups are independent splits of the world)."""
    sp: int = 1
    """Sequence-parallel size."""
    backend: BackendName = "auto"
    """Collective backend: auto, torch, symm or nvshmem (see ISPConfig.backend)."""
    comm_timeout: float = 300.0
    """Seconds any rank waits for a collective before the run stops with the hang's
    diagnosis (which rank is not responding or out of step), printed and written to
    hang.txt and hang.json in --out (ISPConfig.timeout_s)."""
    overlap: bool = True
    """Prefetch gathers and reduce-scatter asynchronously."""
    memory_pool: bool = True
    """Gather blocks into the fixed slot pool."""
    shard_outer: bool = False
    """Also shard the embedding, final norm and head across the WP group."""
    state_sharding: StateSharding = "wp"
    """Over which ranks gradients and optimizer state are split: wp (the WP group) or
    world (the whole job; see ISPConfig.state_sharding and docs/sharding.md)."""
    replica_sync: ReplicaSync = "micro"
    """When gradients cross the replica group (between nodes): micro (every micro-step)
    or step (the last micro-step of --grad-accum carries them all: one crossing per
    optimizer step; the earlier micro-steps keep WP shards of their gradients' sum in
    place of the gradient shards, more memory with --state-sharding world; see
    ISPCommunicator.set_requires_replica_sync and docs/sharding.md)."""
    vocab_parallel: bool = False
    """Split the output head along the vocab and compute the loss vocab-parallel."""
    ckpt: float = 0.0
    """Activation checkpointing ratio."""
    device: Device = "auto"
    """Where to train: cuda (one process per GPU, ``LOCAL_RANK``'s device, NCCL), cpu
    (gloo) or auto (cuda when torch sees a GPU)."""
    bf16: bool | None = None
    """Compute in bfloat16 (fp32 master weights, fp32 gradient reduction); default: on
    for cuda, off for cpu."""
    compile: bool = False
    """torch.compile every transformer block (the torchtitan recipe); the first step's
    time, compilation included, is reported apart. The memory forecast (and
    ``--plan``) then counts what a compiled block keeps for backward, and ``--plan``
    (``--search`` too) times its fused kernels ([Note: fused regions])."""
    peak_tflops: float = 0.0
    """The device's peak bf16 TFLOP/s for MFU (0: from a table of known GPUs; MFU is
    left out for an unknown one and on cpu)."""
    lr: float = 3e-3
    """Peak AdamW learning rate."""
    warmup: int = 10
    """Linear warm-up steps, then cosine decay to lr / 10."""
    weight_decay: float = 0.01
    """AdamW weight decay."""
    lora_rank: int = 0
    """Fine-tune LoRA adapters of this rank (alpha = 2 x rank) on --lora-targets instead
    of every weight (0: off; needs the peft package)."""
    init_from: str = ""
    """Start from the weights of a model.pt or model.safetensors (what isp-export
    writes) instead of the initialisation; with --lora-rank, they are the frozen base."""
    lora_targets: str = "q_proj,k_proj,v_proj,o_proj"
    """Comma-separated names of the linears that get LoRA adapters (the model's own
    module names; the default is the attention projections of the reference llama and
    of llama, mistral, qwen2 and qwen3 folders; a model without them, as Phi-3's fused
    qkv_proj, is refused in one line saying what to pass)."""
    clip: float = 1.0
    """Clip the global gradient norm to this value before each step (0: no clipping)."""
    seed: int = 0
    """Model initialisation seed: each module is seeded from it and its name, so the
    initial weights do not depend on --wp, --sp or --shard-outer."""
    log_every: int = 10
    """Print a line every N steps (also the steps --report-to reports)."""
    report_to: str = "none"
    """Where else the metrics go, as in the Hugging Face Trainer: none, tensorboard
    (event files in OUT/tensorboard: tensorboard --logdir OUT), wandb (Weights & Biases;
    WANDB_MODE=offline writes OUT/wandb only), or a comma list. Each --log-every step,
    each evaluation and the last step: the scalars of metrics.jsonl; the flags once.
    Written by the process that writes metrics.jsonl; a resume continues the same
    curves."""
    save_every: int = 0
    """Checkpoint every N steps (0: only at the end)."""
    final_save: bool = True
    """Checkpoint at the end of the run. --no-final-save: none (a measurement whose
    weights nobody needs; --save-every still saves)."""
    async_save: bool = False
    """Write checkpoints in the background (dcp.async_save) while training goes on;
    the next save, or the end of the run, waits for the previous one."""
    keep_checkpoints: int = 0
    """Keep the newest K complete checkpoints: once one is committed, older ones beyond
    K are removed (0: keep every one; torchtitan's keep_latest_k)."""
    resume: bool | Literal["auto"] = False
    """Continue from the latest complete checkpoint in --out (metrics.jsonl is cut back
    to its step; --steps must be larger), with the flags of the run that saved it for
    those not given, launch flags and --init-from aside (one line names a flag given
    anew that changes the run's).
    ``--resume auto``: continue when a complete checkpoint exists, start fresh
    otherwise (one command that starts a run and survives its restarts; it takes
    the whole command, no flags from config.json)."""
    overwrite: bool = False
    """Start again in an --out that holds checkpoints: isp-train's files there (metrics,
    trace, run files, checkpoints) are removed first (without it, such a folder is
    refused; a folder with a run but no checkpoint is written over, its metrics and
    trace started anew)."""
    plan: bool = False
    """Print the memory forecast of these flags (MiB per rank for every phase: wrap,
    forward, backward, optimizer, save, async save, load, by part) and exit; the last
    line is one JSON object, phase -> MiB, comparable with the peak memory a run logs.
    The world is --nproc-per-node x --nnodes (or WORLD_SIZE). Also the predicted step
    time, tokens/s and MFU (the JSON gains step_s and tokens_per_s), on a profile of
    this machine (calibrated on first use, a minute or two, and cached), of --target
    or of --profile."""
    target: str = ""
    """With --plan: plan for a device you are not on: h100, h200, a100, b200 or cpu,
    optionally xG for G per node (h100x8; a bare GPU name is 8 a node, cpu 1), published
    figures; the world is G x --nodes (a --nproc-per-node other than G is refused) and
    no device of that kind is needed here."""
    nodes: int = 1
    """With --target: how many nodes of it."""
    network_gbit: float = 0.0
    """With --target and --nodes: a node's bandwidth across nodes, in Gbit/s, all its
    NICs together, as a cluster's sheet gives it (the GPU targets' default is one NIC a
    GPU: 8 x 400 = 3200 on h100x8; a node with one 400 Gb/s NIC: 400). Each GPU is
    given its share (docs/planner.md)."""
    profile: str = ""
    """With --plan: a profile file (bench/calibrate.py writes one) instead of this
    machine's cached calibration."""
    recalibrate: bool = False
    """With --plan: measure this machine again (a minute or two) and replace its cached
    calibration when the new one is steady (a calibration taken on a busy machine
    misleads every later plan)."""
    virtual_world: int = 0
    """Train as one rank of a job of this many ranks, on this one process (torch's
    fake process group): the layout flags apply to it, --batch is the job's (this rank
    takes its share, as in the real job), and every collective takes its modelled
    time (--virtual-gbps, or --target and --nodes, or --profile). metrics.jsonl gains
    comm_s, exposed_comm_s and comm_late_s; its tokens/s is the whole job's. No
    checkpoint: --save-every, --resume, --init-from and --async-save are refused
    (docs/virtual.md)."""
    virtual_rank: int = 0
    """With --virtual-world: which rank of the job this process is."""
    virtual_gbps: float = 0.0
    """With --virtual-world: every collective at this bus bandwidth (G x 1e9 bytes/s),
    with no latency (instead of --target's or --profile's links)."""
    search: bool = False
    """With --plan: enumerate the layouts (wp, sp, replicas, state sharding,
    shard-outer, vocab-parallel, micro-batch x grad-accum for the same global batch),
    each with the fewest blocks checkpointed that fit, and print the five fastest that
    fit, each with its command line."""
    trace: bool = True
    """Record the compute/communication timeline (trace.json, timeline.png)."""
    memory_breakdown: bool = False
    """Measure where each phase's peak memory goes, by the memory forecast's parts:
    every rank's peaks from the second step on go to memory_breakdown.json, beside the
    forecast of these flags; rank 0 prints its own. It sees every operator from Python,
    which slows each step: a diagnosis, not a way to train."""
    save_on_signal: bool = True
    """On Ctrl-C or SIGTERM (a preemption), finish the step, save a checkpoint and leave
    with one line; --resume continues from it. --no-save-on-signal: leave at once, with
    one line and no checkpoint."""
    nproc_per_node: int = 0
    """Launch this many ranks on this machine (through torch's elastic launcher: no
    torchrun needed); 0: the ranks are launched already (torchrun) or this is the one."""
    max_restarts: int = 0
    """With --nproc-per-node: restart the ranks up to this many times when one fails
    (torch's elastic agent); each restart resumes from the latest complete checkpoint.
    A mistake found before the first step is not restarted: it would happen again."""
    nnodes: int = 1
    """Machines taking part, with --nproc-per-node on each (they meet at --rdzv-endpoint)."""
    rdzv_endpoint: str = ""
    """host:port where the machines of a --nnodes > 1 launch meet (c10d rendezvous)."""

    def targets(self) -> list[str]:
        """--lora-targets as names (spaces after the commas allowed)."""
        return lora_target_names(self.lora_targets)

    def __post_init__(self) -> None:
        for name in ("steps", "layers", "hidden", "heads", "kv_heads", "seq", "batch", "grad_accum", "sp", "log_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{_flag(name)} must be >= 1, got {getattr(self, name)}")
        for name in ("wp", "warmup", "save_every", "lora_rank", "nproc_per_node", "max_restarts", "eval_every"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{_flag(name)} must be >= 0, got {getattr(self, name)}")
        self._check_eval()
        parse_report_to(self.report_to)  # one line for an unknown tracker or a missing package
        if not 0.0 <= self.ckpt <= 1.0:
            raise ValueError(f"--ckpt must be in [0, 1], got {self.ckpt}")
        self._check_memory_breakdown()
        if not self.clip >= 0:
            raise ValueError(f"--clip must be >= 0, got {self.clip}")
        if not 0 < self.lr < MAX_LR:  # AdamW keeps the learning rate as a float (or refuses it)
            raise ValueError(f"--lr must be a number in (0, {MAX_LR:g}), got {self.lr}")
        if not self.weight_decay >= 0:
            raise ValueError(f"--weight-decay must be >= 0, got {self.weight_decay}")
        if self.seed < 0:
            raise ValueError(f"--seed must be >= 0, got {self.seed}")
        if not 0 < self.comm_timeout <= MAX_TIMEOUT_S:
            raise ValueError(f"--comm-timeout must be in (0, {MAX_TIMEOUT_S:g}] seconds, got {self.comm_timeout}")
        if self.device not in get_args(Device):
            raise ValueError(f"--device must be one of auto, cpu, cuda, got {self.device!r}")
        self._check_plan()
        virtual.check(self)  # one line for a flag a virtual run refuses
        if self.virtual_world:
            self.save_on_signal = False  # nothing to save: a signal ends a virtual run at once
        if self.device == "cuda" and not torch.cuda.is_available() and not (self.plan and self.target):
            raise ValueError(f"--device cuda: torch {torch.__version__} sees no CUDA device here (use --device cpu)")
        if not self.peak_tflops >= 0:
            raise ValueError(f"--peak-tflops must be >= 0, got {self.peak_tflops}")
        self._check_launch()
        if self.resume not in (True, False, "auto"):
            raise ValueError(f"--resume takes no value or auto, got {self.resume!r}")
        if self.keep_checkpoints < 0:
            raise ValueError(f"--keep-checkpoints must be >= 0 (0: keep all), got {self.keep_checkpoints}")
        if self.resume and self.overwrite:
            raise ValueError("--resume and --overwrite contradict each other: continue the run, or start it again")
        for name, choices in (("state_sharding", get_args(StateSharding)), ("replica_sync", get_args(ReplicaSync))):
            if getattr(self, name) not in choices:
                raise ValueError(f"--{_flag(name)} must be {' or '.join(choices)}, got {getattr(self, name)!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"--backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if self.hidden % self.heads or (self.hidden // self.heads) % 2:
            raise ValueError(f"--hidden {self.hidden} / --heads {self.heads} must be an even head size (rotary pairs)")
        if self.heads % self.kv_heads:
            raise ValueError(f"--heads {self.heads} must be a multiple of --kv-heads {self.kv_heads}")
        if self.lora_targets != TrainConfig.lora_targets and not self.lora_rank:
            raise ValueError(f"--lora-targets {self.lora_targets} needs --lora-rank R (without it every weight trains)")
        if self.lora_rank and not self.targets():
            raise ValueError("--lora-targets: give the names of the modules to adapt, comma-separated (q_proj,v_proj)")
        if self.data:
            from isp_comm.train.store import check_data

            check_data(self.data)  # one line naming --data, before ranks start
        if self.model:
            from isp_comm.train.hf_model import check_model_folder

            check_model_folder(self.model)  # one line naming the supported types, or unread weights
        if self.init_from and os.path.isdir(self.init_from):
            raise ValueError(
                f"--init-from {self.init_from} is a folder: it takes an exported model.pt or .safetensors file "
                "(isp-export RUN writes one from a run's checkpoint; --resume continues a run)"
            )
        if self.init_from and not os.path.isfile(self.init_from):
            raise ValueError(f"--init-from {self.init_from}: no such file")
        if self.tokenizer:
            if not os.path.isdir(self.tokenizer):
                raise ValueError(f"--tokenizer {self.tokenizer}: no such folder")
            from isp_comm.train.store import is_pretokenized

            if not self.data or is_pretokenized(self.data):
                raise ValueError("--tokenizer needs --data, a text file to tokenize")
        self._check_bytes_for_model()

    def _check_launch(self) -> None:
        """The flags isp-train launches the ranks with."""
        if self.nnodes < 1 or (self.nnodes > 1 and not (self.nproc_per_node and self.rdzv_endpoint)):
            raise ValueError("--nnodes > 1 needs --nproc-per-node and --rdzv-endpoint HOST:PORT on every machine")
        if self.rdzv_endpoint.upper().startswith("HOST:") or self.rdzv_endpoint.upper().endswith(":PORT"):
            raise ValueError(  # as --plan --search prints it
                f"--rdzv-endpoint {self.rdzv_endpoint}: put the first node's address and a free port in place of "
                "HOST:PORT (node0:29500), the same on every node"
            )
        if self.max_restarts and not self.nproc_per_node:
            raise ValueError("--max-restarts needs --nproc-per-node (under torchrun, give torchrun --max-restarts)")

    def _check_bytes_for_model(self) -> None:
        """Refuse a ``.txt`` ``--data`` or ``--eval-data`` for a ``--model`` folder
        without a tokenizer (and no ``--tokenizer``): its bytes (0-255) went to the model
        as its own token ids, a pretrained model trained on 256 arbitrary tokens of its
        vocabulary without a word (the built-in corpus under --model gets a warning)."""
        if not self.model or self.tokenizer:
            return
        from isp_comm.train.hf_model import has_tokenizer

        for flag, path in (("--data", self.data), ("--eval-data", self.eval_data)):
            if path.endswith(".txt") and os.path.isfile(path) and not has_tokenizer(self.model):
                raise ValueError(
                    f"{flag} {path}: --model {self.model} has no tokenizer, and the file's bytes are not its token "
                    "ids: give --tokenizer DIR (the model's), or to train on the bytes as ids, save them as a .npy"
                )

    def _check_memory_breakdown(self) -> None:
        """--memory-breakdown against the flags it cannot measure, each refusal saying
        which flag to drop."""
        if self.memory_breakdown and self.compile:
            raise ValueError(
                "--memory-breakdown sees eager operators only: a --compile'd block is one call to it; drop one "
                "(--compile to measure the eager run, or --memory-breakdown to train compiled)"
            )
        if self.memory_breakdown and self.plan:
            raise ValueError("--memory-breakdown measures a run and --plan only forecasts one: give one of them")

    def _check_plan(self) -> None:
        if self.nodes < 1:
            raise ValueError(f"--nodes must be >= 1, got {self.nodes}")
        if self.search and not self.plan:
            raise ValueError("--search plans a run: give it with --plan")
        if (self.target or self.profile or self.nodes > 1) and not (self.plan or self.virtual_world):
            raise ValueError(
                "--target, --nodes and --profile plan a run or model a virtual one: give them with --plan "
                "or --virtual-world"
            )
        if self.target and self.profile:
            raise ValueError("--target and --profile: give one (a profile file already describes its device)")
        if self.recalibrate and (not self.plan or self.target or self.profile):
            raise ValueError(
                "--recalibrate measures this machine for --plan: give it with --plan, without --target or --profile"
            )
        if self.nodes > 1 and not self.target:
            raise ValueError("--nodes needs --target (the nodes of that kind)")
        if self.network_gbit and not (self.target and self.nodes > 1):
            raise ValueError(
                "--network-gbit is the bandwidth between a --target's nodes: give it with --target and "
                "--nodes 2 or more"
            )
        if self.target:
            from isp_comm.planner.targets import parse_target

            cluster = parse_target(self.target, self.nodes, self.network_gbit)  # one line naming the known targets
            if self.plan and self.nproc_per_node and self.nproc_per_node != cluster.per_node:
                # it was ignored without a word: the plan was for the target's GPUs a node
                n, name = self.nproc_per_node, cluster.target.name
                raise ValueError(
                    f"--nproc-per-node {n} with --plan --target {self.target}: the target sets the ranks a node "
                    f"({cluster.per_node}); give --target {name}x{n} to plan {n} a node, without --nproc-per-node"
                )

    def _check_eval(self) -> None:
        if self.eval_batches < 1:
            raise ValueError(f"--eval-batches must be >= 1, got {self.eval_batches}")
        if not 0.0 <= self.eval_split < 1.0:
            raise ValueError(f"--eval-split must be in [0, 1), got {self.eval_split}")
        if self.eval_split and self.eval_data:
            raise ValueError("--eval-split and --eval-data: give one source of validation data")
        if self.eval_every and not (self.eval_split or self.eval_data):
            raise ValueError("--eval-every needs --eval-split F or --eval-data PATH")
        if (self.eval_split or self.eval_data) and not self.eval_every:
            raise ValueError("--eval-split / --eval-data need --eval-every N")
        if self.eval_data:
            from isp_comm.train.store import check_data

            try:
                check_data(self.eval_data)
            except ValueError as exc:
                raise as_eval_data_error(exc) from exc


def lora_target_names(text: str) -> list[str]:
    """The module names of a --lora-targets value (or a run.json's), spaces stripped:
    "q_proj, v_proj" once named " v_proj", which no module is."""
    return [t.strip() for t in text.split(",") if t.strip()]


def as_eval_data_error(exc: ValueError) -> ValueError:
    """A refusal of --eval-data's file by the code that reads --data's, naming the flag
    the user gave."""
    return ValueError(str(exc).replace("--data", "--eval-data", 1))


def check_layout(cfg: TrainConfig, world: int) -> None:
    """The flags against the world, before any rank starts (and before ``--plan``
    calibrates): a ``ValueError`` naming the flag (not the internal field) for --wp or
    --sp that does not divide the world, a --batch that world / sp does not divide
    (:func:`check_world`), a --seq that --sp does not, and for the reference llama's
    --heads and --kv-heads that --sp cannot split (its all-to-all splits the heads; a
    --model folder's heads are checked where its model is built)."""
    check_world(cfg, world)
    check_shape(cfg)


def check_shape(cfg: TrainConfig) -> None:
    """What --sp decides of the model's shape: the sequence and the heads it splits."""
    if cfg.seq % cfg.sp:
        raise ValueError(f"--seq {cfg.seq} must be divisible by --sp {cfg.sp}")
    if not cfg.model:
        if cfg.heads % cfg.sp:
            raise ValueError(f"--heads {cfg.heads} must be divisible by --sp {cfg.sp} (each SP rank takes whole heads)")
        check_heads(cfg.heads, cfg.kv_heads, cfg.sp)


def check_world(cfg: TrainConfig, world: int) -> None:
    """What the world size decides: --sp and --wp dividing it, --batch divided by
    world / sp."""
    if world % cfg.sp:
        raise ValueError(f"--sp {cfg.sp} does not divide the world size {world}")
    if cfg.wp and world % cfg.wp:
        raise ValueError(f"--wp {cfg.wp} does not divide the world size {world}")
    if cfg.batch % (groups := world // cfg.sp):
        near = -(-cfg.batch // groups) * groups
        raise ValueError(
            f"--batch {cfg.batch} must be divisible by world / sp = {groups}; it is the whole job's sequences a "
            f"step: --batch {near} would do"
        )


def check_heads(heads: int, kv_heads: int, sp: int) -> None:
    """A ``ValueError`` naming --sp when ``sp`` cannot split these heads and key/value
    heads (the rule SP applies, :func:`~isp_comm.sequence_parallel.kv_repeats`)."""
    from isp_comm.sequence_parallel import kv_repeats

    try:
        kv_repeats(heads, kv_heads, sp)
    except ValueError as exc:
        raise ValueError(f"--sp {sp}: {exc}") from None


def _resume_value(text: str) -> str:
    if text != "auto":
        raise argparse.ArgumentTypeError(f"takes no value or auto, got {text!r}")
    return text


def _flag(name: str) -> str:
    return name.replace("_", "-")


class _Parser(argparse.ArgumentParser):
    """Errors are one line, printed by rank 0 only (every rank parses the flags)."""

    def error(self, message: str):  # type: ignore[override]
        fail(message)


def fail(message: str, every_rank: bool = False, restart: bool = False) -> NoReturn:
    """Exit 2 with one line, printed by rank 0. The other ranks leave a moment later,
    so that torchrun, which stops the job at the first failed rank, lets rank 0 print.
    ``every_rank``: a rank other than 0 prints too, naming itself (what failed there
    may not fail on rank 0: ``--plan``'s ranks work alone, without a process group).
    Under ``--max-restarts``, no attempt follows unless ``restart`` (a failure during
    the steps; see [Note: no restart for a mistake])."""
    if not restart:
        survive.no_restart()
    rank = os.environ.get("RANK", "0")
    if rank == "0":
        print(f"isp-train: error: {message}", file=sys.stderr, flush=True)
    else:
        if every_rank:
            print(f"isp-train: error: rank {rank}: {message}", file=sys.stderr, flush=True)
        if threading.current_thread() is threading.main_thread():  # the launcher's SIGTERM ends the wait, quietly
            leave_on_signals(2)
        time.sleep(1.0)
    raise SystemExit(2)


def field_docs(cls: type) -> dict[str, str]:
    """Each dataclass field's docstring (the string literal under it), read from the
    class's source: the one text behind ``--help`` and the README's flag table."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for stmt, after in zip(body, body[1:]):
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            if (
                isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)
            ):
                docs[stmt.target.id] = " ".join(after.value.value.split())
    return docs


def parser() -> argparse.ArgumentParser:
    """isp-train's flags: ``--config`` and one per TrainConfig field, each unset
    (None) unless given, so that a config file's values show through."""
    p = _Parser(
        prog="isp-train",
        description="Train the reference llama, or a transformers model (--model), with ISP. With --nproc-per-node "
        "N it launches N ranks on this machine itself (no torchrun needed; torchrun --nproc-per-node N -m "
        "isp_comm.train ... works too); every flag can also be set in --config.",
    )
    keys = "keys with underscores, e.g. kv_heads = 2"
    p.add_argument("--config", default="", help=f"a TOML or JSON file (a run's config.json) setting flags ({keys})")
    docs = field_docs(TrainConfig)
    for f in fields(TrainConfig):
        kind = type(f.default)
        shown = "auto" if f.default is None else (f.default if f.default != "" else "none")
        text = f"{docs.get(f.name, '')} (default: {shown})".replace("%", "%%")
        if f.name == "resume":  # --resume, or --resume auto
            p.add_argument("--resume", nargs="?", const=True, default=None, type=_resume_value, help=text)
        elif kind is bool or "bool" in str(f.type):
            p.add_argument(f"--{_flag(f.name)}", action=argparse.BooleanOptionalAction, default=None, help=text)
        else:
            p.add_argument(f"--{_flag(f.name)}", type=kind, default=None, help=text)
    return p


def parse_config(argv: list[str] | None = None) -> TrainConfig:
    """CLI flags over an optional ``--config FILE.toml`` over the defaults."""
    p = parser()
    args = p.parse_args(argv)
    values: dict = {}
    if args.config:
        try:
            values = read_config_file(args.config)
        except ValueError as exc:
            p.error(f"--config {args.config}: {exc}")
    given = {k: v for k, v in vars(args).items() if v is not None and k != "config"}
    values.update(given)
    taken: dict = {}
    if values.get("resume") is True and not args.config:
        try:
            values, taken = _resumed_values(values, given)
        except ValueError as exc:
            p.error(str(exc))
    try:
        cfg = TrainConfig(**values)
        if taken:
            _check_resumed_layout(cfg, taken)
    except (ValueError, TypeError) as exc:
        p.error(_name_taken_flag(str(exc), values, taken))
    return cfg


def _name_taken_flag(message: str, values: dict, taken: dict) -> str:
    """A refusal that starts with a flag ``--resume`` took from the run (not typed now)
    names the file it came from: ``--resume --data STORE`` of a run begun on text took
    its ``--tokenizer`` and stopped with "--tokenizer needs --data, a text file to
    tokenize", which sent the user looking for a flag they had not given."""
    named = next((k for k in taken if message.startswith(f"--{_flag(k)} ")), None)
    if named is None or named in ("sp", "wp", "batch", "seq"):  # the layout's: _check_resumed_layout says so
        return message
    return (
        f"{message} ({shown(named, values[named])}: the resumed run's, from {taken[named]}; give "
        f"--{_flag(named)} anew, or an empty value to drop it)"
    )


NOT_RESUMED = frozenset(
    {
        *("out", "resume", "overwrite"),  # where the run is, and how this command treats it
        *("plan", "target", "nodes", "network_gbit", "profile", "recalibrate", "search"),  # a plan asked of it
        *("nproc_per_node", "nnodes", "rdzv_endpoint", "max_restarts"),  # how it is launched now
        "init_from",  # read by a new run only
    }
)
"""Flags a ``--resume`` does not take from the run's: where the run is, what is asked of
this command (a plan), how it is launched (the ranks never see the launch flags, and a
resume may change the world), and what only a new run reads."""


def _resumed_values(values: dict, given: dict) -> tuple[dict, dict]:
    """``--resume`` (without ``--config``): the flags of the run that saved the
    checkpoint it resumes from (its ``flags.json``; ``OUT/config.json`` for a checkpoint
    from before those), under the ones given now, as torchtitan keeps a job's config
    (before, a flag left out fell back to its default: a resume quietly trained with
    another accumulation, checkpointing or learning rate). The flags given anew that
    change the run's are named in one line on rank 0. ``--resume auto`` takes none: it
    is given the whole command (a restart, a requeue) and may start a new run. Also
    returns the flags taken, each with the file it came from."""
    from isp_comm.train.checkpoint import FLAGS, latest

    out = values.get("out", TrainConfig.out)
    ck = latest(out)
    path = os.path.join(ck, FLAGS) if ck else ""
    if not os.path.isfile(path):
        path = os.path.join(out, "config.json")
    if not os.path.isfile(path):
        return values, {}  # no checkpoint, or a folder from before config.json: run_folder says what is missing
    try:
        saved = {k: v for k, v in read_config_file(path).items() if k not in NOT_RESUMED}
    except ValueError as exc:
        raise ValueError(f"--resume: {path}: {exc}") from exc
    anew = {  # --steps: see run_folder
        k: v for k, v in given.items() if k in saved and absolute(k, saved[k]) != absolute(k, v) and k != "steps"
    }
    changed = [f"{shown(k, v)} (the run had {shown(k, saved[k])})" for k, v in anew.items()]
    merged = {**saved, **values}
    launcher = bool(merged.get("nproc_per_node")) and "LOCAL_RANK" not in os.environ  # its rank 0 says it
    if changed and not launcher and os.environ.get("RANK", "0") == "0":
        print(f"isp-train: resuming with the flags of {path}, except {'; '.join(changed)}", flush=True)
    return merged, {k: path for k in saved if k not in given}


def _check_resumed_layout(cfg: TrainConfig, taken: dict) -> None:
    """The layout a ``--resume`` took against the world it resumes on, which may be
    another (a checkpoint reshards): a layout flag that no longer fits names the file
    it came from, since the user did not type it (``--sp 2`` of a 2-rank run, resumed
    on one rank, needs ``--sp 1``)."""
    if cfg.plan:  # a plan checks the world it is asked for
        return
    try:
        check_layout(cfg, job_world(cfg))
    except ValueError as exc:
        named = [k for k in ("sp", "wp", "batch", "seq") if k in taken and f"--{k} " in str(exc)]
        if not named:
            raise
        flags = ", ".join(shown(k, getattr(cfg, k)) for k in named)
        raise ValueError(
            f"{exc} ({flags}: the resumed run's, from {taken[named[0]]}; give --{named[0]} for this world)"
        ) from exc


def job_world(cfg: TrainConfig) -> int:
    """The number of ranks the job's flags and launch describe: ``--nproc-per-node`` ×
    ``--nnodes`` for the launcher, torchrun's ``WORLD_SIZE`` in a rank, and
    ``--virtual-world`` over both."""
    launching = bool(cfg.nproc_per_node) and "LOCAL_RANK" not in os.environ
    world = cfg.nproc_per_node * cfg.nnodes if launching else int(os.environ.get("WORLD_SIZE", "1"))
    return cfg.virtual_world or world


def shown(key: str, value: object) -> str:
    """A flag as it is typed: ``--lr 0.05``, ``--no-trace``."""
    if isinstance(value, bool):
        return f"--{'' if value else 'no-'}{_flag(key)}"
    return f"--{_flag(key)} {value}"


def read_config_file(path: str) -> dict:
    """The fields set in a TOML file, or in a JSON one (such as the ``config.json`` a
    run writes), checked key by key: a ``ValueError`` naming an unknown key (with the
    field it likely means) or a value of the wrong type. Booleans are strictly
    ``true`` / ``false``; a JSON ``null`` leaves the field at its default."""
    try:
        with open(path, "rb") as fh:
            values = json.load(fh) if path.endswith(".json") else tomllib.load(fh)
    except OSError as exc:
        raise ValueError(exc.strerror or str(exc)) from exc
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"not valid {'JSON' if path.endswith('.json') else 'TOML'}: {exc}") from exc
    if not isinstance(values, dict):
        raise ValueError("expected a table of flags")
    kinds = {f.name: (f.type, f.default) for f in fields(TrainConfig)}
    for key, value in values.items():
        if key not in kinds:
            close = key.replace("-", "_")
            hint = f" (keys use underscores: {close})" if close in kinds else ""
            raise ValueError(f"unknown key {key!r}{hint}")
        annotation, default = kinds[key]
        expected = _expected_type(str(annotation), default)
        if value is None:
            if default is not None and key != "bf16":
                raise ValueError(f"{key} = null: give a {expected.__name__}")
            continue
        if key == "resume" and value == "auto":
            continue
        ok = isinstance(value, expected) and not (expected is not bool and isinstance(value, bool))
        if expected is float and isinstance(value, int) and not isinstance(value, bool):
            ok = True
        if not ok:
            raise ValueError(f"{key} must be {_KIND_NAMES[expected]}, got {value!r} ({type(value).__name__})")
    return {k: v for k, v in values.items() if v is not None}


_KIND_NAMES = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


def _expected_type(annotation: str, default: object) -> type:
    if "bool" in annotation:
        return bool
    return type(default) if default is not None else str


def resolve_device(cfg: TrainConfig) -> torch.device:
    """The device this rank trains on: ``LOCAL_RANK``'s GPU for cuda."""
    if cfg.device == "cpu" or (cfg.device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())


def as_dict(cfg: TrainConfig) -> dict:
    return dataclasses.asdict(cfg)


PATH_FLAGS = frozenset({"data", "data_cache", "eval_data", "model", "tokenizer", "init_from", "profile"})
"""Flags naming files or folders: a run records them absolute."""


def absolute(key: str, value: object) -> object:
    """A flag's value with a path made absolute (``PATH_FLAGS``), as a run records it."""
    return os.path.abspath(value) if key in PATH_FLAGS and isinstance(value, str) and value else value


def saved_flags(cfg: TrainConfig) -> dict:
    """The flags a run records (config.json, and each checkpoint's flags.json): all but
    ``resume``, so that ``--config`` of them starts the same run anew; paths absolute,
    so that a resume, or ``--config``, from another working directory reads the same
    files (before, ``--data corpus.txt`` resumed from elsewhere found no data)."""
    return {k: absolute(k, v) for k, v in as_dict(cfg).items() if k != "resume"}
