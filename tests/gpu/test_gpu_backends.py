"""GPU backends against NCCL (skipped without CUDA; CI has no GPU and never runs them)."""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"
)


def _worker(rank: int, world: int, name: str) -> None:
    import torch.distributed as dist

    from isp_comm.backends import make_backend

    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    backend = make_backend(name, dev, 60.0)
    group = dist.group.WORLD
    for dtype in (torch.float32, torch.bfloat16):
        for n in (1, 1000, 4099):
            g = torch.Generator(device="cpu").manual_seed(rank)
            inp = torch.randn(n, generator=g).to(dev, dtype)
            out, ref = torch.empty(world * n, device=dev, dtype=dtype), torch.empty(world * n, device=dev, dtype=dtype)
            backend.all_gather(out, inp, group).wait(60)
            dist.all_gather_into_tensor(ref, inp)
            assert torch.equal(out, ref)
            big = torch.randn(world * n, generator=g).to(dev, dtype)
            rs, rs_ref = torch.empty(n, device=dev, dtype=dtype), torch.empty(n, device=dev, dtype=dtype)
            backend.reduce_scatter(rs, big, group).wait(60)
            dist.reduce_scatter_tensor(rs_ref, big)
            # sums of `world` N(0, 1) values that differ from NCCL's only in summation order:
            # a few ulps in fp32; bf16 / fp16 keep 8 / 11 mantissa bits, so 1e-2 of O(1) values
            low = dtype != torch.float32
            torch.testing.assert_close(rs, rs_ref, rtol=1e-2 if low else 1e-5, atol=1e-2 if low else 1e-5)
    torch.cuda.synchronize()
    backend.close()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["symm", "nvshmem"])
def test_gpu_backend_matches_nccl(name: str) -> None:
    if name == "nvshmem":
        pytest.importorskip("nvshmem.core")
    import torch.multiprocessing as mp

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29561")
    mp.spawn(_run, args=(2, name), nprocs=2, join=True)


def _run(rank: int, world: int, name: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("nccl", rank=rank, world_size=world)
    try:
        _worker(rank, world, name)
    finally:
        dist.destroy_process_group()
