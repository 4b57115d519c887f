"""The virtual backend's device-side delay on a GPU (skipped without CUDA): a
collective modelled at 2 ms takes 2 ms on the compute stream's clock, within 5%,
and the host does not wait for it."""

from __future__ import annotations

import time

import pytest
import torch

from isp_comm.testing import run_virtual

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _timed(rank: int, world: int, modelled_s: float, count: int) -> dict:
    from isp_comm import ParallelGroups
    from isp_comm.backends.virtual import FlatLink, ring_traffic
    from isp_comm.virtual import virtual_backend

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    groups = ParallelGroups.create(wp_size=world)
    inp = torch.randn(2**20, device=dev)  # 4 MiB a rank, 32 MiB gathered
    out = torch.empty(world * inp.numel(), device=dev)
    bw = ring_traffic("all_gather", world, out.numel() * 4) / modelled_s
    backend = virtual_backend(dev, FlatLink(bw))
    for _ in range(3):  # warm-up
        backend.all_gather(out, inp, groups.wp_group).wait(10.0)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(10_000_000)  # about 5 ms: the GPU is busy while the host issues, so no launch is timed
    start.record()
    t0 = time.perf_counter()
    for _ in range(count):
        backend.all_gather(out, inp, groups.wp_group).wait(10.0)  # the compute stream waits
    host_s = time.perf_counter() - t0
    end.record()
    end.synchronize()
    ok = bool((out.view(world, -1) == inp).all())
    backend.close()
    return {"device_s": start.elapsed_time(end) / 1e3 / count, "host_s": host_s, "local_bytes": ok}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("count", [1, 10])
def test_a_2ms_collective_takes_2ms_on_the_device(count: int) -> None:
    got = run_virtual(_timed, 8, 0, 0.002, count, timeout_s=100)
    assert got["device_s"] == pytest.approx(0.002, rel=0.05), got
    assert got["host_s"] < 0.5 * 0.002 * count, got  # issued without a host sleep
    assert got["local_bytes"]
