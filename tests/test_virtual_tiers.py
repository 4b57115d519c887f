"""Tiers of links (isp_comm/backends/tiers.py): the one link model of the planner and
the virtual world, checked against figures worked out by hand from the links'
published bandwidths and the collectives' bytes, never only against the model's
own functions.

The published figures used below, as arithmetic:

- NVLink 4: 900 GB/s bidirectional per H100 SXM (NVIDIA H100 data sheet), so
  450e9 bytes/s one way;
- InfiniBand: one ConnectX-7 NIC of 400 Gb/s per GPU (NVIDIA DGX H100 user guide:
  eight single-port ConnectX-7 for the compute fabric), so 400e9 / 8 = 50e9 bytes/s;
- NCCL's share of the link at 8 GiB and above: 0.82 inside a node (nccl-tests on
  8x H100 SXM without NVLS: all_reduce bus bandwidth about 369 GB/s, 369 / 450 =
  0.82) and 0.88 across nodes (multi-node nccl-tests at >= 1 GiB: 85-92% of the
  NIC's line rate);
- latency per ring step: 8 us inside a node, 15 us across (nccl-tests' small
  all_reduce on 8x H100: 10-20 us for the whole ring).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time

import pytest
import torch

from isp_comm import ISPConfig
from isp_comm.backends.tiers import INTER, INTRA, Demand, TierSchedule
from isp_comm.backends.virtual import SPIN_PRIORITY
from isp_comm.models.llama import LlamaConfig, build
from isp_comm.planner.links import ProfileLink, collective_demand
from isp_comm.planner.profile import COLLECTIVES, Link, from_target
from isp_comm.planner.step import _Clock, collective_time, step_time
from isp_comm.planner.targets import parse_target
from isp_comm.testing import run_virtual

NVLINK = 450e9  # bytes/s one way: 900 GB/s bidirectional (H100 SXM data sheet)
IB = 400e9 / 8  # bytes/s: one 400 Gb/s ConnectX-7 per GPU (DGX H100)
NVLINK_NCCL, IB_NCCL = 0.82, 0.88  # NCCL's share at >= 8 GiB (nccl-tests, see the module note)
LAT_NVLINK, LAT_IB = 8e-6, 15e-6  # seconds per ring step
GIB8 = 2**33  # bytes: at and beyond it NCCL's share is flat

SLACK_S = 0.030
"""How much later than its modelled end a CPU collective may complete: the comm
thread's wake-up on a 2-core machine shared with other jobs."""


def h100(nodes: int):
    return from_target(parse_target("h100x8", nodes))


def flat_h100(nodes: int):
    """h100x8's profile with the links at their published bandwidth, no NCCL share
    and no latency: a collective's time is its bytes over the bandwidth."""
    links = {
        INTRA: dict.fromkeys(COLLECTIVES, Link(latency_s=0.0, bytes_per_s=NVLINK)),
        INTER: dict.fromkeys(COLLECTIVES, Link(latency_s=0.0, bytes_per_s=IB)),
    }
    return dataclasses.replace(h100(nodes), collectives={"torch": links})


# ---- the rules, on an explicit clock ------------------------------------------------------
def test_tiers_run_at_once_and_a_tier_serves_one_collective_at_a_time() -> None:
    ms = 1e-3
    nv, ib = Demand(0.0, ((INTRA, 4 * ms),)), Demand(0.0, ((INTER, 4 * ms),))
    s = TierSchedule()  # a 4 ms collective on NVLink and one on InfiniBand, issued together: 4 ms
    assert (s.place(0.0, "wp", nv), s.place(0.0, "replica", ib)) == (pytest.approx(4 * ms), pytest.approx(4 * ms))
    s = TierSchedule()  # two on one link, in two groups: the second ends at 8 ms
    assert (s.place(0.0, "a", ib), s.place(0.0, "b", ib)) == (pytest.approx(4 * ms), pytest.approx(8 * ms))
    s = TierSchedule()  # ... and in one group
    assert (s.place(0.0, "a", ib), s.place(0.0, "a", ib)) == (pytest.approx(4 * ms), pytest.approx(8 * ms))
    s = TierSchedule()  # latency holds the group, not the tier
    lat = Demand(1 * ms, ((INTRA, 4 * ms),))
    assert s.place(0.0, "a", lat) == pytest.approx(5 * ms)
    assert s.place(0.0, "b", nv) == pytest.approx(8 * ms)  # the tier was free at 4 ms
    assert s.place(0.0, "a", nv) == pytest.approx(12 * ms)  # group a was busy to 5 ms, the tier to 8
    s = TierSchedule()  # a collective that depends on another starts when it ends
    assert s.place(0.0, "replica", ib, after=3 * ms) == pytest.approx(7 * ms)
    hier = Demand(0.0, ((INTRA, 2 * ms), (INTER, 3 * ms)))  # both tiers: the longer part
    assert TierSchedule().place(0.0, "wp", hier) == pytest.approx(3 * ms)
    assert s.busy == {INTER: pytest.approx(4 * ms)}


