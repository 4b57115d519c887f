"""One rank of a big job, side by side: isp-comm and FSDP2 under the same modelled
collectives, the compute-only bound and the planner's prediction.

    python bench/virtual.py                 # on one GPU: Llama-3-8B at N=8, Llama-3-70B at N=64
    python bench/virtual.py --quick         # tiny configurations on CPU, under 5 minutes
    python bench/virtual.py --config llama3-8b --repeats 3 --out DIR

Each system runs in a process of its own as rank 0 of a virtual world of N ranks
(torch's fake process group, ``isp_comm.virtual``), with the job's batch per rank:

- **isp-comm**: ``ISPCommunicator`` with wp = N (every block and, with
  ``shard_outer``, the outer parameters sharded over the world; ``vocab_parallel``
  where the config says), activation checkpointing on every block;
- **FSDP2**: ``fully_shard`` on every block and on the root over the same world,
  the same mixed precision (bf16 parameters, fp32 reductions on a GPU) and the same
  checkpointing; its all-gathers and reduce-scatters go through
  ``set_custom_all_gather`` / ``set_custom_reduce_scatter`` to the same virtual
  backend, so they take the same modelled time on a side stream and its gathered
  weights hold real bytes (this rank's shard in every chunk);
- **compute-only**: isp-comm's run with every collective taking no time (its local
  copies remain): the lower bound of a step;
- **planner**: ``isp-train --plan``'s step-time model and memory forecast for the
  same layout on the same link model.

The link model is the planner's (a target's published NVLink and InfiniBand
figures: ``isp_comm/planner/targets.py``), so the planner's network is the virtual
run's; what the comparison checks is the compute, the memory and the overlap.

Measured per process: ``--steps`` steps after two warm-up steps; the median step,
exposed communication (isp-comm: its waits, ``comm.stats()``; FSDP2: its step less
the compute-only step, derived), peak allocated and reserved memory (CUDA) or peak
RSS (CPU). Over ``--repeats`` processes: the median, with the range. Prints a
markdown table per configuration and writes OUT/virtual.json (--out, default
bench/results/local): per system, ``runs`` holds each process's figures (one entry
per process run) and each figure's summary over them, ``{"median", "min", "max",
"runs"}``.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import resource
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import add_out, markdown_table, progress, save_results  # noqa: E402
from isp_comm.testing import run_virtual  # noqa: E402
from models.llama import LlamaConfig  # noqa: E402


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
    """One job: the model, the world and its nodes, the sequence and the layout."""

    world: int
    target: str
    """The link model's target (``h100x8``: 8 per node); nodes = world / per node."""
    model: LlamaConfig
    seq: int
    batch_per_rank: int = 1
    ckpt: float = 1.0
    shard_outer: bool = True
    vocab_parallel: bool = False
    bf16: bool = True


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
}
QUICK = {  # on CPU: fp32, the nominal cpu target's links (5 GB/s in a node of N), under 5 minutes
    "tiny-n4": Config(world=4, target="cpux4", model=_llama(512, 128, 384, 4, 4, 2, 64), seq=64, bf16=False),
    "tiny-n8": Config(
        world=8, target="cpux8", model=_llama(512, 128, 384, 4, 4, 2, 64), seq=64, bf16=False, vocab_parallel=True
    ),
}
SYSTEMS = ("isp-comm", "fsdp2", "compute-only")


class NoLink:
    """Every collective takes no time (the compute-only bound)."""

    def seconds(self, op: str, ranks: tuple[int, ...], nbytes: int) -> float:
        return 0.0

    def describe(self) -> str:
        return "no communication time"


