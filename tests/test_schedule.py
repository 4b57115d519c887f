"""When collectives happen: gathers per pass, prefetch order, timing independence."""

from __future__ import annotations

import pytest
import torch

from isp_comm import ISPCommunicator, ISPConfig, ParallelGroups
from isp_comm.models.llama import build
from isp_comm.testing import run_ranks
from tests.parity import Case, batches, loss_fn, train_isp


def _schedule_worker(rank: int, world: int, ckpt: float) -> dict:
    case = Case(ckpt=ckpt)
    model = build(case.model_config())
    comm = ISPCommunicator(model, ParallelGroups.create(wp_size=world), ISPConfig(activation_checkpointing=ckpt))
    n = len(comm.units)
    hook = comm.scheduler_hook()
    events = comm.record_events()
    x, y = batches(case, world)[0][0]
    hook.before_forward()
    loss = loss_fn(model(x.chunk(world)[rank]), y.chunk(world)[rank])
    fwd = list(events)
    hook.before_backward()
    loss.backward()
    hook.after_backward()
    bwd = events[len(fwd) :]
    stats = comm.stats()
    comm.close()
    return {"n": n, "fwd": fwd, "bwd": bwd, "stats": stats}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("ckpt", [0.0, 0.5, 1.0])
def test_gather_once_per_pass_and_prefetch_order(ckpt: float) -> None:
    for r in run_ranks(_schedule_worker, 2, ckpt, timeout_s=100):
        n, fwd, bwd = r["n"], r["fwd"], r["bwd"]
        # Exactly one gather of each block per forward and per backward, whatever the
        # checkpoint ratio (the recompute reuses the backward gather).
        assert sorted(i for k, i, _ in fwd if k == "all_gather") == list(range(n))
        assert sorted(i for k, i, _ in bwd if k == "all_gather") == list(range(n))
        assert sorted(i for k, i, _ in bwd if k == "reduce_scatter") == list(range(n))
        # Forward: block i+1's gather is issued before block i computes.
        for i in range(n - 1):
            assert fwd.index(("all_gather", i + 1, "forward")) < fwd.index(("compute", i, "forward")), fwd
        # Backward: block i-1's gather is issued before block i's backward computes, and
        # block i's reduce-scatter is issued before block i-1's backward computes.
        first_compute = {i: bwd.index(next(e for e in bwd if e[:2] == ("compute", i))) for i in range(n)}
        for i in range(1, n):
            assert bwd.index(("all_gather", i - 1, "backward")) < first_compute[i], bwd
            assert bwd.index(("reduce_scatter", i, "backward")) < first_compute[i - 1], bwd
        s = r["stats"]
        assert s["outstanding_handles"] == 0 and s["slots_held"] == 0 and s["slot_fallbacks"] == 0


def _delay_worker(rank: int, world: int, delay: float) -> tuple:
    case = Case(optim="adamw", micro=2, ckpt=0.5, bias=True, steps=2)
    sd, losses, _ = train_isp(case, rank, world, world, debug_delay_s=delay)
    return {k: v.clone() for k, v in sd.items()}, losses


@pytest.mark.slow  # 11 s; the CI tier's backends take random delays back to back
@pytest.mark.timeout(200)
def test_random_delays_change_nothing() -> None:
    plain = run_ranks(_delay_worker, 3, 0.0, timeout_s=90)
    delayed = run_ranks(_delay_worker, 3, 0.02, timeout_s=150)
    for (sd_a, loss_a), (sd_b, loss_b) in zip(plain, delayed):
        assert loss_a == loss_b  # bitwise: the reduction order does not depend on timing
        for k in sd_a:
            assert torch.equal(sd_a[k], sd_b[k]), k
