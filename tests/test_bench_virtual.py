"""bench/virtual.py --quick (its smallest configuration, one timed step): isp-comm and
FSDP2 side by side under the same modelled collectives, in processes of their own."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_quick_prints_isp_comm_and_fsdp2_side_by_side(tmp_path) -> None:
    cmd = [sys.executable, os.path.join(ROOT, "bench", "virtual.py"), "--quick", "--config", "tiny-n4"]
    cmd += ["--steps", "1", "--out", str(tmp_path)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=380, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = {ln.split("|")[1].strip(): ln for ln in res.stdout.splitlines() if ln.startswith("| ")}
    assert {"isp-comm", "fsdp2", "compute-only", "planner"} <= set(rows), res.stdout
    with open(tmp_path / "virtual.json") as f:
        result = json.load(f)["rows"][0]
    systems = result["systems"]
    for name in ("isp-comm", "fsdp2", "compute-only"):  # --quick runs one process per system: one run listed
        assert len(systems[name]["runs"]) == 1
        assert all(s["runs"] == 1 and s["min"] == s["median"] == s["max"] for s in _summaries(systems[name]))
    for name in ("isp-comm", "fsdp2"):  # the same modelled collectives: both issued time, both finished
        assert systems[name]["comm_s"]["median"] > 0 and systems[name]["step_s"]["median"] > 0
    fsdp2 = systems["fsdp2"]  # its exposed time, derived per run from the compute-only step
    compute = systems["compute-only"]["step_s"]["median"]
    assert fsdp2["runs"][0]["exposed_comm_s"] == max(fsdp2["runs"][0]["step_s"] - compute, 0.0)
    # isp-comm and FSDP2 move the same bytes of weights and gradients: within 2x of each other's
    # modelled time (isp-comm adds its replicated norms' all-reduce, FSDP2 its root's gather)
    ratio = systems["isp-comm"]["comm_s"]["median"] / systems["fsdp2"]["comm_s"]["median"]
    assert 0.5 < ratio < 2.0, ratio
    assert systems["compute-only"]["comm_s"]["median"] == 0


def _summaries(system: dict) -> list[dict]:
    """A system's figures summarised over its runs (every key but ``runs``)."""
    return [v for k, v in system.items() if k != "runs" and isinstance(v, dict)]
