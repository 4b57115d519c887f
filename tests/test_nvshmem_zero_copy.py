"""NVSHMEM without copies, on CPU: the pool's buffers in the symmetric heap, the
pointer-level collectives on their slices, what orders a push into a buffer a peer
still reads, the heap sized from the plan, ``staged_bytes``, and close after a
failed step. The fakes are in tests/fakes.py: :class:`FakeNvshmem` (collectives over
gloo, every call bound to the installed nvshmem4py's signature) and
:class:`PushingNvshmem` (processes as PEs, heaps in shared memory, puts after random
delays). None of this has run on a GPU (see docs/gpus.md)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from isp_comm.backends import nvshmem_backend
from isp_comm.backends.nvshmem_backend import HEAP_GRANULARITY, HEAP_MARGIN, heap_size_for, scratch_need
from isp_comm.backends.streams import HostRuntime
from isp_comm.memory_pool import copied_collectives
from isp_comm.testing import run_ranks

nvshmem = pytest.importorskip("nvshmem.core", reason="the test extra installs nvshmem4py-cu13 (Linux x86-64)")
nvshmem_bindings = pytest.importorskip("nvshmem.bindings")


def _backend(fake):
    from tests.fakes import Checked, FakeBindings, _Device

    api = nvshmem_backend.NvshmemApi(Checked(fake, nvshmem), _Device, Checked(FakeBindings(fake), nvshmem_bindings))
    return nvshmem_backend.NvshmemBackend(torch.device("cpu"), 60.0, api=api, runtime=HostRuntime())


# ---- the heap: sized from the plan ------------------------------------------------------------
def test_scratch_of_planned_collectives_adds_every_size_and_sizes_each_destination() -> None:
    """Finding: ``reserve`` once kept the largest size per lane (the sizes of a lane
    each get their own scratch, so they add up), sized an all-reduce's destination as
    a reduce-scatter's (nbytes / world) and counted one bucket size where each gets its
    own three buffers (a source and two destinations)."""
    assert scratch_need("all_reduce", [100], 4) == 100 + 2 * 100  # the destination is whole
    assert scratch_need("reduce_scatter", [100], 4) == 100 + 2 * 25
    assert scratch_need("all_gather", [10], 4) == 10 + 2 * 40
    assert scratch_need("all_reduce", [100, 60, 100], 4) == 300 + 180  # each distinct size, once
    assert scratch_need("all_to_all", [0], 2) == 0
    # the collectives a wrap plans: pooled blocks run on the pool (none listed), the outer
    # unit's gather and reduce-scatter, the replica all-reduce, the world's of replicated params
    got = copied_collectives((2, 2, 4), True, [(8, [16]), (8, [16])], (4, [8, 8]), [("all_reduce", [8, 8])], 40)
    assert got == [
        ("wp", "all_gather", [4]),
        ("wp", "reduce_scatter", [8, 8]),
        ("replica", "all_reduce", [8, 8]),
        ("world", "all_reduce", [40]),
    ]
    unpooled = copied_collectives((4, 1, 4), False, [(8, [16, 4]), (6, [12])], None, [("all_reduce", [4, 1, 3])], 0)
    assert unpooled == [("wp", "all_gather", [8, 6]), ("wp", "reduce_scatter", [16, 4, 12])]


def test_heap_size_set_when_unset_is_the_plan_plus_margin_in_nvshmem_granules() -> None:
    assert heap_size_for(0) == HEAP_GRANULARITY
    assert heap_size_for(HEAP_GRANULARITY - HEAP_MARGIN) == HEAP_GRANULARITY
    assert heap_size_for(HEAP_GRANULARITY - HEAP_MARGIN + 1) == 2 * HEAP_GRANULARITY


def _heap_worker(rank: int, world: int) -> dict:
    from tests.fakes import FakeNvshmem

    os.environ.pop("NVSHMEM_SYMMETRIC_SIZE", None)
    fake = FakeNvshmem(heap_bytes=1 << 40)
    backend = _backend(fake)
    group = dist.group.WORLD
    pair = dist.new_group([0, 1])  # at world 4 NCCL's (here gloo's): counts nothing
    before = fake.pe
    gathered, bucket = 1 << 20, 3 << 20
    backend.plan_symmetric(group, 5 << 20, [(group, "all_gather", [gathered]), (pair, "all_reduce", [bucket])])
    seen = {
        "initialized before the plan": before is not None,
        "set": os.environ.get("NVSHMEM_SYMMETRIC_SIZE"),
        "heap": backend.device_heap_bytes,
        "need": (5 << 20) + gathered + 2 * gathered * world + (0 if world > 2 else 3 * bucket),
    }
    backend.close()
    seen["after close"] = os.environ.get("NVSHMEM_SYMMETRIC_SIZE")
    return seen


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 4])
def test_nvshmem_heap_is_sized_from_the_plan_before_init(world: int) -> None:
    """Unset, ``NVSHMEM_SYMMETRIC_SIZE`` is set from the plan before NVSHMEM starts (and
    unset again at close); only world-sized groups count (the others are NCCL's)."""
    for seen in run_ranks(_heap_worker, world, timeout_s=100):
        assert seen["initialized before the plan"] is False, seen
        assert seen["set"] == str(heap_size_for(seen["need"])) and seen["heap"] == heap_size_for(seen["need"]), seen
        assert seen["after close"] is None, seen


# ---- the collectives on the pool's buffers ------------------------------------------------------
def _direct_worker(rank: int, world: int) -> dict:
    """Gathers and reduce-scatters between slices of heap buffers, at offsets and with
    uneven sizes, in the three dtypes, against torch.distributed; then one that copies."""
    from tests.fakes import FakeNvshmem

    fake = FakeNvshmem()
    backend = _backend(fake)
    group, checked = dist.group.WORLD, 0
    backend.plan_symmetric(group, 1 << 16, [])
    for dt in (torch.float32, torch.bfloat16, torch.float16):
        send, land, out = (backend.empty(4096, dt, torch.device("cpu"), group) for _ in range(3))
        for n, at in ((7, 3), (1, 0), (250, 11)):
            g = torch.Generator().manual_seed(rank * 31 + n)
            x = torch.randn(n, generator=g).to(dt)
            send[at : at + n].copy_(x)
            region = land[5 : 5 + n * world]
            backend.all_gather(region, send[at : at + n], group).wait(60)
            ref = torch.empty(n * world, dtype=dt)
            dist.all_gather_into_tensor(ref, x)
            assert torch.equal(region, ref), (dt, n)
            big = torch.randn(n * world, generator=g).to(dt)
            land[at : at + n * world].copy_(big)
            backend.reduce_scatter(out[9 : 9 + n], land[at : at + n * world], group).wait(60)
            rs_ref = torch.empty(n, dtype=dt)
            dist.reduce_scatter_tensor(rs_ref, big)
            tol = dict(rtol=1e-5, atol=1e-5) if dt == torch.float32 else dict(rtol=1e-2, atol=2e-2)
            torch.testing.assert_close(out[9 : 9 + n], rs_ref, **tol)
            checked += 2
    staged = backend.staged_bytes
    backend.all_reduce(torch.ones(6), group).wait(60)  # not in the heap: copied in and out
    result = {
        "checked": checked,
        "staged before the copy": staged,
        "staged by the copy": backend.staged_bytes - staged,
        "direct": (backend.direct_all_gathers, backend.direct_reduce_scatters),
        "calls": list(fake.calls),
    }
    backend.close()
    return result


@pytest.mark.timeout(200)
@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_pool_collectives_run_on_heap_slices_without_copies(world: int) -> None:
    for r in run_ranks(_direct_worker, world, timeout_s=180):
        assert r["checked"] == 18 and r["direct"] == (9, 9), r
        assert r["staged before the copy"] == 0 and r["staged by the copy"] == 2 * 6 * 4, r
        # every pool collective is a pointer-level one, each after a team sync
        assert r["calls"][:-1] == ["sync", "fcollect@ptr", "sync", "reducescatter@ptr"] * 9, r
        assert r["calls"][-1] == "reduce", r


def _in_place_worker(rank: int, world: int) -> dict:
    """A gather whose output holds its input (at this rank's chunk) and a
    reduce-scatter whose output is this rank's chunk of its input, both on the heap."""
    from tests.fakes import FakeNvshmem

    backend = _backend(FakeNvshmem())
    group, n = dist.group.WORLD, 5
    backend.plan_symmetric(group, 1 << 16, [])
    buf = backend.empty(n * world, torch.float32, torch.device("cpu"), group)
    mine = buf[rank * n : (rank + 1) * n]
    mine.copy_(torch.arange(n) + 10.0 * rank)
    backend.all_gather(buf, mine, group).wait(60)
    gathered = torch.equal(buf, torch.cat([torch.arange(n) + 10.0 * r for r in range(world)]))
    buf.copy_(torch.arange(n * world) + 100.0 * rank)
    backend.reduce_scatter(mine, buf, group).wait(60)
    want = sum(torch.arange(n * world) + 100.0 * r for r in range(world))[rank * n : (rank + 1) * n]
    direct = (backend.direct_all_gathers, backend.direct_reduce_scatters)
    result = {"right": (gathered, torch.equal(mine, want)), "direct": direct}
    backend.close()
    return result


@pytest.mark.timeout(120)
def test_an_in_place_collective_on_the_heap_goes_through_the_scratch() -> None:
    """NVSHMEM's collectives do not say that a destination may overlap the source:
    an output lying on its input takes the copying path (none runs on the buffers)."""
    for r in run_ranks(_in_place_worker, 2, timeout_s=100):
        assert r == {"right": (True, True), "direct": (0, 0)}, r


# ---- ordering: a push into a buffer a peer still reads --------------------------------------------
def _ordering_worker(rank: int, world: int, landing: bool, sync: bool) -> dict:
    """The engine's use of the pool at ``comm_granularity="module"`` (gathers straight
    into two slots, the next block's issued before the compute that reads the other)
    or ``"block"`` (every gather into one landing buffer, copied into the slot before
    the next is issued), on :class:`PushingNvshmem`. Rank 0 reads slowly; a peer ahead
    of it pushes its next gather as soon as it issues it."""
    import time

    from tests.fakes import PushingNvshmem

    fake = PushingNvshmem(heap_bytes=1 << 16, max_delay_s=0.002, seed=rank)
    if not sync:  # the backend as it would be without its team sync
        fake.team_sync_on_stream = lambda team, stream: 0
    backend = _backend(fake)
    group, cpu, n, blocks = dist.group.WORLD, torch.device("cpu"), 32, 10
    backend.plan_symmetric(group, 4 * 4 * n * world, [])
    slots = [backend.empty(n * world, torch.float32, cpu, group) for _ in range(2)]
    land, send = backend.empty(n * world, torch.float32, cpu, group), backend.empty(n, torch.float32, cpu, group)

    def block(i: int, pe: int) -> torch.Tensor:
        return torch.arange(n, dtype=torch.float32) + 1000.0 * i + 100.0 * pe

    def want(i: int) -> torch.Tensor:
        return torch.cat([block(i, pe) for pe in range(world)])

    def gather(i: int, into: torch.Tensor) -> None:
        send.copy_(block(i, rank))
        backend.all_gather(into, send, group).wait(60)

    slow = 0.015 if rank == 0 else 0.0
    wrong = 0
    if not landing:
        gather(0, slots[0])
    for i in range(blocks):
        slot = slots[i % 2]
        if landing:  # gather into the landing buffer, copy it out slowly, PE chunk by chunk
            gather(i, land)
            for pe in range(world):
                time.sleep(slow)
                slot[pe * n : (pe + 1) * n].copy_(land[pe * n : (pe + 1) * n])
            wrong += not torch.equal(slot, want(i))
        else:  # prefetch the next block into the other slot, then compute on this one
            if i + 1 < blocks:
                gather(i + 1, slots[(i + 1) % 2])
            for _ in range(3):
                wrong += not torch.equal(slot, want(i))
                time.sleep(slow)
    backend.close()
    return {"wrong": wrong, "direct": backend.direct_all_gathers, "syncs": fake.calls.count("sync")}


def _ordering_cases(rank: int, world: int) -> dict:
    cases = [(landing, sync) for landing in (False, True) for sync in (True, False)]
    return {case: _ordering_worker(rank, world, *case) for case in cases}


@pytest.mark.serial  # the race needs rank 1 to run in rank 0's 15 ms sleeps
@pytest.mark.timeout(200)
def test_a_push_never_lands_in_a_buffer_a_peer_still_reads() -> None:
    """[Note: what orders a push into a pool buffer]: with the team sync before each
    collective no rank ever reads a peer's next block in the buffer it is reading
    (slots, and the landing buffer); the same runs with the sync made a no-op do (the
    test would catch its removal)."""
    ranks = run_ranks(_ordering_cases, 2, timeout_s=180)
    for landing in (False, True):
        synced = [r[(landing, True)] for r in ranks]
        assert all(r["wrong"] == 0 and r["direct"] == 10 and r["syncs"] == 10 for r in synced), (landing, synced)
        unsynced = [r[(landing, False)] for r in ranks]
        assert unsynced[0]["wrong"] > 0, (landing, unsynced)  # rank 0, the slow reader, saw rank 1's next block


# ---- the engine: parity, staged_bytes, close ------------------------------------------------------
def _train_worker(rank: int, world: int, backend: str, granularity: str, dtype: str) -> dict:
    """ISP training at wp = world on ``backend`` (``nvshmem`` on the fakes, or the CPU
    ``symm`` backend) against single-process training, the replicated parameters frozen
    so that every collective of a step is a pool gather or reduce-scatter, but for the
    checks of the weights (the first forward's, backward 2's: small all-gathers out of
    the schedule, [Note: replicas that drift apart]), whose staged bytes are counted apart."""
    import isp_comm.communicator as communicator
    from isp_comm import ISPCommunicator, ISPConfig, ParallelGroups
    from isp_comm.collectives import StepCollectives
    from isp_comm.models.llama import LlamaConfig, build
    from tests.fakes import FakeNvshmem

    os.environ.pop("NVSHMEM_SYMMETRIC_SIZE", None)  # isp-comm sizes the heap
    fakes = []
    in_checks = [0]
    gather = StepCollectives.all_gather

    def counted(self, *args, **kwargs):
        before = self.backend.staged_bytes
        try:
            return gather(self, *args, **kwargs)
        finally:
            in_checks[0] += self.backend.staged_bytes - before

    StepCollectives.all_gather = counted  # this rank's process only

    def make(name, device, timeout_s):
        fakes.append(FakeNvshmem())
        return _backend(fakes[-1])

    if backend == "nvshmem":
        communicator.make_backend = make
    cfg = LlamaConfig(vocab_size=37, hidden=36, ffn_hidden=50, n_layers=3, n_heads=6, n_kv_heads=1)
    ref, model = build(cfg, seed=1), build(cfg, seed=1)
    param_dtype = torch.bfloat16 if dtype == "bf16" else None
    name = "symm" if backend == "symm" else "torch"  # nvshmem: make_backend is the fakes'
    config = ISPConfig(backend=name, comm_granularity=granularity, param_dtype=param_dtype)
    comm = ISPCommunicator(model, ParallelGroups.create(wp_size=world), config)
    for m in (ref, model):
        for name, p in m.named_parameters():
            if not comm.is_sharded(name):
                p.requires_grad_(False)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    ropt = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=0.1)
    staged, checks = [], []
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randint(0, 37, (2 * world, 7), generator=g), torch.randint(0, 37, (2 * world, 7), generator=g)
        before, checked = comm.stats()["staged_bytes"], in_checks[0]
        comm.cross_entropy(model(x[2 * rank : 2 * rank + 2]), y[2 * rank : 2 * rank + 2]).backward()
        opt.step(), opt.zero_grad()
        checks.append(in_checks[0] - checked)
        staged.append(comm.stats()["staged_bytes"] - before - checks[-1])
        F.cross_entropy(ref(x).flatten(0, 1).float(), y.flatten()).backward()
        ropt.step(), ropt.zero_grad()
    full, want = comm.full_state_dict(), ref.state_dict()
    err = max((full[k].float() - want[k].float()).abs().max().item() for k in want)
    stats = comm.stats()
    heap = [(b.handle, b.size) for b in fakes[0]._tracked.values()] if fakes else []
    comm.ctx.failed = rank == 1  # a failed step on one rank: its close frees nothing, finalizes nothing
    comm.close()
    calls = fakes[0].calls if fakes else []
    in_heap = [n for n, p in model.named_parameters() if any(a <= p.data_ptr() < a + b for a, b in heap)]
    return {
        "err": err,
        "staged": staged,
        "checks": checks,
        "direct": (stats["direct_all_gathers"], stats["direct_reduce_scatters"]),
        "gathers": stats["all_gathers"],
        "heap": stats["device_heap_bytes"],
        "ptr calls": sum(c.endswith("@ptr") for c in calls),
        "finalized": fakes[0].pe is None if fakes else None,
        "params left in the heap": in_heap,
    }


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "backend,granularity,dtype",
    [("nvshmem", "block", "fp32"), ("nvshmem", "module", "bf16"), ("symm", "block", "fp32")],
)
def test_a_step_stages_nothing_on_the_pool_collectives(backend: str, granularity: str, dtype: str) -> None:
    """``staged_bytes`` is 0 per step when every collective is a pool gather or
    reduce-scatter, on nvshmem (the fakes) and on CPU shared memory; training matches
    single-process training (fp32: as tests/test_engine_parity.py; bf16 gathers round
    every weight to 8 mantissa bits, so 1e-2 of these O(0.1) weights)."""
    results = run_ranks(_train_worker, 2, backend, granularity, dtype, timeout_s=280)
    for rank, r in enumerate(results):
        assert r["err"] < (2e-6 if dtype == "fp32" else 1e-2), r
        assert r["staged"] == [0, 0, 0], r
        assert r["checks"][0] > 0 and r["checks"][1] > 0 and r["checks"][2] == 0, r  # first forward, backward 2
        assert r["direct"][0] > 0 and r["direct"][1] > 0, r
        if backend == "nvshmem":
            assert r["heap"] == HEAP_GRANULARITY, r  # the plan plus margin, in one granule
            assert r["ptr calls"] == sum(r["direct"]), r
            # close frees and finalizes, except after a failed step (rank 1 here)
            assert r["finalized"] is (rank == 0), r
            # the shards moved into the heap leave it before it is freed (after a failure it is never freed)
            assert (r["params left in the heap"] == []) is (rank == 0 or dtype == "bf16"), r  # bf16: none moved


