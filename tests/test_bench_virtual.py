"""bench/virtual.py --quick (its smallest configuration, one timed step): isp-comm and
FSDP2 side by side under the same modelled collectives, in processes of their own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.timeout(100)
def test_help_describes_it_in_a_whole_sentence() -> None:
    # argparse was given the docstring's first line, which stopped at "under the same modelled"
    cmd = [sys.executable, os.path.join(ROOT, "bench", "virtual.py"), "--help"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=90, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "under the same modelled collectives, the compute-only bound and the planner's prediction." in " ".join(
        res.stdout.split()
    ), res.stdout


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("config", ["tiny-n4", "tiny-n8-world"])
def test_quick_prints_isp_comm_and_fsdp2_side_by_side(tmp_path, config: str) -> None:
    # tiny-n8-world: independent sharding (weights over WP 2, state over all 8) beside FSDP2
    cmd = [sys.executable, os.path.join(ROOT, "bench", "virtual.py"), "--quick", "--config", config]
    cmd += ["--steps", "1", "--breakdown", "--profile", "--out", str(tmp_path)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=380, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = {ln.split("|")[1].strip(): ln for ln in res.stdout.splitlines() if ln.startswith("| ")}
    assert {"isp-comm", "fsdp2", "compute-only", "planner"} <= set(rows), res.stdout
    # --breakdown: both eager systems' peaks by category, side by side, each adding up
    assert "Memory at each system's peak, by category" in res.stdout and "**tracked peak**" in rows, res.stdout
    assert "measured: each system's compute" in res.stdout and "not calibrated on this machine" in res.stdout
    assert "FSDP2's exposed comm: its step less the compute-only step" in res.stdout
    with open(tmp_path / "virtual.json") as f:
        result = json.load(f)["rows"][0]
    systems = result["systems"]
    assert result["layout"]["state_sharding"] == ("world" if config.endswith("world") else "wp"), result["layout"]
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
    assert "breakdown" not in systems["compute-only"]
    for name in ("isp-comm", "fsdp2"):
        b = systems[name]["breakdown"]
        assert sum(b["parts"].values()) == b["tracked"] > 0 and b["parts"].get("other", 0) <= 0.02 * b["tracked"], b
    # --profile: every system's profiled step by kind, side by side
    assert "One step under torch.profiler, ms by kind" in res.stdout, res.stdout
    for name in ("isp-comm", "fsdp2", "compute-only"):
        prof = systems[name]["profile"]
        assert prof["kinds"]["matrix products"] > 0 and prof["wall_ms"] > 0, prof


def _summaries(system: dict) -> list[dict]:
    """A system's figures summarised over its runs (every key but ``runs``, the breakdown's and the profile's)."""
    return [v for k, v in system.items() if k not in ("runs", "breakdown", "profile") and isinstance(v, dict)]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_quick_best_layout_runs_both_systems_eager_and_compiled(tmp_path) -> None:
    """``--layout best``: --plan --search's fastest layout that fits, isp-comm and FSDP2
    (as torchtitan sets it up), eager and compiled per block, the planner beside them
    (60 s on the 2-core machine, two of them compiling)."""
    cmd = [sys.executable, os.path.join(ROOT, "bench", "virtual.py"), "--quick", "--layout", "best"]
    cmd += ["--config", "tiny-n4", "--steps", "1", "--out", str(tmp_path)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=580, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = {ln.split("|")[1].strip() for ln in res.stdout.splitlines() if ln.startswith("| ")}
    systems = {"isp-comm", "isp-comm compiled", "fsdp2", "fsdp2 compiled", "compute-only", "planner"}
    assert systems <= rows, res.stdout
    assert "the planner's fastest layout that fits in 16 GiB on cpux4" in res.stdout, res.stdout
    assert "FSDP2 (full sharding)" in res.stdout or "FSDP2 (hybrid sharding)" in res.stdout, res.stdout
    with open(tmp_path / "virtual.json") as f:
        result = json.load(f)["rows"][0]
    lay, said = result["layout"], result["search"]
    flags = f"--wp {lay['wp']} --sp {lay['sp']} --batch {lay['batch']} --grad-accum {lay['grad_accum']}"
    assert said["flags"].startswith(flags), (said, lay)  # the layout run is the one the search chose
    got = result["systems"]
    for name in systems - {"planner", "compute-only"}:
        assert got[name]["comm_s"]["median"] > 0 and got[name]["step_s"]["median"] > 0, name
    # torchtitan's units: the embedding (gathered again in backward), 4 blocks (likewise),
    # the final norm with the head (kept gathered into backward), the root (nothing left)
    fsdp = result["fsdp2_layout"]  # FSDP2's own fastest layout: no SP, the outer parameters sharded
    assert fsdp["sp"] == 1 and fsdp["shard_outer"] and fsdp["state_sharding"] == "wp", fsdp
    layers, accum = result["model"]["n_layers"], fsdp["grad_accum"]
    for name in ("fsdp2", "fsdp2 compiled"):
        assert got[name]["all_gathers"]["median"] == (2 * layers + 3) * accum, (name, got[name]["all_gathers"])


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_gpu_runs_of_independent_sharding_plan_their_layouts() -> None:
    """What ``--config llama3-70b-8k --layout best --kind world``, ``--config
    llama3-70b-8k-1nic --layout best`` and ``--scaling`` will run on a GPU, planned here
    on meta (h100x8's published figures): isp-comm's fastest layout with its state over
    the world that fits 80 GB, FSDP2's own fastest (no SP, full or hybrid sharding), the
    same on one NIC a node, and a layout for each of N = 8, 64 and 1,024."""
    import torch

    sys.path.insert(0, ROOT)
    from bench.virtual import CONFIGS, SCALING, best_layout

    cpu = torch.device("cpu")
    lay, said = best_layout(CONFIGS["llama3-70b-8k"], cpu, "world")
    assert lay.state_sharding == "world" and lay.world == 64 and said["capacity_gib"] <= 80.0, said
    fsdp, _ = best_layout(CONFIGS["llama3-70b-8k"], cpu, "fsdp2")
    assert fsdp.sp == 1 and fsdp.state_sharding == "wp" and not fsdp.vocab_parallel, fsdp
    worlds = [best_layout(CONFIGS[name], cpu)[0].world for name in SCALING]
    assert worlds == [8, 64, 1024], worlds
    # one 400 Gb/s NIC a node: the fastest of any kind keeps its gathers inside a node
    # and puts the state over the world, ahead of FSDP2's own fastest
    lay, said = best_layout(CONFIGS["llama3-70b-8k-1nic"], cpu)
    assert (lay.wp, lay.state_sharding) == (8, "world") and "400 Gbit/s a node" in said["target"], said
    _, fsdp_said = best_layout(CONFIGS["llama3-70b-8k-1nic"], cpu, "fsdp2")
    assert said["step_s"] < fsdp_said["step_s"]


def test_fsdp2_is_planned_with_its_own_loss() -> None:
    """torchtitan's loss (``F.cross_entropy`` on an fp32 copy of the logits) at
    Llama-3-8B's shape, one sequence of 8,192 tokens a rank, bf16: 8,192 x 128,256
    logits of 2 + 4 + 4 bytes at the forward's loss (10,020 MiB) and 3 x 4 at its
    backward (12,024 MiB); the forecast's forward and backward take them in place of
    isp-comm's loss, the backward at the larger of its own peak and the loss's."""
    import dataclasses

    sys.path.insert(0, ROOT)
    from bench.virtual import CONFIGS, LOSS, _with_fsdp2_loss, fsdp2_loss_bytes
    from isp_comm.planner.search import Layout

    lay = Layout(8, 8, 1, 0.0, True, False, 8, 1)
    loss = fsdp2_loss_bytes(CONFIGS["llama3-8b"], lay)
    assert loss == {"forward": 10_020 * 2**20, "backward": 12_024 * 2**20}

    @dataclasses.dataclass
    class Forecast:
        phases: dict

    fc = Forecast({"forward": {"acts": 100, LOSS: 3}, "backward": {"acts": 60, "grads": 50, LOSS: 1}, "optimizer": {}})
    got = _with_fsdp2_loss(fc, {"forward": 10, "backward": 12}).phases
    assert got["forward"] == {"acts": 100, LOSS: 10}
    assert got["backward"] == {"acts": 100, LOSS: 12}  # the loss's backward (112) over the blocks' (111)
    fc.phases["backward"]["grads"] = 60
    assert _with_fsdp2_loss(fc, {"forward": 10, "backward": 12}).phases["backward"] == fc.phases["backward"]


def _recorded(monkeypatch):
    """bench/virtual.py with its processes recorded, not run: the module, and the
    (system, run) of each process in order; the n-th process's step takes n seconds."""
    sys.path.insert(0, ROOT)
    import bench.virtual as virtual

    recorded = []

    def record(fn, world, rank, run, system, steps, extras, timeout_s):
        recorded.append((system, run))
        return {"step_s": float(len(recorded)), "comm_s": 0.1, "exposed_comm_s": 0.0, "all_gathers": 1}

    monkeypatch.setattr(virtual, "run_virtual", record)
    monkeypatch.setattr(virtual, "predict", lambda run, device=None, compiled=False: {"step_s": 1.0, "target": "x"})
    return virtual, recorded


def test_isp_comm_runs_in_fsdp2s_layout_when_asked(monkeypatch) -> None:
    """``--systems isp-comm@fsdp2``: isp-comm built as itself (eager, or compiled with
    ``isp-comm compiled@fsdp2``) in FSDP2's fastest layout, so that the two compare in
    one layout; plain ``isp-comm`` keeps its own. Each process is recorded, not run."""
    virtual, recorded = _recorded(monkeypatch)
    systems = ("isp-comm", "isp-comm@fsdp2", "isp-comm compiled@fsdp2", "fsdp2")
    result = virtual.bench_config("tiny-n4", virtual.QUICK["tiny-n4"], 1, 1, 60.0, "best", "any", systems)
    own, fsdp = result["layout"], result["fsdp2_layout"]
    assert own != fsdp  # the tiny config's fastest isp-comm layout uses SP, FSDP2's cannot
    built = {s: (b, lay) for s, (b, lay) in zip(systems, [(c[0], c[1].layout) for c in recorded])}
    assert built["isp-comm"][0] == "isp-comm" and built["isp-comm"][1].sp == own["sp"]
    for name, as_built in (("isp-comm@fsdp2", "isp-comm"), ("isp-comm compiled@fsdp2", "isp-comm compiled")):
        assert built[name][0] == as_built and built[name][1].sp == fsdp["sp"] == 1, built[name]
        assert built[name][1] == built["fsdp2"][1]
    assert "planner compiled" not in result["systems"]  # the planner plans isp-comm's own layout only


def test_best_layout_runs_a_job_once_whatever_its_fixed_layouts() -> None:
    """``--layout best`` replaces a configuration's layout by the planner's, so two
    configurations that differ only in their fixed layouts are one job there:
    ``--quick --layout best`` ran tiny-n8-world as tiny-n8 again (a review's catch)."""
    sys.path.insert(0, ROOT)
    import bench.virtual as virtual

    names, said = virtual.distinct_jobs(list(virtual.QUICK))
    assert names == ["tiny-n4", "tiny-n8"] and said == [
        "bench/virtual.py: tiny-n8-world is tiny-n8's job in another layout: --layout best runs it once"
    ]
    # a system's knob is not a layout: the pooled and unpooled 64th of the 8B stay two runs
    assert virtual.distinct_jobs(list(virtual.SCALED)) == (list(virtual.SCALED), [])
    assert virtual.distinct_jobs(list(virtual.CONFIGS))[0] == list(virtual.CONFIGS)


@pytest.mark.parametrize(
    "name, kind",
    [
        ("at::cuda::(anonymous namespace)::spin_kernel(long)", "virtual spin"),  # torch.cuda._sleep
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_warpgroupsize2x1x1", "matrix products"),
        ("nvjet_tst_192x192_64x4_2x1_v_bz_coopB_TNT", "matrix products"),
        ("void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits>", "attention"),
        # the names as the profiler gives them, template arguments and all: cutlass and
        # wgmma in them are attention's, not a matrix product's
        (
            "void pytorch_flash::flash_fwd_kernel<pytorch_flash::Flash_fwd_kernel_traits<128, 64, 64, 4, 0, 0, "
            "cutlass::bfloat16_t, pytorch_flash::Flash_kernel_traits<128, 64, 64, 4, cutlass::bfloat16_t>>, "
            "0, 1, 0, 0, 1, 1, 0>(pytorch_flash::Flash_fwd_params)",
            "attention",
        ),
        ("fmha_cutlassF_bf16_aligned_64x128_rf_sm80(PyTorchMemEffAttention::AttentionKernel)", "attention"),
        ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x128_4x1x1_kernel0_0", "attention"),
        ("triton_poi_fused__scaled_dot_product_flash_attention_transpose_0", "compiled (triton)"),
        ("void cublasLt::splitKreduce_kernel<32, 16, int, __nv_bfloat16, __nv_bfloat16, float>", "matrix products"),
        ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", "compiled (triton)"),
        ("void at::native::elementwise_kernel<128, 4, direct_copy_kernel_cuda(at::TensorIteratorBase&)>", "copies"),
        ("Memcpy DtoD (Device -> Device)", "copies"),
        ("void at::native::vectorized_elementwise_kernel<4, at::native::silu_kernel>", "other"),
        ("aten::addmm", "matrix products"),
    ],
)
def test_kernels_are_sorted_by_what_their_names_say(name: str, kind: str) -> None:
    """bench/kernel_profile.py: kernel names as torch 2.11's CUDA build and inductor
    give them (a triton kernel that copies is compiled code, not a copy)."""
    sys.path.insert(0, ROOT)
    from bench.kernel_profile import kind_of

    assert kind_of(name) == kind


def test_a_record_functions_span_on_the_gpu_is_not_a_kernel() -> None:
    """A ``record_function``'s span projected on the GPU's timeline (Kineto's
    GPU_USER_ANNOTATION: FSDP2's "FSDP::all_gather_copy_in", a compiled region's) has
    device type CUDA and covers kernels that are rows of their own: it is not counted,
    as torch's own table leaves it out of its device total."""
    sys.path.insert(0, ROOT)
    from torch.autograd import DeviceType

    from bench.kernel_profile import _entries

    def row(key: str, us: float, annotation: bool) -> object:
        return types.SimpleNamespace(
            key=key, count=1, device_type=DeviceType.CUDA, self_device_time_total=us, is_user_annotation=annotation
        )

    prof = types.SimpleNamespace(
        key_averages=lambda: [
            row("FSDP::all_gather_copy_in", 900.0, True),
            row("Memcpy DtoD (Device -> Device)", 5.0, False),
        ]
    )
    assert _entries(prof, cuda=True) == [("Memcpy DtoD (Device -> Device)", 1, 0.005)]


def test_a_profiled_step_is_summed_by_kind() -> None:
    """On CPU the clock is the aten operators' self time: a product and a copy land in
    their kinds, the rest in "other", the top entries by time."""
    sys.path.insert(0, ROOT)
    from bench.kernel_profile import profile_step, profile_table

    a, b = torch.randn(256, 256), torch.empty(256, 256)
    got = profile_step(lambda: (b.copy_(a @ a), b.relu_()), torch.device("cpu"))
    kinds = got["kinds"]
    assert kinds["matrix products"] > 0 and kinds["copies"] > 0 and kinds["other"] > 0, got
    assert kinds["virtual spin"] == kinds["attention"] == 0, got
    ms = [t["ms"] for t in got["top"]]
    assert ms == sorted(ms, reverse=True) and abs(sum(kinds.values()) - sum(ms)) < 1e-6 * max(ms), got
    assert "| matrix products |" in profile_table({"a": got, "b": got})


def test_repeats_run_in_rounds(monkeypatch) -> None:
    """``--repeats 2`` of two systems: a, b, a, b (each system once a round), so that a
    drift of the machine's speed falls on both; each system's runs summarised apart."""
    virtual, recorded = _recorded(monkeypatch)
    result = virtual.bench_config(
        "tiny-n4", virtual.QUICK["tiny-n4"], 2, 1, 60.0, "fixed", "any", ("isp-comm", "fsdp2")
    )
    assert [c[0] for c in recorded] == ["isp-comm", "fsdp2", "isp-comm", "fsdp2"]
    assert [r["step_s"] for r in result["systems"]["isp-comm"]["runs"]] == [1.0, 3.0]
    assert result["systems"]["fsdp2"]["step_s"] == {"median": 3.0, "min": 2.0, "max": 4.0, "runs": 2}


def test_results_name_the_gpu_they_ran_on(tmp_path, monkeypatch) -> None:
    """bench/common.save_results: with CUDA, the machine record names the GPU, its
    memory and torch's CUDA and NCCL (an H100 run's folder lacked them)."""
    import argparse
    import types

    import torch.distributed as dist

    sys.path.insert(0, ROOT)
    from bench.common import save_results

    props = types.SimpleNamespace(name="NVIDIA H100 80GB HBM3", total_memory=81559 * 2**20)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props)
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 28, 9))
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    with open(save_results("x", argparse.Namespace(out=str(tmp_path)), [])) as f:
        machine = json.load(f)["machine"]
    assert machine["gpu"] == "NVIDIA H100 80GB HBM3" and machine["gpu_mib"] == 81559, machine
    assert machine["cuda"] == "13.0" and machine["nccl"] == "2.28.9", machine
