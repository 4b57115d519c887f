"""Measure this machine into a planner profile (isp_comm/planner/calibrate.py says how).

    python bench/calibrate.py [--worlds 1 2] [--profile FILE] [--out DIR]

Writes the profile (default OUT/profile.json) that ``isp-train --plan --profile FILE``
and bench/plan_check.py read, prints what was measured, and keeps the same figures in
OUT/calibrate.json. One thread per rank; run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import add_out, markdown_table, progress, save_results  # noqa: E402
from isp_comm.planner.calibrate import calibrate  # noqa: E402
from isp_comm.planner.profile import describe_noise  # noqa: E402


def summary(prof) -> str:
    """The figures of a profile a reader checks first, as a table."""
    rows = [["host dispatch per operator", f"{prof.op_host_s * 1e6:.2f} us"]]
    for p in ("fp32", "bf16"):
        best = max(r for _, r in prof.gemm[p])
        rows.append([f"GEMM {p}, largest measured rate", f"{best / 1e9:.1f} GFLOP/s"])
    for d in (16, 64):
        rate = prof.attention_rate(False, False, 4.0 * 1024 * 1024 * d * 0.5, d)
        rows.append([f"attention fp32 forward, seq 1024, head dim {d}", f"{rate / 1e9:.1f} GFLOP/s"])
    rows.append(["element-wise, largest size", f"{prof.elementwise[-1][1] / 1e9:.2f} GB/s"])
    rows.append(["AdamW streaming", f"{prof.optimizer_bytes_per_s / 1e9:.2f} GB/s"])
    rows.append(["AdamW per tensor", f"{prof.optimizer_tensor_s * 1e6:.1f} us"])
    for backend, scopes in prof.collectives.items():
        for op, link in scopes["intra"].items():
            fit = f"{link.latency_s * 1e6:.1f} us + {link.bytes_per_s / 1e9:.2f} GB/s"
            rows.append([f"{backend} {op} (2 ranks)", fit])
    for k, v in prof.host_block_s.items():
        rows.append([f"engine host cost per block ({k})", f"{v * 1e3:.3f} ms"])
    for k, v in prof.host_step_s.items():
        rows.append([f"loop host cost per step ({k})", f"{v * 1e3:.3f} ms"])
    for k, v in prof.compute_scale.items():
        rows.append([f"kernels inside a step over alone ({k})", f"{v:.2f} x"])
    for k, v in prof.runtime_bytes.items():
        rows.append([f"runtime memory beyond the forecast ({k})", f"{v / 2**20:.1f} MiB"])
    for k, v in prof.transient_share.items():
        rows.append([f"share of the step's transient tensors beyond the forecast ({k})", f"{100 * v:.1f}%"])
    if prof.noise:
        verdict = "steady" if prof.noise["steady"] else "noisy (isp-train --plan would not cache it)"
        rows.append(["noise: speed probes, steps of a run, the large run repeated", describe_noise(prof.noise)])
        rows.append(["noise: verdict", verdict])
    return markdown_table(["what", "measured"], rows, "lr")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[1, 2], help="ranks of the framework runs")
    ap.add_argument("--profile", default="", help="where to write the profile (default OUT/profile.json)")
    add_out(ap)
    args = ap.parse_args()
    t0 = time.perf_counter()
    prof = calibrate(worlds=tuple(args.worlds), progress=progress)
    seconds = time.perf_counter() - t0
    path = args.profile or os.path.join(args.out, "profile.json")
    prof.save(path)
    print(summary(prof))
    print(f"calibrated in {seconds:.1f} s; profile: {path}")
    print(save_results("calibrate", args, [{"seconds": seconds, "profile": dataclasses.asdict(prof)}]))


if __name__ == "__main__":
    main()