def test_the_planners_clock_runs_each_tier_on_its_own() -> None:
    """The step model's clock (one TierSchedule): a 4 ms NVLink collective and a 4 ms
    InfiniBand one, issued together and waited for, cost the compute 4 ms, not 8."""
    ms = 1e-3
    nv, ib = Demand(0.0, ((INTRA, 4 * ms),)), Demand(0.0, ((INTER, 4 * ms),))
    clock = _Clock(overlap=True)
    a, b = clock.issue(nv, "wp"), clock.issue(ib, "replica")
    clock.wait(a)
    clock.wait(b)
    assert clock.t == pytest.approx(4 * ms) and clock.exposed == pytest.approx(4 * ms)
    clock = _Clock(overlap=True)
    a, b = clock.issue(ib, "wp"), clock.issue(ib, "replica")
    clock.wait(b)
    assert clock.t == pytest.approx(8 * ms)


# ---- the link model against hand arithmetic -------------------------------------------------
def test_a_collectives_time_from_published_figures() -> None:
    prof = h100(8)  # 8 nodes of 8 H100s
    nv_ag = 7 * LAT_NVLINK + 7 / 8 * GIB8 / (NVLINK * NVLINK_NCCL)  # WP 8 inside a node: 20.4 ms
    ib_ag = 7 * LAT_IB + 7 / 8 * GIB8 / (IB * IB_NCCL)  # 8 replicas, one a node: 170.9 ms
    # a WP group of 16 on 2 nodes, NCCL's ring over the 16, its channels spread over the
    # NICs: each link of a ring carries 15/16 of a channel's part (every chunk but one),
    # 7 of a node's 8 GPUs pass it on over NVLink (7/8 x 15/16 of 8 GiB), and each NIC
    # carries 15/16 of the 1/8 of the buffer its channels take; the longer part, and the
    # ring's 15 steps, 14 inside a node and 1 across
    hier = (
        14 * LAT_NVLINK
        + 1 * LAT_IB
        + max(7 / 8 * 15 / 16 * GIB8 / (NVLINK * NVLINK_NCCL), 15 / 16 * GIB8 / 8 / (IB * IB_NCCL))
    )
    cases = [
        ("all_gather", tuple(range(8)), nv_ag),
        ("reduce_scatter", tuple(range(0, 64, 8)), ib_ag),
        ("all_gather", tuple(range(16)), hier),
        ("all_reduce", tuple(range(8)), 2 * 7 * LAT_NVLINK + 2 * 7 / 8 * GIB8 / (NVLINK * NVLINK_NCCL)),
        # an all-reduce over 16 ranks on 2 nodes: twice the ring's bytes on each tier, in its
        # tree's steps (2 x 7 along the chain inside a node, 2 x 1 across the two nodes)
        (
            "all_reduce",
            tuple(range(16)),
            14 * LAT_NVLINK
            + 2 * LAT_IB
            + max(2 * 7 / 8 * 15 / 16 * GIB8 / (NVLINK * NVLINK_NCCL), 2 * 15 / 16 * GIB8 / 8 / (IB * IB_NCCL)),
        ),
        # the world's all-reduce, 64 ranks on 8 nodes: the tree's 2 x 7 steps inside and
        # 2 x log2(8) across (its ring would take 2 x 63), the ring's bytes
        (
            "all_reduce",
            tuple(range(64)),
            14 * LAT_NVLINK
            + 6 * LAT_IB
            + max(2 * 7 / 8 * 63 / 64 * GIB8 / (NVLINK * NVLINK_NCCL), 2 * 63 / 64 * GIB8 / 8 / (IB * IB_NCCL)),
        ),
        # an all-to-all over 16 ranks on 2 nodes: 7/16 of the input to its node, 8/16 out of its NIC
        ("all_to_all", tuple(range(16)), 7 * LAT_NVLINK + 1 * LAT_IB + 8 / 16 * GIB8 / (IB * IB_NCCL)),
    ]
    link = ProfileLink(prof, "torch")
    for op, ranks, expected in cases:
        assert link.seconds(op, ranks, GIB8) == pytest.approx(expected, rel=1e-9), (op, ranks)
    # the planner's call for the same groups: rank 0's WP group, its replicas strided over the world
    assert collective_time(prof, "torch", "all_gather", 8, GIB8) == pytest.approx(nv_ag, rel=1e-9)
    assert collective_time(prof, "torch", "reduce_scatter", 8, GIB8, 64) == pytest.approx(ib_ag, rel=1e-9)
    assert collective_time(prof, "torch", "all_gather", 16, GIB8) == pytest.approx(hier, rel=1e-9)
    d = collective_demand(prof, "torch", "all_gather", tuple(range(16)), GIB8)
    assert d.on(INTRA) == pytest.approx(105 / 128 * GIB8 / (NVLINK * NVLINK_NCCL), rel=1e-9)
    assert d.on(INTER) == pytest.approx(15 / 128 * GIB8 / (IB * IB_NCCL), rel=1e-9)