def _profile(cfg: Config):
    from isp_comm.planner import profile as profiles
    from isp_comm.planner.targets import parse_target

    per_node = parse_target(cfg.target).per_node
    return profiles.from_target(parse_target(cfg.target, max(cfg.world // per_node, 1)))


def _device() -> torch.device:
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def _isp(cfg: Config, system: str, device: torch.device):
    """The model wrapped by isp-comm on the virtual backend; (model, loss_fn, comm, clip)."""
    from isp_comm import ISPCommunicator, ParallelGroups
    from isp_comm.planner.links import ProfileLink
    from isp_comm.virtual import virtual_backend
    from models.llama import build

    with torch.device("meta"):
        model = build(cfg.model)  # each module made real on the device while it is sharded
    icfg = _isp_config(cfg)
    link = NoLink() if system == "compute-only" else ProfileLink(_profile(cfg), "torch")
    backend = virtual_backend(device, link)
    comm = ISPCommunicator(model, ParallelGroups.create(wp_size=cfg.world), icfg, backend=backend)
    return model, comm.cross_entropy, comm, lambda: comm.clip_grad_norm_(1.0)


def _isp_config(cfg: Config):
    from isp_comm import ISPConfig

    return ISPConfig(
        activation_checkpointing=cfg.ckpt,
        shard_outer_params=cfg.shard_outer,
        vocab_parallel=cfg.vocab_parallel,
        param_dtype=torch.bfloat16 if cfg.bf16 else None,
        reduce_dtype=torch.float32 if cfg.bf16 else None,
        init_seed=0,
    )


def _fsdp2(cfg: Config, device: torch.device):
    """FSDP2 on every block and the root, its collectives on the virtual backend."""
    import torch.nn.functional as F
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from isp_comm.integrations.fsdp2 import BackendAllGather, BackendReduceScatter
    from isp_comm.planner.links import ProfileLink
    from isp_comm.virtual import virtual_backend
    from models.llama import build

    with torch.device("meta"):
        model = build(cfg.model)
    n_ckpt = round(cfg.ckpt * len(model.layers))
    for i in range(n_ckpt):
        model.layers[i] = checkpoint_wrapper(model.layers[i])
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if cfg.bf16 else None
    kw = {"mp_policy": mp} if mp is not None else {}
    for block in model.layers:
        fully_shard(block, **kw)
    fully_shard(model, **kw)
    model.to_empty(device=device)
    with torch.no_grad():
        for p in model.parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            local.normal_(0.0, 0.02) if local.dim() > 1 else local.fill_(1.0)
    backend = virtual_backend(device, ProfileLink(_profile(cfg), "torch"))
    ag, rs = BackendAllGather(backend, 300.0), BackendReduceScatter(backend, 300.0)
    for m in [*model.layers, model]:
        m.set_custom_all_gather(ag)
        m.set_custom_reduce_scatter(rs)

    def loss_fn(logits, labels):
        return F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten())

    def clip():
        return torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)

    return model, loss_fn, backend, clip


def _peak(device: torch.device) -> dict:
    if device.type == "cuda":
        return {
            "peak_alloc_mib": torch.cuda.max_memory_allocated(device) / 2**20,
            "peak_reserved_mib": torch.cuda.max_memory_reserved(device) / 2**20,
        }
    return {"peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_system(rank: int, world: int, cfg: Config, system: str, steps: int) -> dict:
    """One process: build, two warm-up steps, ``steps`` timed ones (runs in a virtual world)."""
    device = _device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if system == "fsdp2":
        model, loss_fn, comm, clip = _fsdp2(cfg, device)
        stats = None
    else:
        model, loss_fn, comm, clip = _isp(cfg, system, device)
        stats = comm.stats
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, foreach=True)
    gen = torch.Generator().manual_seed(rank)
    times, exposed, issued = [], [], []
    for step in range(steps + 2):
        tokens = torch.randint(0, cfg.model.vocab_size, (cfg.batch_per_rank, cfg.seq + 1), generator=gen).to(device)
        _sync(device)
        s0 = stats() if stats else None
        m0 = comm.modelled_comm_s if not stats else 0.0
        t0 = time.perf_counter()
        loss = loss_fn(model(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        clip()
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync(device)
        dt = time.perf_counter() - t0
        if step >= 2:
            times.append(dt)
            if stats:
                s1 = stats()
                exposed.append(s1["exposed_comm_s"] - s0["exposed_comm_s"])
                issued.append(s1["comm_s"] - s0["comm_s"])
            else:
                issued.append(comm.modelled_comm_s - m0)
        if not math.isfinite(float(loss.detach())):
            raise RuntimeError(f"{system}: loss {float(loss)} at step {step}")
    out = {
        "step_s": statistics.median(times),
        "comm_s": statistics.median(issued),
        "exposed_comm_s": statistics.median(exposed) if exposed else None,
        **_peak(device),
    }
    comm.close()
    return out


def predict(cfg: Config) -> dict:
    """The planner's step and memory for the same layout, on the same links."""
    from isp_comm.memory_forecast import forecast
    from isp_comm.planner.memory import device_memory
    from isp_comm.planner.step import step_time
    from models.llama import build

    prof = _profile(cfg)
    with torch.device("meta"):
        model = build(cfg.model)
    icfg = _isp_config(cfg)
    batch = cfg.batch_per_rank * cfg.world
    st = step_time(model, icfg, prof, world=cfg.world, wp=cfg.world, sp=1, batch=batch, seq=cfg.seq)
    out = {"step_s": st.step_s, "comm_s": sum(st.comm_s.values()), "exposed_comm_s": sum(st.exposed_comm.values())}
    if prof.device == "cuda":
        fc = forecast(model, icfg, cfg.world, cfg.world, 1, batch, cfg.seq, device="cuda", local_world=1)
        dm = device_memory(fc, prof, world=cfg.world, wp=cfg.world, sp=1, baseline=0, capacity=prof.memory_bytes)
        out["peak_alloc_mib"] = max(dm.forecast.peak(ph) for ph in ("wrap", "forward", "backward", "optimizer")) / 2**20
        out["peak_reserved_mib"] = dm.reserved / 2**20
    return out


def _flops_per_token(cfg: Config) -> float:
    from isp_comm.model_flops import flops_per_token
    from models.llama import build

    with torch.device("meta"):
        return flops_per_token(build(cfg.model), cfg.seq)


def _summary(runs: list[dict], key: str) -> dict | None:
    """``key`` over the runs that have it: the median, the range and how many runs
    (a dict, so that one run's figure does not read as several runs')."""
    vals = [r[key] for r in runs if r.get(key) is not None]
    if not vals:
        return None
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals), "runs": len(vals)}


def bench_config(name: str, cfg: Config, repeats: int, steps: int, timeout_s: float) -> dict:
    """Every system, ``repeats`` processes each, and the planner's prediction."""
    result = {"config": name, **dataclasses.asdict(cfg), "systems": {}}
    for system in SYSTEMS:
        runs = []
        for r in range(repeats):
            progress(f"bench/virtual.py: {name} {system} run {r + 1}/{repeats}")
            runs.append(run_virtual(run_system, cfg.world, 0, cfg, system, steps, timeout_s=timeout_s))
        result["systems"][system] = {"runs": runs, **{k: _summary(runs, k) for k in runs[0]}}
    fsdp = result["systems"]["fsdp2"]  # no waits to count: each run's step less the compute-only median
    compute = result["systems"]["compute-only"]["step_s"]["median"]
    for run in fsdp["runs"]:
        run["exposed_comm_s"] = max(run["step_s"] - compute, 0.0)
    fsdp["exposed_comm_s"] = _summary(fsdp["runs"], "exposed_comm_s")
    fsdp["exposed_comm_derived"] = "step_s less compute-only's median step_s"
    result["systems"]["planner"] = predict(cfg)
    result["flops_per_token"] = _flops_per_token(cfg)
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
    tokens = result["batch_per_rank"] * result["seq"]
    rows = []
    for system in (*SYSTEMS, "planner"):
        s = result["systems"][system]
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny configurations on CPU (under 5 minutes)")
    ap.add_argument("--config", choices=[*CONFIGS, *QUICK], action="append", help="only these (repeatable)")
    ap.add_argument("--repeats", type=int, default=0, help="processes per system (default: 3; 1 with --quick)")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per process, after two warm-up steps")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds a process may take")
    add_out(ap)
    args = ap.parse_args()
    table_of = QUICK if args.quick else CONFIGS
    names = args.config or list(table_of)
    repeats = args.repeats or (1 if args.quick else 3)
    if not args.quick and not torch.cuda.is_available():
        ap.error("the GPU configurations need CUDA: run with --quick on CPU")
    from isp_comm.train.metrics import peak_tflops

    peak = peak_tflops(_device())
    results = []
    for name in names:
        cfg = {**CONFIGS, **QUICK}[name]
        res = bench_config(name, cfg, repeats, args.steps, args.timeout)
        results.append(res)
        print(f"\n### {name}: world {cfg.world} ({cfg.target} links), seq {cfg.seq}, batch {cfg.batch_per_rank}/rank\n")
        print(table(res, peak))
    path = save_results("virtual", args, results)
    print(f"\nraw JSON: {path}")


if __name__ == "__main__":
    main()
