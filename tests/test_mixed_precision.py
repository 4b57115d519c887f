"""bf16 compute from fp32 master shards; gradients reduced in reduce_dtype."""

from __future__ import annotations

import pytest
import torch

from isp_comm import ISPCommunicator, ISPConfig, ParallelGroups
from isp_comm.testing import run_ranks
from models.llama import build
from tests.parity import Case, batches, loss_fn, max_diff, train_isp, train_reference


def _dtype_worker(rank: int, world: int) -> dict:
    case = Case()
    model = build(case.model_config())
    cfg = ISPConfig(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    comm = ISPCommunicator(model, ParallelGroups.create(wp_size=world), cfg)
    seen = {}
    lin = model.layers[1].mlp.up_proj
    h = lin.register_forward_hook(lambda m, i, o: seen.update(w=m.weight.dtype, x=i[0].dtype, out=o.dtype))
    x, y = batches(case, world)[0][0]
    before = comm.stats()
    loss = loss_fn(model(x.chunk(world)[rank]), y.chunk(world)[rank])
    loss.backward()
    after = comm.stats()
    h.remove()
    u = comm.units[1]
    out = {
        "seen": seen,
        "shard": lin.weight.dtype,
        "grad": lin.weight.grad.dtype,
        "norm_grad": model.layers[1].mlp_norm.weight.grad.dtype,
        "gather_bytes": after["bytes_gathered"] - before["bytes_gathered"],
        "reduce_bytes": after["bytes_reduced"] - before["bytes_reduced"],
        "gathered_numel": sum(v.gathered_numel for v in comm.units),
        "u1": u.gathered_numel,
    }
    comm.close()
    return out


@pytest.mark.timeout(90)
def test_bf16_compute_fp32_master_and_reduce() -> None:
    for r in run_ranks(_dtype_worker, 2, timeout_s=80):
        assert r["seen"] == {"w": torch.bfloat16, "x": torch.bfloat16, "out": torch.bfloat16}
        assert r["shard"] == r["grad"] == r["norm_grad"] == torch.float32
        n = r["gathered_numel"]
        assert r["gather_bytes"] == 2 * n * 2  # forward + backward, 2 bytes per element
        assert r["reduce_bytes"] == n * 4  # one fp32 reduce-scatter per block


def _bf16_train(rank: int, world: int, reduce_dtype) -> dict:
    case = Case(optim="sgd", micro=2, ckpt=0.5, bias=True)
    sd, losses, _ = train_isp(case, rank, world, world, param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)
    ref, ref_losses = train_reference(case, world)
    return {"diff": max_diff(sd, ref), "loss": max(abs(a - b) for a, b in zip(losses, ref_losses))}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("reduce_dtype", [torch.float32, None])
def test_bf16_training_tracks_fp32(reduce_dtype) -> None:
    for r in run_ranks(_bf16_train, 2, reduce_dtype, timeout_s=100):
        # bf16 has 8 mantissa bits (relative error 2^-9 ~ 2e-3 per rounding): the loss
        # agrees to a few 1e-3 and three SGD steps move weights by lr * grad error.
        assert r["loss"] < 2e-2, r
        assert r["diff"] < 5e-3, r