def test_a_node_with_one_nic_shares_it_among_its_gpus() -> None:
    """--network-gbit 400 on h100x8: a node's one 400 Gb/s NIC (50 GB/s) carries all
    its ring crossings; the default is the DGX's eight, 3,200 Gbit/s a node."""
    node = 400e9 / 8  # bytes/s out of a node: one ConnectX-7
    one_nic = ProfileLink(from_target(parse_target("h100x8", 4, network_gbit=400)), "torch")  # 4 nodes of 8
    # WP 16 on 2 nodes: the node sends its ring's 15/16 of the buffer out of its one NIC
    wp16 = (
        14 * LAT_NVLINK
        + 1 * LAT_IB
        + max(7 / 8 * 15 / 16 * GIB8 / (NVLINK * NVLINK_NCCL), 15 / 16 * GIB8 / (node * IB_NCCL))
    )
    assert one_nic.seconds("all_gather", tuple(range(16)), GIB8) == pytest.approx(wp16, rel=1e-9)
    # 4 replicas, one a node: a node's 8 replica groups each send 3/4 of their buffer at once
    replicas = 3 * LAT_IB + 8 * 3 / 4 * GIB8 / (node * IB_NCCL)
    assert one_nic.seconds("reduce_scatter", tuple(range(0, 32, 8)), GIB8) == pytest.approx(replicas, rel=1e-9)
    default, eight = (ProfileLink(from_target(parse_target("h100x8", 4, gbit)), "torch") for gbit in (0, 3200))
    for ranks in (tuple(range(16)), tuple(range(0, 32, 8))):
        assert default.seconds("all_gather", ranks, GIB8) == pytest.approx(eight.seconds("all_gather", ranks, GIB8))


