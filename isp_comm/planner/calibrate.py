"""Measuring this machine into a :class:`~isp_comm.planner.profile.Profile`.

One thread per rank, as isp-train runs on CPU. What is measured, and how:

* GEMM throughput by size (``torch.mm`` of LLM-like shapes in the three layouts a
  linear's forward and backward use, fp32 and bf16) and fused
  attention (``scaled_dot_product_attention``, causal, forward and backward), each
  the whole call's time (its dispatch included: on CPU the host runs the kernel);
* element-wise bandwidth by size (an add, a multiply, a SiLU and a row sum, whole
  calls, their bytes read and written over their summed time), and the host's cost
  per dispatched operator (an add of one element), which the model charges to the
  operators that move no bytes (views);
* AdamW: two layouts (many small tensors, few large ones) give its cost per tensor
  and its streaming rate;
* each CPU backend's collectives (``symm``: shared memory; ``torch``: gloo) at 2
  ranks over four sizes, fitted to latency + bytes / bandwidth;
* the framework: a tiny reference llama (width 64, 1 and 4 blocks) trained by
  isp-train itself for a few steps at each world; what its step takes beyond the
  model of its operators and collectives is the host cost per block (the slope over
  blocks) and per step (the rest), and what its peak RSS holds beyond the memory
  forecast is the runtime's memory. These are calibration runs of a model too small
  to compute anything: none of the validation grid's configurations is used.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from isp_comm.planner.profile import COLLECTIVES, Link, Profile
from isp_comm.planner.targets import TARGETS

TINY = ["--hidden", "64", "--heads", "4", "--kv-heads", "2", "--seq", "32", "--no-trace", "--log-every", "1000"]
"""The calibration model: the reference llama at width 64, sequences of 32 tokens."""


def _time(fn: Callable[[], object], min_s: float = 0.03, repeats: int = 3) -> float:
    """Median seconds of one call (each sample: as many calls as fill ``min_s``)."""
    fn()
    t0, k = time.perf_counter(), 0
    while time.perf_counter() - t0 < min_s / 3:
        fn()
        k += 1
    per = (time.perf_counter() - t0) / max(k, 1)
    calls = max(1, int(min_s / max(per, 1e-9)))
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - t0) / calls)
    return statistics.median(samples)


def _dispatch_s() -> float:
    a, b = torch.ones(1), torch.ones(1)
    return _time(lambda: torch.add(a, b), min_s=0.05)


def _gemm(dtype: torch.dtype, op_s: float) -> list[list[float]]:
    curve = []
    for m, k, n in [(16, 32, 32), (32, 64, 64), (64, 64, 192), (128, 128, 128), (256, 128, 352), (256, 256, 256),
                    (512, 256, 704), (512, 512, 512), (1024, 512, 1376), (1024, 1024, 1024)]:  # fmt: skip
        # the three layouts a linear's forward and backward use: x W^T, dy W, dy^T x
        a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
        bt, at = torch.randn(n, k, dtype=dtype).t(), torch.randn(k, m, dtype=dtype).t()
        flops = 2.0 * m * k * n
        s = statistics.fmean(_time(lambda x=x, y=y: torch.mm(x, y)) for x, y in ((a, b), (a, bt), (at, b)))
        curve.append([flops, flops / s])
    return _monotone(curve)


def _attention(dtype: torch.dtype, op_s: float) -> tuple[list[list[float]], list[list[float]]]:
    fwd, bwd = [], []
    for s_len, d in [(32, 16), (64, 32), (128, 32), (256, 32), (512, 64), (1024, 64)]:
        q, k, v = (torch.randn(1, 4, s_len, d, dtype=dtype, requires_grad=True) for _ in range(3))
        flops = 4.0 * 4 * s_len * s_len * d * 0.5

        def forward(q=q, k=k, v=v):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

        t_f = _time(forward)

        def both(q=q, k=k, v=v):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            torch.autograd.grad(out.sum(), (q, k, v))

        t_b = max(_time(both) - t_f - 4 * op_s, 0.1 * t_f)  # less the forward and the sum and grad calls
        fwd.append([flops, flops / t_f])
        bwd.append([2.5 * flops, 2.5 * flops / t_b])
    return _monotone(fwd), _monotone(bwd)


def _elementwise(op_s: float) -> list[list[float]]:
    curve = []
    for k in range(10, 27, 2):  # 1 KiB .. 64 MiB per operand
        n = (1 << k) // 4
        a, b = torch.randn(n // 64, 64), torch.randn(n // 64, 64)
        # four kinds, each with the bytes the model counts (inputs and output): binary,
        # unary, an activation, and a reduction over the last dimension
        kinds = [
            (lambda a=a, b=b: torch.add(a, b), 3 * n * 4),
            (lambda a=a: torch.mul(a, 2.0), 2 * n * 4),
            (lambda a=a: F.silu(a), 2 * n * 4),
            (lambda a=a: a.sum(-1), n * 4 + n // 16),
        ]
        seconds = sum(_time(fn) for fn, _ in kinds)
        nbytes = sum(b for _, b in kinds)
        curve.append([nbytes / len(kinds), nbytes / seconds])
    return curve


def _optimizer() -> tuple[float, float]:
    """AdamW's (seconds per tensor, bytes per second), from many small and few large tensors."""

    def run(n_tensors: int, numel: int) -> float:
        ps = [torch.nn.Parameter(torch.randn(numel)) for _ in range(n_tensors)]
        for p in ps:
            p.grad = torch.randn(numel)
        opt = torch.optim.AdamW(ps, lr=1e-3)
        return _time(opt.step, min_s=0.1)

    small_n, small_e, large_n, large_e = 128, 16, 4, 1 << 20
    t_small, t_large = run(small_n, small_e), run(large_n, large_e)
    per_tensor = t_small / small_n
    stream = max(t_large - large_n * per_tensor, 1e-9)
    return per_tensor, 28.0 * large_n * large_e / stream


