"""The planner (issue 37): step time, device profiles and the layout search, on meta
models and published target figures; and through isp-train --plan on a machine
without CUDA. Timing against measurement is bench/plan_check.py's (never asserted)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch

from isp_comm import ISPConfig
from isp_comm.memory_forecast import PHASES, forecast
from isp_comm.models.llama import LlamaConfig, build
from isp_comm.planner import profile as profiles
from isp_comm.planner import search
from isp_comm.planner.memory import device_memory
from isp_comm.planner.step import collective_time, step_time
from isp_comm.planner.targets import gpu_target, parse_target

BF16 = {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32}


def _meta(**kw):
    with torch.device("meta"):
        return build(LlamaConfig(**kw))


def _evaluators(model, prof, world: int, seq: int):
    memo: dict = {}
    blocks = list(model.layers)

    def cfg(lay: search.Layout) -> ISPConfig:
        return ISPConfig(
            **BF16,
            activation_checkpointing=lay.ckpt,
            shard_outer_params=lay.shard_outer,
            vocab_parallel=lay.vocab_parallel,
            state_sharding=lay.state_sharding,
        )

    def memory(lay: search.Layout):
        fc = forecast(
            model, cfg(lay), world, lay.wp, lay.sp, lay.batch, seq, device=prof.device,
            local_world=prof.per_node, blocks=blocks, memo=memo,
        )  # fmt: skip
        return device_memory(fc, prof, world=world, wp=lay.wp, sp=lay.sp, baseline=0, capacity=prof.memory_bytes)

    def step(lay: search.Layout):
        return step_time(
            model, cfg(lay), prof, world=world, wp=lay.wp, sp=lay.sp, batch=lay.batch, seq=seq,
            grad_accum=lay.grad_accum, memo=memo,
        )  # fmt: skip

    return memory, step


def test_70b_on_1024_gpus_ranks_every_layout() -> None:
    """Build, forecast and time every layout of a 70B on 128 nodes of 8 H100 (sp up to 8):
    the fitting ones first, the fastest plausible. How long the search takes a user is
    bench/search_time.py's (never asserted)."""
    model = _meta(vocab_size=128256, hidden=8192, ffn_hidden=28672, n_layers=80, n_heads=64, n_kv_heads=8)
    prof = profiles.from_target(parse_target("h100x8", nodes=128))
    memory, step = _evaluators(model, prof, 1024, 8192)
    candidates = search.layouts(1024, 1024, 8192, 64, max_sp=8)
    ranked = search.rank(candidates, memory, step, blocks=80)
    best = ranked[0]
    assert best.fits and best.step is not None
    assert 10.0 < best.step.mfu_pct < 70.0  # a plausible figure for bf16 on H100, not a measured one
    assert all(r.fits for r in ranked[: sum(r.fits for r in ranked)])


def test_70b_on_64_gpus_keeps_gathers_in_a_node_with_state_over_the_world() -> None:
    """Llama-3-70B's shape on 8 nodes of 8 H100s, seq 8192, one sequence a rank, bf16,
    the outer parameters sharded and every block checkpointed: with WP 8 (every gather
    on NVLink) the optimizer state over WP (1/8 of the model's masters and moments a
    rank) cannot fit 80 GB; over the world (1/64) it does, near the compute bound. The
    search ranks both settings; its fastest layout with the new sharding fits at 40%
    MFU or more with at most 10% of the step exposed (modelled, from published figures)."""
    model = _meta(vocab_size=128256, hidden=8192, ffn_hidden=28672, n_layers=80, n_heads=64, n_kv_heads=8)
    prof = profiles.from_target(parse_target("h100x8", nodes=8))
    memory, step = _evaluators(model, prof, 64, 8192)
    wp8 = search.Layout(64, 8, 1, 1.0, True, False, 64, 1)
    world = dataclasses.replace(wp8, state_sharding="world")
    assert not memory(wp8).fits and memory(world).fits
    assert memory(wp8).device_total > 2.5 * memory(world).device_total  # masters, moments and gradients: 1/8 -> 1/64
    candidates = search.layouts(64, 64, 8192, 64, max_sp=8, vocab_parallel=False)
    ranked = search.rank(candidates, memory, step, blocks=80)
    best = next(r for r in ranked if r.fits and r.layout.state_sharding == "world")
    assert best.step.mfu_pct >= 40.0, best
    assert sum(best.step.exposed_comm.values()) <= 0.10 * best.step.step_s, best


