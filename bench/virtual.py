"""One rank of a big job, side by side: isp-comm and FSDP2 under the same modelled
collectives, the compute-only bound and the planner's prediction.

    python bench/virtual.py                 # on one GPU: Llama-3-8B at N=8, Llama-3-70B at N=64
    python bench/virtual.py --quick         # tiny configurations on CPU, under 5 minutes
    python bench/virtual.py --config llama3-8b --repeats 3 --out DIR
    python bench/virtual.py --config llama3-8b --layout best    # the planner's fastest layout that fits
    python bench/virtual.py --quick --layout best                # the same, tiny, on CPU
    python bench/virtual.py --config llama3-8b-64th --systems isp-comm,fsdp2 --breakdown   # CPU: peaks by part

Each system runs in a process of its own as rank 0 of a virtual world of N ranks
(torch's fake process group, ``isp_comm.virtual``), with the job's batch per rank.

**Layouts.** ``--layout fixed`` (the default) runs each configuration as written
(wp = N, its checkpointing, ``shard_outer`` and ``vocab_parallel``, one micro-step).
``--layout best`` takes ``isp-train --plan --search``'s fastest layout that fits for
the configuration's global batch (wp, sp, replicas, checkpointing, ``shard_outer``,
``vocab_parallel``, micro-batch and accumulation), planned on the device the run is
on (an H200 with the h200 target's figures), and runs it eager and compiled.

- **isp-comm**: ``ISPCommunicator`` in the layout; ``compiled``: every block
  compiled before wrapping, as ``isp-train --compile``;
- **FSDP2**, as torchtitan sets it up (with ``--layout best``, in its own fastest
  layout that fits: full sharding, or hybrid sharding over a WP group with the
  replicas' all-reduce through ``set_all_reduce_hook`` on the same backend):
  activation checkpointing on the same blocks,
  then (``compiled``) every block compiled, then ``fully_shard`` on the embedding,
  on every block, on the final norm with the head together (not resharded after
  forward: backward starts with them), and on the root, with the same mixed
  precision (bf16 parameters, fp32 reductions on a GPU); sharded over the world
  (FSDP2 has no sequence parallel: each rank takes whole sequences, the same
  tokens per rank and the same global batch, see :func:`fsdp_shape`); its
  all-gathers and reduce-scatters go through ``set_custom_all_gather`` /
  ``set_custom_reduce_scatter`` to the same virtual backend, so they take the same
  time and its gathered weights hold real bytes; its buffers are waited for on the
  streams that allocated them and recorded on no other (``record_streams=False``),
  as FSDP2's own synchronous NCCL calls leave them;
- **compute-only**: isp-comm's eager run with every collective taking no time (its
  local copies remain): the lower bound of a step;
- **planner**: ``isp-train --plan``'s step-time model and memory forecast for the
  same layout on the same link model.

The link model is the planner's (a target's published NVLink and InfiniBand
figures: ``isp_comm/planner/targets.py``), so the planner's network is the virtual
run's; what the comparison checks is the compute, the memory and the overlap.

Measured per process: ``--steps`` steps after two warm-up steps; the median step,
exposed communication (isp-comm: its waits, ``comm.stats()``; FSDP2: its step less
the compute-only step, derived), peak allocated and reserved memory (CUDA) or peak
RSS (CPU). Over ``--repeats`` processes, run in rounds (every system once a round,
so that a drift of the machine falls on all alike): the median, with the range. Prints a
markdown table per configuration and writes OUT/virtual.json (--out, default
bench/results/local): per system, ``runs`` holds each process's figures (one entry
per process run) and each figure's summary over them, ``{"median", "min", "max",
"runs"}``. ``--breakdown`` and ``--profile`` end each process with one more step,
under the memory breakdown or ``torch.profiler`` (``bench/kernel_profile.py``: its
device time by kind of kernel), and print them side by side.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import add_out, markdown_table, progress, save_results  # noqa: E402
from bench.kernel_profile import profile_step, profile_table  # noqa: E402
from isp_comm.models.llama import LlamaConfig  # noqa: E402
from isp_comm.testing import run_virtual  # noqa: E402
from isp_comm.train.metrics import peak_rss_bytes  # noqa: E402


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
    """One job: the model, the world and its nodes, the sequence and the layout."""

    world: int
    target: str
    """The link model's target (``h100x8``: 8 per node); nodes = world / per node."""
    network_gbit: float = 0.0
    """A node's bandwidth across nodes in Gbit/s, as isp-train's --network-gbit (0: the
    target's, one NIC a GPU)."""
    model: LlamaConfig
    seq: int
    batch_per_rank: int = 1
    ckpt: float = 1.0
    shard_outer: bool = True
    vocab_parallel: bool = False
    bf16: bool = True
    wp: int = 0
    """The fixed layout's WP size (0: the world)."""
    state_sharding: str = "wp"
    """The fixed layout's ``ISPConfig.state_sharding``."""
    memory_gib: float = 0.0
    """``--layout best``: what a layout must fit in (0: the device's memory), e.g. 80 for
    "fits an 80 GB GPU" on an H200."""
    release_reduce_buffers: bool | None = None
    """isp-comm's ``ISPConfig.release_reduce_buffers`` (None: its default for the
    device; True on CPU gives the reduce-scatter pairs back between backwards, as a
    CUDA run does by default)."""
    memory_pool: bool = True
    """isp-comm's ``ISPConfig.memory_pool`` (False: each gathered block's buffer made
    when it is gathered and freed when it is released, as FSDP2 does)."""


def _llama(vocab, hidden, ffn, layers, heads, kv, seq) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=vocab, hidden=hidden, ffn_hidden=ffn, n_layers=layers, n_heads=heads, n_kv_heads=kv,
        max_seq_len=seq,
    )  # fmt: skip