def _monotone(curve: list[list[float]]) -> list[list[float]]:
    """Sorted by size (the step model interpolates between neighbours)."""
    return sorted(curve)


def _calls(backend, group, full: torch.Tensor, part: torch.Tensor) -> dict[str, Callable[[], None]]:
    spare = full.clone()
    return {
        "all_gather": lambda: backend.all_gather(full, part, group).wait(60),
        "reduce_scatter": lambda: backend.reduce_scatter(part, full, group).wait(60),
        "all_to_all": lambda: backend.all_to_all(full, spare, group).wait(60),
        "all_reduce": lambda: backend.all_reduce(full, group).wait(60),
    }


def _collectives_rank(rank: int, world: int, sizes: Sequence[int]) -> dict:
    """On each of 2 ranks: seconds of each collective of each backend at each size."""
    import torch.distributed as dist

    from isp_comm.backends import make_backend

    torch.set_num_threads(1)
    out: dict = {}
    for name in ("symm", "torch"):
        backend = make_backend(name, torch.device("cpu"), 60.0)
        group = dist.group.WORLD
        try:
            for nbytes in sizes:
                n = nbytes // 4
                full = backend.empty(n, torch.float32, torch.device("cpu"), group)
                part = backend.empty(n // world, torch.float32, torch.device("cpu"), group)
                calls = _calls(backend, group, full, part)
                for op, call in calls.items():
                    dist.barrier()
                    reps = max(3, min(50, (1 << 22) // nbytes))
                    samples = []
                    for _ in range(3):
                        dist.barrier()
                        t0 = time.perf_counter()
                        for _ in range(reps):
                            call()
                        samples.append((time.perf_counter() - t0) / reps)
                    out.setdefault(name, {}).setdefault(op, []).append([nbytes, statistics.median(samples)])
        finally:
            backend.close()
    return out


def _fit(points: list[list[float]], op: str, world: int) -> Link:
    """Least squares of t = latency x steps + traffic / bandwidth (the step model's form)."""
    steps = 2 * (world - 1) if op == "all_reduce" else world - 1
    share = 2 * (world - 1) / world if op == "all_reduce" else (world - 1) / world
    xs = [share * b for b, _ in points]
    ys = [t for _, t in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    slope = max(slope, 1e-12)
    alpha = max(my - slope * mx, 0.0)
    return Link(latency_s=alpha / steps, bytes_per_s=1.0 / slope, curve=[[1.0, 1.0]])


def measure_collectives(sizes: Sequence[int] = (1 << 14, 1 << 18, 1 << 22, 1 << 24)) -> dict:
    """Both CPU backends at 2 ranks, fitted per collective."""
    from isp_comm.testing import run_ranks

    raw = run_ranks(_collectives_rank, 2, list(sizes), timeout_s=120.0)
    merged = {b: {op: [[s, max(a, c)] for (s, a), (_, c) in zip(raw[0][b][op], raw[1][b][op])] for op in COLLECTIVES}
              for b in raw[0]}  # fmt: skip
    return {b: {"intra": {op: _fit(pts, op, 2) for op, pts in ops.items()}} for b, ops in merged.items()}


def _train(world: int, layers: int, steps: int, out: str) -> dict:
    """A tiny isp-train run; the median step_s after the first two steps and the peak RSS."""
    cmd = [sys.executable, "-m", "isp_comm.train", *TINY, "--layers", str(layers), "--steps", str(steps)]
    cmd += ["--out", out, "--overwrite", "--batch", str(2 * world), "--device", "cpu", "--no-bf16"]
    if world > 1:
        cmd += ["--nproc-per-node", str(world)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    if res.returncode:
        raise RuntimeError(f"calibration run failed: {res.stderr[-1500:]}")
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return {"step_s": statistics.median(r["step_s"] for r in rows[2:]), "peak_rss_mib": rows[-1]["peak_rss_mib"]}


def _plan(world: int, layers: int, profile_path: str) -> dict:
    """``isp-train --plan`` of the same tiny run, on a profile without host costs: the
    modelled step and the memory forecast (a fresh process: its baseline is a run's)."""
    cmd = [sys.executable, "-m", "isp_comm.train", "--plan", *TINY, "--layers", str(layers), "--profile", profile_path]
    cmd += ["--batch", str(2 * world), "--device", "cpu", "--no-bf16", "--nproc-per-node", str(world)]
    res = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=120)
    if res.returncode:
        raise RuntimeError(f"calibration plan failed: {res.stderr[-1500:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


SMALL = (1, 4)
"""Blocks of the calibration model's two runs (the per-block cost is the slope)."""


def tiny_runs(worlds: Sequence[int], steps: int = 8) -> dict[int, list[dict]]:
    """The calibration model trained by isp-train at each world, with 1 and 4 blocks.
    Run first, while this process is small: a child's peak RSS (``ru_maxrss``) starts
    from its parent's at the fork."""
    with tempfile.TemporaryDirectory() as tmp:
        return {w: [_train(w, n, steps, os.path.join(tmp, f"run{w}-{n}")) for n in SMALL] for w in worlds}


def framework(prof: Profile, runs: dict[int, list[dict]]) -> Profile:
    """The engine's and the loop's host cost, and the runtime's memory, from the tiny
    runs (see the module note) against the model of the same runs on ``prof``."""
    host_block, host_step, runtime, raw = {}, {}, {}, {}
    small = SMALL
    with tempfile.TemporaryDirectory() as tmp:
        for world, measured in runs.items():
            key = "multi" if world > 1 else "single"
            bare = dataclasses.replace(prof, per_node=world)
            path = os.path.join(tmp, f"bare{world}.json")
            bare.save(path)
            planned = [_plan(world, layers, path) for layers in small]
            residual = [m["step_s"] - p["step_s"] for m, p in zip(measured, planned)]
            per_block = max((residual[1] - residual[0]) / (small[1] - small[0]), 0.0)
            host_block[key] = per_block
            host_step[key] = max(residual[0] - per_block * small[0], 0.0)
            peak = max(v for k, v in planned[1].items() if k in ("forward", "backward", "optimizer"))
            runtime[key] = int(max(measured[1]["peak_rss_mib"] - peak, 0.0) * 2**20)
            raw[key] = {"layers": list(small), "measured": measured, "planned": planned}
    return dataclasses.replace(
        prof, host_block_s=host_block, host_step_s=host_step, runtime_bytes=runtime, calibration=raw
    )


def calibrate(worlds: Sequence[int] = (1, 2), progress: Callable[[str], None] = lambda _m: None) -> Profile:
    """This machine's profile: micro-benchmarks in this process (one thread), the
    collectives at 2 ranks when ``worlds`` holds one above 1, and the framework's
    cost at each of ``worlds``."""
    progress(f"framework: tiny isp-train runs at world {', '.join(map(str, worlds))}")
    runs = tiny_runs(worlds)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        op_s = _dispatch_s()
        progress(f"dispatch {op_s * 1e6:.1f} us per operator; GEMMs and attention")
        gemm = {"fp32": _gemm(torch.float32, op_s), "bf16": _gemm(torch.bfloat16, op_s)}
        attention: dict[str, list[list[float]]] = {}
        for name, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            attention[name], attention[name + "_bwd"] = _attention(dt, op_s)
        elementwise = _elementwise(op_s)
        per_tensor, stream = _optimizer()
    finally:
        torch.set_num_threads(threads)
    cpu = TARGETS["cpu"]
    nominal = Link(latency_s=cpu.latency_intra_s, bytes_per_s=cpu.nvlink_bytes_per_s)
    collectives = {b: {"intra": dict.fromkeys(COLLECTIVES, nominal)} for b in ("symm", "torch")}
    if max(worlds) > 1:
        progress("collectives at 2 ranks (symm, torch)")
        collectives = measure_collectives()
    with open("/proc/meminfo") as f:
        avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    when = datetime.date.today().isoformat()
    prof = Profile(
        name="this machine",
        source=f"calibrated {when}: {os.cpu_count()} cores, torch {torch.__version__}, "
        f"{torch.backends.cpu.get_cpu_capability()}",
        device="cpu",
        per_node=1,
        nodes=1,
        memory_bytes=avail,
        peak_flops={"fp32": max(r for _, r in gemm["fp32"]), "bf16": max(r for _, r in gemm["bf16"])},
        gemm=gemm,
        attention=attention,
        elementwise=elementwise,
        op_host_s=op_s,
        op_device_s=0.0,
        optimizer_bytes_per_s=stream,
        optimizer_tensor_s=per_tensor,
        collectives=collectives,
        default_backend="symm",
        overlap=False,
    )
    progress("framework: the model of the same runs")
    return framework(prof, runs)
