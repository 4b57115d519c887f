"""The collectives outside the block schedule (``comm.all_reduce``,
``comm.all_gather_object``, the clip's norm): through the backend, with the
communicator's deadline, on gloo and on CPU shared memory."""

from __future__ import annotations

import time

import pytest
import torch

from isp_comm import ISPCommTimeout, ISPCommunicator, ISPConfig, ParallelGroups
from isp_comm.models.llama import LlamaConfig, build
from isp_comm.testing import run_ranks
from tests.parity import TINY


def _comm(backend: str, timeout_s: float = 60.0) -> ISPCommunicator:
    model = build(LlamaConfig(**TINY), seed=0)
    return ISPCommunicator(model, ParallelGroups.create(wp_size=1), ISPConfig(backend=backend, timeout_s=timeout_s))


def _worker(rank: int, world: int, backend: str) -> tuple:
    comm = _comm(backend)
    total = comm.all_reduce(torch.tensor([rank + 0.5, 1.0], dtype=torch.float64), what="a test sum")
    # uneven lengths: the padding must not leak into the objects
    objs = comm.all_gather_object({"rank": rank, "text": "x" * (7 * rank + 1)}, what="a test gather")
    stats_before = comm.stats()["all_reduces"]
    comm.close()
    return total.tolist(), objs, stats_before


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", ["torch", pytest.param("symm", marks=pytest.mark.slow)])
def test_all_reduce_and_object_gather(backend: str) -> None:
    world = 3
    for total, objs, _ in run_ranks(_worker, world, backend, timeout_s=100):
        assert total == [0.5 + 1.5 + 2.5, 3.0]  # exact: small halves in float64
        assert objs == [{"rank": r, "text": "x" * (7 * r + 1)} for r in range(world)]


def _stalled(rank: int, world: int, backend: str) -> tuple[str, float] | None:
    comm = _comm(backend, timeout_s=3.0)
    comm.all_reduce(torch.ones(2), what="a first step's all-reduce")  # every rank: the group is set up
    if rank == 1:  # never joins the next all-reduce; exits after the others gave up
        time.sleep(8.0)
        return None
    t0 = time.monotonic()
    try:
        comm.all_reduce(torch.ones(2), what="the step's loss all-reduce")
    except ISPCommTimeout as exc:
        return str(exc), time.monotonic() - t0
    return "no timeout", time.monotonic() - t0


@pytest.mark.serial  # a 3 s deadline, timed
@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", [pytest.param("torch", marks=pytest.mark.slow), "symm"])
def test_a_stalled_peer_ends_the_all_reduce_at_the_deadline(backend: str) -> None:
    """The loss all-reduce waits under ``ISPConfig.timeout_s`` (3 s here), not the
    process group's 30 minutes, and its message names what and which rank."""
    results = run_ranks(_stalled, 3, backend, timeout_s=100)
    for rank in (0, 2):
        message, waited = results[rank]
        assert "the step's loss all-reduce" in message and f"rank {rank}" in message, message
        assert waited < 3.0 + 4.0, waited  # the deadline plus a generous margin for a loaded machine
