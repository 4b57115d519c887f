"""TorchBackend on CPU (gloo): collectives gloo would run wrong without a word."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from isp_comm.backends import TorchBackend
from isp_comm.testing import run_ranks

TIMEOUT = 20.0


def _unfit_cases(world: int, rank: int) -> list:
    """(name, issue, the tensor whose every element must stay 9) per case: strided
    outputs (each the even elements of a guard), sizes and dtypes that do not fit."""
    guard = torch.full((4 * world,), 9.0)
    strided = guard[::2]
    mine = torch.full((2,), float(rank + 1))
    return [
        ("all-reduce strided", lambda b, g: b.all_reduce(guard[: 2 * world : 2], g), guard),
        ("all-gather strided", lambda b, g: b.all_gather(strided, mine, g), guard),
        ("reduce-scatter strided", lambda b, g: b.reduce_scatter(guard[:4:2], mine.repeat(world), g), guard),
        ("all-to-all strided", lambda b, g: b.all_to_all(strided, torch.ones(2 * world), g), guard),
        ("all-to-all indivisible", lambda b, g: b.all_to_all(guard[: world + 1], torch.ones(world + 1), g), guard),
        ("all-gather one into two", lambda b, g: b.all_gather(guard[: 2 * world], mine[:1], g), guard),
        ("reduce-scatter one into two", lambda b, g: b.reduce_scatter(guard[:2], torch.ones(world), g), guard),
        ("all-gather dtypes", lambda b, g: b.all_gather(guard[: 2 * world], mine.double(), g), guard),
    ]


def _unfit_worker(rank: int, world: int) -> list[str]:
    torch.set_num_threads(1)
    backend, group, said = TorchBackend(), dist.group.WORLD, []
    for name, issue, guard in _unfit_cases(world, rank):
        try:
            issue(backend, group).wait(5.0)
            said.append(f"{name}: no error")
        except ValueError:
            said.append(f"{name}: refused")
        if not torch.equal(guard, torch.full_like(guard, 9.0)):
            said.append(f"{name}: wrote {guard.tolist()}")
    total = torch.ones(3)
    backend.all_reduce(total, group).wait(TIMEOUT)  # the group is still in step
    said.append(f"in step {total.tolist() == [float(world)] * 3}")
    return said


@pytest.mark.timeout(90)
def test_what_gloo_would_run_wrong_is_refused_before_anything_is_sent() -> None:
    """See [Note: what gloo does not check]: each case is a ValueError on every rank,
    the guard is untouched and the group stays in step."""
    for said in run_ranks(_unfit_worker, 2, timeout_s=80):
        assert said == [f"{name}: refused" for name, _, _ in _unfit_cases(2, 0)] + ["in step True"], said


def _reduce_scatter_into_another_chunk_worker(rank: int, world: int) -> list[float]:
    torch.set_num_threads(1)
    inp = torch.arange(1.0, 2 * world + 1) * (rank + 1)
    TorchBackend().reduce_scatter(inp[:2], inp, dist.group.WORLD).wait(TIMEOUT)  # chunk 0, on every rank
    return inp[:2].tolist()


@pytest.mark.timeout(60)
def test_reduce_scatter_whose_output_is_another_chunk_of_its_input() -> None:
    """The chunks sent to the peers are copied before the output is written: on rank
    1 the output is chunk 0, which it sends to rank 0."""
    got = run_ranks(_reduce_scatter_into_another_chunk_worker, 2, timeout_s=50)
    assert got == [[3.0, 6.0], [9.0, 12.0]], got
