"""End to end: isp-comm against FSDP2 and single-process training, in one run.

    python bench/e2e.py [--steps 7] [--warmup 2] [--layers 8] [--worlds 2 4]
    python bench/e2e.py --param-types [--worlds 4]

The reference llama (default about 30M parameters: 8 layers, hidden 512, FFN 1408,
16/4 heads, vocab 8192), sequence 256, global batch 4 sequences, AdamW, the same
seed and data for every run. Step time is the median over the steps after warm-up
(slowest rank); exposed communication is the share of the step the training thread
waited on isp-comm's collectives (FSDP2 does not report it). Prints a markdown table
and writes OUT/e2e.json (--out, default bench/results/local). Peak RSS is each process's high-water mark (VmHWM)
since it started training set-up.

``--param-types`` measures what keeping plain tensors as parameters saves over
DTensor parameters (FSDP2's choice), where the parameters are touched as such: the
AdamW step and gradient clipping. After two ISP training steps (everything
sharded), the same shards and gradients are stepped as plain tensors with
``comm.clip_grad_norm_`` and as DTensor views of them with the stock
``torch.nn.utils.clip_grad_norm_``, alternately, and both norms are checked equal.
Writes OUT/e2e_param_types.json (--out, default bench/results/local).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import MIB, add_out, proc_status_bytes, progress, reset_peak_rss, save_results  # noqa: E402
from isp_comm import ISPCommunicator, ISPConfig, ParallelGroups  # noqa: E402
from isp_comm.models.llama import LlamaConfig, build  # noqa: E402
from isp_comm.testing import run_ranks  # noqa: E402

SEQ, BATCH, CORES = 256, 4, os.cpu_count() or 1


def model_config(layers: int) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=8192, hidden=512, ffn_hidden=1408, n_layers=layers, n_heads=16, n_kv_heads=4, max_seq_len=SEQ
    )


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randint(0, 8192, (BATCH, SEQ + 1), generator=g)
    return x[:, :-1], x[:, 1:]


def _train(model, steps: int, rank: int, world: int, comm=None) -> dict:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    times, exposed, losses = [], [], []
    per = BATCH // world
    for step in range(steps):
        x, y = batch(step)
        x, y = x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]
        c0 = comm.stats()["exposed_comm_s"] if comm else 0.0
        if world > 1:
            dist.barrier()
        t0 = time.perf_counter()
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        dt = time.perf_counter() - t0
        avg = loss.detach().clone()
        if world > 1:
            t = torch.tensor([dt])
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            dt = t.item()
            dist.all_reduce(avg)
        times.append(dt)
        exposed.append(((comm.stats()["exposed_comm_s"] - c0) / dt) if comm else float("nan"))
        losses.append(avg.item() / world)
    return {
        "times": times,
        "exposed": exposed,
        "losses": losses,
        "peak_rss_mib": proc_status_bytes("VmHWM") / MIB,
    }


def _worker(rank: int, world: int, kind: str, layers: int, steps: int) -> dict:
    torch.set_num_threads(max(1, CORES // world))
    reset_peak_rss()
    model = build(model_config(layers), seed=0)
    comm = backend = None
    if kind.startswith("fsdp2"):
        from torch.distributed.fsdp import fully_shard

        mods = [*model.layers, model]
        for m in mods:
            fully_shard(m)
        if kind == "fsdp2+symm":
            from isp_comm.integrations.fsdp2 import use_symm_collectives

            backend = use_symm_collectives(mods)
    else:
        backend_name, _, outer = kind.split(":")[1].partition("+")
        cfg = ISPConfig(backend=backend_name, shard_outer_params=outer == "outer")
        comm = ISPCommunicator(model, ParallelGroups.create(wp_size=world), cfg)
    out = _train(model, steps, rank, world, comm)
    if comm is not None:
        comm.close()
    if backend is not None:
        backend.close()
    return out


def _param_types_worker(rank: int, world: int, layers: int, repeats: int) -> dict:
    """Median seconds of (clip + AdamW step) on plain shards and on DTensor views."""
    from torch.distributed.tensor import DTensor, Replicate

    torch.set_num_threads(max(1, CORES // world))
    model = build(model_config(layers), seed=0)
    comm = ISPCommunicator(model, ParallelGroups.create(wp_size=world), ISPConfig(shard_outer_params=True))
    _train(model, 2, rank, world, comm)
    names = dict(model.named_parameters())
    plain = list(names.values())
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in plain]
    for p, g in zip(plain, grads):
        p.grad = g
    state = comm._state  # the DTensor views the checkpoints use
    # as FSDP2 has them: sharded ones Shard on the WP dim, replicated ones Replicate
    rep = lambda t: DTensor.from_local(t, state.mesh, [Replicate(), Replicate()], run_check=False)  # noqa: E731
    as_dt = lambda n, t: state.as_dtensor(n, t) if n in state.sharded else rep(t)  # noqa: E731
    views = [torch.nn.Parameter(as_dt(n, p.detach())) for n, p in names.items()]
    for v, n, g in zip(views, names, grads):
        v.grad = as_dt(n, g)
    opt_plain = torch.optim.AdamW(plain, lr=0.0, foreach=False)
    opt_dt = torch.optim.AdamW(views, lr=0.0, foreach=False)
    t_plain, t_dt, norms = [], [], []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        n_plain = comm.clip_grad_norm_(1e9)
        opt_plain.step()
        t_plain.append(time.perf_counter() - t0)
        dist.barrier()
        t0 = time.perf_counter()
        n_dt = torch.nn.utils.clip_grad_norm_(views, 1e9)
        opt_dt.step()
        t_dt.append(time.perf_counter() - t0)
        norms.append((n_plain.item(), n_dt.full_tensor().item() if isinstance(n_dt, DTensor) else n_dt.item()))
    comm.close()
    assert all(abs(a - b) <= 1e-5 * a for a, b in norms), norms  # the same global norm both ways
    return {"plain_s": statistics.median(t_plain), "dtensor_s": statistics.median(t_dt), "norms": norms}


def param_types(args: argparse.Namespace) -> None:
    rows = []
    for world in args.worlds:
        res = run_ranks(_param_types_worker, world, args.layers, args.repeats, timeout_s=3600, start="spawn")
        plain = max(r["plain_s"] for r in res)
        dt = max(r["dtensor_s"] for r in res)
        rows.append({"world": world, "plain_s": plain, "dtensor_s": dt, "per_rank": res})
        print(f"| {world} | {1000 * plain:.1f} | {1000 * dt:.1f} | {dt / plain:.2f}x |")
    save_results("e2e_param_types", args, rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--param-types", action="store_true", help="only the plain-vs-DTensor parameter measurement")
    ap.add_argument("--repeats", type=int, default=7, help="--param-types: timed repetitions")
    add_out(ap)
    args = ap.parse_args()
    if args.param_types:
        print("| world | clip + AdamW step, plain ms | DTensor ms | ratio |\n|---:|---:|---:|---:|")
        param_types(args)
        return
    torch.set_num_threads(CORES)
    reset_peak_rss()
    rows = [{"run": "single process", "world": 1, **_train(build(model_config(args.layers), seed=0), args.steps, 0, 1)}]
    for world in args.worlds:
        for kind in ("fsdp2", "fsdp2+symm", "isp:torch", "isp:symm", "isp:symm+outer"):
            progress(f"e2e: {kind} at world {world} ...")
            res = run_ranks(_worker, world, kind, args.layers, args.steps, timeout_s=3600, start="spawn")
            rows.append({"run": kind, "world": world, **res[0], "peak_rss_mib": max(r["peak_rss_mib"] for r in res)})
    w = args.warmup
    ref = rows[0]
    ref_t = statistics.median(ref["times"][w:])
    fsdp = {r["world"]: statistics.median(r["times"][w:]) for r in rows if r["run"] == "fsdp2"}
    print(
        f"{args.layers} layers, seq {SEQ}, global batch {BATCH}, AdamW, {args.steps - w} measured steps, "
        f"{CORES} cores\n"
    )
    print(
        "| run | world | step s (median) | vs single | vs FSDP2 same world | peak RSS/rank MiB | exposed comm "
        "| final loss | loss - single |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        t = statistics.median(r["times"][w:])
        r["median_step_s"] = t
        vs_fsdp = f"{t / fsdp[r['world']]:.2f}x" if r["world"] in fsdp else "-"
        exp = statistics.median(r["exposed"][w:])
        exp_s = "-" if exp != exp else f"{100 * exp:.0f}%"
        print(
            f"| {r['run']} | {r['world']} | {t:.3f} | {t / ref_t:.2f}x | {vs_fsdp} | {r['peak_rss_mib']:.0f} | "
            f"{exp_s} | {r['losses'][-1]:.5f} | {r['losses'][-1] - ref['losses'][-1]:+.1e} |"
        )
    save_results("e2e", args, rows)


if __name__ == "__main__":
    main()