def test_a_layout_that_cannot_fit_is_ranked_as_not_fitting() -> None:
    model = _meta(vocab_size=32000, hidden=4096, ffn_hidden=11008, n_layers=32, n_heads=32, n_kv_heads=32)
    prof = profiles.from_target(parse_target("h100x8"))
    memory, step = _evaluators(model, prof, 8, 4096)
    candidates = search.layouts(8, 8, 4096, 32)
    ranked = search.rank(candidates, memory, step, blocks=32)
    fits = [r.fits for r in ranked]
    assert any(fits) and not all(fits)
    assert fits == sorted(fits, reverse=True)  # every fitting layout before every other
    assert all(r.layout.ckpt >= 31 / 32 for r in ranked if not r.fits)  # shown at their smallest
    unsharded = [r for r in ranked if r.layout.wp == 1 and r.layout.batch == 8]
    by_state = {r.layout.state_sharding: r for r in unsharded if not r.layout.shard_outer}
    assert not by_state["wp"].fits  # 7B unsharded: 16 bytes a parameter, 112 GB, at any checkpointing
    # its gradients and optimizer state over the 8 ranks (the weights still whole on each): 7B's 16
    # bytes a parameter drop to 2 + 16/8, and the same layout fits
    assert by_state["world"].fits
    steps = [r.step.step_s for r in ranked if r.fits]
    assert steps == sorted(steps)
    table = search.table(ranked, lambda lay: "isp-train " + " ".join(lay.flags()))
    assert table.count("\n1: isp-train") == 1 and "\n5: isp-train" in table


def test_the_least_checkpointing_that_fits_by_bisection() -> None:
    """A stand-in forecast that fits from 37 of 80 blocks checkpointed: the search
    finds 37 in at most 2 + log2(80) forecasts; all-fit and none-fit at the ends; and
    the forecast's one bump, every block checkpointed holding a hidden state more than
    all but the last (see ``least_checkpointing``), does not hide the layouts below."""
    lay = search.Layout(8, 8, 1, 1.0, False, False, 8, 1)
    asked: list[float] = []

    @dataclasses.dataclass
    class DeviceMemory:
        device_total: int
        fits: bool

    def memory(k0: int, bump: bool = False):
        def at(layout: search.Layout):
            asked.append(layout.ckpt)
            k = round(layout.ckpt * 80)
            total = 1000 - k + (2 if bump and k == 80 else 0)  # falls with k, but for the bump
            return DeviceMemory(total, total <= 1000 - k0)

        return at

    best, mem = search.least_checkpointing(lay, memory(37), 80)
    assert (best.ckpt, mem.fits) == (37 / 80, True) and round(best.ckpt * 80) == 37
    assert len(asked) <= 2 + 7 and 36 / 80 in asked  # the block below was forecast and did not fit
    asked.clear()
    assert search.least_checkpointing(lay, memory(0), 80)[0].ckpt == 0.0 and len(asked) == 2
    asked.clear()
    best, mem = search.least_checkpointing(lay, memory(81), 80)
    assert (best.ckpt, mem.fits, asked) == (1.0, False, [1.0, 79 / 80])  # both smallest candidates tried
    asked.clear()
    best, mem = search.least_checkpointing(lay, memory(79, bump=True), 80)  # 80 does not fit, 79 does
    assert (round(best.ckpt * 80), mem.fits) == (79, True)
    best, mem = search.least_checkpointing(lay, memory(80, bump=True), 80)  # neither: the smaller shown
    assert (round(best.ckpt * 80), mem.fits, mem.device_total) == (79, False, 921)


def test_the_search_keeps_no_more_blocks_checkpointed_than_memory_needs() -> None:
    """On the real forecast (a 7B shape on 8 H100s, wp 8): the search's layout fits,
    and the same layout with one block fewer checkpointed does not."""
    model = _meta(vocab_size=32000, hidden=4096, ffn_hidden=11008, n_layers=32, n_heads=32, n_kv_heads=32)
    prof = profiles.from_target(parse_target("h100x8"))
    memory, _ = _evaluators(model, prof, 8, 16384)
    lay = search.Layout(8, 8, 1, 1.0, True, False, 16, 1)
    best, mem = search.least_checkpointing(lay, memory, 32)
    k = round(best.ckpt * 32)
    assert 0 < k < 32, k  # neither end: the case the bisection is for
    assert mem.fits and memory(best).fits
    assert not memory(dataclasses.replace(best, ckpt=(k - 1) / 32)).fits


