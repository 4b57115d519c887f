"""``isp-train --plan``: memory per phase, the predicted step, and with ``--search`` the
fastest layouts, for this machine, a profile file or a target you are not on."""

from __future__ import annotations

import dataclasses
import json
import os
import sys

import torch

from isp_comm.discovery import find_blocks
from isp_comm.memory_forecast import forecast
from isp_comm.planner import memory as planner_memory
from isp_comm.planner import profile as profiles
from isp_comm.planner import search as planner_search
from isp_comm.planner.step import StepTime, step_time
from isp_comm.planner.targets import gpu_target, parse_target
from isp_comm.processes import usable_cores
from isp_comm.train import hf_model
from isp_comm.train.config import TrainConfig, check_heads, check_layout, check_shape, check_world, resolve_device
from isp_comm.train.metrics import proc_status_bytes
from isp_comm.train.model import build_meta_model, isp_config, use_bf16
from isp_comm.train.sources import load_tokens

CALIBRATE_ENV = "ISP_COMM_PLAN_CALIBRATE"
"""``0``: --plan without --target or --profile does not calibrate this machine; it
uses the nominal ``cpu`` target (the tests set it: calibrating takes a minute).
``quick``: it calibrates with fewer sizes and steps, once (not repeated when noisy), a
rough profile cached under a name of its own (tests of the calibration's coordination)."""
NOT_FLAGS = {
    "plan", "target", "nodes", "network_gbit", "profile", "search", "recalibrate", "nproc_per_node", "nnodes",
    "rdzv_endpoint",
}  # fmt: skip
"""Flags of planning, not of the run a search prints (``device`` too, when planning a --target)."""
LAYOUT_FLAGS = {
    "wp", "sp", "ckpt", "shard_outer", "vocab_parallel", "state_sharding", "replica_sync", "batch", "grad_accum",
}  # fmt: skip


def _gpu_target() -> str:
    """The known target this machine's GPU is, or ''."""
    return gpu_target(torch.cuda.get_device_name())


