"""What a step costs: MFU against the device's peak (FLOPs per token from
``isp_comm/model_flops.py``), and peak memory (GPU or RSS)."""

from __future__ import annotations

import resource
import sys

import torch

PEAK_BF16_TFLOPS = {  # dense bf16 tensor-core peaks from the vendors' data sheets
    "H200": 989.4,
    "H100 SXM": 989.4,
    "H100 80GB HBM3": 989.4,
    "H100 NVL": 835.0,
    "H100 PCIe": 756.0,
    "H100": 989.4,
    "A100": 312.0,
    "L40S": 362.1,
    "A10G": 70.0,
    "L4": 121.0,
}


def peak_tflops(device: torch.device, override: float = 0.0) -> float:
    """Peak bf16 TFLOP/s of ``device``: ``override`` when set, else the table's entry
    for the GPU's name (the longest match), else 0 (unknown: no MFU)."""
    if override > 0:
        return override
    if device.type != "cuda":
        return 0.0
    name = torch.cuda.get_device_name(device)
    hits = [k for k in PEAK_BF16_TFLOPS if k in name]
    return PEAK_BF16_TFLOPS[max(hits, key=len)] if hits else 0.0


def proc_status_bytes(field: str) -> int:
    """A ``/proc/self/status`` memory field (``VmRSS``, ``VmHWM``, ``RssFile``, ...) in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def peak_rss_bytes() -> int:
    """This process's peak resident memory: ``VmHWM``, the high-water mark of its own
    address space. Not ``ru_maxrss``: Linux carries that over ``fork`` and ``execve``,
    so a process started by a larger one (a notebook, a test runner, a driver script)
    would report its parent's size until it outgrew it. Where there is no ``/proc``,
    ``ru_maxrss`` (bytes on macOS, KiB elsewhere)."""
    try:
        return proc_status_bytes("VmHWM")
    except (OSError, KeyError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)


def reset_peak_rss() -> None:
    """Reset this process's VmHWM to its current RSS."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


class StepMeter:
    """Per-step MFU and peak memory for the metrics and the progress bar."""

    def __init__(self, device: torch.device, peak_override: float = 0.0) -> None:
        self.device = device
        self.peak = peak_tflops(device, peak_override) * 1e12
        self.cuda = device.type == "cuda"

    def read(self, flops_per_s: float) -> dict[str, float]:
        """MFU (when the peak is known) and peak memory since the start, in MiB:
        allocated and reserved on a GPU, the process's peak RSS on CPU."""
        out: dict[str, float] = {}
        if self.peak:
            out["mfu_pct"] = 100.0 * flops_per_s / self.peak
        if self.cuda:
            out["peak_alloc_mib"] = torch.cuda.max_memory_allocated(self.device) / 2**20
            out["peak_reserved_mib"] = torch.cuda.max_memory_reserved(self.device) / 2**20
        else:
            out["peak_rss_mib"] = peak_rss_bytes() / 2**20
        return out

    def postfix(self, last: dict) -> dict[str, str]:
        out = {"mfu": f"{last['mfu_pct']:.1f}%"} if "mfu_pct" in last else {}
        if self.cuda:
            out["mem"] = f"{last['peak_alloc_mib']:.0f}/{last['peak_reserved_mib']:.0f}MiB"
        else:
            out["rss"] = f"{last['peak_rss_mib']:.0f}MiB"
        return out

    def line(self, last: dict) -> str:
        """The memory (and MFU) part of a plain log line."""
        return "  ".join(f"{k} {v}" for k, v in self.postfix(last).items())

    def summary(self, last: dict) -> str:
        mfu = f"MFU {last['mfu_pct']:.1f}%, " if "mfu_pct" in last else ""
        if self.cuda:
            alloc, reserved = last["peak_alloc_mib"], last["peak_reserved_mib"]
            return f"{mfu}peak GPU memory {alloc:.0f} MiB allocated, {reserved:.0f} reserved"
        return f"{mfu}peak RSS {last['peak_rss_mib']:.0f} MiB/rank"
