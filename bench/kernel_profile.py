"""Where a step's device time goes, by kind of work: one step under ``torch.profiler``,
its kernels (CUDA) or aten operators (CPU) summed by what they do, so that two
systems' steps compare side by side (``bench/virtual.py --profile``).

On CUDA the clock is each kernel's own time, on every stream: kernels that overlap
(a collective's spin on a side stream beside a matrix product) both count, so the
kinds can add up to more than the step. On CPU it is each aten operator's self CPU
time, on the threads that ran it. The kind of a kernel is read from its name
(:data:`KINDS`, first match); what matches none is "other".
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

KINDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    # torch.cuda._sleep's kernel: the virtual backend's modelled collectives, on side streams
    ("virtual spin", ("spin_kernel",)),
    # inductor's kernels, whatever aten operators they were fused from (their names
    # may carry "_scaled_dot_product_flash_attention" or "mm")
    ("compiled (triton)", ("triton",)),
    # before the products: PyTorch's flash kernels name cutlass::bfloat16_t in their
    # template arguments, memory-efficient attention is fmha_cutlass*, cuDNN's is
    # cudnn_generated_fort_native_sdpa_sm90_flash_*_wgmma_*
    ("attention", ("flash", "fmha", "attention", "sdpa")),
    (
        "matrix products",
        ("gemm", "gemv", "cublas", "cutlass", "xmma", "nvjet", "wgmma", "aten::mm", "aten::addmm", "aten::bmm"),
    ),
    ("copies", ("copy", "memcpy", "memset", "aten::cat")),
)
"""Each kind and the name fragments (lower case) that mark its kernels or operators,
in the order they are tried."""
OTHER = "other"
TOP = 15
"""Entries kept by time, beside the kinds."""


def kind_of(name: str) -> str:
    """The kind (:data:`KINDS`) of a kernel or operator named ``name``."""
    low = name.lower()
    return next((kind for kind, marks in KINDS if any(m in low for m in marks)), OTHER)


def _entries(prof, cuda: bool) -> list[tuple[str, int, float]]:
    """(name, calls, ms) of the kernels (CUDA) or aten operators (CPU) the profile saw."""
    from torch.autograd import DeviceType

    rows = []
    for e in prof.key_averages():
        if getattr(e, "is_user_annotation", False):
            # a record_function's span on the GPU's timeline (FSDP2's "FSDP::...", a compiled
            # region's): device type CUDA, but its kernels are rows of their own
            continue
        if cuda and e.device_type == DeviceType.CUDA:  # a kernel, a copy or a memset: its own time
            us = e.self_device_time_total
        elif not cuda and e.key.startswith("aten::"):
            us = e.self_cpu_time_total
        else:
            continue
        if us > 0:
            rows.append((e.key, e.count, us / 1e3))
    return rows


def profile_step(step: Callable[[], object], device: torch.device) -> dict:
    """``step()`` once under ``torch.profiler`` (it should end synchronised): its wall
    time, its device time by kind (ms) and the :data:`TOP` entries by time."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize(device)
        wall_ms = (time.perf_counter() - t0) * 1e3
    rows = _entries(prof, cuda)
    kinds = dict.fromkeys([*(k for k, _ in KINDS), OTHER], 0.0)
    for name, _, ms in rows:
        kinds[kind_of(name)] += ms
    top = sorted(rows, key=lambda r: -r[2])[:TOP]
    return {
        "clock": "CUDA kernels' own time" if cuda else "aten operators' self CPU time",
        "wall_ms": wall_ms,
        "kinds": kinds,
        "top": [{"name": n[:160], "calls": c, "ms": ms, "kind": kind_of(n)} for n, c, ms in top],
    }


def profile_table(named: dict[str, dict]) -> str:
    """The profiles (:func:`profile_step`) of several systems, ms by kind, side by side."""
    from bench.common import markdown_table

    kinds = [*(k for k, _ in KINDS), OTHER]
    rows = [[k, *(f"{p['kinds'].get(k, 0.0):,.1f}" for p in named.values())] for k in kinds]
    busy = [sum(ms for k, ms in p["kinds"].items() if k != kinds[0]) for p in named.values()]
    rows.append(["all but the spins", *(f"{ms:,.1f}" for ms in busy)])
    rows.append(["the profiled step's wall time", *(f"{p['wall_ms']:,.1f}" for p in named.values())])
    clock = {p["clock"] for p in named.values()}
    return (
        f"One step under torch.profiler, ms by kind ({', '.join(sorted(clock))}; a run's step after its timed ones):"
        "\n\n" + markdown_table(["", *named], rows, "l" + "r" * len(named))
    )