def test_each_knob_moves_the_right_way() -> None:
    """More checkpointing: slower and smaller. More wp: less memory, more communication."""
    model = _meta(vocab_size=32000, hidden=4096, ffn_hidden=11008, n_layers=8, n_heads=32, n_kv_heads=8)
    prof = profiles.from_target(parse_target("h100x8"))
    memory, step = _evaluators(model, prof, 8, 4096)
    lay = search.Layout(8, 8, 1, 0.0, False, False, 8, 1)
    ckpt = dataclasses.replace(lay, ckpt=1.0)
    assert step(ckpt).step_s > step(lay).step_s
    assert memory(ckpt).peak < memory(lay).peak
    wp2 = dataclasses.replace(lay, wp=2)
    assert memory(lay).peak < memory(wp2).peak
    assert step(lay).comm_s["all_gather"] > step(wp2).comm_s["all_gather"]
    # a larger micro-batch per rank: fewer steps of fixed cost, more activations
    big = dataclasses.replace(lay, batch=16)
    assert step(big).tokens_per_s > step(lay).tokens_per_s and memory(big).peak > memory(lay).peak


def test_targets_and_profiles() -> None:
    c = parse_target("h100x8", nodes=8)
    assert (c.per_node, c.nodes, c.world, c.target.name) == (8, 8, 64, "h100")
    assert parse_target("a100").per_node == 8 and parse_target("cpu").world == 1
    with pytest.raises(ValueError, match="one of h100, h200, a100, b200, cpu"):
        parse_target("tpu")
    prof = profiles.from_target(c)
    assert prof.link("torch", 8, "all_gather").bytes_per_s > prof.link("torch", 16, "all_gather").bytes_per_s
    assert profiles.interp([[1.0, 2.0], [100.0, 4.0]], 10.0) == pytest.approx(3.0)
    # a run is planned with its own GPU's figures (an H200's 141 GB, not an H100's 80)
    assert gpu_target("NVIDIA H200") == "h200" and gpu_target("NVIDIA H100 80GB HBM3") == "h100"
    assert gpu_target("NVIDIA GeForce RTX 4090") == "" and gpu_target("cpu") == ""


def test_attention_is_timed_by_head_and_head_dim() -> None:
    """A calibrated profile's attention: one head's rate at its head dim, between the
    dims measured (log-linear), clamped outside them; targets keep one curve. In a
    step: twice the heads cost twice the time; a narrower head of the same FLOPs
    costs more; and the kinds of compute add up to forward and backward at world 1."""
    prof = profiles.from_target(parse_target("cpu"))
    slow, fast = [[1e3, 10e9], [1e9, 20e9]], [[1e3, 30e9], [1e9, 60e9]]
    half = [[x, r / 2] for x, r in slow]  # the backward's own curve at dim 16
    attention = {"fp32@16": slow, "fp32_bwd@16": half, "fp32@64": fast, "fp32_bwd@64": fast}
    cal = dataclasses.replace(prof, attention=attention)
    assert cal.attention_rate(False, False, 1e9, 16) == pytest.approx(20e9)
    assert cal.attention_rate(False, False, 1e9, 32) == pytest.approx(40e9)  # halfway in log dim
    assert cal.attention_rate(False, True, 1e9, 8) == pytest.approx(10e9)  # below the dims measured, backward's
    assert cal.attention_rate(False, False, 1e9, 128) == pytest.approx(60e9)
    assert prof.attention_rate(True, True, 1e9, 16) == profiles.interp(prof.attention["bf16_bwd"], 1e9)
    forward_only = dataclasses.replace(prof, attention={"fp32@16": slow})
    assert forward_only.attention_rate(False, True, 1e9, 16) == pytest.approx(20e9)  # no backward: the forward's

    def attention_s(heads: int, kv: int, hidden: int) -> float:
        model = _meta(vocab_size=256, hidden=hidden, ffn_hidden=256, n_layers=2, n_heads=heads, n_kv_heads=kv)
        return step_time(model, None, cal, world=1, wp=1, sp=1, batch=2, seq=256).compute_s["attention"]

    assert attention_s(8, 4, 512) == pytest.approx(2 * attention_s(4, 4, 256), rel=1e-6)  # same head, twice the heads
    assert attention_s(8, 4, 256) > 1.4 * attention_s(4, 4, 256)  # same FLOPs in heads of 32, not 64
    model = _meta(vocab_size=256, hidden=128, ffn_hidden=256, n_layers=3, n_heads=4, n_kv_heads=2)
    st = step_time(model, ISPConfig(activation_checkpointing=1.0), cal, world=1, wp=1, sp=1, batch=2, seq=64)
    assert sum(st.compute_s.values()) == pytest.approx(st.phases["forward"] + st.phases["backward"], rel=1e-9)
    assert st.compute_s["copies"] > 0  # wp 1: each gather is a copy into the slot, gradients are packed


