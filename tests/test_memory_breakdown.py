"""Where every byte of a measured peak goes (issue 55): the breakdown's parts add up to
the tracked peak with almost nothing unattributed, at world 1 and on 2 ranks, and they
line up with the memory forecast's lines of the same names."""

from __future__ import annotations

import dataclasses
import os
import re

import pytest
import torch

from isp_comm.loss import CHUNK_BYTES
from isp_comm.memory_breakdown import CATEGORIES, Breakdown, MemoryBreakdown, category
from isp_comm.memory_breakdown.parts import tensor_parts
from tests.memory_probe import Point, forecast_point, measure_breakdown

SMALL = {"hidden": 128, "layers": 2, "vocab": 1024, "seq": 64, "batch": 4}
UNATTRIBUTED = 0.02
"""The issue's bound: the parts sum to the tracked peak within 2%."""
EXACT = ("master shards", "replicated params", "pool slots and landing", "reduce-scatter buffers", "optimizer state")
"""Parts the forecast counts from the engine's own decisions: equal, but for AdamW's
step counts (a 4-byte tensor per parameter, which the forecast leaves out)."""
UNDER = 0.02
"""How far the forecast's tensors at a phase's largest moment may fall under its tracked
peak: a forecast under the peak calls a layout a fit that runs out of memory. At these
points they came within 0.2% under."""
OVER = 0.08
"""How far over. Some of the forecast's lines are bounds, which at these small shapes (a
head and an embedding as large as a block) add up to 6.8% over the 2-rank bf16 point's
backward: the embedding's bf16 cast counted to the backward's end (autograd keeps none:
an embedding's backward needs its indices, not its weight) and its gradient through the
blocks' backward (it is made last). Counting them where they live was tried (2026-12-06)
and undone: an outside review measured it 2.5% under where the backward peaks at block
0's gradients beside the embedding's, the block's unsharded gradients there twice the
forecast's line (10.5 MiB against 5.25, while the bf16 gradients are packed into the
fp32 reduce-scatter input; not yet traced to the tensor), which the bounds had covered."""
SCALARS = 4096
LINGERING = 16
"""The clip's two fp64 partial norms (``ShardedState.clip_grad_norm_``): gloo's worker thread
drops its reference to a finished all-reduce in its own time, so when the optimizer's
step begins they are alive in one run and freed in another (seen once in CI: 16 bytes
more at the optimizer's peak of two otherwise equal runs; a 2-rank gloo all-reduce's
tensor outlived its ``wait()`` and last Python reference in 123 and 192 of 2,000 tries)."""
CPU = torch.device("cpu")