def test_groups_spread_unevenly_over_nodes_go_at_the_pace_of_their_thinnest_node() -> None:
    """A WP group of 12 on nodes of 8 holds 8 ranks on one node and 4 on the next: the
    ring's crossings of the node of 4, 11/12 of the buffer, go through its 4 NICs. And a
    layout's groups differ: at WP 6, ranks 0-5 stay in node 0, ranks 6-11 span two."""
    from isp_comm.planner.links import slowest_group

    prof = h100(6)  # 6 nodes of 8 H100s, world 48
    nv = GIB8 / (NVLINK * NVLINK_NCCL)
    ib = GIB8 / (IB * IB_NCCL)
    wp12 = 10 * LAT_NVLINK + 1 * LAT_IB + max(7 / 8 * 11 / 12 * nv, 11 / 12 / 4 * ib)  # the node of 4 sets the pace
    assert ProfileLink(prof, "torch").seconds("all_gather", tuple(range(12)), GIB8) == pytest.approx(wp12, rel=1e-9)
    assert slowest_group(prof, "torch", "all_gather", 12, 48, False, GIB8).seconds == pytest.approx(wp12, rel=1e-9)
    # WP 6: group 0 inside node 0 (5/6 on NVLink); group 1 has 2 ranks on node 0 and
    # 4 on node 1: the pair carries the ring's 5/6 of the buffer through 2 NICs
    wp6 = 4 * LAT_NVLINK + 1 * LAT_IB + max(3 / 4 * 5 / 6 * nv, 5 / 6 / 2 * ib)
    assert slowest_group(prof, "torch", "all_gather", 6, 48, False, GIB8).seconds == pytest.approx(wp6, rel=1e-9)
    # the replicas of WP 6 (8 ranks strided by 6): ranks 0, 6, 12, ... lie 2 to a node
    # on some nodes, 1 on others; a node holding 1 receives 7/8 through its one NIC
    rep = 2 * LAT_NVLINK + 5 * LAT_IB + max(1 / 2 * 7 / 8 * nv, 7 / 8 * ib)  # 6 nodes: 2, 1, 1, 2, 1, 1
    assert slowest_group(prof, "torch", "reduce_scatter", 8, 48, True, GIB8).seconds == pytest.approx(rep, rel=1e-9)


def test_a_virtual_run_times_the_backend_the_planner_times(tmp_path) -> None:
    """--virtual-world --profile FILE models the collectives of the backend --plan
    times for the same flags (the profile's default for ``auto``): a calibrated CPU
    profile measures the shared-memory backend and gloo, and a virtual run took
    gloo's links while the plan took shared memory's."""
    from isp_comm.train.config import TrainConfig
    from isp_comm.train.virtual import link_model

    cpu = from_target(parse_target("cpux2"))
    assert {"symm", "torch"} <= set(cpu.collectives) and cpu.default_backend == "symm"
    path = str(tmp_path / "profile.json")
    cpu.save(path)
    for requested, timed in (("auto", "symm"), ("symm", "symm"), ("torch", "torch")):
        cfg = TrainConfig(virtual_world=2, profile=path, backend=requested)
        assert link_model(cfg).backend == timed, requested
    assert link_model(TrainConfig(virtual_world=16, target="h100x8", nodes=2)).backend == "torch"  # NCCL's