def test_the_engines_copies_follow_its_landing() -> None:
    """A 'staging' gather is copied out of the landing buffer; 'per-parameter' (peers
    write the slot) is not: fewer copies, the packing of gradients left."""
    model = _meta(vocab_size=32000, hidden=2048, ffn_hidden=5504, n_layers=4, n_heads=16, n_kv_heads=8)
    prof = profiles.from_target(parse_target("h100x8"))

    def copies(granularity: str) -> float:
        cfg = ISPConfig(**BF16, comm_granularity=granularity)
        return step_time(model, cfg, prof, world=8, wp=8, sp=1, batch=8, seq=2048).compute_s["copies"]

    assert 0 < copies("module") < copies("block")


def test_the_engines_casts_and_copies_follow_the_state_sharding() -> None:
    """[Note: the engine's copies] by hand, every byte at one bandwidth ``bw`` (a copy of
    x bytes moves 2x). Two blocks of 43,008 elements (q, o 64x64; k, v 32x64; gate, up,
    down 160x64), bf16 gathers from fp32 masters, fp32 reduce, world 4, wp 2. State over
    WP: each of a micro-step's two gathers first casts the shard (86,016 B of masters
    read, 43,008 B written: 129,024 B); the reduced shard (86,016 B) is divided and
    written to .grad. Over the world: no cast per gather; the reduced shard is packed
    replica-major (86,016 B copied: 172,032 moved) and the piece (43,008 B) divided and
    written (172,032 moved together, as the shard's 344,064 less that); once a step the
    pieces are cast (64,512 B moved) and the gather unpacked (86,016 B). Per block the
    world's copies are 2 x 129,024 - 64,512 - 86,016 = 107,520 B fewer."""
    model = _meta(vocab_size=512, hidden=64, ffn_hidden=160, n_layers=2, n_heads=4, n_kv_heads=2)
    bw = 1e9
    flat = dataclasses.replace(
        profiles.from_target(parse_target("h100x8")), elementwise=[[1.0, bw], [1e15, bw]], compute_scale={}
    )

    def copies(state: str) -> float:
        cfg = ISPConfig(**BF16, state_sharding=state)
        return step_time(model, cfg, flat, world=4, wp=2, sp=1, batch=4, seq=64).compute_s["copies"]

    assert copies("wp") - copies("world") == pytest.approx(2 * 107_520 / bw, rel=1e-9)


def test_the_vocab_parallel_head_pays_its_collectives() -> None:
    """The vocab-parallel head gathers the WP group's hidden states and reduce-scatters
    their gradient, both on the compute path: the reduce-scatter is charged at its size
    and the forward waits for the gathers (backward saves the whole head's all-reduce,
    so it may wait less); at wp 1 there is nothing to pay."""
    model = _meta(vocab_size=32000, hidden=2048, ffn_hidden=5632, n_layers=2, n_heads=16, n_kv_heads=8)
    prof = profiles.from_target(parse_target("h100x8", nodes=2))

    def st(wp: int, vocab_parallel: bool):
        cfg = ISPConfig(**BF16, vocab_parallel=vocab_parallel)
        return step_time(model, cfg, prof, world=16, wp=wp, sp=1, batch=16, seq=2048)

    plain, vocab = st(8, False), st(8, True)
    hidden_grad = collective_time(prof, prof.default_backend, "reduce_scatter", 8, 8 * 2048 * 2048 * 2)
    assert vocab.comm_s["reduce_scatter"] - plain.comm_s["reduce_scatter"] == pytest.approx(hidden_grad, rel=1e-9)
    assert vocab.comm_s["all_gather"] > plain.comm_s["all_gather"]
    assert vocab.exposed_comm["forward"] > plain.exposed_comm["forward"]
    assert st(1, True).exposed_comm["forward"] == st(1, False).exposed_comm["forward"]


