"""The memory forecast: against measured peaks on CPU ranks, on a meta-built 70B, and
through isp-train (--plan, and the warning before a run that will not fit)."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import torch

import isp_comm
from isp_comm import ISPConfig
from isp_comm.loss import CHUNK_BYTES
from isp_comm.memory_forecast import PHASES, forecast
from isp_comm.models.llama import LlamaConfig, build
from isp_comm.train.metrics import proc_status_bytes, reset_peak_rss
from tests.memory_probe import Point, forecast_point, measure

TOLERANCE = 0.10
"""The issue's goal, for every phase of rank 0: the errors measured on these two points
were at most 6% (README "Will it fit?" has the grid)."""


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "pt",
    [
        Point(world=2, wp=2, layers=3, vocab=2048, batch=2, seq=256),
        pytest.param(  # slow tier (12 s): the CI tier keeps the world-2 point
            Point(world=4, wp=2, sp=2, layers=3, vocab=2048, batch=2, seq=256, ckpt=0.5, bf16=True),
            marks=pytest.mark.slow,
        ),
    ],
    ids=["w2", "w4-sp2-ckpt-bf16"],
)
def test_forecast_against_measured_peaks(pt: Point) -> None:
    fc = forecast_point(pt)
    got = measure(pt)[0]["measured"]
    errors = {ph: (fc.peak(ph) - got[ph]) / got[ph] for ph in PHASES}
    assert all(abs(e) <= TOLERANCE for e in errors.values()), errors


@pytest.mark.serial  # timed: under 5 s
def test_forecast_70b_on_meta_is_quick_and_small() -> None:
    """The issue's bound: under 5 s and 200 MB for a meta-built 70B config."""
    cfg = LlamaConfig(vocab_size=128256, hidden=8192, ffn_hidden=28672, n_layers=80, n_heads=64, n_kv_heads=8)
    with torch.device("meta"):
        model = build(cfg)
    reset_peak_rss()
    before = proc_status_bytes("VmRSS")
    t0 = time.perf_counter()
    fc = isp_comm.forecast(model, ISPConfig(param_dtype=torch.bfloat16), 64, 64, 1, 64, 8192, device="cuda")
    seconds = time.perf_counter() - t0
    grown = proc_status_bytes("VmHWM") - before
    assert seconds < 5.0 and grown < 200 * 2**20, (seconds, grown / 2**20)
    # 70.6e9 parameters over 64 ranks: fp32 master shards of the blocks alone are ~3.98 GiB
    assert 3.9 * 2**30 < fc.phases["wrap"]["master shards"] < 4.1 * 2**30
    assert fc.peak("backward") > fc.peak("optimizer")  # the logits of 8192 x 128256 weigh most there
    assert len(fc.activations_by_block) == 80 and len(set(fc.activations_by_block)) == 1


def test_forecast_parts_follow_the_knobs() -> None:
    """Checkpointing keeps only block inputs; shard-outer moves the replicated
    parameters into shards; a larger wp shrinks the master shards."""
    cfg = LlamaConfig(vocab_size=512, hidden=64, ffn_hidden=160, n_layers=4, n_heads=4, n_kv_heads=2)
    with torch.device("meta"):
        model = build(cfg)
    base = forecast(model, None, world=2, wp=2, sp=1, batch=2, seq=64)
    ckpt = forecast(model, ISPConfig(activation_checkpointing=1.0), 2, 2, 1, 2, 64)
    assert all(c < a for c, a in zip(ckpt.activations_by_block, base.activations_by_block))
    assert ckpt.activations_by_block[0] == 2 * 64 * 64 * 4 // 2  # one rank's [1, 64, 64] fp32 input
    outer = forecast(model, ISPConfig(shard_outer_params=True), 2, 2, 1, 2, 64)
    repl = outer.phases["forward"]["replicated params"]
    assert repl == 8 * 64 * 4  # the blocks' norms alone (the final norm is sharded with the head)
    wider = forecast(model, None, 4, None, 1, 4, 64)
    assert wider.phases["forward"]["master shards"] < base.phases["forward"]["master shards"]
    assert set(base.phases) == set(PHASES) - {"evaluate"}  # no validation asked for
    ev = forecast(model, None, 2, 2, 1, 2, 64, evaluate=True).phases["evaluate"]
    assert "gradient shards" not in ev and ev["optimizer state"] == base.phases["optimizer"]["optimizer state"]
    with pytest.raises(ValueError, match="multiple of world / sp"):
        forecast(model, None, 2, 2, 1, 3, 64)