CONFIGS = {
    # Llama-3-8B's shape (vocab 128256, hidden 4096, ffn 14336, 32 layers, 32 heads, 8 KV heads)
    "llama3-8b": Config(world=8, target="h100x8", model=_llama(128256, 4096, 14336, 32, 32, 8, 8192), seq=8192),
    # Llama-3-70B's (hidden 8192, ffn 28672, 80 layers, 64 heads, 8 KV heads), 8 nodes of 8:
    # the head vocab-parallel (2.1B replicated parameters otherwise, ~34 GB a rank)
    "llama3-70b": Config(
        world=64, target="h100x8", model=_llama(128256, 8192, 28672, 80, 64, 8, 4096), seq=4096, vocab_parallel=True
    ),
    # the scaling run: Llama-3-8B at 8 nodes and at 128, sequences of 8192, one a rank
    "llama3-8b-n64": Config(world=64, target="h100x8", model=_llama(128256, 4096, 14336, 32, 32, 8, 8192), seq=8192),
    "llama3-8b-n1024": Config(
        world=1024, target="h100x8", model=_llama(128256, 4096, 14336, 32, 32, 8, 8192), seq=8192
    ),
    # Llama-3-70B at 8 nodes, the configuration of the independent sharding's goal: seq 8192,
    # one a rank, every layout held to 80 GB
    "llama3-70b-8k": Config(
        world=64, target="h100x8", model=_llama(128256, 8192, 28672, 80, 64, 8, 8192), seq=8192, memory_gib=80.0
    ),
}
# the same 70B job on nodes of one 400 Gb/s NIC each, where the planner expects the state
# over the world to lead full sharding (docs/sharding.md); by name only
CONFIGS["llama3-70b-8k-1nic"] = dataclasses.replace(CONFIGS["llama3-70b-8k"], network_gbit=400.0)
SCALING = ("llama3-8b", "llama3-8b-n64", "llama3-8b-n1024")
"""``--scaling``: these in the planner's best layout each, tokens/s/GPU against the first's."""
QUICK = {  # on CPU: fp32, the nominal cpu target's links (5 GB/s in a node of N), under 5 minutes
    "tiny-n4": Config(world=4, target="cpux4", model=_llama(512, 128, 384, 4, 4, 2, 64), seq=64, bf16=False),
    "tiny-n8": Config(
        world=8, target="cpux8", model=_llama(512, 128, 384, 4, 4, 2, 64), seq=64, bf16=False, vocab_parallel=True
    ),
    # independent sharding: weights over WP 2, gradients and optimizer state over all 8
    "tiny-n8-world": Config(
        world=8,
        target="cpux8",
        model=_llama(512, 128, 384, 4, 4, 2, 64),
        seq=64,
        bf16=False,
        wp=2,
        state_sharding="world",
    ),  # fmt: skip
}
_LLAMA3_8B_64TH = Config(
    world=8, target="cpux8", model=_llama(16032, 512, 1792, 4, 4, 1, 1024), seq=1024, release_reduce_buffers=True
)
SCALED = {
    # on CPU, by name only: Llama-3-8B's fixed layout at N=8 (wp 8, the outer parameters sharded,
    # every block checkpointed, bf16 compute) at 1/8 of its width (4 heads of 128, one KV head),
    # vocabulary and sequence, 4 blocks: every per-block buffer, the embedding, the head and the
    # logits are 1/64 of the 8B's (bench/memory_breakdown.py --review's point); the reduce-scatter
    # pairs given back between backwards, as on CUDA
    "llama3-8b-64th": _LLAMA3_8B_64TH,
    # the same without isp-comm's pool: each block's gathered buffer made and freed around its use, as FSDP2's
    "llama3-8b-64th-unpooled": dataclasses.replace(_LLAMA3_8B_64TH, memory_pool=False),
}
EVERY_CONFIG = {**CONFIGS, **QUICK, **SCALED}
"""Every configuration ``--config`` names."""
LAYOUT_FIELDS = ("ckpt", "shard_outer", "vocab_parallel", "wp", "state_sharding")
"""A :class:`Config`'s fixed layout: what ``--layout best`` replaces by the planner's."""


def distinct_jobs(names: list[str]) -> tuple[list[str], list[str]]:
    """``--layout best``'s configurations: the names, less those whose job (everything
    but :data:`LAYOUT_FIELDS`) an earlier one has, since the planner gives both the same
    layout (``tiny-n8-world`` is ``tiny-n8`` in another layout); and a line for each
    left out."""
    defaults = {f.name: f.default for f in dataclasses.fields(Config) if f.name in LAYOUT_FIELDS}
    kept: list[tuple[Config, str]] = []  # a model's config is not hashable
    said = []
    for name in names:
        job = dataclasses.replace(EVERY_CONFIG[name], **defaults)
        same = next((other for j, other in kept if j == job), None)
        if same is not None:
            said.append(f"bench/virtual.py: {name} is {same}'s job in another layout: --layout best runs it once")
            continue
        kept.append((job, name))
    return [name for _, name in kept], said


SYSTEMS = ("isp-comm", "fsdp2", "compute-only")
"""``--layout fixed``: eager runs."""
BEST_SYSTEMS = ("isp-comm", "isp-comm compiled", "fsdp2", "fsdp2 compiled", "compute-only")
"""``--layout best``: eager and compiled (per block, as isp-train and torchtitan)."""
IN_FSDP2_LAYOUT = "@fsdp2"
"""``--layout best``, after an isp-comm system (``isp-comm@fsdp2``, ``isp-comm
compiled@fsdp2``): isp-comm in FSDP2's fastest layout rather than its own, so that
the two systems compare in one layout (FSDP2's has no SP and no vocab-parallel head)."""


class NoLink:
    """Every collective takes no time (the compute-only bound)."""

    def demand(self, op: str, ranks: tuple[int, ...], nbytes: int):
        from isp_comm.backends.tiers import NONE

        return NONE

    def describe(self) -> str:
        return "no communication time"


