"""``comm.set_requires_replica_sync(False)``: the micro-steps of an accumulation but the
last keep their gradient shards after the WP reduce-scatter, and the last one's replica
collective carries the step's sum (see [Note: replica reductions deferred]). Compared
with single-process training of the same global batch, as every parity test."""

from __future__ import annotations

import os
from collections import Counter

import pytest
import torch

from isp_comm import ISPCommunicator, ISPConfig, ParallelGroups
from isp_comm.testing import run_ranks
from tests.parity import (
    Case,
    backward_that_raises,
    batches,
    check_parity,
    loss_fn,
    make_optim,
    max_diff,
    train_isp,
    train_reference,
)
from tests.test_unused_parameters import PLANS, _unused_worker

WORLD = {"state_sharding": "world"}
BASE = Case(optim="sgd", micro=3, clip=0.5, bias=True, ckpt=0.5, defer=True)

# (case, config) at world 4: wp 2 x 2 replicas unless "wp" says otherwise
CASES = [
    (BASE, {}),
    (Case(optim="adamw", micro=3, bias=True, defer=True), {}),
    (BASE, WORLD),
    (Case(optim="adamw", micro=2, clip=0.5, bias=True, defer=True), WORLD),
    # the outer parameters sharded: the gathered head's and norm's gradients through the
    # outer unit, the hidden-split embedding's rows (summed over WP by their own
    # backward) straight to the replicas, deferred replica-major
    (BASE, {**WORLD, "shard_outer_params": True}),
    (BASE, {"shard_outer_params": True}),
    (BASE, {"backend": "torch"}),
    (Case(micro=2, defer=True), {**WORLD, "overlap": False, "memory_pool": False}),
    (Case(optim="adamw", micro=3, defer=True), {"wp": 1}),  # four replicas
]


def _cases_worker(rank: int, world: int, cases: list[tuple[Case, dict]]) -> list[tuple]:
    out = []
    for case, kw in cases:
        kw = dict(kw)
        ref_sd, ref_losses = train_reference(case, world)
        sd, losses, _ = train_isp(case, rank, world, kw.pop("wp", 2), **kw)
        out.append((case, max_diff(sd, ref_sd), max(abs(a - b) for a, b in zip(losses, ref_losses))))
    return out


@pytest.mark.timeout(400)
def test_deferred_replica_reductions_match_single_process() -> None:
    # fp32: the sums' order changes (a rank's micro-steps summed before the replicas'),
    # which the parity tests' limits (their reasons in tests/parity.py) hold
    check_parity(run_ranks(_cases_worker, 4, CASES, timeout_s=380))


def _bf16_worker(rank: int, world: int) -> list[dict]:
    out = []
    for reduce_dtype in (torch.float32, None):
        case = Case(optim="sgd", micro=3, ckpt=0.5, bias=True, defer=True)
        kw = dict(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)
        sd, losses, _ = train_isp(case, rank, world, 2, **kw, **WORLD)
        ref, ref_losses = train_reference(case, world)
        out.append({"diff": max_diff(sd, ref), "loss": max(abs(a - b) for a, b in zip(losses, ref_losses))})
    return out


@pytest.mark.timeout(200)
def test_deferred_replica_reductions_in_bf16() -> None:
    # bf16 compute from fp32 masters, the sums kept in the reduce dtype (bf16 when None,
    # as FSDP2 keeps its partial reduce output): test_mixed_precision's limits and reasons
    for per_rank in run_ranks(_bf16_worker, 4, timeout_s=180):
        for r in per_rank:
            assert r["loss"] < 8e-2 and r["diff"] < 6e-4, r


def _counts_worker(rank: int, world: int, config_kw: dict) -> dict:
    out, groups = {}, []
    for name, case in (
        ("one", Case(micro=1, steps=2)),
        ("plain", Case(micro=3, steps=2)),
        ("deferred", Case(micro=3, steps=2, defer=True)),
    ):
        after = lambda comm: groups.append(sum(len(u.groups) for u in comm.sharded_units))  # noqa: E731
        _, _, stats = train_isp(case, rank, world, 2, after_wrap=after, **config_kw)
        out[name] = (stats["all_reduces"], stats["reduce_scatters"], stats["bytes_reduced"])
    out["groups"] = groups[0]  # reduce groups a micro-step reduces over the replicas
    return out