def test_the_step_models_traffic_on_each_tier_by_hand() -> None:
    """The step's collectives on a profile of published bandwidths alone (no NCCL share,
    no latency): world 16 on 2 nodes of 8, wp 8, two replicas (ranks 0 and 8: one a
    node, over InfiniBand). A block of the model below has 786,432 linear weights
    (q, o: 256 x 256; k, v: 128 x 256; gate, up, down: 768 x 256), fp32: 3,145,728
    bytes gathered and reduce-scattered; the embedding, head and norms (263,424
    elements) are replicated and all-reduced over the world."""
    cfg = LlamaConfig(vocab_size=512, hidden=256, ffn_hidden=768, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64)
    with torch.device("meta"):
        model = build(cfg)
    prof = flat_h100(2)
    block = (2 * 256 * 256 + 2 * 128 * 256 + 3 * 768 * 256) * 4
    whole = (2 * 512 * 256 + 5 * 256) * 4
    wp_ag = 7 / 8 * block / NVLINK  # the WP group: ranks 0-7, one node
    rep = 1 / 2 * (block / 8) / IB  # the WP shard over the 2 replicas
    # the world's all-reduce over 16 ranks on 2 nodes: 2 x 7/8 inside, 2 x 15/16 of 1/8 across
    world_ar = max(2 * 7 / 8 * 15 / 16 * whole / NVLINK, 2 * 15 / 16 * whole / 8 / IB)
    small = max(2 * 7 / 8 * 15 / 16 * 8 / NVLINK, 2 * 15 / 16 * 8 / 8 / IB)  # the loss and the flag: 8 bytes each
    kw = {"world": 16, "wp": 8, "sp": 1, "batch": 16, "seq": 64}
    memo: dict = {}
    for sharding, accum in (("wp", 1), ("world", 1), ("world", 2)):
        st = step_time(model, ISPConfig(), prof, **kw, grad_accum=accum, memo=memo, state_sharding=sharding)
        world = sharding == "world"
        expected = {
            "all_gather": accum * 2 * 2 * wp_ag + (2 * rep if world else 0.0),  # replica gathers once a step
            "reduce_scatter": accum * (2 * wp_ag + (2 * rep if world else 0.0)),
            "all_to_all": 0.0,
            "all_reduce": accum * (world_ar + (0.0 if world else 2 * 2 * rep)) + 2 * small,
        }
        assert st.comm_s == pytest.approx(expected, rel=1e-9), sharding
        inter = (2 if world else 0) * rep + accum * 2 * (1 if world else 2) * rep
        across = 2 * 15 / 16 * (accum * whole + 2 * 8) / 8 / IB  # the world's all-reduces' part across
        assert st.link_busy_s[INTER] == pytest.approx(inter + across, rel=1e-9)
    with pytest.raises(ValueError, match="state_sharding must be one of wp, world"):
        step_time(model, ISPConfig(), prof, **kw, state_sharding="replica")


