"""The main job runs under torchrun and its loss falls; bad flags fail with one line."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone"]


@pytest.mark.timeout(150)
def test_isp_train_loss_falls() -> None:
    args = [
        "-m",
        "isp_comm.train",
        "--steps",
        "30",
        "--layers",
        "2",
        "--hidden",
        "32",
        "--batch",
        "4",
        "--seq",
        "32",
        "--lr",
        "1e-2",
    ]
    res = subprocess.run(TORCHRUN + args, capture_output=True, text=True, timeout=140)
    assert res.returncode == 0, res.stderr[-3000:]
    losses = [float(m) for m in re.findall(r"loss (\d+\.\d+)", res.stdout)]
    assert len(losses) >= 3, res.stdout
    assert losses[-1] < losses[0] - 1.0, losses  # from ~ln(256) = 5.5 towards the chain's entropy


@pytest.mark.timeout(60)
def test_isp_train_bad_flag() -> None:
    res = subprocess.run([sys.executable, "-m", "isp_comm.train", "--steps", "0"], capture_output=True, text=True)
    assert res.returncode != 0
    assert "--steps must be >= 1" in res.stderr
    assert "Traceback" not in res.stderr
