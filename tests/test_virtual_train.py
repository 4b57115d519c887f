"""isp-train --virtual-world: one rank of an N-rank job in one process. Its
metrics, its refusals, and the CPU acceptance of issue 48: its memory against a real
2-rank run's, its memory at N=8 against N=2, and its step against the modelled time."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

import pytest

from tests.test_train import SMALL, _one_line_error, torchrun

# Blocks large enough that the sharded state (16 bytes a parameter: fp32 weights,
# gradients, AdamW's two moments) is a visible share of a rank's RSS: 4 blocks of
# 6.3M parameters (hidden 768, ffn 2048, kv dim 256), 403 MB of state in all.
BIG = ["--layers", "4", "--hidden", "768", "--heads", "12", "--kv-heads", "4", "--seq", "32", "--no-trace"]
BIG_BLOCK_PARAMS = 4 * (2 * 768 * 768 + 2 * 768 * 256 + 3 * 768 * 2048)


def virtual(*args: str, timeout: float = 200) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "isp_comm.train", "--device", "cpu", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def rows(out: str) -> list[dict]:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def peak_mib(out: str) -> float:
    return max(r["peak_rss_mib"] for r in rows(out))


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "args, text",
    [
        (["--save-every", "2"], "--save-every with --virtual-world: a virtual run holds one rank's shards"),
        (["--resume"], "--resume with --virtual-world: a virtual run saves no checkpoint, so there is none"),
        (["--async-save"], "--async-save with --virtual-world: a virtual run holds one rank's shards"),
        # each refused flag has its own reason: --plan and --nproc-per-node once gave the checkpoints' one
        (["--init-from", __file__], "--init-from with --virtual-world: a virtual run measures a rank's memory"),
        (["--nproc-per-node", "2"], "--nproc-per-node with --virtual-world: a virtual run is one process"),
        (["--plan", "--virtual-gbps", "100"], "--plan forecasts a job without running it"),
        # a link model given with a value no link has once asked for a link model
        (["--virtual-gbps", "-1"], "--virtual-gbps must be > 0 (the bus bandwidth in GB/s), got -1.0"),
        (["--virtual-rank", "4"], "the rank in [0, 4)"),
        ([], "--virtual-world needs a link model"),
        (["--virtual-gbps", "1", "--target", "h100x8"], "give one link model"),
        (["--target", "h100x8", "--nodes", "2"], "is 16 ranks; --virtual-world is 4"),
    ],
)
def test_a_virtual_run_refuses_with_one_line(args: list[str], text: str, tmp_path, capsys) -> None:
    """Checked with the flags, before any process group: one line, exit 2."""
    from isp_comm.train.config import parse_config

    with pytest.raises(SystemExit) as exc:
        parse_config(["--virtual-world", "4", *args, "--out", str(tmp_path / "run"), "--device", "cpu"])
    assert exc.value.code == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln]
    assert len(err) == 1 and "isp-train: error:" in err[0] and text in err[0], err


@pytest.mark.timeout(100)
def test_the_refusal_is_one_line_from_the_command(tmp_path) -> None:
    _one_line_error(
        virtual("--virtual-world", "4", "--init-from", __file__, "--out", str(tmp_path / "r")), "--init-from"
    )


@pytest.mark.timeout(100)
def test_a_modelled_collective_past_the_deadline_is_one_line(tmp_path) -> None:
    """A link so slow that one modelled collective outlasts --comm-timeout: its wait
    would time out and the hang diagnosis ask after ranks that do not exist; the run
    says what took too long instead."""
    res = virtual(*SMALL, "--steps", "2", "--virtual-world", "4", "--virtual-gbps", "1e-6", "--comm-timeout", "5",
                  "--out", str(tmp_path / "r"))  # fmt: skip
    _one_line_error(res, "past the 5.0 s deadline (--comm-timeout")


@pytest.mark.timeout(200)
def test_a_virtual_rank_writes_metrics_and_says_it_is_virtual(tmp_path) -> None:
    """Rank 3 of 4 (wp 2, sp 2): the run's files as a normal run's, plus comm_s and
    exposed_comm_s each step; the first line and the closing line say it is virtual
    and what is modelled; no checkpoint; one lane in the trace (no peer's spans)."""
    out = str(tmp_path / "run")
    res = virtual(*SMALL, "--virtual-world", "4", "--virtual-rank", "3", "--wp", "2", "--sp", "2")
    assert res.returncode != 0  # no link model: refused
    res = virtual(*SMALL, "--steps", "4", "--virtual-world", "4", "--virtual-rank", "3", "--wp", "2", "--sp", "2",
                  "--virtual-gbps", "0.5", "--out", out)  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    lines = res.stdout.splitlines()
    assert lines[0].startswith("isp-train: VIRTUAL run: rank 3 of 4") and "0.5 GB/s" in lines[0], lines[0]
    assert "VIRTUAL run done" in lines[-1] and "no checkpoint" in lines[-1], lines[-1]
    got = rows(out)
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    for r in got:
        assert r["comm_s"] > 0 and 0 <= r["exposed_comm_s"] <= r["step_s"] and r["comm_late_s"] >= 0
    assert not os.path.exists(os.path.join(out, "checkpoints"))
    rank0 = str(tmp_path / "rank0")
    res = virtual(*SMALL, "--steps", "1", "--virtual-world", "2", "--virtual-gbps", "1", "--no-trace", "--out", rank0)
    assert res.returncode == 0, res.stderr[-3000:]
    assert not os.path.exists(os.path.join(rank0, "checkpoints"))  # before: an empty folder (rank 0 made it)
    with open(os.path.join(out, "trace.json")) as f:
        pids = {e["pid"] for e in json.load(f)["traceEvents"] if e["ph"] == "X"}
    assert len(pids) == 1


def test_the_closing_line_says_when_this_machine_fell_behind_the_model() -> None:
    """Exposed time beyond the modelled time needs a cause on the line: the CPU's own
    copies ran past the modelled ends (the comm thread's ``late_s``)."""
    from isp_comm.backends.virtual import FlatLink
    from isp_comm.train.config import TrainConfig
    from isp_comm.train.virtual import summary

    cfg = TrainConfig(virtual_world=8, virtual_gbps=1.0)
    last = {"step_s": 0.2, "comm_s": 0.001, "exposed_comm_s": 0.004}
    assert "past the modelled ends" not in summary(cfg, {**last, "comm_late_s": 0.0}, FlatLink(1e9))
    line = summary(cfg, {**last, "comm_late_s": 0.07}, FlatLink(1e9))
    assert "this machine's copies ran 0.070 s past the modelled ends" in line, line


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_virtual_memory_against_real_runs_and_across_worlds(tmp_path) -> None:
    """Peak RSS per rank, 3 steps, 2 sequences a rank. (1) Virtual N=2 within 12% of
    a real 2-rank run over gloo (--backend torch), as issue 48 asks, and of one on CPU
    shared memory (--backend symm: collectives in place, as NCCL's). Gloo's own
    all-gather and reduce-scatter held several times their bytes in temporaries (this
    model's gloo run peaked 953 MiB against the virtual run's 719, +33%); the torch
    backend runs them as broadcasts and reduces on CPU (see [Note: gloo's gather and
    reduce-scatter on CPU]): 766 MiB (757-780, 3 runs; symm 760, virtual 719-729).
    (2) Virtual N=8 lower than N=2 by what is sharded over the N: the state, 16 bytes x
    the block parameters, and the two reduce-scatter outputs kept on CPU, 4 bytes x the
    largest block each, x (1/2 - 1/8) = 162 MiB, within 25% (RSS keeps what the
    allocator does not return: 158-166 MiB in four runs alone, 182 in a CI run beside
    other tests; counting the state alone, 144 MiB, left that run 1.9 MiB outside)."""
    common = [*BIG, "--steps", "3"]
    real = {}
    for backend in ("symm", "torch"):
        out = str(tmp_path / f"real_{backend}")
        res = torchrun(2, *common, "--batch", "4", "--backend", backend, "--device", "cpu", "--out", out, timeout=280)
        assert res.returncode == 0, res.stderr[-3000:]
        real[backend] = peak_mib(out)
    v = {}
    for n in (2, 8):
        out = str(tmp_path / f"virtual_{n}")
        res = virtual(*common, "--batch", str(2 * n), "--virtual-world", str(n), "--virtual-gbps", "5", "--out", out)
        assert res.returncode == 0, res.stderr[-3000:]
        v[n] = peak_mib(out)
    for backend in ("torch", "symm"):
        assert abs(v[2] - real[backend]) <= 0.12 * real[backend], (backend, v, real)
    share = (16 * BIG_BLOCK_PARAMS + 2 * 4 * BIG_BLOCK_PARAMS // 4) * (1 / 2 - 1 / 8) / 2**20
    assert abs((v[2] - v[8]) - share) <= 0.25 * share, (v, share)


@pytest.mark.serial  # two runs timed against each other
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_without_overlap_the_step_grows_by_the_modelled_time(tmp_path) -> None:
    """--no-overlap: every collective is waited for when issued, so a step is its
    compute plus its collectives' modelled time. Dropping the bandwidth from 20 to
    0.001 GB/s grows the median step (steps 2-8) by the modelled time it adds, within
    20% (the host's noise on a tiny model, and the comm thread's wake-up after each
    of a step's ~100 collectives, are milliseconds against ~0.5 s added)."""
    med = {}
    for gbps in ("20", "0.001"):
        out = str(tmp_path / f"g{gbps}")
        res = virtual(*SMALL, "--steps", "8", "--virtual-world", "4", "--no-overlap", "--no-trace",
                      "--virtual-gbps", gbps, "--out", out)  # fmt: skip
        assert res.returncode == 0, res.stderr[-3000:]
        later = rows(out)[1:]
        med[gbps] = (statistics.median(r["step_s"] for r in later), statistics.median(r["comm_s"] for r in later))
    grown, modelled = med["0.001"][0] - med["20"][0], med["0.001"][1] - med["20"][1]
    assert modelled > 0.2, med
    assert abs(grown - modelled) <= 0.2 * modelled, med
