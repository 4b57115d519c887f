"""FSDP2 with isp-comm's symmetric-memory collectives trains like FSDP2 with gloo."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.fsdp import fully_shard

from isp_comm.backends import SymmCpuBackend
from isp_comm.integrations.fsdp2 import use_symm_collectives
from isp_comm.testing import run_ranks
from tests.parity import Case, batches, loss_fn, max_diff, train_reference


def _train(case: Case, model, rank: int, world: int) -> dict[str, torch.Tensor]:
    """SGD on the case's batches, each rank its slice; the full state dict after."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in batches(case, world):
        for x, y in step:
            loss_fn(model(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.full_tensor() for k, v in model.state_dict().items()}


def _fsdp_worker(rank: int, world: int, symm: bool) -> tuple[float, int]:
    case = Case(optim="sgd", micro=1, bias=True)
    model = case.build()
    mods = [*model.layers, model]
    for m in mods:
        fully_shard(m)
    backend = use_symm_collectives(mods) if symm else None
    assert backend is None or isinstance(backend, SymmCpuBackend)  # chosen by the parameters' device
    sd = _train(case, model, rank, world)
    symm_ops = 0
    if backend is not None:
        symm_ops = sum(g.epoch for g in backend._groups.values() if g is not None)
        backend.close()
    ref, _ = train_reference(case, world)
    return max_diff(sd, ref), symm_ops


@pytest.mark.timeout(120)
@pytest.mark.parametrize("symm", [False, True])
def test_fsdp2_with_symm_collectives(symm: bool) -> None:
    for err, symm_ops in run_ranks(_fsdp_worker, 2, symm, timeout_s=100):
        assert err < 2e-6  # fp32 SGD parity, as in test_engine_parity
        assert (symm_ops > 0) == symm  # the collectives really went through shared memory


def _hsdp_worker(rank: int, world: int) -> float:
    from torch.distributed.device_mesh import DeviceMesh

    from isp_comm import ParallelGroups
    from isp_comm.integrations.fsdp2 import BackendAllGather, BackendReduceScatter, BackendReplicaAllReduce

    case = Case(optim="sgd", micro=1, bias=True)
    model = case.build()
    groups = ParallelGroups.create(wp_size=2)  # shard over WP groups of 2, replicate over the 2 replicas
    mesh = DeviceMesh.from_group(groups.wp_group, "cpu")
    mods = [*model.layers, model]
    for m in mods:
        fully_shard(m, mesh=mesh)
    backend = SymmCpuBackend()
    for m in mods:
        m.set_custom_all_gather(BackendAllGather(backend, 60.0))
        m.set_custom_reduce_scatter(BackendReduceScatter(backend, 60.0))
        m.set_all_reduce_hook(BackendReplicaAllReduce(backend, groups.replica_group, 60.0))
    sd = _train(case, model, rank, world)
    backend.close()
    ref, _ = train_reference(case, world)
    return max_diff(sd, ref)


@pytest.mark.timeout(120)
def test_fsdp2_hybrid_sharding_through_the_all_reduce_hook() -> None:
    # world 4: FSDP2 over WP groups of 2, its gradients averaged over the 2 replicas by
    # the hook: single-process training (fp32 SGD parity, as in test_engine_parity)
    for err in run_ranks(_hsdp_worker, 4, timeout_s=100):
        assert err < 2e-6