def test_a_recomputed_block_shares_the_input_its_checkpoint_kept() -> None:
    """In fp32 a block's first norm saves the block's input itself, so its
    recomputation holds no second copy of what its checkpoint kept: checkpointing the
    last block too costs nothing at its own moment (the backward never grows with
    more blocks checkpointed). In bf16 the norm saves an fp32 copy instead, and the
    kept input is one hidden state more at that moment."""
    cfg = LlamaConfig(vocab_size=64, hidden=64, ffn_hidden=160, n_layers=4, n_heads=4, n_kv_heads=2)
    with torch.device("meta"):
        model = build(cfg)
    # one rank's [1, 1024, 64] input: long enough that the last block's moment is the peak
    # (its activations kept outweigh the earlier moments' gradient shards of later blocks)
    for dtype in (None, torch.bfloat16):
        configs = [ISPConfig(activation_checkpointing=k / 4, param_dtype=dtype) for k in range(5)]
        back = [forecast(model, c, 2, 2, 1, 2, 1024).peak("backward") for c in configs]
        assert all(b < a for a, b in zip(back[:-2], back[1:-1])), (dtype, back)
        # by at most the input of one rank's [1, 1024, 64] hidden state in bf16
        assert back[4] == back[3] if dtype is None else back[3] < back[4] <= back[3] + 1024 * 64 * 2, back


@pytest.mark.timeout(120)
def test_plan_prints_the_table_and_exits_0() -> None:
    cmd = [sys.executable, "-m", "isp_comm.train", "--plan", "--nproc-per-node", "4", "--layers", "2"]
    cmd += ["--hidden", "64", "--ckpt", "0.5", "--shard-outer"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=100)
    assert res.returncode == 0, res.stderr[-2000:]
    lines = res.stdout.strip().splitlines()
    assert any(line.startswith("| **peak** |") for line in lines)
    peaks = json.loads(lines[-1])
    assert list(peaks) == [
        *(ph for ph in PHASES if ph != "evaluate"),
        "step_s",
        "tokens_per_s",
    ]  # the phases, then the predicted step (issue 37)
    assert all(peaks[ph] > 100 for ph in PHASES if ph in peaks)  # baseline included


def test_warning_names_the_biggest_part(monkeypatch) -> None:
    from isp_comm.train import preflight
    from isp_comm.train.config import parse_config
    from isp_comm.train.model import build_meta_model, isp_config

    cfg = parse_config(["--layers", "2", "--hidden", "64", "--seq", "512", "--batch", "8"])
    model, _ = build_meta_model(cfg, 256, "")
    icfg = isp_config(cfg, bf16=False)
    monkeypatch.setattr(preflight, "free_memory_per_rank", lambda device, local: 2**20)
    (line,), fc = preflight.memory_warnings(cfg, model, icfg, 2, torch.device("cpu"))
    part, _ = fc.biggest(fc.worst())
    assert part in line and "try " in line and fc.worst() in line, line
    monkeypatch.setattr(preflight, "free_memory_per_rank", lambda device, local: 2**40)
    assert preflight.memory_warnings(cfg, model, icfg, 2, torch.device("cpu"))[0] == []


def test_warning_names_only_phases_the_run_goes_through(monkeypatch) -> None:
    # A small model's highest phase is the async save's staging copy; without
    # --async-save the warning once named it anyway ("try a synchronous save (no
    # --async-save)"), and the saves' phases with no save at all
    from isp_comm.train import preflight
    from isp_comm.train.config import parse_config
    from isp_comm.train.model import build_meta_model, isp_config

    monkeypatch.setattr(preflight, "free_memory_per_rank", lambda device, local: 2**20)
    said = {}
    for extra in ([], ["--async-save"], ["--no-final-save"]):
        cfg = parse_config(["--layers", "2", "--hidden", "64", "--seq", "8", "--batch", "2", *extra])
        model, _ = build_meta_model(cfg, 256, "")
        (line,), fc = preflight.memory_warnings(cfg, model, isp_config(cfg, bf16=False), 2, torch.device("cpu"))
        said[" ".join(extra)] = line
    assert fc.worst() == "async_save"
    assert "for the async_save phase" in said["--async-save"]
    assert "for the backward phase" in said[""] and "for the backward phase" in said["--no-final-save"], said