def planning_profile(cfg: TrainConfig, world: int) -> tuple[profiles.Profile, int]:
    """The profile to plan on and the world: --target's (its GPUs per node x --nodes),
    --profile's, or this machine's (calibrated once and cached)."""
    if cfg.target:
        cluster = parse_target(cfg.target, cfg.nodes, cfg.network_gbit)
        return profiles.from_target(cluster), cluster.world
    local = int(os.environ.get("LOCAL_WORLD_SIZE", 0)) or cfg.nproc_per_node or world
    if cfg.profile:
        prof = profiles.load(cfg.profile)
    elif resolve_device(cfg).type == "cuda":
        gpu = _gpu_target()
        if not gpu:
            raise ValueError(f"--plan: no known target for {torch.cuda.get_device_name()}: give --target or --profile")
        prof = profiles.from_target(parse_target(f"{gpu}x{local}", max(world // local, 1)))
        return prof, world
    elif os.environ.get(CALIBRATE_ENV) == "0":
        prof = dataclasses.replace(profiles.from_target(parse_target("cpu")), name="this machine (nominal cpu)")
    else:
        quick = os.environ.get(CALIBRATE_ENV) == "quick"
        progress = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
        prof = profiles.cached(local, progress, recalibrate=cfg.recalibrate, quick=quick)
    if prof.device == "cpu":
        with open("/proc/meminfo") as f:
            avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
        cores = prof.cores or usable_cores()  # a calibration's own, else this machine's
        prof = dataclasses.replace(prof, memory_bytes=avail // max(local, 1), cores=cores)
    return dataclasses.replace(prof, per_node=local, nodes=max(world // local, 1)), world


def command_line(cfg: TrainConfig, prof: profiles.Profile, layout: planner_search.Layout) -> str:
    """The isp-train command that runs ``layout`` with the rest of ``cfg``'s flags."""
    default = TrainConfig()
    parts = ["isp-train", "--nproc-per-node", str(prof.per_node)]
    if prof.nodes > 1:
        parts += ["--nnodes", str(prof.nodes), "--rdzv-endpoint", "HOST:PORT"]
    for f in dataclasses.fields(TrainConfig):
        value = getattr(cfg, f.name)
        if f.name in NOT_FLAGS | LAYOUT_FLAGS or value == getattr(default, f.name):
            continue
        if f.name == "device" and cfg.target:  # the target's device: its GPUs
            continue
        flag = "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            parts.append(flag if value else "--no-" + flag[2:])
        elif value is not None:
            parts += [flag, str(value)]
    return " ".join(parts + layout.flags())


@dataclasses.dataclass
class _Planner:
    """A meta model on a profile's device: each configuration's memory and step."""

    model: torch.nn.Module
    prof: profiles.Profile
    world: int
    bf16: bool
    baseline: int
    memo: dict = dataclasses.field(default_factory=dict)

    @property
    def blocks(self) -> list[torch.nn.Module]:
        """The model's blocks, found once (the forecast's memo keeps them)."""
        if "blocks" not in self.memo:
            self.memo["blocks"] = list(find_blocks(self.model))
        return self.memo["blocks"]

    def memory(self, c: TrainConfig) -> planner_memory.DeviceMemory:
        wp, prof, blocks = c.wp or self.world, self.prof, self.blocks
        fc = forecast(
            self.model, isp_config(c, self.bf16), self.world, wp, c.sp, c.batch, c.seq, device=prof.device,
            local_world=prof.per_node, blocks=blocks, memo=self.memo, evaluate=bool(c.eval_every),
            cuda_workspace=prof.cuda.get("workspace"), compiled=c.compile,
            grad_accum=c.grad_accum, deferred_replica_sync=c.replica_sync == "step",
        )  # fmt: skip
        return planner_memory.device_memory(
            fc, prof, world=self.world, wp=wp, sp=c.sp, baseline=self.baseline, capacity=prof.memory_bytes
        )

    def step(self, c: TrainConfig) -> StepTime:
        return step_time(
            self.model, isp_config(c, self.bf16), self.prof, world=self.world, wp=c.wp or self.world, sp=c.sp,
            batch=c.batch, seq=c.seq, grad_accum=c.grad_accum, memo=self.memo,
            deferred_replica_sync=c.replica_sync == "step", compiled=c.compile,
        )  # fmt: skip


def _print_plan(cfg: TrainConfig, planner: _Planner, mem: planner_memory.DeviceMemory, st: StepTime) -> None:
    """The table, the parts outside it, whether it fits, and the predicted step."""
    prof, world, fc, cuda = planner.prof, planner.world, mem.forecast, planner.prof.device == "cuda"
    replicas = world // (cfg.wp or world)
    layout = f", {replicas} replicas, state over {cfg.state_sharding}" if replicas > 1 else ""
    # a noisy calibration (given by --profile, or measured for this plan and not cached) says so here too
    noisy = "" if prof.noise.get("steady", True) else f"; a noisy calibration: {profiles.describe_noise(prof.noise)}"
    print(
        f"isp-train --plan: {prof.device}{' bf16' if planner.bf16 else ''}, world {world}, wp {cfg.wp or world}, "
        f"sp {cfg.sp}{layout}, batch {cfg.batch}, seq {cfg.seq}; MiB per rank "
        f"({'CUDA allocated' if cuda else 'RSS'}); on {prof.name} ({prof.source}{noisy})"
    )
    print(fc.table(planner.baseline))
    if fc.shm_bytes:
        print(f"shared memory (/dev/shm) of the host for the symmetric-memory backend: {fc.shm_bytes / 2**20:.1f} MiB")
    for ph, nbytes in fc.host_staging.items():
        print(f"host memory per rank for DCP's staging in {ph}: {nbytes / 2**20:.1f} MiB")
    for part, nbytes in mem.outside.items():
        print(f"not in max_memory_allocated: {part}: {nbytes / 2**20:.1f} MiB")
    if cuda:
        print(f"reserved (max_memory_reserved) forecast: {mem.reserved / 2**20:.1f} MiB")
    verdict = "fits" if mem.fits else "does NOT fit"
    of = f"{mem.capacity / 2**20:,.0f} MiB" + ("" if cuda else " (a rank's share of the host's memory)")
    print(
        f"device holds at most {mem.device_total / 2**20:,.1f} MiB of {of}: {verdict} "
        f"(a plan keeps {100 * planner_memory.MARGIN:.0f}% free)"
    )
    ph, ex = st.phases, st.exposed_comm
    print(
        f"predicted step{' (compiled blocks)' if cfg.compile else ''}: {st.step_s:.4g} s, "
        f"{st.tokens_per_s:,.0f} tokens/s"
        + (f", MFU {st.mfu_pct:.1f}%" if st.mfu_pct else "")
        + f"; forward {ph['forward']:.4g} s, backward {ph['backward']:.4g} s (recompute included), optimizer "
        f"{ph['optimizer']:.4g} s, loop {ph['host']:.4g} s; exposed communication: forward {ex['forward']:.3g} s, "
        f"backward {ex['backward']:.3g} s, optimizer {ex['optimizer']:.3g} s"
    )
    print("predicted compute (forward and backward): " + ", ".join(f"{k} {v:.4g} s" for k, v in st.compute_s.items()))
    if prof.cores and prof.per_node > prof.cores:
        print(
            f"{prof.per_node} ranks on {prof.cores} cores: each rank computes {prof.cores}/{prof.per_node} of the "
            f"time, so the step is planned {prof.per_node / prof.cores:.3g}x what a core per rank would take"
        )


def _search(cfg: TrainConfig, planner: _Planner) -> None:
    """--search: every layout of the world for the same global batch, ranked."""
    heads, kv_heads = _heads(planner.model)
    candidates = planner_search.layouts(
        planner.world, cfg.batch * cfg.grad_accum, cfg.seq, heads, kv_heads=kv_heads,
        vocab_parallel=not cfg.model and not cfg.lora_rank,
    )  # fmt: skip

    def layout_config(lay: planner_search.Layout) -> TrainConfig:
        return dataclasses.replace(cfg, **{k: getattr(lay, k) for k in LAYOUT_FLAGS})

    ranked = planner_search.rank(
        candidates,
        lambda lay: planner.memory(layout_config(lay)),
        lambda lay: planner.step(layout_config(lay)),
        blocks=len(planner.blocks),
    )
    print(planner_search.table(ranked, lambda lay: command_line(cfg, planner.prof, lay)))


def _heads(model: torch.nn.Module) -> tuple[int, int]:
    """(attention heads, key/value heads) of the reference llama or a transformers model."""
    ref = getattr(model, "cfg", None)
    if ref is not None and hasattr(ref, "n_heads"):
        return ref.n_heads, ref.n_kv_heads
    config = model.config
    return config.num_attention_heads, getattr(config, "num_key_value_heads", None) or config.num_attention_heads


def _check_layout(cfg: TrainConfig, world: int) -> None:
    """:func:`check_layout` for the world planned; with --target, a refusal the world
    caused says that world came from --target and --nodes (it gave "world / sp = 16"
    for a --batch 8 and left the user to guess where 16 came from)."""
    if not cfg.target:
        check_layout(cfg, world)
        return
    cluster = parse_target(cfg.target, cfg.nodes)
    try:
        check_world(cfg, cluster.world)
    except ValueError as exc:
        unit = "GPU" if cluster.target.device == "cuda" else "rank"
        per_node = f"{cluster.per_node} {unit}{'s' if cluster.per_node > 1 else ''} a node"
        nodes = f"{cluster.nodes} node{'s' if cluster.nodes > 1 else ''}"
        where = f"the world of --target {cfg.target} --nodes {cfg.nodes}: {per_node} x {nodes}"
        raise ValueError(f"{exc} ({where})") from None
    check_shape(cfg)


def plan(cfg: TrainConfig, world: int) -> None:
    """``--plan``: the forecast table for these flags on the planning profile's device,
    the predicted step, with ``--search`` the fastest layouts, then one JSON line
    (phase -> MiB per rank, absolute, and ``step_s``, ``tokens_per_s``). Under a
    launcher (``torchrun --nproc-per-node N``) every rank waits for the profile (one
    of them calibrates: [Note: one process calibrates]) and rank 0 alone prints."""
    _check_layout(cfg, world)  # before calibrating
    if cfg.model:  # the model's own vocabulary (0: nothing to check it against)
        vocab, tok_dir = 0, ""
    elif cfg.tokenizer:
        vocab, tok_dir = len(hf_model.load_tokenizer(cfg.tokenizer)), cfg.tokenizer
    else:
        vocab, tok_dir = load_tokens(cfg.data)[1], ""
    model, _ = build_meta_model(cfg, vocab, tok_dir)
    check_heads(*_heads(model), cfg.sp)
    prof, world = planning_profile(cfg, world)
    if os.environ.get("RANK", "0") != "0":
        return
    device = torch.device(prof.device)
    base = 0 if device.type == "cuda" else proc_status_bytes("VmRSS")
    planner = _Planner(model, prof, world, use_bf16(cfg, device), base)
    mem = planner.memory(cfg)  # first: its checks name the flags
    st = planner.step(cfg)
    _print_plan(cfg, planner, mem, st)
    if cfg.search:
        _search(cfg, planner)
    out = mem.forecast.as_mib(base)
    out.update(step_s=round(st.step_s, 6), tokens_per_s=round(st.tokens_per_s, 1))
    print(json.dumps(out))