@pytest.mark.timeout(200)
@pytest.mark.parametrize("config_kw", [{}, WORLD, {**WORLD, "shard_outer_params": True}], ids=["wp", "world", "outer"])
def test_the_replicas_reduce_once_a_step(config_kw: dict) -> None:
    # 2 steps of 3 micro-steps, against 2 of 1 (the same count of replica collectives
    # when deferred) and 2 of 3 synced every micro-step
    for r in run_ranks(_counts_worker, 4, config_kw, timeout_s=180):
        one, plain, deferred = r["one"], r["plain"], r["deferred"]
        assert deferred[0] == one[0] < plain[0], r  # all-reduces: the whole gradients' buckets (and replicas' "wp")
        if not config_kw:  # every micro-step's WP reduce-scatters, the replicas' all-reduces once a step
            assert deferred[1] == plain[1], r
        else:  # each group's replica reduce-scatter once a step (2 micro-steps x 2 steps fewer), no more
            assert deferred[1] == plain[1] - 4 * r["groups"], r
            assert deferred[2] < plain[2], r  # bytes reduce-scattered (all-reduces are not counted)


def _refusals_worker(rank: int, world: int) -> list[str]:
    case = Case(micro=2, bias=True)
    model = case.build()
    comm = ISPCommunicator(model, ParallelGroups.create(wp_size=2), ISPConfig())
    opt = make_optim("sgd", model.parameters())
    (x, y), (x2, y2) = batches(case, world)[0]
    seen = []
    comm.set_requires_replica_sync(False)
    loss_fn(model(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
    for what, call in (
        ("step", opt.step),
        ("clip", lambda: comm.clip_grad_norm_(1.0)),
        ("freeze", lambda: (model.layers[0].attn.q_proj.weight.requires_grad_(False), model(x))),
    ):
        try:
            call()
        except RuntimeError as e:
            seen.append(f"{what}: {e}")
    model.layers[0].attn.q_proj.weight.requires_grad_(True)
    comm.set_requires_replica_sync(True)
    loss_fn(model(x2.chunk(world)[rank]), y2.chunk(world)[rank]).backward()
    opt.step()  # the syncing backward reduced both micro-steps': the step goes through
    try:
        comm.set_requires_replica_sync(1)
    except TypeError as e:
        seen.append(f"type: {e}")
    comm.close()
    return seen


@pytest.mark.timeout(120)
def test_a_step_before_the_gradients_crossed_the_replicas_is_refused() -> None:
    for seen in run_ranks(_refusals_worker, 4, timeout_s=100):
        assert [s.split(":")[0] for s in seen] == ["step", "clip", "freeze", "type"], seen
        assert "1 backward(s) wait for their replica reduction" in seen[0], seen
        assert "set_requires_replica_sync(True)" in seen[1] and "requires_grad changed" in seen[2], seen


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "config_kw", [{}, {"state_sharding": "world", "shard_outer_params": True}], ids=["wp2x2", "wp2x2-world"]
)
def test_deferred_with_unused_parameters_and_a_block_the_last_micro_step_skips(config_kw: dict) -> None:
    # tests/test_unused_parameters.py's plans with each step's micro-steps but the last
    # deferred: its third step runs block 2 in the first micro-step only, so block 2's
    # deferred sum is reduced over the replicas on its own when the syncing backward
    # ends; with find_unused_parameters a parameter used in a deferred micro-step only
    # keeps its gradient, and the pooler none
    results = run_ranks(_unused_worker, 4, 2, config_kw, "cpu", (True, False), PLANS, True, True, timeout_s=280)
    for (found, found_none), (zeroed, zeroed_none) in results:
        assert found < 1e-5 and found_none == [], (found, found_none)  # the unused test's bound and reason
        assert zeroed > 1e-3 and "pooler.weight" in zeroed_none, (zeroed, zeroed_none)


def _sums_worker(rank: int, world: int, config_kw: dict) -> dict:
    from isp_comm.memory_forecast import forecast

    case = Case(micro=2, bias=True)
    model = case.build()
    comm = ISPCommunicator(model, ParallelGroups.create(wp_size=2), ISPConfig(**config_kw))
    (x, y), (x2, y2) = batches(case, world)[0]
    comm.set_requires_replica_sync(False)
    loss_fn(model(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
    held = sum(d.total.numel() * d.total.element_size() for d in comm.engine.reducer._deferred.values())
    comm.set_requires_replica_sync(True)
    loss_fn(model(x2.chunk(world)[rank]), y2.chunk(world)[rank]).backward()
    storages = {s.grad.untyped_storage().data_ptr(): s.grad.untyped_storage().nbytes()
                for u in comm.sharded_units for s in u.shards if s.grad is not None}  # fmt: skip
    comm.close()
    with torch.device("meta"):
        meta = case.build()
    shape = (world, 2, 1, case.batch_per_rank * world, case.seq, "sgd")
    deferred = forecast(meta, ISPConfig(**config_kw), *shape, grad_accum=2, deferred_replica_sync=True)
    accumulated = forecast(meta, ISPConfig(**config_kw), *shape, grad_accum=2)
    one = forecast(meta, ISPConfig(**config_kw), *shape, deferred_replica_sync=True)  # one micro-step: none
    sums, shards = "deferred gradient sums", "gradient shards"
    return {
        "held": (held, deferred.phases["forward"].get(sums, 0), one.phases["backward"].get(sums, 0)),
        "grads": (sum(storages.values()), accumulated.phases["forward"].get(shards, 0)),
        "not both": deferred.phases["forward"].get(shards, 0) + accumulated.phases["forward"].get(sums, 0),
    }


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "config_kw",
    [{}, {**WORLD, "shard_outer_params": True}, {"param_dtype": torch.bfloat16, "reduce_dtype": None}],
    ids=["wp", "world-outer", "bf16"],
)
def test_the_forecast_counts_what_an_accumulation_holds(config_kw: dict) -> None:
    # rank 0's (the forecast's rank: its shards are the largest), in the forward of a
    # later micro-step: every byte of the deferred sums the engine keeps after a
    # deferred micro-step, or of the gradient shards after a syncing one; none with
    # one micro-step a step
    r = run_ranks(_sums_worker, 4, config_kw, timeout_s=100)[0]
    (held, forecast, one), (grads, grads_forecast) = r["held"], r["grads"]
    assert held > 0 and forecast == held and one == 0, r
    assert grads > 0 and grads_forecast == grads and r["not both"] == 0, r


def _spans(out: str, name: str) -> dict[int, int]:
    """Per rank, the trace's spans whose name begins with ``name``."""
    import json

    with open(os.path.join(out, "trace.json")) as f:
        events = json.load(f)["traceEvents"]
    return dict(Counter(e["pid"] for e in events if e.get("name", "").startswith(name)))


@pytest.mark.timeout(300)
def test_isp_train_replica_sync_step(tmp_path) -> None:
    """isp-train --replica-sync step at world 4 (wp 2 x 2, the state over the world,
    3 micro-steps a step, one of the two blocks checkpointed) trains as --replica-sync micro, with the whole gradients'
    all-reduce once a step, not once a micro-step; --plan counts the sums it keeps."""
    from tests.test_planner import _plan
    from tests.test_train import SMALL, isp_train, losses

    a, b = str(tmp_path / "step"), str(tmp_path / "micro")
    common = [*SMALL, "--steps", "3", "--grad-accum", "3", "--wp", "2", "--state-sharding", "world", "--ckpt", "0.5"]
    for out, sync in ((a, "step"), (b, "micro")):
        res = isp_train(4, *common, "--replica-sync", sync, "--out", out)
        assert res.returncode == 0, res.stderr[-3000:]
        # its first line says the layout: the replicas, the state's group, the blocks checkpointed
        words = "world 4, wp 2, sp 1, 2 replicas, state over world, 1 of 2 blocks checkpointed, backend"
        assert words in res.stdout + res.stderr, res.stdout[-2000:]
    # fp32: the sums' order (a rank's micro-steps summed before the replicas'), a few
    # ulps (5e-7 seen at step 2)
    assert max(abs(losses(a)[s] - losses(b)[s]) for s in (1, 2, 3)) < 2e-6, (losses(a), losses(b))
    once, every = _spans(a, "replicated gradients"), _spans(b, "replicated gradients")
    assert len(once) == 4 and all(every[r] == 3 * n > 0 for r, n in once.items()), (once, every)
    plan = [*SMALL, "--nproc-per-node", "4", "--wp", "2", "--grad-accum", "2"]
    res, plain = _plan(*plan, "--replica-sync", "step"), _plan(*plan)
    assert res.returncode == 0 and plain.returncode == 0, res.stderr[-2000:] + plain.stderr[-2000:]
    assert "deferred gradient sums" in res.stdout and "deferred gradient sums" not in plain.stdout, res.stdout
    assert "world 4, wp 2, sp 1, 2 replicas, state over wp, batch" in plain.stdout.splitlines()[0], plain.stdout


def _wrapped_and_plain(rank: int, world: int, copies: int) -> tuple:
    """The tiny llama wrapped at wp 2 and a plain copy, SGD at lr 0.1 on each, ``copies``
    of one global batch, and this rank's part of a tensor."""
    from isp_comm.models.llama import LlamaConfig, build
    from tests.parity import TINY

    g = torch.Generator().manual_seed(0)
    data = [(torch.randint(0, 37, (2 * world, 8), generator=g), torch.randint(0, 37, (2 * world, 8), generator=g))]
    model, ref = build(LlamaConfig(**TINY)), build(LlamaConfig(**TINY))
    comm = ISPCommunicator(model, ParallelGroups.create(wp_size=2), ISPConfig())
    opt, ropt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    return data * copies, model, ref, comm, opt, ropt, lambda t: t.chunk(world)[rank]


def _aborted_worker(rank: int, world: int) -> dict:
    data, model, ref, comm, opt, ropt, mine = _wrapped_and_plain(rank, world, 3)
    x, y = data[0]
    # a deferred micro-step, then one whose backward raises once the blocks' own have run:
    # the accumulation is dropped (its sums too), as a plain loop that zeroes its gradients
    comm.set_requires_replica_sync(False)
    loss_fn(model(mine(x)), mine(y)).backward()

    backward_that_raises(model, mine(x), mine(y))
    opt.zero_grad()
    for i, (x, y) in enumerate(data[1:]):  # an accumulation of two, the first deferred
        comm.set_requires_replica_sync(i == 1)
        (loss_fn(model(mine(x)), mine(y)) / 2).backward()
        (loss_fn(ref(x), y) / 2).backward()
    opt.step(), ropt.step()
    full = comm.full_state_dict()
    comm.close()
    return {"weights": max((full[k] - v).abs().max().item() for k, v in ref.state_dict().items())}


@pytest.mark.timeout(120)
def test_an_accumulation_whose_backward_raised_is_dropped_with_its_sums() -> None:
    # fp32 SGD: the sums' order only (tests/parity.py's SGD bound and reason)
    for r in run_ranks(_aborted_worker, 4, timeout_s=100):
        assert r["weights"] < 2e-6, r


def _interleaved_worker(rank: int, world: int) -> dict:
    data, model, ref, comm, opt, ropt, mine = _wrapped_and_plain(rank, world, 2)
    # 1. an accuracy forward with grad (no backward) between a deferred micro-step and the
    # syncing one: the syncing one's forward reads the flag again
    for i, (x, y) in enumerate(data):
        comm.set_requires_replica_sync(i == 1)
        if i == 1:
            model(mine(x)).argmax(-1)
        (loss_fn(model(mine(x)), mine(y)) / 2).backward()
        (loss_fn(ref(x), y) / 2).backward()
    opt.step(), ropt.step()
    opt.zero_grad(), ropt.zero_grad()
    full = comm.full_state_dict()
    out = {"weights": max((full[k] - v).abs().max().item() for k, v in ref.state_dict().items())}
    # 2. a syncing backward that raises after a deferred one: the clip and the step settle
    # it (the step's gradients dropped, as without deferral), not refused
    x, y = data[0]
    comm.set_requires_replica_sync(False)
    loss_fn(model(mine(x)), mine(y)).backward()
    comm.set_requires_replica_sync(True)
    backward_that_raises(model, mine(x), mine(y))
    comm.clip_grad_norm_(1.0)  # settles it too, as a step would
    opt.step()
    out["phase"] = comm.engine.phase.name
    out["grads"] = sum(p.grad is not None for p in model.parameters())
    comm.close()
    return out


@pytest.mark.timeout(120)
def test_the_flag_is_read_again_after_an_accuracy_forward_and_a_raised_backward_is_settled() -> None:
    for r in run_ranks(_interleaved_worker, 4, timeout_s=100):
        assert r["weights"] < 2e-6, r  # fp32 SGD: the sums' order (tests/parity.py's bound and reason)
        assert r["phase"] == "IDLE" and r["grads"] == 0, r


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "flags",
    [
        ["--vocab-parallel"],
        ["--vocab-parallel", "--replica-sync", "step"],
        ["--vocab-parallel", "--shard-outer", "--replica-sync", "step", "--state-sharding", "world"],
    ],
    ids=["micro", "step", "step-world-outer"],
)
def test_a_later_micro_steps_gradients_are_the_forecasts(flags: list[str], tmp_path) -> None:
    """isp-train --memory-breakdown at world 4 (wp 2 x 2), three micro-steps a step: in
    the forward of a later micro-step, the gradient shards (the vocab-parallel head's
    whole one among them, with the state over WP), the deferred sums and the replicated
    gradients that the earlier micro-steps left are what the forecast of the run's flags
    counts, each to a few bytes (AdamW's step counts aside, tests/test_memory_breakdown.py)."""
    import json

    from tests.test_memory_breakdown import SCALARS
    from tests.test_train import SMALL, isp_train

    out = tmp_path / "run"
    res = isp_train(4, *SMALL, "--wp", "2", "--grad-accum", "3", "--steps", "3", *flags, "--memory-breakdown",
                    "--no-trace", "--out", str(out))  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads((out / "memory_breakdown.json").read_text())
    have, want = got["ranks"][0]["phases"]["forward"], got["forecast"]["forward"]
    for part in ("gradient shards", "deferred gradient sums", "replicated grads"):
        assert abs(have.get(part, 0) - want.get(part, 0)) <= SCALARS, (part, have, want)
    assert have.get("deferred gradient sums", 0) > 0 or "step" not in flags, have