HELD_OUT = 0.05
"""The issue's goal for a run's peak RSS. The forecast's measured constants were read
elsewhere: gloo's and the bf16 kernels' runtime on bench/forecast.py's grid (width 256,
4 layers, vocabulary 4096), the planner's runtime and allocator share on the
calibration model (width 64, vocabulary 256); these shapes are neither. Run to run, the
peak RSS of one shape moved by under 2% (docs/forecast.md), which the 5% leaves room
for."""


@pytest.fixture(scope="module")
def calibrated_profile(tmp_path_factory) -> str:
    """This machine calibrated once for two or more ranks (a minute and a half), into a
    profile file of the test's: a noisy calibration plans too (``--plan`` would not
    cache it, and would measure again for each shape: tests/test_calibration.py)."""
    path = str(tmp_path_factory.mktemp("profiles") / "profile.json")
    cmd = [sys.executable, "-m", "isp_comm.planner.calibrate", "--profile", path, "--worlds", "2", "--attempts", "1"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=500)
    assert res.returncode == 0, res.stderr[-2000:]
    return path


@pytest.mark.xdist_group("calibrated_profile")  # one worker: its module fixture calibrates once
@pytest.mark.slow  # a calibration (a minute and a half) and two runs of about 15 s each
@pytest.mark.timeout(700)
@pytest.mark.parametrize(
    "shape",
    [
        ["--nproc-per-node", "2", "--layers", "3", "--hidden", "320", "--heads", "5", "--kv-heads", "1"]
        + ["--seq", "128", "--batch", "4", "--ckpt", "0.5"],
        ["--nproc-per-node", "4", "--wp", "2", "--layers", "2", "--hidden", "384", "--heads", "6"]
        + ["--kv-heads", "2", "--seq", "64", "--batch", "8"],
    ],
    ids=["w2-ckpt0.5", "w4-wp2"],
)
def test_plan_within_5pct_of_a_validating_runs_peak_rss(shape, calibrated_profile, tmp_path) -> None:
    """--plan's highest phase of a step (evaluation included) against the peak RSS
    isp-train logs, on the default (shared-memory) backend, at shapes held out from
    every fit."""
    flags = [*shape, "--eval-every", "3", "--eval-split", "0.05"]
    base = [sys.executable, "-m", "isp_comm.train", *flags]
    plan = subprocess.run(
        [*base, "--plan", "--profile", calibrated_profile], capture_output=True, text=True, timeout=300
    )
    assert plan.returncode == 0, plan.stderr[-2000:]
    planned = json.loads(plan.stdout.strip().splitlines()[-1])
    assert "evaluate" in planned
    predicted = max(planned[ph] for ph in ("forward", "backward", "optimizer", "evaluate"))  # the save comes after
    out = tmp_path / "run"
    run = subprocess.run(
        [*base, "--steps", "6", "--no-trace", "--out", str(out)], capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-2000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert any("eval_loss" in r for r in rows)  # the validation ran (steps 3 and 6)
    measured = rows[-1]["peak_rss_mib"]
    assert abs(predicted - measured) <= HELD_OUT * measured, (predicted, measured)


def test_cuda_forecast_counts_two_cublas_workspaces_from_the_first_backward(monkeypatch) -> None:
    """[Note: cuBLAS's workspaces]: the forward's thread and autograd's device thread
    each hold one, sized as torch sizes it for the GPU (32 MiB on Hopper and later, 8
    MiB + 128 KiB before, $CUBLAS_WORKSPACE_CONFIG when set); none while wrapping."""
    from isp_comm.memory_forecast.weights import cublas_workspace_bytes

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    cfg = LlamaConfig(vocab_size=512, hidden=64, ffn_hidden=160, n_layers=2, n_heads=4, n_kv_heads=2)
    with torch.device("meta"):
        model = build(cfg)
    hopper = forecast(model, None, 2, 2, 1, 2, 64, device="cuda", cuda_workspace=cublas_workspace_bytes((9, 0)))
    assert "workspace: cuBLAS" not in hopper.phases["wrap"]
    assert all(hopper.phases[ph]["workspace: cuBLAS"] == 64 * 2**20 for ph in hopper.names() if ph != "wrap")
    assert cublas_workspace_bytes((8, 0)) == 8 * 2**20 + 128 * 2**10
    assert "workspace: cuBLAS" not in forecast(model, None, 2, 2, 1, 2, 64).phases["backward"]  # CPU
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8:16:8")
    assert cublas_workspace_bytes((9, 0)) == (4096 * 8 + 16 * 8) * 1024


def test_the_backward_peaks_in_the_loss_with_its_gradient_and_two_fp32_chunks() -> None:
    """[Note: the loss's backward]: with logits of 8192 x 128256 on a rank, the chunked
    loss's backward holds the bf16 logits, their bf16 gradient and two fp32 chunks
    (F.cross_entropy on their fp32 copy held three fp32 logits-sized tensors, 11.7 GiB);
    no gradient of the step exists then."""
    cfg = LlamaConfig(vocab_size=128256, hidden=256, ffn_hidden=512, n_layers=2, n_heads=4, n_kv_heads=2)
    with torch.device("meta"):
        model = build(cfg)
    config = ISPConfig(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    fc = forecast(model, config, 8, 8, 1, 8, 8192, device="cuda", cuda_workspace=0)
    back = fc.phases["backward"]
    assert back["logits and loss"] == 8192 * 128256 * (2 + 2) + 2 * CHUNK_BYTES
    assert "replicated grads" not in back and "gradient shards" not in back


def test_cuda_forecast_counts_the_reduce_scatter_pairs_only_while_the_blocks_reduce() -> None:
    """[Note: reduce-scatter pairs between backwards]: on CUDA (by default) no phase
    but the backward holds the pairs, and there the pairs made by the moment it peaks,
    ``max_inflight_reduce_scatter`` at most. Worked by hand: a block's linear weights
    are q and o (64 x 64), k and v (32 x 64), gate, up and down (160 x 64): 43,008 fp32
    elements gathered, 21,504 a rank after the reduce-scatter over wp 2, so a pair
    (input and output) is 64,512 x 4 = 258,048 bytes."""
    cfg = LlamaConfig(vocab_size=512, hidden=64, ffn_hidden=160, n_layers=4, n_heads=4, n_kv_heads=2)
    with torch.device("meta"):
        model = build(cfg)
    pair = 258_048

    def pairs(config: ISPConfig, device: str = "cuda") -> dict[str, int]:
        fc = forecast(model, config, 2, 2, 1, 2, 64, device=device, cuda_workspace=0)  # type: ignore[arg-type]
        return {ph: fc.phases[ph].get("reduce-scatter buffers", 0) for ph in fc.names()}

    released = pairs(ISPConfig())
    assert released["backward"] in (pair, 2 * pair)  # the last block's moment, or a later one
    assert not any(n for ph, n in released.items() if ph != "backward"), released
    assert pairs(ISPConfig(max_inflight_reduce_scatter=1))["backward"] == pair
    assert pairs(ISPConfig(overlap=False))["backward"] == pair  # each reduce completed as it is issued
    three = ISPConfig(max_inflight_reduce_scatter=3, activation_checkpointing=1.0)
    assert pairs(three)["backward"] in (2 * pair, 3 * pair)
    kept = pairs(ISPConfig(release_reduce_buffers=False))
    assert set(kept.values()) == {2 * pair}, kept  # allocated at wrap, alive in every phase
    on_cpu = pairs(ISPConfig(), device="cpu")  # kept, and not resident before they are written
    assert on_cpu == {**kept, "wrap": 0}, on_cpu
    assert not any(pairs(ISPConfig(backend="nvshmem")).values())  # in NVSHMEM's heap, which the allocator does not see
