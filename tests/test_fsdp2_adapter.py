"""FSDP2 with isp-comm's symmetric-memory collectives trains like FSDP2 with gloo."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.fsdp import fully_shard

from isp_comm.backends import SymmCpuBackend
from isp_comm.integrations.fsdp2 import use_symm_collectives
from isp_comm.testing import run_ranks
from tests.parity import Case, batches, loss_fn, max_diff, train_reference


def _fsdp_worker(rank: int, world: int, symm: bool) -> tuple[float, int]:
    case = Case(optim="sgd", micro=1, bias=True)
    model = case.build()
    mods = [*model.layers, model]
    for m in mods:
        fully_shard(m)
    backend = use_symm_collectives(mods) if symm else None
    assert backend is None or isinstance(backend, SymmCpuBackend)  # chosen by the parameters' device
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in batches(case, world):
        for x, y in step:
            loss_fn(model(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
        opt.step()
        opt.zero_grad()
    sd = {k: v.full_tensor() for k, v in model.state_dict().items()}
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