@dataclasses.dataclass(frozen=True)
class Run:
    """What one process runs: a configuration in a layout (isp-train's flags, the
    planner's :class:`~isp_comm.planner.search.Layout`)."""

    cfg: Config
    layout: object
    """A ``Layout``: world, wp, sp, ckpt, shard_outer, vocab_parallel, batch (sequences
    per micro-step over the job) and grad_accum."""


def fixed_layout(cfg: Config):
    """The configuration as written: wp = N, one micro-step."""
    from isp_comm.planner.search import Layout

    wp = cfg.wp or cfg.world
    batch = cfg.batch_per_rank * cfg.world
    return Layout(cfg.world, wp, 1, cfg.ckpt, cfg.shard_outer, cfg.vocab_parallel, batch, 1, cfg.state_sharding)


def _target(cfg: Config, device: torch.device) -> str:
    """The target to plan on: the configuration's, with the GPU this runs on when it
    is a known one (an H200 run is planned with h200 figures; the links are the
    configuration's per-node count)."""
    from isp_comm.planner.targets import gpu_target, parse_target

    per_node = parse_target(cfg.target).per_node
    gpu = gpu_target(torch.cuda.get_device_name(device)) if device.type == "cuda" else ""
    return f"{gpu}x{per_node}" if gpu else cfg.target