def test_profile_file_round_trip(tmp_path) -> None:
    prof = profiles.from_target(parse_target("h200x4", nodes=2))
    path = str(tmp_path / "h200.json")
    prof.save(path)
    assert profiles.load(path) == prof
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="not a profile file"):
        profiles.load(str(tmp_path / "bad.json"))


def _plan(*flags: str, env: dict | None = None, timeout: float = 100) -> subprocess.CompletedProcess:
    from tests.test_train import isp_train

    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "ISP_COMM_PLAN_CALIBRATE": "0", **(env or {})}
    return isp_train(1, "--plan", *flags, env=env, timeout=timeout)


@pytest.mark.timeout(120)
def test_plan_target_works_without_cuda() -> None:
    """--plan --target h100x8 --nodes 2 --search on a machine that sees no GPU: the table,
    the step, the fastest layouts with their command lines, and the JSON contract."""
    res = _plan(
        "--target", "h100x8", "--nodes", "2", "--layers", "4", "--hidden", "1024", "--heads", "8", "--batch", "32"
    )
    assert res.returncode == 0, res.stderr[-2000:]
    lines = res.stdout.strip().splitlines()
    assert "world 16" in lines[0] and "h100x8, 2 nodes" in lines[0]
    assert any(line.startswith("| workspace: cuBLAS |") for line in lines)
    assert any("NCCL buffers" in line for line in lines)
    out = json.loads(lines[-1])
    assert list(out) == [*(ph for ph in PHASES if ph != "evaluate"), "step_s", "tokens_per_s"]
    assert out["step_s"] > 0 and out["tokens_per_s"] > 0
    res = _plan(
        "--target",
        "h100x8",
        "--nodes",
        "2",
        "--layers",
        "4",
        "--hidden",
        "1024",
        "--heads",
        "8",
        "--batch",
        "32",
        "--search",
    )
    assert res.returncode == 0, res.stderr[-2000:]
    commands = [line for line in res.stdout.splitlines() if line[:3] in ("1: ", "2: ", "3: ", "4: ", "5: ")]
    assert len(commands) == 5
    assert all("isp-train --nproc-per-node 8 --nnodes 2 --rdzv-endpoint HOST:PORT" in c for c in commands)
    assert all("--wp" in c and "--grad-accum" in c for c in commands)


@pytest.mark.timeout(120)
def test_plan_refuses_a_bad_target_in_one_line() -> None:
    res = _plan("--target", "h100x")
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [
        "isp-train: error: --target 'h100x': unknown; one of h100, h200, a100, b200, cpu, optionally xG for G "
        "per node (h100x8)"
    ]
    res = subprocess.run(
        [sys.executable, "-m", "isp_comm.train", "--target", "h100"], capture_output=True, text=True, timeout=100
    )
    assert res.returncode == 2 and "give them with --plan" in res.stderr