# ---- the heap in the forecast and the planner ----------------------------------------------------
def test_forecast_and_planner_count_the_heap_outside_the_allocator() -> None:
    """``max_memory_allocated`` does not see NVSHMEM's heap: the forecast takes what
    lives in it (the pool; the shards gathered uncast) out of its phases and gives the
    heap as the backend sizes it, and the planner counts it on the device."""
    from isp_comm import ISPConfig
    from isp_comm.memory_forecast import forecast
    from isp_comm.models.llama import LlamaConfig, build
    from isp_comm.planner import profile as profiles
    from isp_comm.planner.memory import device_memory
    from isp_comm.planner.targets import parse_target

    with torch.device("meta"):
        model = build(LlamaConfig(vocab_size=512, hidden=64, ffn_hidden=160, n_layers=4, n_heads=4, n_kv_heads=2))
    prof = profiles.from_target(parse_target("h100x8"))
    for dtype in (None, torch.bfloat16):
        torch_fc = forecast(model, ISPConfig(param_dtype=dtype), 4, 4, 1, 4, 64, device="cuda")
        nv = forecast(model, ISPConfig(backend="nvshmem", param_dtype=dtype), 4, 4, 1, 4, 64, device="cuda")
        assert torch_fc.device_heap_bytes == 0 and nv.device_heap_bytes == HEAP_GRANULARITY, dtype  # a small plan
        wrap_t, wrap_n = torch_fc.phases["wrap"], nv.phases["wrap"]
        assert "pool slots and landing" in wrap_t and "pool slots and landing" not in wrap_n, dtype
        moved = wrap_t["master shards"] - wrap_n.get("master shards", 0)
        assert moved > 0 if dtype is None else moved == 0, (dtype, moved)  # bf16 gathers read the cast buffer
        kw = dict(world=4, wp=4, sp=1, baseline=0, capacity=prof.memory_bytes)
        mem_t, mem_n = device_memory(torch_fc, prof, **kw), device_memory(nv, prof, **kw)
        assert (
            mem_n.outside["NVSHMEM symmetric heap"] == HEAP_GRANULARITY
            and "NVSHMEM symmetric heap" not in mem_t.outside
        )
        assert mem_n.device_total > mem_t.device_total
    # at wp < world the pool is NCCL's (not in the heap); the world's all-reduce still copies
    part = forecast(model, ISPConfig(backend="nvshmem"), 4, 2, 1, 4, 64, device="cuda")
    assert part.device_heap_bytes == HEAP_GRANULARITY and "pool slots and landing" in part.phases["wrap"]