def _profile(cfg: Config, device: torch.device | None = None):
    from isp_comm.planner import profile as profiles
    from isp_comm.planner.targets import parse_target

    target = _target(cfg, device or _device())
    per_node = parse_target(target).per_node
    return profiles.from_target(parse_target(target, max(cfg.world // per_node, 1), cfg.network_gbit))


def _device() -> torch.device:
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def _meta_model(cfg: Config):
    from isp_comm.models.llama import build

    with torch.device("meta"):
        return build(cfg.model)  # each module made real on the device while it is sharded


def _isp_config(cfg: Config, layout):
    from isp_comm import ISPConfig

    return ISPConfig(
        activation_checkpointing=layout.ckpt,
        shard_outer_params=layout.shard_outer,
        vocab_parallel=layout.vocab_parallel,
        state_sharding=layout.state_sharding,
        release_reduce_buffers=cfg.release_reduce_buffers,
        memory_pool=cfg.memory_pool,
        param_dtype=torch.bfloat16 if cfg.bf16 else None,
        reduce_dtype=torch.float32 if cfg.bf16 else None,
        # No init_seed: a seeded initialisation draws every module on the host's one
        # generator (isp_comm/materialize.py), 8 billion numbers for Llama-3-8B at about
        # 200-300 million a second on one core. On the H200 machine isp-comm's 8B process
        # took 94 s against FSDP2's 29 s, and its 70B one did not finish in 250 s. The
        # step does not depend on the values: each module is drawn on its device, as
        # FSDP2's side is (run_system seeds the device's generator).
        init_seed=None,
    )


def _isp(run: Run, system: str, device: torch.device):
    """The model wrapped by isp-comm on the virtual backend; (model, comm, clip, batches)."""
    from isp_comm import ISPCommunicator, ParallelGroups
    from isp_comm.discovery import find_blocks
    from isp_comm.planner.links import ProfileLink
    from isp_comm.virtual import virtual_backend

    cfg, lay = run.cfg, run.layout
    model = _meta_model(cfg)
    if system.endswith("compiled"):  # as isp-train --compile: every block, then wrapped
        for block in find_blocks(model):
            block.compile()
    link = NoLink() if system == "compute-only" else ProfileLink(_profile(cfg, device), "torch")
    groups = ParallelGroups.create(wp_size=lay.wp, sp_size=lay.sp)
    comm = ISPCommunicator(model, groups, _isp_config(cfg, lay), backend=virtual_backend(device, link))
    per, chunk = lay.batch // (lay.world // lay.sp), cfg.seq // lay.sp
    positions = torch.arange(groups.sp_rank * chunk, (groups.sp_rank + 1) * chunk, device=device)
    shape = (per, chunk, lay.grad_accum)
    return model, comm, lambda: comm.clip_grad_norm_(1.0), shape, positions, comm.cross_entropy


def fsdp_shape(run: Run) -> tuple[int, int, int]:
    """FSDP2's (sequences per micro-step, sequence length, micro-steps) on one rank
    for the layout's global batch and tokens per rank: whole sequences, as many a
    micro-step as isp-comm's micro-step has tokens (at least one); shorter sequences
    of the same tokens only where the job has fewer sequences than ranks."""
    cfg, lay = run.cfg, run.layout
    per_step = lay.batch * lay.grad_accum  # sequences per optimizer step, over the job
    if per_step % lay.world:
        if (per_step * cfg.seq) % lay.world:
            raise ValueError(f"{per_step} sequences of {cfg.seq} tokens do not split over {lay.world} ranks")
        return 1, per_step * cfg.seq // lay.world, 1
    mine = per_step // lay.world
    tokens = lay.batch // (lay.world // lay.sp) * (cfg.seq // lay.sp)  # isp-comm's per micro-step
    micro = max(1, min(mine, tokens // cfg.seq))
    while mine % micro:
        micro -= 1
    return micro, cfg.seq, mine // micro


def _fsdp2(run: Run, system: str, device: torch.device):
    """FSDP2 as torchtitan sets it up (see the module note), its collectives on the
    virtual backend."""
    import torch.nn.functional as F
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from isp_comm.integrations.fsdp2 import BackendAllGather, BackendReduceScatter, BackendReplicaAllReduce
    from isp_comm.planner.links import ProfileLink
    from isp_comm.virtual import virtual_backend

    cfg, lay = run.cfg, run.layout
    model = _meta_model(cfg)
    n_ckpt = _isp_config(cfg, lay).checkpointed_blocks(len(model.layers))  # the blocks isp-comm checkpoints
    for i in range(len(model.layers)):
        block = checkpoint_wrapper(model.layers[i]) if i < n_ckpt else model.layers[i]
        model.layers[i] = torch.compile(block) if system.endswith("compiled") else block
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if cfg.bf16 else None
    kw = {"mp_policy": mp} if mp is not None else {}
    groups = None
    if lay.wp < lay.world:  # hybrid sharding: over WP's group, the replicas' all-reduce through the hook below
        from torch.distributed.device_mesh import DeviceMesh

        from isp_comm import ParallelGroups

        groups = ParallelGroups.create(wp_size=lay.wp)
        kw["mesh"] = DeviceMesh.from_group(groups.wp_group, device.type)
    units = [fully_shard(model.embed, **kw)]
    units += [fully_shard(block, **kw) for block in model.layers]
    units += fully_shard([model.norm, model.lm_head], reshard_after_forward=False, **kw)  # one unit, both modules
    units.append(fully_shard(model, **kw))
    model.to_empty(device=device)
    with torch.no_grad():
        for p in model.parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            local.normal_(0.0, 0.02) if local.dim() > 1 else local.fill_(1.0)
    backend = virtual_backend(device, ProfileLink(_profile(cfg, device), "torch"), record_streams=False)
    ag, rs = BackendAllGather(backend, 300.0), BackendReduceScatter(backend, 300.0)
    replicas = BackendReplicaAllReduce(backend, groups.replica_group, 300.0) if groups is not None else None
    for m in units:
        m.set_custom_all_gather(ag)
        m.set_custom_reduce_scatter(rs)
        if replicas is not None:
            m.set_all_reduce_hook(replicas)

    def loss_fn(logits, labels):
        return F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten())

    def clip():
        return torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)

    per, seq, accum = fsdp_shape(run)
    return model, backend, clip, (per, seq, accum), torch.arange(seq, device=device), loss_fn


def _peak(device: torch.device) -> dict:
    if device.type == "cuda":
        return {
            "peak_alloc_mib": torch.cuda.max_memory_allocated(device) / 2**20,
            "peak_reserved_mib": torch.cuda.max_memory_reserved(device) / 2**20,
        }
    return {"peak_rss_mib": peak_rss_bytes() / 2**20}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_system(rank: int, world: int, run: Run, system: str, steps: int, extras: tuple[str, ...] = ()) -> dict:
    """One process: build, two warm-up steps, ``steps`` timed ones (runs in a virtual
    world); then, as ``extras`` asks, one more step under ``torch.profiler``
    ("profile") and one under the memory breakdown ("breakdown")."""
    device = _device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.manual_seed(0)  # the initial weights, drawn on the device (see _isp_config)
    build = _fsdp2 if system.startswith("fsdp2") else _isp
    model, comm, clip, (per, seq, accum), positions, loss_fn = build(run, system, device)
    stats = getattr(comm, "stats", None)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, foreach=True)
    gen = torch.Generator().manual_seed(rank)
    vocab = run.cfg.model.vocab_size
    times, exposed, issued, gathers = [], [], [], []

    def gathered() -> int:  # all-gathers issued so far (FSDP2: its units' gathers on the backend)
        return stats()["all_gathers"] if stats else comm.issued["all_gather"]

    def draw() -> list[torch.Tensor]:
        batches = [torch.randint(0, vocab, (per, seq + 1), generator=gen).to(device) for _ in range(accum)]
        _sync(device)
        return batches

    def step(batches: list[torch.Tensor]) -> torch.Tensor:
        for tokens in batches:
            loss = loss_fn(model(tokens[:, :-1], position_ids=positions), tokens[:, 1:]) / accum
            loss.backward()
        clip()
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync(device)
        return loss

    for i in range(steps + 2):
        batches = draw()
        s0 = stats() if stats else None
        m0 = comm.modelled_comm_s if not stats else 0.0
        g0 = gathered()
        t0 = time.perf_counter()
        loss = step(batches)
        dt = time.perf_counter() - t0
        if i >= 2:
            times.append(dt)
            gathers.append(gathered() - g0)
            if stats:
                s1 = stats()
                exposed.append(s1["exposed_comm_s"] - s0["exposed_comm_s"])
                issued.append(s1["comm_s"] - s0["comm_s"])
            else:
                issued.append(comm.modelled_comm_s - m0)
        if not math.isfinite(float(loss.detach())):
            raise RuntimeError(f"{system}: loss {float(loss)} at step {i}")
    out = {
        "step_s": statistics.median(times),
        "comm_s": statistics.median(issued),
        "exposed_comm_s": statistics.median(exposed) if exposed else None,
        "all_gathers": statistics.median(gathers),
        **_peak(device),
    }
    if "profile" in extras:
        batches = draw()
        out["profile"] = profile_step(lambda: step(batches), device)
    if "breakdown" in extras:
        out["breakdown"] = measure_breakdown(lambda: step(draw()), comm, opt, model)
    comm.close()
    return out


BREAKDOWN_PHASES = ("forward", "backward", "optimizer")
BREAKDOWN_SYSTEMS = ("isp-comm", "fsdp2")
"""``--breakdown``: the systems whose step the memory breakdown sees (eager ones)."""


def measure_breakdown(
    step: Callable[[], object], comm: object, opt: torch.optim.Optimizer, model: torch.nn.Module
) -> dict:
    """One step under ``isp_comm.memory_breakdown.MemoryBreakdown`` (``comm``: the
    ``ISPCommunicator``, or FSDP2's backend: the breakdown then finds FSDP2's units in
    ``model``): the phase whose tracked peak is highest, its parts, and what the device
    held beyond the tracked tensors at that moment."""
    from isp_comm import ISPCommunicator
    from isp_comm.memory_breakdown import MemoryBreakdown

    tracker = MemoryBreakdown()
    with tracker:
        tracker.attach(comm if isinstance(comm, ISPCommunicator) else None, opt, model=model)
        step()
    b = tracker.result()
    phase = max(BREAKDOWN_PHASES, key=lambda ph: b.tracked.get(ph, 0))
    if phase == "backward":  # which moment of it: the loss's backward, or the blocks'
        phase = max(("backward/loss", "backward/model"), key=lambda ph: b.tracked.get(ph, 0))
    parts = {k: v for k, v in b.phases[phase].items() if v}
    return {"phase": phase, "tracked": b.tracked[phase], "parts": parts, "device": b.device[phase]}


def predict(run: Run, device: torch.device | None = None, compiled: bool = False) -> dict:
    """The planner's step and memory for the same layout, on the same links, on the
    device the run is on; ``compiled``: every block compiled, its memory (what
    inductor keeps) and its step (what inductor fuses: [Note: fused regions] in
    ``isp_comm/planner/fusion.py``)."""
    from isp_comm.memory_forecast import forecast
    from isp_comm.planner.memory import device_memory
    from isp_comm.planner.step import step_time

    cfg, lay = run.cfg, run.layout
    prof = _profile(cfg, device)
    model = _meta_model(cfg)
    icfg = _isp_config(cfg, lay)
    shape = {"world": lay.world, "wp": lay.wp, "sp": lay.sp, "batch": lay.batch, "seq": cfg.seq}
    st = step_time(model, icfg, prof, **shape, grad_accum=lay.grad_accum, compiled=compiled)
    out = {"step_s": st.step_s, "comm_s": sum(st.comm_s.values()), "exposed_comm_s": sum(st.exposed_comm.values())}
    out["target"] = prof.name
    if prof.device == "cuda":
        fc = forecast(
            model, icfg, lay.world, lay.wp, lay.sp, lay.batch, cfg.seq, device="cuda", local_world=1,
            compiled=compiled, grad_accum=lay.grad_accum,
        )  # fmt: skip
        dm = device_memory(fc, prof, world=lay.world, wp=lay.wp, sp=lay.sp, baseline=0, capacity=prof.memory_bytes)
        out["peak_alloc_mib"] = max(dm.forecast.peak(ph) for ph in ("wrap", "forward", "backward", "optimizer")) / 2**20
        out["peak_reserved_mib"] = dm.reserved / 2**20
    return out


LOSS = "logits and loss"
"""The forecast's part for the logits and the loss (``isp_comm/memory_forecast``)."""

LAYOUT_KINDS = ("any", "world", "wp", "fsdp2")
"""Which layouts ``best_layout`` ranks: every one; those with ``state_sharding`` "world"
(or "wp"); those FSDP2 runs (no SP, the outer parameters sharded, no vocab-parallel
head, state sharded like the weights: full sharding when wp = N, else hybrid sharding
with the replicas' all-reduce)."""


def _of_kind(lay, kind: str) -> bool:
    """Whether the search's ``lay`` is one ``kind`` runs here: every micro-step crosses
    the replicas (these runs do not defer it, nor does FSDP2's HSDP beside them)."""
    if lay.replica_sync != "micro":
        return False
    if kind == "fsdp2":
        return lay.sp == 1 and lay.shard_outer and not lay.vocab_parallel and lay.state_sharding == "wp"
    return kind == "any" or lay.state_sharding == kind


def fsdp2_loss_bytes(cfg: Config, lay) -> dict[str, int]:
    """Per phase, what torchtitan's loss holds at its peak, as :func:`_fsdp2` computes
    it (``F.cross_entropy`` on an fp32 copy of the logits), for the rank's tokens of a
    micro-step (no SP: every rank takes whole sequences). Forward: the logits, their
    fp32 copy and log-softmax's fp32 output at once; backward: that output (saved),
    the gradient arriving at it and the one log-softmax's backward makes, all fp32.
    isp-comm's loss (``comm.cross_entropy``) holds one fp32 chunk at a time, which is
    what the forecast counts: FSDP2's layout is planned with these bytes instead."""
    elems = (lay.batch // lay.world) * cfg.seq * cfg.model.vocab_size
    logits = 2 if cfg.bf16 else 4
    return {"forward": elems * (logits + (4 if logits != 4 else 0) + 4), "backward": elems * 3 * 4}


def _with_fsdp2_loss(fc, loss: dict[str, int]):
    """The forecast ``fc`` with FSDP2's loss (:func:`fsdp2_loss_bytes`) in place of
    isp-comm's. The forward's moment is the loss's; the backward's peak is the larger of
    the forecast's and the loss's backward, which is the forward's moment (every
    block's activations, the gathered head) with the loss's backward bytes."""
    fwd, bwd = fc.phases["forward"], fc.phases["backward"]
    at_loss = {**fwd, LOSS: loss["backward"]}
    backward = max(bwd, at_loss, key=lambda parts: sum(parts.values()))
    return dataclasses.replace(
        fc, phases={**fc.phases, "forward": {**fwd, LOSS: loss["forward"]}, "backward": backward}
    )


def best_layout(cfg: Config, device: torch.device | None = None, kind: str = "any") -> tuple[object, dict]:
    """``isp-train --plan --search``'s fastest layout of ``kind`` (:data:`LAYOUT_KINDS`)
    that fits (in ``cfg.memory_gib`` when set), for the configuration's global batch
    (``batch_per_rank x world`` sequences a step), planned on the device the run is
    on; the layout and what the search said of it."""
    from isp_comm.discovery import find_blocks
    from isp_comm.memory_forecast import forecast
    from isp_comm.planner import search
    from isp_comm.planner.memory import device_memory
    from isp_comm.planner.step import step_time

    prof = _profile(cfg, device)
    model = _meta_model(cfg)
    memo: dict = {"blocks": list(find_blocks(model))}
    heads, kv_heads = cfg.model.n_heads, cfg.model.n_kv_heads
    every = search.layouts(cfg.world, cfg.batch_per_rank * cfg.world, cfg.seq, heads, kv_heads=kv_heads)
    candidates = [lay for lay in every if _of_kind(lay, kind)]
    capacity = min(prof.memory_bytes, int(cfg.memory_gib * 2**30)) if cfg.memory_gib else prof.memory_bytes

    def memory(lay):
        icfg = _isp_config(cfg, lay)
        fc = forecast(
            model, icfg, lay.world, lay.wp, lay.sp, lay.batch, cfg.seq, device=prof.device,
            local_world=prof.per_node, blocks=memo["blocks"], memo=memo, grad_accum=lay.grad_accum,
        )  # fmt: skip
        if kind == "fsdp2":
            fc = _with_fsdp2_loss(fc, fsdp2_loss_bytes(cfg, lay))
        return device_memory(fc, prof, world=lay.world, wp=lay.wp, sp=lay.sp, baseline=0, capacity=capacity)

    def step(lay):
        return step_time(
            model, _isp_config(cfg, lay), prof, world=lay.world, wp=lay.wp, sp=lay.sp, batch=lay.batch,
            seq=cfg.seq, grad_accum=lay.grad_accum, memo=memo,
        )  # fmt: skip

    ranked = search.rank(candidates, memory, step, top=1, blocks=len(memo["blocks"]))
    fitting = [r for r in ranked if r.fits]
    if not fitting:
        raise SystemExit(f"bench/virtual.py --layout best: no {kind} layout of {cfg.world} ranks fits on {prof.name}")
    best = fitting[0]
    said = {
        "kind": kind,
        "capacity_gib": capacity / 2**30,
        "exposed_comm_s": sum(best.step.exposed_comm.values()),
        "mfu_pct": best.step.mfu_pct,
        "target": prof.name,
        "layouts": len(ranked),
        "fit": len(fitting),
        "step_s": best.step.step_s,
        "flags": " ".join(best.layout.flags()),
    }
    return best.layout, said


def _flops_per_token(cfg: Config) -> float:
    from isp_comm.model_flops import flops_per_token

    return flops_per_token(_meta_model(cfg), cfg.seq)


def _summary(runs: list[dict], key: str) -> dict | None:
    """``key`` over the runs that have it: the median, the range and how many runs
    (a dict, so that one run's figure does not read as several runs')."""
    vals = [r[key] for r in runs if r.get(key) is not None]
    if not vals:
        return None
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals), "runs": len(vals)}


def bench_config(
    name: str,
    cfg: Config,
    repeats: int,
    steps: int,
    timeout_s: float,
    layout: str = "fixed",
    kind: str = "any",
    systems: tuple[str, ...] | None = None,
    breakdown: bool = False,
    profile: bool = False,
) -> dict:
    """Every system (or ``systems``), ``repeats`` processes each, and the planner's
    prediction. ``layout="best"``: isp-comm in the fastest layout of ``kind`` that
    fits, FSDP2 in its own fastest that fits (full or hybrid sharding).
    ``breakdown``: each eager system's processes end with one step under the memory
    breakdown (compiled code is not seen inside, and compute-only is isp-comm's);
    ``profile``: each process ends with one step under ``torch.profiler``
    (``bench/kernel_profile.py``), the median-step run's kept."""
    device = _device()
    lay, said = (fixed_layout(cfg), None) if layout == "fixed" else best_layout(cfg, device, kind)
    run = Run(cfg, lay)
    result = {"config": name, **dataclasses.asdict(cfg), "layout": dataclasses.asdict(lay), "systems": {}}
    fsdp_run = run
    if said is not None:
        result["search"] = said
        systems = systems or BEST_SYSTEMS
        if any(s.startswith("fsdp2") or s.endswith(IN_FSDP2_LAYOUT) for s in systems):
            fsdp_lay, fsdp_said = best_layout(cfg, device, "fsdp2")
            fsdp_run = Run(cfg, fsdp_lay)
            result["fsdp2_layout"], result["fsdp2_search"] = dataclasses.asdict(fsdp_lay), fsdp_said
    chosen = systems or SYSTEMS
    runs = _rounds(name, cfg, chosen, repeats, steps, timeout_s, run, fsdp_run, breakdown, profile)
    for system in chosen:
        result["systems"][system] = _summarise(runs[system])
    result["systems"]["planner"] = predict(run, device)
    if any(s.endswith("compiled") and s.startswith("isp-comm") for s in result["systems"]):
        result["systems"]["planner compiled"] = predict(run, device, compiled=True)
    if "compute-only" not in result["systems"]:
        return _finish(result, cfg, lay)
    compute = result["systems"]["compute-only"]["step_s"]["median"]
    for system, s in result["systems"].items():
        if system.startswith("fsdp2") and fsdp_run is run:  # each run's step less the compute-only median
            for r in s["runs"]:
                r["exposed_comm_s"] = max(r["step_s"] - compute, 0.0)
            s["exposed_comm_s"] = _summary(s["runs"], "exposed_comm_s")
            s["exposed_comm_derived"] = "step_s less compute-only's median step_s"
    return _finish(result, cfg, lay)


def _rounds(name, cfg, systems, repeats, steps, timeout_s, run, fsdp_run, breakdown, profile) -> dict[str, list]:
    """Each system's ``repeats`` processes, run in rounds (every system once a round,
    in order), so that a drift of the machine's speed falls on every system alike;
    each system's runs, by name."""
    runs: dict[str, list] = {s: [] for s in systems}
    for r in range(repeats):
        for system in systems:
            which = fsdp_run if system.startswith("fsdp2") or system.endswith(IN_FSDP2_LAYOUT) else run
            built = system.removesuffix(IN_FSDP2_LAYOUT)
            progress(f"bench/virtual.py: {name} {system} run {r + 1}/{repeats}")
            extras = (*(("breakdown",) if breakdown and built in BREAKDOWN_SYSTEMS else ()), *(("profile",) * profile))
            runs[system].append(run_virtual(run_system, cfg.world, 0, which, built, steps, extras, timeout_s=timeout_s))
    return runs


def _summarise(runs: list[dict]) -> dict:
    """A system's runs, each figure's summary over them, its breakdown (the median
    tracked peak's run) and its profile (the median step's run)."""
    own = ("breakdown", "profile")  # kept whole, not summarised
    out = {"runs": runs, **{k: _summary(runs, k) for k in runs[0] if k not in own}}
    if "profile" in runs[0]:
        out["profile"] = sorted(runs, key=lambda r: r["step_s"])[(len(runs) - 1) // 2]["profile"]
    if "breakdown" in runs[0]:
        out["breakdown"] = median_breakdown([r["breakdown"] for r in runs])
    return out


def _finish(result: dict, cfg: Config, lay) -> dict:
    result["flops_per_token"] = _flops_per_token(cfg)
    result["tokens_per_rank"] = lay.batch * lay.grad_accum * cfg.seq // lay.world
    return result


def _cell(v, fmt: str = "{:.3f}") -> str:
    if v is None:
        return "—"
    if isinstance(v, dict):  # a summary over runs
        med, lo, hi = v["median"], v["min"], v["max"]
        return fmt.format(med) + (f" ({fmt.format(lo)}-{fmt.format(hi)})" if hi > lo else "")
    return fmt.format(v)


def _median(v):
    """A summary's median, or a single figure (the planner's) as it is."""
    return v["median"] if isinstance(v, dict) else v


def table(result: dict, peak_tflops: float) -> str:
    tokens = result["tokens_per_rank"]
    rows = []
    for system, s in result["systems"].items():
        step = _median(s["step_s"])
        mfu = 100 * result["flops_per_token"] * tokens / step / (peak_tflops * 1e12) if peak_tflops else None
        exposed_v = _median(s.get("exposed_comm_s"))
        pct = None if exposed_v is None else 100 * exposed_v / step
        mem = [s.get(k) for k in ("peak_alloc_mib", "peak_reserved_mib", "peak_rss_mib")]
        issued = s.get("comm_s")
        rows.append(
            [system, _cell(s["step_s"]), f"{tokens / step:.0f}", _cell(mfu, "{:.1f}"), _cell(issued),
             _cell(exposed_v), _cell(pct, "{:.1f}"), *(_cell(m, "{:.0f}") for m in mem)]
        )  # fmt: skip
    header = ["system", "step s", "tokens/s/GPU", "MFU %", "comm s issued", "exposed comm s", "exposed %"]
    return markdown_table([*header, "alloc MiB", "reserved MiB", "RSS MiB"], rows, "l" + "r" * 9)


def _describe_layout(lay: dict) -> str:
    return (
        f"wp {lay['wp']}, sp {lay['sp']}, {lay['world'] // lay['wp']} replicas, state over "
        f"{lay.get('state_sharding', 'wp')}, ckpt {lay['ckpt']:g}, "
        f"shard-outer {'yes' if lay['shard_outer'] else 'no'}, "
        f"vocab-parallel {'yes' if lay['vocab_parallel'] else 'no'}, micro-batch {lay['batch']} x accum "
        f"{lay['grad_accum']}"
    )


def _describe_search(said: dict) -> str:
    fits = f"in {said['capacity_gib']:.0f} GiB " if said.get("capacity_gib") else ""
    kind = "" if said.get("kind", "any") == "any" else f"{said['kind']} "
    return (
        f"the planner's fastest {kind}layout that fits {fits}on {said['target']} ({said['fit']} of "
        f"{said['layouts']} fit, predicted {said['step_s']:.4g} s)"
    )


def describe(result: dict) -> str:
    """The layout lines above a table."""
    lay = result["layout"]
    text = f"world {lay['world']} ({result['target']} links), seq {result['seq']}: {_describe_layout(lay)}"
    if result.get("search"):
        text += f"; {_describe_search(result['search'])}"
    if result.get("fsdp2_layout"):
        fsdp = result["fsdp2_layout"]
        full = "full sharding" if fsdp["wp"] == fsdp["world"] else "hybrid sharding"
        text += f"\nFSDP2 ({full}): {_describe_layout(fsdp)}; {_describe_search(result['fsdp2_search'])}"
    return text


def notes(result: dict) -> str:
    """What under a table is measured and what is modelled, in words."""
    target = result["target"]
    lines = [
        f"- measured: each system's compute, memory and waits on this machine; modelled: every collective's "
        f"time, on the {target} links"
    ]
    if target.startswith("cpu"):
        lines.append(
            f"- planner: predicted on the nominal {target} target (its compute figures too), not calibrated on "
            "this machine: its step is not this machine's"
        )
    else:
        lines.append(f"- planner: predicted from {target}'s published figures, nothing of it measured")
    if "planner compiled" in result["systems"]:
        lines.append(
            "- planner compiled: compiled blocks, their memory (what inductor keeps) and their step (what inductor "
            "fuses: each chain of element-wise operators one kernel of its external bytes)"
        )
    if any(s.get("exposed_comm_derived") for s in result["systems"].values()):
        lines.append("- FSDP2's exposed comm: its step less the compute-only step (derived: its waits are not timed)")
    return "\n".join(lines)


def median_breakdown(runs: list[dict]) -> dict:
    """The runs' breakdowns (:func:`measure_breakdown`) as one: the run whose tracked
    peak is the median, whole (its parts add up to it, at its phase), with the
    number of runs and the tracked peaks' range."""
    ordered = sorted(runs, key=lambda b: b["tracked"])
    out = dict(ordered[(len(ordered) - 1) // 2])
    out.update(runs=len(runs), tracked_range=[ordered[0]["tracked"], ordered[-1]["tracked"]])
    return out


def breakdown_tables(result: dict) -> str:
    """``--breakdown``: each broken-down system's peak (the phase of its highest tracked
    total) by category, then by part, in MiB side by side, with the device's lines."""
    from isp_comm.memory_breakdown import CATEGORIES, category
    from isp_comm.memory_breakdown.parts import by_category, part_order

    named = {k: s["breakdown"] for k, s in result["systems"].items() if "breakdown" in s}
    if not named:
        return ""
    header = ["", *(f"{k} ({b['phase']})" for k, b in named.items())]

    def mib(v: float) -> str:
        return f"{v / 2**20:,.2f}"

    cats = [by_category(b["parts"]) for b in named.values()]
    rows = [[c, *(mib(got.get(c, 0)) for got in cats)] for c in CATEGORIES if any(c in got for got in cats)]
    rows.append(["**tracked peak**", *(f"**{mib(b['tracked'])}**" for b in named.values())])
    lines = list(dict.fromkeys(n for b in named.values() for n in b["device"]))
    rows += [[f"device: {n}", *(mib(b["device"].get(n, 0)) for b in named.values())] for n in lines]
    parts = sorted({p for b in named.values() for p in b["parts"]}, key=part_order)
    part_rows = [[f"{p} ({category(p)})", *(mib(b["parts"].get(p, 0)) for b in named.values())] for p in parts]
    return (
        "Memory at each system's peak, by category (MiB; one step after the timed ones, "
        "tracked tensors and the device's lines at that moment; of several runs, the run "
        "whose tracked peak is the median):\n\n"
        + markdown_table(header, rows, "l" + "r" * len(named))
        + "\n\nBy part:\n\n"
        + markdown_table(header, part_rows, "l" + "r" * len(named))
    )


def scaling_table(results: list[dict], peak_tflops: float) -> str:
    """``--scaling``: each world's tokens/s/GPU, and its efficiency against the first's."""
    rows, first = [], None
    for res in results:
        tokens = res["tokens_per_rank"]
        for system in ("isp-comm", "planner"):
            step = _median(res["systems"][system]["step_s"])
            rate = tokens / step
            first = first or {}
            first.setdefault(system, rate)
            mfu = 100 * res["flops_per_token"] * tokens / step / (peak_tflops * 1e12) if peak_tflops else None
            flags = res["search"]["flags"]
            rows.append([res["layout"]["world"], system, flags, _cell(res["systems"][system]["step_s"]),
                         f"{rate:,.0f}", _cell(mfu, "{:.1f}"), f"{100 * rate / first[system]:.1f}"])  # fmt: skip
    header = ["N", "system", "layout", "step s", "tokens/s/GPU", "MFU %", "efficiency vs first N %"]
    return markdown_table(header, rows, "rllrrrr")


def main() -> None:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))  # the first paragraph
    ap.add_argument("--quick", action="store_true", help="tiny configurations on CPU (under 5 minutes)")
    ap.add_argument(
        "--config", choices=list(EVERY_CONFIG), action="append",
        help=f"only these (repeatable); {', '.join(SCALED)} runs on CPU, named only",
    )  # fmt: skip
    ap.add_argument(
        "--layout", choices=("fixed", "best"), default="fixed",
        help="the configuration's own layout, or --plan --search's fastest that fits, eager and compiled",
    )  # fmt: skip
    ap.add_argument(
        "--kind", choices=LAYOUT_KINDS[:3], default="any",
        help="--layout best: isp-comm's layouts to rank (world: state_sharding world only)",
    )  # fmt: skip
    ap.add_argument("--systems", default="", help="comma-separated: only these systems (default: all)")
    ap.add_argument(
        "--scaling", action="store_true",
        help=f"{', '.join(SCALING)} in the planner's best layout each: tokens/s/GPU and efficiency against N=8",
    )  # fmt: skip
    ap.add_argument(
        "--breakdown", action="store_true",
        help="then one more step of each eager system under the memory breakdown: its peak by part, side by side",
    )  # fmt: skip
    ap.add_argument(
        "--profile", action="store_true",
        help="then one more step of each system under torch.profiler: its device time by kind, side by side",
    )  # fmt: skip
    ap.add_argument("--repeats", type=int, default=0, help="processes per system (default: 3; 1 with --quick)")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per process, after two warm-up steps")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds a process may take")
    add_out(ap)
    args = ap.parse_args()
    table_of = QUICK if args.quick else CONFIGS
    named_only = (*SCALING[1:], "llama3-70b-8k-1nic")
    names = args.config or (list(SCALING) if args.scaling else [n for n in table_of if n not in named_only])
    if args.scaling:
        args.layout, args.systems = "best", args.systems or "isp-comm"
    if args.layout == "best":
        names, said = distinct_jobs(names)
        for line in said:
            print(line)
    repeats = args.repeats or (1 if args.quick else 3)
    if any(n in CONFIGS for n in names) and not torch.cuda.is_available():
        ap.error(f"the GPU configurations need CUDA: run with --quick (or --config {', '.join(SCALED)}) on CPU")
    known = (*BEST_SYSTEMS, *(f"isp-comm{c}{IN_FSDP2_LAYOUT}" for c in ("", " compiled")))
    unknown = [s for s in args.systems.split(",") if s and s not in known]
    if unknown:
        ap.error(f"--systems: unknown {unknown} (one of {', '.join(known)})")
    if IN_FSDP2_LAYOUT in args.systems and args.layout != "best":
        ap.error(f"--systems ...{IN_FSDP2_LAYOUT}: only with --layout best (FSDP2's own fastest layout)")
    from isp_comm.train.metrics import peak_tflops

    peak = peak_tflops(_device())
    results = []
    for name in names:
        cfg = EVERY_CONFIG[name]
        systems = tuple(args.systems.split(",")) if args.systems else None
        res = bench_config(
            name, cfg, repeats, args.steps, args.timeout, args.layout, args.kind, systems, args.breakdown, args.profile
        )
        res["target"] = res["systems"]["planner"]["target"]
        results.append(res)
        print(f"\n### {name}: {describe(res)}\n")
        print(table(res, peak))
        print(f"\n{notes(res)}")
        if args.breakdown:
            print(f"\n{breakdown_tables(res)}")
        profiled = {k: s["profile"] for k, s in res["systems"].items() if "profile" in s}
        if profiled:
            print(f"\n{profile_table(profiled)}")
    if args.scaling:
        print("\n### scaling\n")
        print(scaling_table(results, peak))
    path = save_results("virtual", args, results)
    print(f"\nraw JSON: {path}")


if __name__ == "__main__":
    main()