@pytest.mark.timeout(120)
def test_a_plan_on_a_network_of_one_nic_a_node_picks_the_state_over_the_world() -> None:
    """--network-gbit 400: 2 nodes of 8 H100s with one 400 Gb/s NIC each, for an
    8B-wide model (4 blocks of width 4096, seq 4096: a third of the peak, so the links
    matter). Full sharding over the 16 gathers across the nodes, WP 8 with the state
    over the world only its replica collectives: on the DGX's eight NICs the first is
    the faster, on one NIC the second, and the search's fastest follows. The plan says
    so in its header, the search's command lines leave the flag out (it describes the
    cluster, not the run), and misplaced it is refused in one line."""
    shape = ["--layers", "4", "--hidden", "4096", "--heads", "32", "--kv-heads", "8", "--seq", "4096"]
    shape += ["--batch", "16", "--bf16", "--target", "h100x8", "--nodes", "2"]
    full, world = ["--wp", "16"], ["--wp", "8", "--state-sharding", "world"]
    steps = {}
    for gbit in ("3200", "400"):
        for name, layout in (("full", full), ("world", world)):
            res = _plan(*shape, "--network-gbit", gbit, *layout)
            assert res.returncode == 0, res.stderr[-2000:]
            steps[gbit, name] = json.loads(res.stdout.strip().splitlines()[-1])["step_s"]
            assert ("400 Gbit/s a node across nodes" in res.stdout.splitlines()[0]) == (gbit == "400")
        res = _plan(*shape, "--network-gbit", gbit, "--search")
        assert res.returncode == 0, res.stderr[-2000:]
        first = next(line for line in res.stdout.splitlines() if line.startswith("1: "))
        assert ("--state-sharding world" in first) == (gbit == "400") and "network" not in first, first
    assert steps["3200", "full"] < steps["3200", "world"] and steps["400", "world"] < steps["400", "full"], steps
    # full sharding loses more to the thinner network: all its gathers cross it
    assert steps["400", "full"] - steps["3200", "full"] > steps["400", "world"] - steps["3200", "world"], steps
    res = _plan("--layers", "2", "--target", "h100x8", "--network-gbit", "400")
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [
        "isp-train: error: --network-gbit is the bandwidth between a --target's nodes: give it with --target and "
        "--nodes 2 or more"
    ]


@pytest.mark.timeout(120)
def test_plan_of_a_target_says_where_its_world_came_from() -> None:
    """A --batch the target's world does not divide names --target and --nodes (it gave
    "world / sp = 16" alone), and a --nproc-per-node the target's count contradicts is
    refused (it was ignored without a word, the plan for the target's 8 a node)."""
    for flags, words in [
        (
            ["--target", "h100", "--nodes", "2", "--batch", "8"],
            "--batch 8 must be divisible by world / sp = 16; it is the whole job's sequences a step: --batch 16 "
            "would do (the world of --target h100 --nodes 2: 8 GPUs a node x 2 nodes)",
        ),
        (
            ["--target", "h100x8", "--nproc-per-node", "4"],
            "--nproc-per-node 4 with --plan --target h100x8: the target sets the ranks a node (8); give --target "
            "h100x4 to plan 4 a node, without --nproc-per-node",
        ),
    ]:
        res = _plan("--layers", "2", *flags)
        lines = res.stderr.strip().splitlines()
        assert res.returncode == 2 and len(lines) == 1 and words in lines[0], res.stderr
    # a refusal the world did not cause is not given the world's origin
    res = _plan("--layers", "2", "--target", "h100x8", "--sp", "8", "--heads", "4", "--hidden", "64")
    assert res.returncode == 2 and "--heads 4 must be divisible" in res.stderr and "the world of" not in res.stderr
    res = _plan("--layers", "2", "--target", "h100x8", "--nproc-per-node", "8")  # the same count: no contradiction
    assert res.returncode == 0 and "world 8" in res.stdout.splitlines()[0], res.stderr[-2000:]


