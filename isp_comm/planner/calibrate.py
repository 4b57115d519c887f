"""Measuring this machine into a :class:`~isp_comm.planner.profile.Profile`.

One thread per rank, as isp-train runs on CPU. What is measured, and how:

* GEMM throughput by size (``torch.mm`` of LLM-like shapes in the three layouts a
  linear's forward and backward use, fp32 and bf16) and fused attention
  (``scaled_dot_product_attention``, causal, forward and backward, by one head's
  FLOPs at head dims 16 to 128: on one thread the heads run in turn, and a narrow
  head runs slower per FLOP), each the whole call's time (its dispatch included: on
  CPU the host runs the kernel), its operands cycled through 64 MiB of copies
  (``POOL_BYTES``: not hot in cache);
* element-wise bandwidth by size (an add, a multiply, a SiLU and a row sum, whole
  calls, their bytes read and written over their summed time), and the host's cost
  per dispatched operator (an add of one element), which the model charges to the
  operators that move no bytes (views);
* AdamW: two layouts (many small tensors, few large ones) give its cost per tensor
  and its streaming rate;
* each CPU backend's collectives (``symm``: shared memory; ``torch``: gloo) at 2
  ranks over four sizes, fitted to latency + bytes / bandwidth;
* the framework: a small reference llama (width 64) trained by isp-train itself for
  20 to 30 steps at each world, three times (:data:`RUNS`): 1 and 4 blocks at 64 tokens
  per rank, and 4 blocks at 2,048. Each measured step is ``scale x kernels +
  the rest + blocks x per-block cost + per-step cost`` (the model's kernels, GEMMs,
  attention, element-wise and the engine's copies, and the rest, views' dispatch,
  communication and optimizer, of the same run): three runs give the three unknowns, the host cost per
  block and per step, and how much slower the kernels run inside a step than
  alone (caches, allocation, autograd; the microbenchmarks time them alone). What
  the two 4-block runs' peak RSS holds beyond the memory forecast is a constant (the
  runtime's memory) plus a share of the step's transient tensors (what the allocator
  keeps): two runs, two unknowns. None of the validation grid's configurations is
  used.
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

from isp_comm.memory_forecast import PHASES
from isp_comm.planner.memory import transient
from isp_comm.planner.profile import (
    CALIBRATION_ATTEMPTS,
    COLLECTIVES,
    Link,
    Profile,
    describe_noise,
    launcher_free_env,
)
from isp_comm.planner.step import COMPUTE_KINDS, KERNELS
from isp_comm.planner.targets import TARGETS
from isp_comm.processes import die_with_parent_if_asked, usable_cores

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


POOL_BYTES = 64 * 2**20
"""Operands are cycled through copies filling this much memory, 16 times a 4 MiB L2: in
a step, an operator reads tensors that many others were written after (measured hot,
in cache, element-wise operators ran three times faster than in a real step)."""


def _clone(t: object) -> object:
    if not isinstance(t, torch.Tensor):
        return t
    return t.detach().clone().requires_grad_(t.requires_grad)


def _cold(make: Callable[[], tuple], fn: Callable[..., object]) -> Callable[[], object]:
    """``fn`` over copies of ``make()``'s operands, a different copy each call."""
    first = make()
    nbytes = sum(t.numel() * t.element_size() for t in first if isinstance(t, torch.Tensor))
    n_copies = min(max(POOL_BYTES // max(nbytes, 1), 1), 4096)
    # clones (a copy, strides kept), not new random draws: where the bytes live is what
    # matters, and 64 MiB of randn took 80 ms against a copy's 25 ms, for each of ~120 calls
    copies = [first] + [tuple(_clone(t) for t in first) for _ in range(n_copies - 1)]
    state = [0]

    def call() -> object:
        state[0] = (state[0] + 1) % len(copies)
        return fn(*copies[state[0]])

    return call


PROBE_GEMM = 192
"""The speed probe's GEMM size: 64 products of 192 x 192 in fp32 take a few ms on one
thread of the project's CPU, over operands out of L2 (see :func:`probe`)."""


def probe() -> float:
    """Seconds of a fixed piece of work on one thread (GEMMs and element-wise operators
    over 48 MiB): the machine's speed now. The best of five, so a single preemption
    does not count; the calibration takes one between each of its stages, and a
    machine whose probes disagree was not measured at one speed (see
    [Note: a calibration's noise])."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        g = torch.Generator().manual_seed(0)
        mats = [torch.randn(PROBE_GEMM, PROBE_GEMM, generator=g) for _ in range(64)]
        big = torch.randn(4 * 2**20, generator=g)

        def work() -> None:
            for a, b in zip(mats, mats[1:]):
                torch.mm(a, b)
            torch.add(big, big).mul_(0.5)

        work()
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            work()
            best = min(best, time.perf_counter() - t0)
        return best
    finally:
        torch.set_num_threads(threads)


def _dispatch_s() -> float:
    a, b = torch.ones(1), torch.ones(1)
    return _time(lambda: torch.add(a, b), min_s=0.05)


GEMM_SIZES = [(16, 32, 32), (32, 64, 64), (64, 64, 192), (128, 128, 128), (256, 128, 352), (256, 256, 256),
              (512, 256, 704), (512, 512, 512), (1024, 512, 1376), (1024, 1024, 1024)]  # fmt: skip
"""(m, k, n) of the GEMMs timed; a quick calibration times every third."""


def _gemm(dtype: torch.dtype, op_s: float, quick: bool = False) -> list[list[float]]:
    curve = []
    for m, k, n in GEMM_SIZES[::3] if quick else GEMM_SIZES:
        # the three layouts a linear's forward and backward use: x W^T, dy W, dy^T x
        layouts = [
            lambda m=m, k=k, n=n: (torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)),
            lambda m=m, k=k, n=n: (torch.randn(m, k, dtype=dtype), torch.randn(n, k, dtype=dtype).t()),
            lambda m=m, k=k, n=n: (torch.randn(k, m, dtype=dtype).t(), torch.randn(k, n, dtype=dtype)),
        ]
        flops = 2.0 * m * k * n
        s = statistics.fmean(_time(_cold(make, torch.mm)) for make in layouts)
        curve.append([flops, flops / s])
    return _monotone(curve)


ATTENTION_HEAD_DIMS = {"fp32": (16, 32, 64, 128), "bf16": (64,)}
"""Head dims at which fused attention is measured, per precision (bf16 on CPU: one;
its rate at other dims is taken as at 64), each at sequence lengths 32 to 1,024."""


def _attention(name: str, dtype: torch.dtype, op_s: float, quick: bool = False) -> dict[str, list[list[float]]]:
    """Forward and backward FLOP/s by one head's FLOPs at each head dim (4 heads a call:
    on one thread the heads run one after another, the rate is the same for 32); a
    quick calibration: head dim 64 alone, three sequence lengths."""
    curves: dict[str, list[list[float]]] = {}
    for d in (64,) if quick else ATTENTION_HEAD_DIMS[name]:
        fwd, bwd = [], []
        for s_len in (32, 256, 1024) if quick else (32, 64, 128, 256, 512, 1024):

            def make(s_len=s_len, d=d):
                return tuple(torch.randn(1, 4, s_len, d, dtype=dtype, requires_grad=True) for _ in range(3))

            flops = 4.0 * s_len * s_len * d * 0.5  # one head's, causal

            def forward(q, k, v):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)

            t_f = _time(_cold(make, forward)) / 4

            def both(q, k, v):
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
                torch.autograd.grad(out.sum(), (q, k, v))

            # less the forward, the sum and grad calls
            t_b = max(_time(_cold(make, both)) / 4 - t_f - op_s, 0.1 * t_f)
            fwd.append([flops, flops / t_f])
            bwd.append([2.5 * flops, 2.5 * flops / t_b])
        curves[f"{name}@{d}"], curves[f"{name}_bwd@{d}"] = fwd, bwd
    return curves


def _elementwise(op_s: float, quick: bool = False) -> list[list[float]]:
    curve = []
    for k in range(10, 27, 4 if quick else 2):  # 1 KiB .. 64 MiB per operand
        n = (1 << k) // 4

        def make(n=n):
            return torch.randn(n // 64, 64), torch.randn(n // 64, 64)

        # four kinds, each with the bytes the model counts (inputs and output): binary,
        # unary, an activation, and a reduction over the last dimension
        kinds = [
            (lambda a, b: torch.add(a, b), 3 * n * 4),
            (lambda a, _b: torch.mul(a, 2.0), 2 * n * 4),
            (lambda a, _b: F.silu(a), 2 * n * 4),
            (lambda a, _b: a.sum(-1), n * 4 + n // 16),
        ]
        seconds = sum(_time(_cold(make, fn)) for fn, _ in kinds)
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

    raw = run_ranks(_collectives_rank, 2, list(sizes), timeout_s=120.0, start="spawn")
    merged = {b: {op: [[s, max(a, c)] for (s, a), (_, c) in zip(raw[0][b][op], raw[1][b][op])] for op in COLLECTIVES}
              for b in raw[0]}  # fmt: skip
    return {b: {"intra": {op: _fit(pts, op, 2) for op, pts in ops.items()}} for b, ops in merged.items()}


RUNS = ((1, 32, 2), (4, 32, 2), (4, 256, 8))
"""The calibration model's runs: (blocks, seq, sequences per rank). Two with almost no
compute (the per-block cost is their slope) and one with 2,048 tokens per rank (how
much slower the operators run inside a step than alone)."""

RUN_STEPS = (30, 30, 20)
"""Steps of each of :data:`RUNS` (the median after two warm-up steps is its figure).
The two cheap runs' steps take 5-20 ms: at two ranks on two cores, the median of 6
of them moved by up to 14% from that of 38 in the same process, and their slope is
the per-block cost; 28 more steps cost under a second. The large run's steps take
110-160 ms, and a run now and then has a slow stretch of 4 to 7 steps (10-50% over
the rest) after its warm-up: over 8 steps that stretch was the median (a run up to 30%
slow), over 18 it is not."""


def _flags(world: int, layers: int, seq: int, per_rank: int) -> list[str]:
    shape = ["--layers", str(layers), "--seq", str(seq), "--batch", str(per_rank * world)]
    return [*TINY, *shape, "--device", "cpu", "--no-bf16"]


def measure_run(flags: list[str], world: int, steps: int, out: str, timeout: float = 300) -> dict:
    """isp-train with ``flags`` for ``steps`` steps at ``world`` ranks (one thread
    each) into ``out``: the median ``step_s`` after the first two steps (warm-up) and
    rank 0's peak RSS, or on CUDA its peak allocated and reserved memory
    (bench/plan_check.py and bench/plan_gpu.py measure their grids with it too)."""
    cmd = [sys.executable, "-m", "isp_comm.train", *flags, "--steps", str(steps), "--out", out, "--overwrite"]
    cmd += ["--nproc-per-node", str(world)] if world > 1 else []
    env = launcher_free_env(OMP_NUM_THREADS="1")  # see [Note: the calibration's own runs]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    if res.returncode:
        raise RuntimeError(f"isp-train {' '.join(flags)} failed: {res.stderr[-1500:]}")
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    peaks = {k: rows[-1][k] for k in ("peak_rss_mib", "peak_alloc_mib", "peak_reserved_mib") if k in rows[-1]}
    steps = [r["step_s"] for r in rows[2:]]
    return {"step_s": statistics.median(steps), "step_spread": spread(steps), **peaks}


def spread(samples: Sequence[float]) -> float:
    """How much ``samples`` disagree: their interquartile range over their median (0
    for fewer than four). Robust to one slow step; a slow stretch of a quarter of them
    or more shows."""
    if len(samples) < 4:
        return 0.0
    q1, _, q3 = statistics.quantiles(samples, n=4, method="inclusive")
    return (q3 - q1) / statistics.median(samples)


def _plans(world: int, profile_path: str) -> list[dict]:
    """``isp-train --plan`` of each of :data:`RUNS` on a profile without host costs:
    the memory forecast (a fresh process each: its baseline is a run's) and the
    modelled phases. The plans run side by side: nothing in them is timed."""
    procs, env = [], launcher_free_env(OMP_NUM_THREADS="1")
    for run in RUNS:
        cmd = [sys.executable, "-m", "isp_comm.train", "--plan", *_flags(world, *run), "--profile", profile_path]
        cmd += ["--nproc-per-node", str(world)]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (_out, err) in zip(procs, outs):
        if p.returncode:
            raise RuntimeError(f"calibration plan failed: {err[-1500:]}")
    return [_read_plan(out) for out, _err in outs]


def _read_plan(stdout: str) -> dict:
    """A plan's JSON line, its predicted phases' and kinds of compute's seconds, and
    its transient MiB."""
    lines = stdout.strip().splitlines()
    out = json.loads(lines[-1])
    for head, keys in (("predicted step:", ("forward", "backward", "optimizer")), ("predicted compute", COMPUTE_KINDS)):
        line = next(line for line in lines if line.startswith(head))
        for key in keys:
            out[key + "_s"] = float(line.split(f" {key} ", 1)[1].split(" s", 1)[0])
    out["transient_mib"] = _transient_mib(lines)
    return out


def _transient_mib(lines: list[str]) -> float:
    """The step's transient tensors (:func:`~isp_comm.planner.memory.transient`) of the
    plan's table: its rows are parts, its columns :data:`PHASES`, in MiB."""
    phases: dict[str, dict[str, float]] = {ph: {} for ph in PHASES}
    names: list[str] = []  # the table's columns (``evaluate`` only when the run validates)
    for line in lines:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| part |"):
            names = cells[1:]
        elif line.startswith("| ") and names and len(cells) == len(names) + 1 and not cells[0].startswith(("-", "*")):
            for ph, cell in zip(names, cells[1:]):
                if cell:
                    phases[ph][cells[0]] = float(cell)
    return transient(phases)


QUICK_STEPS = (10, 10, 8)
"""Steps of each of :data:`RUNS` in a quick calibration."""


def tiny_runs(worlds: Sequence[int], quick: bool = False) -> dict[int, list[dict]]:
    """The calibration model trained by isp-train at each world (:data:`RUNS`, for
    :data:`RUN_STEPS`): each run's peak RSS is its own (``VmHWM``,
    :func:`~isp_comm.train.metrics.peak_rss_bytes`), whatever this process holds."""
    with tempfile.TemporaryDirectory() as tmp:
        out: dict[int, list[dict]] = {}
        for w in worlds:
            out[w] = [
                measure_run(_flags(w, *r), w, steps, os.path.join(tmp, f"{w}-{i}"))
                for i, (r, steps) in enumerate(zip(RUNS, QUICK_STEPS if quick else RUN_STEPS))
            ]
        return out


def large_again(worlds: Sequence[int]) -> dict[int, dict]:
    """The large framework run (the last of :data:`RUNS`) again at each world, at the
    end of a calibration: its step against the first one's says whether the machine
    kept its speed (:func:`noise`); its RSS is not read. A quick calibration leaves it
    out."""
    blocks, seq, per_rank = RUNS[-1]
    steps = RUN_STEPS[-1]
    with tempfile.TemporaryDirectory() as tmp:
        return {w: measure_run(_flags(w, blocks, seq, per_rank), w, steps, os.path.join(tmp, str(w))) for w in worlds}


def _solve(rows: list[list[float]], rhs: list[float]) -> list[float]:
    """The 3 x 3 linear system ``rows @ x = rhs``."""
    return torch.linalg.solve(torch.tensor(rows, dtype=torch.float64), torch.tensor(rhs, dtype=torch.float64)).tolist()


def _beyond_forecast(measured: list[dict], planned: list[dict]) -> tuple[int, float]:
    """What peak RSS holds beyond the forecast, as ``runtime + share x transient``:
    two runs of the same model that differ in tokens give the two unknowns."""
    gaps, transients = [], []
    for m, p in zip(measured, planned):
        gaps.append(m["peak_rss_mib"] - max(p[ph] for ph in ("forward", "backward", "optimizer")))
        transients.append(p["transient_mib"])
    share = max((gaps[1] - gaps[0]) / max(transients[1] - transients[0], 1e-9), 0.0)
    return int(max(gaps[0] - share * transients[0], 0.0) * 2**20), share


def framework(prof: Profile, runs: dict[int, list[dict]]) -> Profile:
    """The engine's and the loop's host cost, the kernels' slowdown inside a step,
    and the runtime's memory, from the calibration runs against the model of the same
    runs on ``prof``: each run's measured step is ``scale x kernels + the rest +
    blocks x per-block cost + per-step cost``; three runs, three unknowns."""
    host_block, host_step, scale, runtime, share, raw = {}, {}, {}, {}, {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for world, measured in runs.items():
            key = "multi" if world > 1 else "single"
            path = os.path.join(tmp, f"bare{world}.json")
            dataclasses.replace(prof, per_node=world).save(path)
            planned = _plans(world, path)
            slowed = [sum(p[k + "_s"] for k in KERNELS) for p in planned]
            rows = [[e, r[0], 1.0] for e, r in zip(slowed, RUNS)]
            rhs = [m["step_s"] - p["optimizer_s"] - (p["forward_s"] + p["backward_s"] - e)
                   for m, p, e in zip(measured, planned, slowed)]  # fmt: skip
            k, per_block, per_step = _solve(rows, rhs)
            scale[key], host_block[key], host_step[key] = max(k, 1.0), max(per_block, 0.0), max(per_step, 0.0)
            runtime[key], share[key] = _beyond_forecast(measured[1:], planned[1:])
            raw[key] = {
                "runs": [list(r) for r in RUNS],
                "measured": measured,
                "planned": planned,
                "solved": [k, per_block, per_step],
            }
    return dataclasses.replace(
        prof,
        host_block_s=host_block,
        host_step_s=host_step,
        compute_scale=scale,
        runtime_bytes=runtime,
        transient_share=share,
        calibration=raw,
    )


NOISE_LIMIT = 0.10
"""The most a calibration's measurements may disagree with themselves and still be
cached: the planner's goal for a step's median error is 10%, which a profile measured
while the machine's speed moved by more cannot meet (see [Note: a calibration's noise])."""


def noise(probes: Sequence[float], runs: dict[int, list[dict]], again: dict[int, dict]) -> dict:
    """How noisy a calibration was, and whether it is steady enough to cache.

    [Note: a calibration's noise]
    A calibration is a minute of timings on a machine that other work may share: taken
    while the machine was busy, one put every later prediction 43-77% long (issue 55).
    Three figures say whether the machine kept one speed while it was measured, each
    against :data:`NOISE_LIMIT`:

    * ``probe_spread``: a fixed piece of work (:func:`probe`) timed between the stages
      (before and after the framework runs, between the micro-benchmarks, after the
      collectives, at the end): the slowest over the fastest, less 1;
    * ``run_spread``: the largest interquartile range over median of the steps of any
      framework run (:func:`spread`): a slow stretch inside a run;
    * ``repeat_spread``: the large framework run, the one that solves how much slower
      kernels run inside a step, run again at the end: how far its two medians lie
      apart over the smaller one (a slow minute during one of them).

    What none of them sees: a machine busy for the whole calibration at one steady
    load, which measures steadily slow."""
    run_spread = max((r["step_spread"] for rs in runs.values() for r in rs), default=0.0)
    repeat = [abs(a["step_s"] - runs[w][-1]["step_s"]) / min(a["step_s"], runs[w][-1]["step_s"])
              for w, a in again.items()]  # fmt: skip
    out = {
        "probe_s": [round(p, 6) for p in probes],
        "probe_spread": max(probes) / min(probes) - 1 if probes else 0.0,
        "run_spread": run_spread,
        "repeat_spread": max(repeat, default=0.0),
        "limit": NOISE_LIMIT,
    }
    out["steady"] = max(out["probe_spread"], out["run_spread"], out["repeat_spread"]) <= NOISE_LIMIT
    return out


def _kernels(quick: bool, progress: Callable[[str], None], probes: list[float]) -> dict:
    """The micro-benchmarks, one thread, a probe after each stage."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        op_s = _dispatch_s()
        progress(f"dispatch {op_s * 1e6:.1f} us per operator; GEMMs and attention")
        gemm = {"fp32": _gemm(torch.float32, op_s, quick), "bf16": _gemm(torch.bfloat16, op_s, quick)}
        probes.append(probe())
        attention = {
            **_attention("fp32", torch.float32, op_s, quick),
            **_attention("bf16", torch.bfloat16, op_s, quick),
        }
        probes.append(probe())
        elementwise = _elementwise(op_s, quick)
        per_tensor, stream = _optimizer()
        probes.append(probe())
    finally:
        torch.set_num_threads(threads)
    return {"op_s": op_s, "gemm": gemm, "attention": attention, "elementwise": elementwise,
            "optimizer": (per_tensor, stream)}  # fmt: skip


def calibrate(
    worlds: Sequence[int] = (1, 2), progress: Callable[[str], None] = lambda _m: None, *, quick: bool = False
) -> Profile:
    """This machine's profile: micro-benchmarks in this process (one thread), the
    collectives at 2 ranks when ``worlds`` holds one above 1, and the framework's
    cost at each of ``worlds``; its ``noise`` says how steady the machine was
    (:func:`noise`). ``quick``: fewer sizes and steps (about half the time), a rougher
    profile: for tests of what uses one, not for planning."""
    probes = [probe()]
    progress(f"framework: tiny isp-train runs at world {', '.join(map(str, worlds))}")
    runs = tiny_runs(worlds, quick)
    probes.append(probe())
    k = _kernels(quick, progress, probes)
    cpu = TARGETS["cpu"]
    nominal = Link(latency_s=cpu.latency_intra_s, bytes_per_s=cpu.nvlink_bytes_per_s)
    collectives = {b: {"intra": dict.fromkeys(COLLECTIVES, nominal)} for b in ("symm", "torch")}
    if max(worlds) > 1:
        progress("collectives at 2 ranks (symm, torch)")
        collectives = measure_collectives((1 << 14, 1 << 22) if quick else (1 << 14, 1 << 18, 1 << 22, 1 << 24))
        probes.append(probe())
    with open("/proc/meminfo") as f:
        avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    when = datetime.date.today().isoformat()
    prof = Profile(
        name="this machine",
        source=f"calibrated {when}: {usable_cores()} cores, torch {torch.__version__}, "
        f"{torch.backends.cpu.get_cpu_capability()}" + (" (quick)" if quick else ""),
        device="cpu",
        per_node=1,
        nodes=1,
        cores=usable_cores(),
        memory_bytes=avail,
        peak_flops={"fp32": max(r for _, r in k["gemm"]["fp32"]), "bf16": max(r for _, r in k["gemm"]["bf16"])},
        gemm=k["gemm"],
        attention=k["attention"],
        elementwise=k["elementwise"],
        op_host_s=k["op_s"],
        op_device_s=0.0,
        optimizer_bytes_per_s=k["optimizer"][1],
        optimizer_tensor_s=k["optimizer"][0],
        collectives=collectives,
        default_backend="symm",
        overlap=False,
    )
    progress("framework: the model of the same runs" + ("" if quick else "; the large run again"))
    prof = framework(prof, runs)
    again = {} if quick else large_again(worlds)
    probes.append(probe())
    return dataclasses.replace(prof, noise=noise(probes, runs, again))


def main() -> None:
    """``python -m isp_comm.planner.calibrate --profile FILE [--worlds 1 2]``: what
    ``isp-train --plan`` runs on first use (bench/calibrate.py also prints a summary)."""
    import argparse

    die_with_parent_if_asked()  # started by a --plan: not past it
    ap = argparse.ArgumentParser(description="measure this machine into a planner profile")
    ap.add_argument("--profile", required=True, help="where to write the profile")
    ap.add_argument("--worlds", type=int, nargs="+", default=[1, 2])
    ap.add_argument(
        "--attempts", type=int, default=CALIBRATION_ATTEMPTS, help="calibrations at most, until one is steady"
    )
    ap.add_argument("--quick", action="store_true", help="fewer sizes and steps: a rough profile (tests)")
    args = ap.parse_args()
    steady_calibration(tuple(args.worlds), args.attempts, args.quick, print).save(args.profile)


def steady_calibration(
    worlds: Sequence[int], attempts: int, quick: bool, progress: Callable[[str], None] = lambda _m: None
) -> Profile:
    """Calibrate until a profile is steady, at most ``attempts`` times; the least noisy
    one (its ``noise`` says whether it is steady, and how many attempts it took)."""
    best: Profile | None = None
    for attempt in range(1, max(attempts, 1) + 1):
        prof = calibrate(worlds, progress, quick=quick)
        prof = dataclasses.replace(prof, noise={**prof.noise, "attempt": attempt})
        if best is None or _worst(prof) < _worst(best):
            best = prof
        if prof.noise["steady"]:
            break
        progress(f"calibration {attempt} was noisy ({describe_noise(prof.noise)})")
    assert best is not None
    return best


def _worst(prof: Profile) -> float:
    return max(prof.noise[k] for k in ("probe_spread", "run_spread", "repeat_spread"))


if __name__ == "__main__":
    main()
