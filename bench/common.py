"""Helpers the benchmarks share: process memory figures, markdown tables, raw JSON."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence

from isp_comm.train.metrics import proc_status_bytes, reset_peak_rss  # noqa: F401 - for the benchmarks

MIB = 2**20
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
LOCAL = os.path.join(RESULTS, "local")
"""Where a run writes its raw JSON unless told (``--out``): untracked, so benchmarking
never changes the repository; the figures the README quotes are copies in RESULTS."""


def add_out(ap) -> None:
    """The ``--out DIR`` every benchmark takes for its raw JSON."""
    ap.add_argument("--out", default=LOCAL, help="folder for the raw JSON (default: bench/results/local, untracked)")


def progress(message: str) -> None:
    """One line on stderr while a long benchmark runs."""
    print(message, file=sys.stderr, flush=True)


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]], align: str | None = None) -> str:
    """A markdown table; ``align`` has one character per column, ``l`` or ``r``."""
    align = align or "r" * len(header)
    rule = ["---" if a == "l" else "---:" for a in align]
    lines = [header, rule, *[[str(c) for c in r] for r in rows]]
    return "\n".join("| " + " | ".join(line) + " |" for line in lines)


def save_results(name: str, args: object, rows: list) -> str:
    """Write ``{"args": ..., "machine": ..., "rows": ...}`` to ``OUT/NAME.json``
    (``args.out``, else bench/results/local); returns the path. ``machine``: cores,
    torch and its CPU capability (the CPU kernels, and so some figures, depend on it);
    with CUDA, the GPU, its memory, and torch's CUDA and NCCL versions."""
    import torch

    folder = getattr(args, "out", None) or LOCAL
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"{name}.json")
    machine = {"cores": os.cpu_count(), "torch": torch.__version__, "cpu": torch.backends.cpu.get_cpu_capability()}
    if torch.cuda.is_available():
        import torch.distributed as dist

        props = torch.cuda.get_device_properties(0)
        nccl = ".".join(map(str, torch.cuda.nccl.version())) if dist.is_nccl_available() else None
        machine.update(gpu=props.name, gpu_mib=props.total_memory // 2**20, cuda=torch.version.cuda, nccl=nccl)
    args = vars(args) if hasattr(args, "__dict__") else args
    with open(path, "w") as f:
        json.dump({"args": {k: _portable(v) for k, v in args.items()}, "machine": machine, "rows": rows}, f, indent=1)
    return path


def _portable(value: object) -> object:
    """An argument as the results keep it: a path inside the checkout relative to it,
    one outside as "(outside the checkout)" (results are committed; machines' paths are not)."""
    if not (isinstance(value, str) and os.path.isabs(value)):
        return value
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    rel = os.path.relpath(value, root)
    return "(outside the checkout)" if rel.startswith("..") else rel


def wrap_world1(kind: str, model, bf16: bool):
    """``model`` as the world-1 run ``kind`` trains it: ``"fsdp2"`` (``fully_shard`` per
    block and root), ``"isp"`` (an ISPCommunicator, returned to close) or anything else
    (left as it is); ``bf16``: bf16 compute, fp32 reduction, as each wrapper spells it."""
    import torch

    if kind == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        kw = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)} if bf16 else {}
        for block in model.layers:
            fully_shard(block, **kw)
        fully_shard(model, **kw)
    elif kind == "isp":
        from isp_comm import ISPCommunicator, ISPConfig, ParallelGroups

        mp = {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32} if bf16 else {}
        return ISPCommunicator(model, ParallelGroups.create(wp_size=1), ISPConfig(**mp))
    return None