@pytest.mark.serial  # it calibrates this machine
@pytest.mark.timeout(120)
def test_plan_checks_the_layout_before_calibrating(tmp_path) -> None:
    """A layout a run would refuse is refused by --plan too, in one line naming the
    flag, before this machine is calibrated (minutes); and the search offers no SP
    size the heads cannot take, nor planning flags, in the commands it prints."""
    env = {"ISP_COMM_PLAN_CALIBRATE": "1", "ISP_COMM_CACHE_DIR": str(tmp_path / "cache")}
    for flags, words in [
        (["--nproc-per-node", "3", "--batch", "8"], "--batch 8 must be divisible by world / sp = 3"),
        (["--target", "h100x8", "--sp", "8", "--heads", "4", "--hidden", "64"], "--heads 4 must be divisible"),
        (["--nproc-per-node", "2", "--sp", "2", "--hidden", "192", "--heads", "6", "--kv-heads", "3"], "--sp 2: 3 key"),
    ]:
        res = _plan("--layers", "2", *flags, env=env)
        lines = res.stderr.strip().splitlines()
        assert res.returncode == 2 and len(lines) == 1 and words in lines[0], res.stderr
        assert "calibrating" not in res.stderr and not os.path.exists(tmp_path / "cache"), res.stderr
    assert {lay.sp for lay in search.layouts(4, 4, 64, 6, kv_heads=3)} == {1}  # 3 KV heads: no SP 2
    assert {lay.sp for lay in search.layouts(4, 4, 64, 6, kv_heads=6)} == {1, 2}
    small = ["--layers", "2", "--hidden", "192", "--heads", "6", "--kv-heads", "3", "--seq", "64", "--batch", "4"]
    for where in (["--nproc-per-node", "2", "--recalibrate"], ["--target", "cpux2", "--device", "cpu"]):
        res = _plan(*small, *where, "--search")
        assert res.returncode == 0, res.stderr[-2000:]
        commands = [line for line in res.stdout.splitlines() if line[:3] in ("1: ", "2: ", "3: ")]
        unwanted = ("--sp 2", "--recalibrate", "--device cpu" if "--target" in where else "--sp 2")
        assert commands and not any(w in c for c in commands for w in unwanted), commands


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_cpu_validation_benchmark_runs_and_rescores(tmp_path) -> None:
    """bench/plan_check.py end to end at its smallest (one grid point, one run, one
    round of the search's check over its first two picks) on the nominal cpu target's
    profile, then --rescore of what it saved. Its figures go in the docs; nothing here
    judges them."""
    path = str(tmp_path / "cpu.json")
    profiles.from_target(parse_target("cpu")).save(path)
    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "plan_check.py")
    small = ["--only", "1", "--repeats", "1", "--steps", "3", "--search-repeats", "1", "--search-picks", "2"]
    small += ["--out", str(tmp_path)]
    res = subprocess.run(
        [sys.executable, script, "--profile", path, *small], capture_output=True, text=True, timeout=500
    )
    assert res.returncode == 0, res.stderr[-2000:]
    with open(tmp_path / "plan_check.json") as f:
        (saved,) = json.load(f)["rows"]
    (point,) = saved["grid"]
    assert point["predicted_step_s"] > 0 and len(point["step_s"]) == 1 and point["peak_rss_mib"][0] > 0
    search_runs = saved["search"]["runs"]
    assert "search #1" in search_runs and len(search_runs) == 2 and all(len(v) == 1 for v in search_runs.values())
    assert saved["search"]["fastest"] in search_runs and [t["ckpt"] for t in saved["torchtitan"]] == [0.0, 1.0]
    again = [
        sys.executable,
        script,
        "--profile",
        path,
        "--rescore",
        str(tmp_path / "plan_check.json"),
        "--out",
        str(tmp_path),
    ]
    res = subprocess.run(again, capture_output=True, text=True, timeout=200)
    assert res.returncode == 0, res.stderr[-2000:]
    with open(tmp_path / "plan_check_rescore.json") as f:
        (scored,) = json.load(f)["rows"]
    assert scored["points"] == 1 and scored["step_error_pct"] == [pytest.approx(point["step_error_pct"])]


@pytest.mark.timeout(120)
def test_more_ranks_than_cores_share_them() -> None:
    """4 ranks on 2 cores were planned as if each had a core of its own (an outside
    check measured the step three times the plan). Each rank computes half the time,
    so the step takes twice the core-per-rank one, phase by phase; with a core each,
    nothing changes."""
    model = _meta(n_layers=2, hidden=64, n_heads=4, n_kv_heads=2, vocab_size=256)
    cpu = dataclasses.replace(profiles.from_target(parse_target("cpu")), per_node=4, nodes=1)
    kw = dict(world=4, wp=2, sp=1, batch=4, seq=32)
    alone = step_time(model, None, cpu, **kw)
    assert step_time(model, None, dataclasses.replace(cpu, cores=4), **kw).step_s == alone.step_s
    shared = step_time(model, None, dataclasses.replace(cpu, cores=2), **kw)
    assert shared.step_s == pytest.approx(2 * alone.step_s, rel=1e-12)
    assert shared.tokens_per_s == pytest.approx(alone.tokens_per_s / 2, rel=1e-12)
    for ph, t in alone.phases.items():
        assert shared.phases[ph] == pytest.approx(2 * t, rel=1e-12)
    cores = len(os.sched_getaffinity(0))
    n = 2 * cores
    res = _plan("--nproc-per-node", str(n), "--batch", str(n), "--layers", "2", "--hidden", "32", "--heads", "4")
    assert res.returncode == 0, res.stderr[-2000:]
    assert f"{n} ranks on {cores} cores: each rank computes {cores}/{n} of the time" in res.stdout, res.stdout