# ---- the virtual backend on CPU: a comm thread -----------------------------------------------
def _tiers_on_cpu(rank: int, world: int) -> dict:
    """Rank 0 of 64 (8 nodes of 8 H100s), collectives on meta tensors of many GiB (their
    times are long enough to measure on a shared CPU; no memory is touched)."""
    import torch.distributed as dist

    from isp_comm import ParallelGroups
    from isp_comm.virtual import virtual_backend

    groups = ParallelGroups.create(wp_size=8)
    other = dist.new_group([0, 16, 32, 48])  # a second group across nodes
    backend = virtual_backend(torch.device("cpu"), ProfileLink(h100(8), "torch"))

    def gather(group, n: int, nbytes: int):
        out = torch.empty(nbytes // 4, device="meta")
        return backend.all_gather(out, torch.empty(nbytes // 4 // n, device="meta"), group)

    def timed(*issue) -> list[float]:
        t0 = time.perf_counter()
        handles = [f() for f in issue]
        ends = []
        for h in handles:
            h.wait(10.0)
            ends.append(time.perf_counter() - t0)
        return ends

    got = {
        "nvlink_and_ib": timed(
            lambda: gather(groups.wp_group, 8, 8 * GIB8), lambda: gather(groups.replica_group, 8, GIB8)
        ),
        "ib_two_groups": timed(lambda: gather(groups.replica_group, 8, GIB8), lambda: gather(other, 4, GIB8)),
        "ib_one_group": timed(
            lambda: gather(groups.replica_group, 8, GIB8), lambda: gather(groups.replica_group, 8, GIB8)
        ),
        "tier_s": backend.tier_s,
        "comm_s": backend.modelled_comm_s,
    }
    backend.close()
    return got


@pytest.mark.serial  # ends timed within 30 ms
@pytest.mark.timeout(120)
def test_the_virtual_world_runs_nvlink_and_infiniband_at_once_and_shares_each() -> None:
    got = run_virtual(_tiers_on_cpu, 64, 0, timeout_s=100)
    nv = 7 * LAT_NVLINK + 7 / 8 * (8 * GIB8) / (NVLINK * NVLINK_NCCL)  # 163.0 ms
    ib8 = 7 * LAT_IB + 7 / 8 * GIB8 / (IB * IB_NCCL)  # 170.9 ms
    ib4 = 3 * LAT_IB + 3 / 4 * GIB8 / (IB * IB_NCCL)  # 146.5 ms
    for name, ends in (
        ("nvlink_and_ib", (nv, ib8)),
        ("ib_two_groups", (ib8, ib8 + ib4)),
        ("ib_one_group", (ib8, 2 * ib8)),
    ):
        for measured, modelled in zip(got[name], ends):
            assert modelled <= measured <= modelled + SLACK_S, (name, got[name], ends)
    assert got["nvlink_and_ib"][1] < nv + ib8 - 0.1  # together: about the longer one, not the sum
    assert got["comm_s"] == pytest.approx(nv + 4 * ib8 + ib4, rel=1e-9)
    assert got["tier_s"][INTRA] == pytest.approx(nv - 7 * LAT_NVLINK, rel=1e-9)


# ---- the CUDA path on the host: streams as clocks of device time --------------------------------
class _Stream:
    def __init__(self, name: str, priority: int = 0) -> None:
        self.name, self.t, self.priority = name, 0.0, priority
        self.cuda_stream = id(self)

    def wait_stream(self, other: _Stream) -> None:
        self.t = max(self.t, other.t)

    def wait_event(self, event: _Event) -> None:
        self.t = max(self.t, event.t)

    def synchronize(self) -> None:
        return None


class _Event:
    def __init__(self, rt: TimedRuntime) -> None:
        self.rt, self.t = rt, 0.0

    def record(self, stream: _Stream | None = None) -> None:
        self.t = (stream or self.rt.current).t

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None

    def elapsed_time(self, other: _Event) -> float:
        return (other.t - self.t) * 1e3


class TimedRuntime:
    """The runtime seam (isp_comm/backends/streams.py) where each stream is a clock of
    device time: a kernel (``spin``) moves its stream's clock, a wait moves it to the
    event's; what a GPU does with streams, in order, without one."""

    def __init__(self) -> None:
        self.compute = _Stream("compute")
        self.current = self.compute
        self.streams: list[_Stream] = []
        self.recorded: list[tuple[int, str]] = []  # (tensor id, stream) of record_stream

    def stream(self, _device, priority: int = 0) -> _Stream:
        self.streams.append(_Stream(f"side {len(self.streams)}", priority))
        return self.streams[-1]

    def current_stream(self, _device) -> _Stream:
        return self.current

    @contextlib.contextmanager
    def use(self, stream: _Stream):
        before, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = before

    def event(self) -> _Event:
        return _Event(self)

    def record_stream(self, tensor: torch.Tensor, stream: _Stream) -> None:
        self.recorded.append((id(tensor), stream.name))

    def synchronize(self, _device) -> None:
        return None

    def device_context(self, _device):
        return contextlib.nullcontext()

    def spin(self, seconds: float) -> None:
        """The stand-in of ``torch.cuda._sleep`` on the current stream."""
        self.current.t += seconds


def _tiers_on_streams(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from isp_comm import ParallelGroups
    from isp_comm.backends.virtual import VirtualBackend

    groups = ParallelGroups.create(wp_size=8)
    other = dist.new_group([0, 16, 32, 48])
    got = {}
    # 4 ms on NVLink over the WP group: 7/8 x B / 450e9 = 4e-3; on InfiniBand over the 8
    # replicas: 7/8 x B / 50e9; over the 4 ranks of ``other``: 3/4 x B / 50e9
    sizes = {"nv": 4e-3 * NVLINK * 8 / 7, "ib8": 4e-3 * IB * 8 / 7, "ib4": 4e-3 * IB * 4 / 3}
    for case, issues in {
        "nvlink_and_ib": [("nv", groups.wp_group, 8), ("ib8", groups.replica_group, 8)],
        "ib_two_groups": [("ib8", groups.replica_group, 8), ("ib4", other, 4)],
        "ib_one_group": [("ib8", groups.replica_group, 8), ("ib8", groups.replica_group, 8)],
        "compute_between": [("nv", groups.wp_group, 8), ("spin", None, 0), ("nv", groups.wp_group, 8)],
    }.items():
        rt = TimedRuntime()
        backend = VirtualBackend(
            torch.device("cpu"), ProfileLink(flat_h100(8), "torch"), runtime=rt, delay=rt, record_streams=False
        )
        handles = []
        for size, group, n in issues:
            if size == "spin":  # the compute stream runs 10 ms of kernels between the issues
                rt.spin(10e-3)
                continue
            numel = round(sizes[size] / 4 / n) * n
            handles.append(backend.all_gather(torch.empty(numel), torch.empty(numel // n), group))
        ends = []
        for h in handles:
            h.wait(10.0)  # the compute stream waits for the collective's event
            ends.append(rt.compute.t)
        got[case] = ends
        got[case + "_recorded"] = rt.recorded
        got[case + "_priorities"] = sorted(s.priority for s in rt.streams)
        backend.close()
    rt = TimedRuntime()
    backend = VirtualBackend(torch.device("cpu"), ProfileLink(flat_h100(8), "torch"), runtime=rt, delay=rt)
    backend.all_gather(torch.empty(8), torch.empty(1), groups.wp_group).wait(1.0)
    got["recorded_by_default"] = len(rt.recorded)
    rt = TimedRuntime()  # 4 ms on NVLink and 1 ms of latency, twice in one group
    backend = VirtualBackend(torch.device("cpu"), _WithLatency(), runtime=rt, delay=rt, record_streams=False)
    for _ in range(2):
        backend.all_gather(torch.empty(8), torch.empty(1), groups.wp_group).wait(1.0)
    got["latency"], got["latency_priorities"] = rt.compute.t, sorted(s.priority for s in rt.streams)
    return got


class _WithLatency:
    """Every collective: 4 ms on NVLink, then 1 ms of latency."""

    def demand(self, op: str, ranks: tuple[int, ...], nbytes: int) -> Demand:
        return Demand(1e-3, ((INTRA, 4e-3),))

    def describe(self) -> str:
        return "4 ms on NVLink and 1 ms of latency"


@pytest.mark.timeout(120)
def test_the_cuda_path_gives_the_same_order_on_streams() -> None:
    """[Note: the virtual backend on CUDA] on a runtime whose streams keep device time:
    the same ends as the comm thread's rules, to the nanosecond (no host timing)."""
    got = run_virtual(_tiers_on_streams, 64, 0, timeout_s=100)
    ms = 1e-3
    assert got["nvlink_and_ib"] == pytest.approx([4 * ms, 4 * ms], abs=1e-9)  # not 8: two tiers
    assert got["ib_two_groups"] == pytest.approx([4 * ms, 8 * ms], abs=1e-9)  # one tier, two groups
    assert got["ib_one_group"] == pytest.approx([4 * ms, 8 * ms], abs=1e-9)
    # the second, issued after 10 ms of compute, starts then (its stream waits for the
    # caller's): it ends at 14 ms; the first ended at 4 ms, hidden behind the compute
    assert got["compute_between"] == pytest.approx([10 * ms, 14 * ms], abs=1e-9)
    assert got["nvlink_and_ib_recorded"] == [] and got["recorded_by_default"] == 2  # its input and output
    # two groups' streams at the default priority, the two tiers' ahead of them: a spin
    # must not queue behind the blocks of the kernel that fills the GPU when it starts
    assert got["nvlink_and_ib_priorities"] == [SPIN_PRIORITY, SPIN_PRIORITY, 0, 0] and SPIN_PRIORITY < -1  # FSDP2's: -1
    # the latency holds the group (the second starts after the first's 5 ms) and spins on
    # a high-priority stream of the group's own, as the tiers do
    assert got["latency"] == pytest.approx(10 * ms, abs=1e-9)
    assert got["latency_priorities"] == [SPIN_PRIORITY, SPIN_PRIORITY, 0]


# ---- the step model's schedule of the replicas' collectives, by hand ------------------------------
def _costs(n: int, **kw):
    """A micro-step of ``n`` blocks of 10 ms of compute each, every collective taking
    nothing unless given (``_Costs``' fields)."""
    from isp_comm.backends.tiers import NONE
    from isp_comm.planner.step import _Costs

    base = dict(
        fwd=[10e-3] * n, bwd=[10e-3] * n, outer=0.0, compute={}, land=[0.0] * n, pack=[0.0] * n, outer_land=0.0,
        outer_pack=0.0, grads=[True] * n, ag=[NONE] * n, rs=[NONE] * n, rep=[NONE] * n, rep_ag=[NONE] * n, a2a=NONE,
        vocab_fwd={}, vocab_bwd={}, outer_ag=NONE, outer_rs=NONE, outer_rep=NONE, outer_rep_ag=NONE, repl_ar=NONE,
        summed=NONE, summed_ag=NONE, n_ckpt=0, max_inflight=2, send=[0.0] * n, outer_send=0.0,
        piece_send=[0.0] * n, unpack=[0.0] * n, outer_refresh=0.0,
    )  # fmt: skip
    return _Costs(**{**base, **kw})


def test_the_replica_gathers_run_two_blocks_ahead_and_hold_the_wp_gather() -> None:
    """state_sharding="world", the first forward: 4 blocks of 10 ms, a WP gather of 2 ms
    on NVLink, a replica gather of 15 ms on InfiniBand (REPLICA_GATHER_AHEAD = 2). Before
    a block's WP gather is issued the compute stream waits for its replica gather (to
    unpack it), as ``WeightRefresh.ensure`` does. By hand: replica gathers of blocks 0
    and 1 at 0 ms (0-15, 15-30 on InfiniBand); the compute stream waits for replica 0
    (15), WP gather 0 15-17, waited (17); issuing WP gather 1 waits for replica 1 (30),
    WP 1 30-32, replica 2 30-45, block 0 computes 30-40; block 1 waits for replica 2
    (45; WP 2 45-47, replica 3 45-60) and computes 45-55; block 2 waits for replica 3
    (60; WP 3 60-62), computes 60-70; block 3 70-80; the last block's gather again for
    the backward, 80-82, not waited here. Waits: 15 + 2 + 13 + 5 + 5 ms."""
    from isp_comm.planner.step import REPLICA_GATHER_AHEAD, _forward

    assert REPLICA_GATHER_AHEAD == 2
    ms = 1e-3
    wp_ag, rep_ag = Demand(0.0, ((INTRA, 2 * ms),)), Demand(0.0, ((INTER, 15 * ms),))
    clock = _Clock(overlap=True)
    _forward(clock, _costs(4, ag=[wp_ag] * 4, rep_ag=[rep_ag] * 4), first=True)
    assert clock.t == pytest.approx(80 * ms) and clock.exposed == pytest.approx(40 * ms)
    clock = _Clock(overlap=True)  # a later micro-step: no replica gathers, WP gathers hidden but the first
    _forward(clock, _costs(4, ag=[wp_ag] * 4, rep_ag=[rep_ag] * 4), first=False)
    assert clock.t == pytest.approx(42 * ms) and clock.exposed == pytest.approx(2 * ms)


def test_a_blocks_replica_reduce_scatter_follows_its_wp_reduce_scatter() -> None:
    """Backward of 2 blocks of 10 ms: WP reduce-scatters of 2 ms on NVLink, the shard's
    replica reduce-scatter of 15 ms on InfiniBand, issued when the next block's WP
    reduce-scatter is (or when backward drains) and started after its own ends. By hand:
    block 1 computes 0-10, its WP reduce-scatter 10-12; block 0 10-20, its WP
    reduce-scatter 20-22 and then block 1's replica one 20-35; the drain waits for it
    (35), issues block 0's (35-50) and waits (50)."""
    from isp_comm.planner.step import _backward

    ms = 1e-3
    rs, rep = Demand(0.0, ((INTRA, 2 * ms),)), Demand(0.0, ((INTER, 15 * ms),))
    clock = _Clock(overlap=True)
    _backward(clock, _costs(2, rs=[rs] * 2, rep=[rep] * 2), last=0.0)
    assert clock.t == pytest.approx(50 * ms) and clock.exposed == pytest.approx(30 * ms)
    assert clock.links.busy == {INTRA: pytest.approx(4 * ms), INTER: pytest.approx(30 * ms)}