def _check(b: Breakdown, pt: Point) -> None:
    fc = forecast_point(pt)
    for ph in ("forward", "backward", "backward/loss", "backward/model", "optimizer"):
        parts = b.phases[ph]
        assert sum(parts.values()) == b.tracked[ph], ph
        assert b.unattributed(ph) <= UNATTRIBUTED * b.tracked[ph], (ph, parts)
        assert set(b.categories(ph)) <= set(CATEGORIES) and "other" not in {category(p) for p in parts if p != "other"}
        want = fc.phases[ph.split("/")[0]]
        for part in EXACT:
            assert abs(parts.get(part, 0) - want.get(part, 0)) <= SCALARS, (ph, part, parts.get(part), want.get(part))
    optimizer = dict(b.phases["optimizer"])
    for part in ("gradient shards", "replicated grads", "optimizer temporaries"):  # the step's own lines
        assert abs(optimizer.get(part, 0) - fc.phases["optimizer"].get(part, 0)) <= SCALARS, (part, optimizer)
    if pt.world > 1:
        assert b.phases["forward"]["all-reduce buffers"] == fc.phases["forward"]["all-reduce buffers"]
    acts = b.phases["forward"]["activations"]
    want = next(v for k, v in fc.phases["forward"].items() if k.startswith("activations"))
    assert abs(acts - want) <= 0.02 * want, (acts, want)
    # per rank: the vocab-parallel head computes its vocabulary shard for the WP group's tokens
    logits = pt.batch // (pt.world // pt.sp) * pt.seq // pt.sp * pt.vocab
    held = logits * (2 if pt.bf16 else 4)  # the loop holds the logits; the loss backward adds fp32 ones:
    # [Note: the loss's backward] two fp32 shard-sized tensors for the vocab-parallel loss; for the
    # chunked loss the gradient in the logits' dtype and two fp32 chunks (here the whole logits)
    want = held + (2 * 4 * logits if pt.vocab_parallel else held + 2 * 4 * min(logits, CHUNK_BYTES // 4))
    # and a few per-token scalars (the vocab-parallel loss's maxima and sums, the chunked one's log-sum-exp)
    assert abs(b.phases["backward/loss"]["logits and loss"] - want) <= SCALARS + 0.01 * want, b.phases
    # the forward's: the forecast's, less the log-sum-exp's chunk of scratch, which the
    # tracker cannot see inside aten.logsumexp ([Note: the loss's backward])
    unseen = 0 if pt.vocab_parallel else 4 * min(logits, CHUNK_BYTES // 4)
    want = fc.phases["forward"]["logits and loss"] - unseen
    assert abs(b.phases["forward"]["logits and loss"] - want) <= SCALARS + 0.01 * want, b.phases["forward"]
    for ph, unseen_there in (("forward", unseen), ("backward", 0), ("optimizer", 0)):  # the phases' totals
        total = sum(tensor_parts(fc.phases[ph]).values()) - unseen_there
        assert -UNDER * b.tracked[ph] <= total - b.tracked[ph] <= OVER * b.tracked[ph], (ph, total, b.tracked[ph])
    assert "allocator slack and runtime" in b.device["forward"]


@pytest.mark.timeout(180)
def test_breakdown_at_world_1_adds_up_and_lines_up_with_the_forecast() -> None:
    pt = Point(world=1, wp=1, **SMALL)
    (b,) = measure_breakdown(pt)
    _check(b, pt)


@pytest.mark.timeout(180)
def test_breakdown_on_2_ranks_adds_up_and_lines_up_with_the_forecast() -> None:
    """bf16 compute, half the blocks checkpointed: casts, recomputation and the
    replicated gradients' all-reduce buffer are in the step."""
    pt = Point(world=2, wp=2, ckpt=0.5, bf16=True, **SMALL)
    b0, b1 = measure_breakdown(pt)
    _check(b0, pt)
    assert b1.unattributed("backward") <= UNATTRIBUTED * b1.tracked["backward"]
    assert b0.phases["backward/model"].get("gradient shards", 0) > 0


@pytest.mark.timeout(180)
def test_breakdown_with_the_vocab_parallel_head_and_shard_outer() -> None:
    """The head's vocab-parallel loss (two fp32 shard-sized tensors in its backward,
    not three) and the outer parameters sharded and gathered once per step."""
    for pt in (Point(world=2, wp=2, vocab_parallel=True, **SMALL), Point(world=2, wp=2, shard_outer=True, **SMALL)):
        b0, _ = measure_breakdown(pt)
        _check(b0, pt)
    assert b0.phases["forward"].get("outer gather", 0) > 0


@pytest.mark.timeout(180)
def test_breakdown_with_the_state_sharded_over_the_world() -> None:
    """state_sharding="world" (two replicas): the masters are this rank's pieces, the WP
    shard the gathers read is apart, in the gather dtype, and the replica all-gather
    keeps a send and a landing buffer: each its own line, equal to the forecast's."""
    pt = Point(world=2, wp=1, state_sharding="world", **SMALL)
    b0, b1 = measure_breakdown(pt)
    _check(b0, pt)
    assert b1.unattributed("backward") <= UNATTRIBUTED * b1.tracked["backward"]
    fc = forecast_point(pt)
    for ph in ("forward", "backward", "optimizer"):
        for part in ("WP shards (gather dtype)", "replica gather buffers"):
            assert b0.phases[ph][part] == fc.phases[ph][part] > 0, (ph, part, b0.phases[ph])


@pytest.mark.timeout(180)
def test_reduce_scatter_pairs_given_back_between_backwards_leave_every_other_peak() -> None:
    """``release_reduce_buffers=True`` (the default on CUDA; here over gloo): the pairs
    live only while the blocks' backward reduces. The forward's, the loss backward's and
    the optimizer's peaks hold none, in the measurement and in the forecast, and are
    lower by exactly their bytes than with the pairs kept; the blocks' backward holds
    the pairs the forecast's replay of the engine makes, to the byte."""
    kept = Point(world=2, wp=2, **SMALL)
    pt = dataclasses.replace(kept, release_reduce_buffers=True)
    (b0, b1), (k0, _) = measure_breakdown(pt), measure_breakdown(kept)
    fc, fc_kept = forecast_point(pt), forecast_point(kept)
    pairs = fc_kept.phases["forward"]["reduce-scatter buffers"]
    assert fc.phases["backward"]["reduce-scatter buffers"] == pairs > 0  # two blocks reduce: both pairs made
    for ph in ("forward", "backward/loss", "optimizer"):
        assert "reduce-scatter buffers" not in b0.phases[ph], (ph, b0.phases[ph])
        assert abs(b0.tracked[ph] - (k0.tracked[ph] - pairs)) <= LINGERING, ph
    for ph in ("forward", "optimizer"):
        assert "reduce-scatter buffers" not in fc.phases[ph]
        assert fc.peak(ph) == fc_kept.peak(ph) - pairs
    assert b0.phases["backward/model"]["reduce-scatter buffers"] == pairs
    for b in (b0, b1):
        for ph in ("forward", "backward", "optimizer"):
            assert b.unattributed(ph) <= UNATTRIBUTED * b.tracked[ph], (ph, b.phases[ph])


def _fsdp2_breakdown(rank: int, world: int) -> dict:
    """bench/virtual.py's FSDP2 (as torchtitan sets it up, its collectives on the
    virtual backend) on its smallest configuration, full sharding over 4: two steps,
    then one under the breakdown; the figures the test checks."""
    from bench.virtual import QUICK, Run, _fsdp2, fixed_layout

    cfg = QUICK["tiny-n4"]
    model, backend, clip, (per, seq, _), positions, loss_fn = _fsdp2(Run(cfg, fixed_layout(cfg)), "fsdp2", CPU)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    gen = torch.Generator().manual_seed(rank)

    def step() -> None:
        tokens = torch.randint(0, cfg.model.vocab_size, (per, seq + 1), generator=gen)
        loss_fn(model(tokens[:, :-1], position_ids=positions), tokens[:, 1:]).backward()
        clip()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step(), step()
    tracker = MemoryBreakdown()
    with tracker:
        tracker.attach(None, opt, model=model)
        step()
    first = tracker.result()
    with tracker:  # entered again: its hooks, removed on the way out, are made again
        tracker.attach(None, opt, model=model)
        tracker.reset_peaks()
        step()
    params = list(model.parameters())
    out = {
        "breakdown": first,
        "again": tracker.result(),
        "shards": sum(p.to_local().untyped_storage().nbytes() for p in params),  # the padded local shards
        "params": len(params),
        # a DTensor's numel is the whole parameter's
        "block": sum(p.numel() * p.element_size() for p in model.layers[0].parameters()),
        "head": sum(p.numel() * p.element_size() for p in [*model.norm.parameters(), *model.lm_head.parameters()]),
    }
    backend.close()
    return out


@pytest.mark.timeout(180)
def test_fsdp2_breakdown_counts_local_shards_and_resized_gathers() -> None:
    """FSDP2 beside isp-comm ([Note: what the breakdown reads of FSDP2]): its DTensors
    counted by their local shards (the moments are 2x this rank's fp32 shards, not 2x
    the model's), its gathered parameters at the size of the moment though FSDP2
    resizes their storages in place (a block's at the backward's peak, none when it
    has resharded), its flat buffers named, and nothing held past its collective."""
    from isp_comm.testing import run_virtual

    got = run_virtual(_fsdp2_breakdown, 4, 0, timeout_s=150)
    b, shards = got["breakdown"], got["shards"]
    for ph in ("forward", "backward", "optimizer"):
        parts = b.phases[ph]
        assert sum(parts.values()) == b.tracked[ph], ph
        assert b.unattributed(ph) <= UNATTRIBUTED * b.tracked[ph], (ph, parts)
        assert parts["master shards"] == shards, (ph, parts)
        assert parts["optimizer state"] == 2 * shards + 4 * got["params"], (ph, parts)  # moments and step counts
    for ph in ("forward", "backward/model"):  # the peak is inside a block: it alone is gathered
        assert b.phases[ph]["unsharded params"] == got["block"], b.phases[ph]
    assert b.phases["backward/loss"]["unsharded params"] == got["head"]  # the head and final norm, one unit
    backward = b.phases["backward"]
    assert backward["block gradients (unsharded)"] > 0 and backward["reduce-scatter buffers"] > 0, backward
    assert backward["all-gather buffers"] > 0, backward
    for part in ("unsharded params", "all-gather buffers", "reduce-scatter buffers"):  # all resharded, all done
        assert b.phases["optimizer"].get(part, 0) == 0, (part, b.phases["optimizer"])
    assert b.phases["optimizer"]["gradient shards"] == shards
    assert got["again"].phases["backward"] == backward  # entered again, the same step seen the same way


def test_fsdp2s_copies_name_the_buffers_they_fill() -> None:
    """FSDP2's own operators name their flat buffers when they fill them, also one no
    owner holds when the breakdown next reads the owners (the last unit's
    reduce-scatter input, dropped in FSDP2's final callback of a backward)."""
    import torch.distributed.fsdp._fully_shard._fsdp_collectives  # noqa: F401 - defines torch.ops.fsdp

    grads, shards = [torch.ones(4), torch.ones(2, 6)], [torch.ones(8), torch.ones(8)]  # made before: untracked
    tracker = MemoryBreakdown()
    with tracker, tracker.phase("backward"):
        rs_input = torch.empty(2, 8)
        torch.ops.fsdp.chunk_cat(grads, dim=0, num_chunks=2, out=rs_input)
        flat = torch.empty(16)
        torch.ops.fsdp.all_gather_copy_in(shards, flat, [8, 8], 16, 0)
        parts = tracker.result().phases["backward"]
    assert parts == {"reduce-scatter buffers": 64, "all-gather buffers": 64}, parts


@pytest.mark.timeout(240)
def test_breakdown_follows_the_slots_made_and_freed_without_the_pool() -> None:
    """``memory_pool=False``: a block's slot is resized to its bytes when gathered and
    to nothing when released, as FSDP2 does, which no operator shows ([Note: storages
    FSDP2 resizes]): the blocks' backward holds the slots of the block it computes and
    of the one prefetched, the loss's backward and the optimizer step none, and the
    cast send buffer the gathers keep is named."""
    from tests.memory_probe import build_model

    # 4 blocks: the pairs of the first reduces have completed when the backward ends, so only
    # naming them while they live names them
    pt = Point(world=2, wp=2, bf16=True, memory_pool=False, **{**SMALL, "layers": 4})
    b0, _ = measure_breakdown(pt)
    block = sum(p.numel() * 2 for p in build_model(pt).layers[0].parameters())  # gathered in bf16
    send = block // pt.wp  # the rank's shard, cast for its gather
    assert b0.phases["backward/model"]["pool slots and landing"] == 2 * block + send, b0.phases["backward/model"]
    assert b0.phases["backward/model"]["reduce-scatter buffers"] > 0  # a pair made for a reduce in flight
    for ph in ("backward/loss", "optimizer"):
        assert b0.phases[ph]["pool slots and landing"] == send, (ph, b0.phases[ph])
    for ph in ("forward", "backward", "optimizer"):
        assert b0.unattributed(ph) <= UNATTRIBUTED * b0.tracked[ph], (ph, b0.phases[ph])
    # the forecast of memory_pool=False: the kept send buffer alone outside the blocks' backward, the
    # slots and the pairs in flight in it ([Note: slot lifetime]); its forward misses the measurement by
    # what the pooled forecast misses (the log-sum-exp's chunk the tracker cannot see), its optimizer
    # step matches but for AdamW's step counts, and its backward, whose moment adds up bounds (two
    # reduces in flight, the head's gradients), is not under the measured peak
    fc, pooled = forecast_point(pt), dataclasses.replace(pt, memory_pool=True)
    (p0, _), fc_pooled = measure_breakdown(pooled), forecast_point(pooled)

    def tensors(parts: dict[str, int]) -> int:
        return sum(tensor_parts(parts).values())

    for ph in ("forward", "optimizer"):
        assert fc.phases[ph]["pool slots and landing"] == send, (ph, fc.phases[ph])
    gap = tensors(fc_pooled.phases["forward"]) - p0.tracked["forward"]
    assert abs(tensors(fc.phases["forward"]) - b0.tracked["forward"] - gap) <= SCALARS, (fc.phases["forward"], gap)
    assert abs(tensors(fc.phases["optimizer"]) - b0.tracked["optimizer"]) <= SCALARS
    assert tensors(fc.phases["backward"]) >= b0.tracked["backward"]


def test_a_storage_resized_in_place_counts_at_its_size_of_the_moment() -> None:
    """[Note: storages FSDP2 resizes], on plain tensors: a storage named as gathered
    parameters is freed by a resize no operator shows, and the next operator's read
    takes it out of the total; resized back, FSDP2's next operator brings it in, and
    the peak counts it."""
    import torch.distributed.fsdp._fully_shard._fsdp_collectives  # noqa: F401 - defines torch.ops.fsdp

    from isp_comm.memory_breakdown.fsdp2 import UNSHARDED

    grads = [torch.ones(4), torch.ones(4)]  # made before: untracked
    tracker = MemoryBreakdown()
    with tracker, tracker.phase("backward"):
        gathered = torch.zeros(1024)  # 4 KiB
        tracker._tag(gathered, UNSHARDED)  # as its owners name FSDP2's gathered parameters
        gathered.untyped_storage().resize_(0)  # FSDP2's free_storage
        scratch = torch.zeros(16)  # any operator
        assert tracker.current == 64
        gathered.untyped_storage().resize_(4096)  # FSDP2's alloc_storage, before its copy
        rs_input = torch.empty(2, 4)
        assert tracker.current == 64 + 32  # no operator of FSDP2's yet: not seen
        torch.ops.fsdp.chunk_cat(grads, dim=0, num_chunks=2, out=rs_input)
        assert tracker.current == 4096 + 64 + 32
        peak = tracker.result()
        del scratch
    assert peak.phases["backward"][UNSHARDED] == 4096 and peak.tracked["backward"] == 4096 + 64 + 32


def test_a_tracked_storage_leaves_the_total_when_freed_and_its_peak_stays() -> None:
    """The tracker's own arithmetic, on plain tensors: a storage counts once (views
    share it), leaves the running total when freed, and the phase's peak keeps it."""
    tracker = MemoryBreakdown()
    with tracker:
        with tracker.phase("forward"):
            a = torch.zeros(1024)  # 4 KiB
            view = a[:10]
            b = a * 2
            del b
        peak = tracker.result()
    assert peak.tracked["forward"] == 8192
    assert tracker.current == 4096 and view.untyped_storage().nbytes() == 4096
    del a, view
    assert tracker.current == 0


def test_the_allocators_untracked_blocks_are_named_by_their_stack_or_size() -> None:
    """CUDA's side, on a snapshot of the allocator's documented form (no GPU here):
    tracked storages and free blocks are left out, a block whose recorded stack names
    cuBLAS's workspace is one, and so is one without a stack of exactly its size."""
    from isp_comm.memory_breakdown.cuda import untracked_blocks

    mib = 2**20
    ws_frames = [{"name": "at::cuda::getNewWorkspace()", "filename": "CublasHandlePool.cpp", "line": 1}]
    snapshot = {
        "segments": [
            {
                "address": 0,
                "blocks": [
                    {"address": 0, "size": 4 * mib, "state": "active_allocated", "frames": []},  # a tracked tensor
                    {"address": 4 * mib, "size": 32 * mib, "state": "active_allocated", "frames": ws_frames},
                    {"address": 36 * mib, "size": 2 * mib, "state": "inactive", "frames": []},
                ],
            },
            {"address": 64 * mib, "blocks": [{"size": 32 * mib, "state": "active_allocated"}]},  # no stack, no address
            {"address": 128 * mib, "blocks": [{"address": 128 * mib, "size": mib, "state": "active_allocated"}]},
        ]
    }
    got = untracked_blocks(snapshot, {0}, 32 * mib)
    assert got == {"workspace: cuBLAS": 64 * mib, "untracked (other)": mib}


def test_the_cuda_device_lines_are_the_allocators_figures_beyond_the_gpus_tracked_storages() -> None:
    """On CUDA a peak's device lines read the allocator at that moment: allocated less
    the tracked storages on the GPU (not the host's: AdamW keeps its step counts
    there), and reserved less allocated ([Note: the device lines])."""
    from isp_comm.memory_breakdown.result import PhasePeak

    peak = PhasePeak(tracked=12, alive=[], device={"allocated": 100, "reserved": 150, "tracked": 8})
    b = Breakdown.of({"backward": peak}, (0, {}), {"workspace: cuBLAS": 64})
    assert b.device["backward"] == {"workspace and untracked": 92, "allocator slack": 50}
    assert "of the untracked, at the end: workspace: cuBLAS" in b.table("backward")


@pytest.mark.timeout(240)
def test_isp_train_reports_each_ranks_breakdown_beside_its_forecast(tmp_path) -> None:
    """isp-train --memory-breakdown on 2 ranks, with grad accumulation, evaluation and an
    asynchronous save: every rank's peaks from step 2 add up with almost nothing
    unattributed (the save is not counted), rank 0's engine-sized parts equal the
    forecast of the run's own flags, and rank 0 prints them."""
    import json

    from tests.test_train import isp_train

    out = tmp_path / "run"
    cmd = ["--layers", "2", "--hidden", "32", "--heads", "4", "--kv-heads", "2", "--batch", "4", "--seq", "32"]
    cmd += ["--steps", "3", "--grad-accum", "2", "--eval-every", "2", "--eval-split", "0.1"]
    cmd += ["--save-every", "2", "--async-save"]  # its staged copies outlive the save: not a step's
    res = isp_train(2, *cmd, "--memory-breakdown", "--out", str(out), timeout=200)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "memory breakdown of rank 0, steps 2-3" in res.stdout, res.stdout
    assert "| part | category | measured MiB | forecast MiB |" in res.stdout, res.stdout
    got = json.loads((out / "memory_breakdown.json").read_text())
    assert got["phases"] == ["forward", "backward", "optimizer", "evaluate"] and len(got["ranks"]) == 2
    for rank in got["ranks"]:
        for ph in got["phases"]:
            parts = rank["phases"][ph]
            assert sum(parts.values()) == rank["tracked"][ph], ph
            assert parts.get("other", 0) <= UNATTRIBUTED * rank["tracked"][ph], (ph, parts)
    for ph in ("forward", "backward", "optimizer"):
        for part in EXACT:
            have, want = got["ranks"][0]["phases"][ph].get(part, 0), got["forecast"][ph].get(part, 0)
            assert abs(have - want) <= SCALARS, (ph, part, have, want)
    # each phase's line puts the tracked peak beside the forecast's tensors, its runtime
    # apart (it once printed the whole forecast: 2.4 MiB tracked beside 7.0 forecast);
    # the printed figures are rounded to 0.1 MiB, of about 2 MiB here: 10%
    lines = re.findall(
        r"  (\w+): tracked peak ([\d.]+) MiB, forecast ([\d.]+) MiB of tensors \(and ([\d.]+) MiB of runtime",
        res.stdout,
    )
    assert [ph for ph, *_ in lines] == got["phases"], res.stdout
    for ph, tracked, tensors, runtime in lines:
        assert abs(float(tracked) - float(tensors)) <= 0.1 * float(tracked) and float(runtime) > 0, (ph, res.stdout)


def test_what_runs_untracked_is_never_counted() -> None:
    """A storage made inside ``untracked()`` is not counted, also after it; one tracked
    before and freed inside still leaves the total."""
    tracker = MemoryBreakdown()
    with tracker:
        tracker.attach()
        kept = torch.ones(1024)
        with tracker.untracked():
            staged = torch.ones(2048)
            del kept
        assert tracker.current == 0
        after = staged + 1
    assert tracker.current == after.untyped_storage().nbytes() == 8192


def test_isp_train_memory_breakdown_refuses_what_it_cannot_see() -> None:
    from isp_comm.train.config import TrainConfig

    # and says what to do: it named the conflict, not the fix
    with pytest.raises(ValueError, match="--memory-breakdown sees eager operators only.*; drop one "):
        TrainConfig(memory_breakdown=True, compile=True)
    with pytest.raises(ValueError, match="--plan only forecasts one"):
        TrainConfig(memory_breakdown=True, plan=True)


def _resident_by_mapping() -> dict[int, int]:
    """This process's resident bytes of each mapping, by its start address (/proc/self/smaps)."""
    out, start = {}, None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(maxsplit=1)[0]
            if "-" in head and not head.endswith(":"):
                start = int(head.split("-")[0], 16)
            elif head == "Rss:" and start is not None:
                out[start] = int(line.split()[1]) * 1024
    return out


def _example_rank(rank: int, world: int) -> dict:
    """examples/memory_breakdown.py's run (its model, the default config: the CPU
    shared-memory backend; the tracker entered before wrapping, so every segment is
    mapped inside it); its breakdown, and what smaps says each shared part holds."""
    from isp_comm import ISPCommunicator, ISPConfig, ParallelGroups
    from isp_comm.memory_breakdown.owners import shared_memory_parts
    from isp_comm.models.llama import LlamaConfig, build

    torch.set_num_threads(1)
    model = build(LlamaConfig(n_layers=4), seed=0)
    tracker = MemoryBreakdown()
    with tracker:
        comm = ISPCommunicator(model, ParallelGroups.create(wp_size=2, sp_size=1), ISPConfig())
        optim = torch.optim.AdamW(model.parameters())
        tracker.attach(comm, optim)
        torch.manual_seed(rank)
        for step in range(2):
            if step == 1:
                tracker.reset_peaks()
            x = torch.randint(0, 256, (2, 65))
            logits = model(x[:, :-1])
            comm.cross_entropy(logits, x[:, 1:]).backward()
            del logits
            optim.step()
            optim.zero_grad()
    resident, smaps = {}, _resident_by_mapping()
    for part, t in shared_memory_parts(comm.backend):  # a page once touched stays: the step's pages
        resident[part] = resident.get(part, 0) + smaps[t.data_ptr()]
    out = {"breakdown": tracker.result().as_dict(), "resident": resident}
    comm.close()
    return out


@pytest.mark.timeout(180)
def test_shared_segments_count_the_pages_a_rank_holds_at_the_examples_shape() -> None:
    """[Note: shared segments count their resident pages]: the shared-memory lines at the
    backward's peak are the pages smaps says the rank holds (not the segments' whole
    mappings, 1.04 and 0.50 MiB where 0.33 and 0.26 are held), within the forecast's
    page rounding (scratch) and the kernel's read fault-around (peers' reduce-scatter
    inputs, up to 64 KiB a buffer); the tensor lines then come within 2% of the peak."""
    from isp_comm import ISPConfig, forecast
    from isp_comm.models.llama import Llama, LlamaConfig
    from isp_comm.testing import run_ranks

    got = run_ranks(_example_rank, 2, timeout_s=150)[0]
    b, resident = Breakdown(**got["breakdown"]), got["resident"]
    with torch.device("meta"):
        fc = forecast(Llama(LlamaConfig(n_layers=4)), ISPConfig(), world=2, wp=2, sp=1, batch=4, seq=64)
    want, parts = fc.phases["backward"], b.phases["backward"]
    scratch, peers = "shared memory: collective scratch", "shared memory: peers' pool pages"
    assert parts[scratch] == resident[scratch] and parts[peers] == resident[peers], (parts, resident)
    page = os.sysconf("SC_PAGE_SIZE")
    assert 0 <= parts[scratch] - want[scratch] <= 3 * page, (parts[scratch], want[scratch])  # ctrl, 2 scratch
    fault_around = ISPConfig().max_inflight_reduce_scatter * (64 << 10)  # a window per peer's input read
    assert 0 <= parts[peers] - want[peers] <= fault_around + 3 * page, (parts[peers], want[peers])
    tensors = sum(tensor_parts(want).values())
    assert abs(b.tracked["backward"] - tensors) <= 0.02 * tensors, (b.tracked["backward"], tensors)