@pytest.mark.parametrize(
    "sharding, overlap, defer", [("world", True, False), ("wp", False, False), ("world", True, True)]
)
def test_micro_steps_that_repeat_are_added_not_replayed(monkeypatch, sharding: str, overlap: bool, defer: bool) -> None:
    """[Note: micro-steps repeat]: 16 micro-steps on 2 nodes, the state over the world
    (replica gathers in the first, replica reduce-scatters in each) or not, with and
    without overlap: three are replayed, and every figure is the replay of all 16's,
    up to float rounding (the sums come in another order). With the replica reductions
    deferred, the last micro-step (the only one crossing the replicas) is replayed too."""
    import isp_comm.planner.step as stepmod

    model = _meta(n_layers=4, hidden=256, n_heads=8, n_kv_heads=4, vocab_size=1024)
    prof = dataclasses.replace(profiles.from_target(parse_target("h100x4", nodes=2)), overlap=overlap)
    cfg = ISPConfig(state_sharding=sharding)
    kw = dict(world=8, wp=4, sp=1, batch=32, seq=256, grad_accum=16, deferred_replica_sync=defer)
    forwards = []
    real = stepmod._forward
    monkeypatch.setattr(stepmod, "_forward", lambda *a, **k: forwards.append(1) or real(*a, **k))
    fast = step_time(model, cfg, prof, **kw)
    replayed = 4 if defer else 3
    assert len(forwards) == replayed
    monkeypatch.setattr(stepmod, "STEADY_TOLERANCE_S", -1.0)  # never the same: every micro-step replayed
    every = step_time(model, cfg, prof, **kw)
    assert len(forwards) == replayed + 16
    pairs = [(fast.step_s, every.step_s), (fast.tokens_per_s, every.tokens_per_s)]
    for name in ("phases", "exposed_comm", "link_busy_s"):
        mine, theirs = getattr(fast, name), getattr(every, name)
        assert set(mine) == set(theirs), name
        pairs += [(mine[k], theirs[k]) for k in theirs]
    assert every.exposed_comm["backward"] > 0 or not overlap  # the links are busy enough to matter
    for got, want in pairs:
        assert got == pytest.approx(want, rel=1e-9, abs=1e-15)


@pytest.mark.parametrize("sharding", ["wp", "world"])
def test_deferred_replica_reductions_cross_the_nodes_once_a_step(sharding: str) -> None:
    """``--replica-sync step``: 16 micro-steps, 2 nodes of 4, wp 4 (every gather on
    NVLink), the replicas across InfiniBand: the inter-node link carries what one
    micro-step's step does (its replica reductions, the replica gathers, the
    optimizer's two 8-byte all-reduces), not 16 micro-steps' reductions (with the
    state over WP, 16 times one micro-step's step within 1%: the optimizer's
    all-reduces counted 16 times, under a microsecond each), and the step is faster."""
    model = _meta(n_layers=4, hidden=256, n_heads=8, n_kv_heads=4, vocab_size=1024)
    prof = profiles.from_target(parse_target("h100x4", nodes=2))
    kw = dict(world=8, wp=4, sp=1, batch=32, seq=256, grad_accum=16, state_sharding=sharding)
    plain = step_time(model, None, prof, **kw)
    deferred = step_time(model, None, prof, **kw, deferred_replica_sync=True)
    once = step_time(model, None, prof, **{**kw, "grad_accum": 1})  # one micro-step: one crossing
    assert deferred.link_busy_s["inter"] == pytest.approx(once.link_busy_s["inter"], rel=1e-9)
    if sharding == "wp":  # no replica gather (once a step under "world"): 16 micro-steps' reductions
        assert plain.link_busy_s["inter"] == pytest.approx(16 * once.link_busy_s["inter"], rel=1e-2)
    assert plain.link_busy_s["inter"] > 1.5 * deferred.link_busy_s["inter"]
    assert deferred.step_s < plain.step_s
