"""What the blockwise attention of logit softcapping and sinks saves: forward and
backward of ``blockwise_attention`` against the written-out attention (``_eager``, which
holds the ``[seq, seq]`` scores; SP's path for those models before, and now only with
dropout), on the CPU in fp32, at several sequence lengths.

    python bench/blockwise_attention.py [--seqs 2048 4096 8192] [--repeats 3]

4 heads of 64 (as many KV heads), batch 1, softcap 2 and sinks, one thread (two threads
on the 2-core machine run slower and noisier than one). Each measurement is a fresh
process: after a 256-token warm-up, the time of one forward and backward and the peak
RSS above the RSS before it (VmHWM); once per cell, the largest tensor an operator
made (a dispatch mode). Prints the medians with their range and writes
OUT/blockwise_attention.json (--out, default bench/results/local).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.common import MIB, add_out, markdown_table, proc_status_bytes, progress, save_results  # noqa: E402

IMPLS = ("written-out", "blockwise")


def _inputs(seq: int):
    import torch

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, seq, 64, generator=g).requires_grad_() for _ in range(3))
    return q, k, v, torch.randn(4, generator=g).requires_grad_(), torch.randn(1, 4, seq, 64, generator=g)


def _attend(impl: str, q, k, v, sinks):
    from isp_comm.sequence_parallel.local import _eager, blockwise_attention

    if impl == "written-out":
        return _eager(q, k, v, None, 0.0, 2.0, sinks)
    return blockwise_attention(q, k, v, None, 2.0, sinks)


def _largest(impl: str, seq: int) -> int:
    """Bytes of the largest tensor an operator made in one forward and backward."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Largest(TorchDispatchMode):
        nbytes = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if hasattr(t, "element_size"):
                    Largest.nbytes = max(Largest.nbytes, t.numel() * t.element_size())
            return out

    q, k, v, sinks, dout = _inputs(seq)
    with Largest():
        _attend(impl, q, k, v, sinks).backward(dout)
    return Largest.nbytes


def one(impl: str, seq: int, largest: bool) -> dict:
    """One measurement, in this process."""
    import torch

    torch.set_num_threads(1)
    if largest:
        return {"largest_mib": _largest(impl, seq) / MIB}
    q, k, v, sinks, dout = _inputs(seq)
    warm = [t[:, :, :256].detach().requires_grad_() for t in (q, k, v)]
    _attend(impl, *warm, sinks).sum().backward()
    base = proc_status_bytes("VmRSS")
    t0 = time.perf_counter()
    _attend(impl, q, k, v, sinks).backward(dout)
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "peak_extra_mib": (proc_status_bytes("VmHWM") - base) / MIB}


def _fresh(impl: str, seq: int, largest: bool) -> dict:
    cmd = [sys.executable, __file__, "--one", impl, str(seq)] + (["--largest"] if largest else [])
    res = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT)
    return json.loads(res.stdout.strip().splitlines()[-1])


def _cell(runs: list[dict], key: str, fmt: str) -> str:
    xs = [r[key] for r in runs]
    return f"{statistics.median(xs):{fmt}} ({min(xs):{fmt}}-{max(xs):{fmt}})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqs", type=int, nargs="+", default=[2048, 4096, 8192])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--one", nargs=2, metavar=("IMPL", "SEQ"), help=argparse.SUPPRESS)
    ap.add_argument("--largest", action="store_true", help=argparse.SUPPRESS)
    add_out(ap)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(args.one[0], int(args.one[1]), args.largest)))
        return
    rows, table = [], []
    for seq in args.seqs:
        cells = {}
        for impl in IMPLS:
            progress(f"{impl} at {seq} tokens")
            runs = [_fresh(impl, seq, False) for _ in range(args.repeats)]
            cells[impl] = (runs, _fresh(impl, seq, True)["largest_mib"])
            rows.append({"impl": impl, "seq": seq, "runs": runs, "largest_mib": cells[impl][1]})
        table.append(
            [seq]
            + [_cell(cells[i][0], "seconds", ".2f") for i in IMPLS]
            + [_cell(cells[i][0], "peak_extra_mib", ".0f") for i in IMPLS]
            + [f"{cells[i][1]:.0f}" for i in IMPLS]
        )
    header = ["seq", "written-out s", "blockwise s", "written-out +MiB", "blockwise +MiB"]
    print(markdown_table(header + ["written-out largest MiB", "blockwise largest MiB"], table))
    print(f"median (range) of {args.repeats} fresh processes; raw: {save_results('blockwise_attention', args, rows)}")


if __name__ == "__main__":
    main()
