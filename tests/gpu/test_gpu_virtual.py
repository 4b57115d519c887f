"""The virtual backend's device-side delay on a GPU (skipped without CUDA): a
collective modelled at 2 ms takes 2 ms on the compute stream's clock, within 5%,
and the host does not wait for it; collectives on NVLink and InfiniBand run at once,
two on one link take turns."""

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


def _tiers(rank: int, world: int, case: str) -> dict:
    """A 4 ms all-gather on NVLink (the WP group of 8) and one on InfiniBand (the 8
    replicas, one a node), or two on InfiniBand, issued together on one GPU: their
    time on the compute stream's clock. The links at their published bandwidths (450e9
    and 50e9 bytes/s), no NCCL share, no latency (tests/test_virtual_tiers.py runs the
    same on a host runtime)."""
    import dataclasses

    from isp_comm import ParallelGroups
    from isp_comm.planner.links import ProfileLink
    from isp_comm.planner.profile import COLLECTIVES, Link, from_target
    from isp_comm.planner.targets import parse_target
    from isp_comm.virtual import virtual_backend

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    groups = ParallelGroups.create(wp_size=8)
    links = {
        "intra": dict.fromkeys(COLLECTIVES, Link(latency_s=0.0, bytes_per_s=450e9)),
        "inter": dict.fromkeys(COLLECTIVES, Link(latency_s=0.0, bytes_per_s=50e9)),
    }
    prof = dataclasses.replace(from_target(parse_target("h100x8", 8)), collectives={"torch": links})
    backend = virtual_backend(dev, ProfileLink(prof, "torch"))
    # 4 ms: 7/8 x B / bandwidth = 4e-3 (the gathered size on the IB link is 9x smaller)
    nv = round(4e-3 * 450e9 * 8 / 7 / 4 / 8) * 8
    ib = round(4e-3 * 50e9 * 8 / 7 / 4 / 8) * 8
    bufs = {n: (torch.empty(n, device=dev), torch.empty(n // 8, device=dev)) for n in (nv, ib)}
    issues = (
        [(nv, groups.wp_group), (ib, groups.replica_group)] if case == "two tiers" else [(ib, groups.replica_group)] * 2
    )
    for _ in range(2):  # warm-up
        for n, g in issues:
            backend.all_gather(*bufs[n], g).wait(10.0)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(10_000_000)  # the GPU busy while the host issues
    start.record()
    handles = [backend.all_gather(*bufs[n], g) for n, g in issues]
    for h in handles:
        h.wait(10.0)
    end.record()
    end.synchronize()
    backend.close()
    return {"device_s": start.elapsed_time(end) / 1e3}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case,modelled_s", [("two tiers", 0.004), ("one tier", 0.008)])
def test_nvlink_and_infiniband_run_at_once_and_one_link_is_shared(case: str, modelled_s: float) -> None:
    """[Note: the virtual backend on CUDA]: 4 ms on NVLink and 4 ms on InfiniBand take
    4 ms together; two 4 ms collectives on InfiniBand take 8 (5%: the spin's calibration
    and the 2 GB gathered output written beside the spin, about 1 ms at HBM speed)."""
    got = run_virtual(_tiers, 64, 0, case, timeout_s=100)
    assert got["device_s"] == pytest.approx(modelled_s, rel=0.05), got
