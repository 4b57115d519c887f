"""The CUDA paths without a GPU: every name and keyword they use of nvshmem4py,
cuda-core, torch's symmetric memory, ``torch.cuda`` and c10d exists in the installed
packages, and the two CUDA backends' own code gives torch.distributed's results on
CPU tensors, at world 2 and 4 over gloo, against fakes with the real layers'
semantics (tests/fakes.py). What only a GPU can show is in tests/gpu.

Also run under torch 2.11 (the GPU machines' torch) in a second environment:
``python -m pytest tests/test_cuda_contracts.py`` there (docs/gpus.md says when).
"""

from __future__ import annotations

import ast
import inspect
import itertools
import os
import re

import numpy as np
import pytest
import torch
import torch.distributed as dist

from isp_comm.backends import cuda_symm, nvshmem_backend
from isp_comm.backends.streams import CudaRuntime, HostRuntime
from isp_comm.backends.torch_backend import TorchBackend, backend_for, runs_on_nccl
from isp_comm.testing import free_port, run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
nvshmem = pytest.importorskip("nvshmem.core", reason="the test extra installs nvshmem4py-cu13 (Linux x86-64)")
nvshmem_bindings = pytest.importorskip("nvshmem.bindings")


# ---- the installed packages have every name the CUDA paths use --------------------------
def test_nvshmem4py_and_cuda_core_have_what_the_backend_uses() -> None:
    from cuda.core import Device

    assert callable(Device.set_current)
    for name in ("get_unique_id", "init", "finalize", "tensor", "free_tensor", "fcollect", "reducescatter", "reduce"):
        assert callable(getattr(nvshmem, name)), name
    assert hasattr(nvshmem, "alltoall") and hasattr(nvshmem.Teams, "TEAM_WORLD")
    assert not hasattr(nvshmem.interop.torch, "empty")  # what the backend once called
    api = nvshmem_backend.load_api()  # the backend's own imports (cuda-core 1.x has no .experimental)
    assert api.core is nvshmem and api.Device is Device and api.bindings is nvshmem_bindings
    # the pointer-level collectives on slices (see [Note: collectives without copies]):
    # nvshmem4py 0.4.1's bindings take (team, dest, src, count, stream), addresses as ints,
    # the count per PE (fcollect: each PE's contribution; reducescatter: each PE's result)
    for dt in nvshmem_backend.BINDING_DTYPES.values():
        for op, count in (("fcollect", "nelem"), ("sum_reducescatter", "nreduce")):
            fn = getattr(nvshmem_bindings, f"{dt}_{op}_on_stream")
            assert list(inspect.signature(fn).parameters) == ["team", "dest", "src", count, "stream"], (dt, op)
    assert list(inspect.signature(nvshmem_bindings.team_sync_on_stream).parameters) == ["team", "stream"]
    assert int(nvshmem.Teams.TEAM_WORLD) == 0  # what the bindings' int32 team takes
    # core's own wrapper passes the same counts: fcollect sized by the source, the others by dest
    src = inspect.getsource(nvshmem.collective_on_buffer)
    assert 'if coll in ("fcollect", "alltoall"):\n        size = src_size' in src
    assert (
        "function_args = [team, int(dest.handle), int(src.handle), size_elem, int(stream.__cuda_stream__()[1])]" in src
    )
    inspect.signature(nvshmem.init).bind(device=None, uid=None, rank=0, nranks=1, initializer_method="uid")
    inspect.signature(nvshmem.tensor).bind((4,), dtype=torch.float32)
    # the unique id travels as 128 raw bytes (needs no GPU: only its host library)
    assert nvshmem.get_unique_id(empty=True)._data.view(np.int8).shape == (128,)
    # nvshmem4py reads a stream through the CUDA stream protocol, which torch's implements
    assert callable(torch.cuda.Stream.__cuda_stream__)


def _pybind_params(method) -> list[str]:
    """Parameter names of a pybind11 method, from its signature line."""
    line = (method.__doc__ or "").strip().splitlines()[0]
    inner = line[line.index("(") + 1 : line.rindex(")")]
    return [m.group(1) for m in re.finditer(r"(?:^|, )(\w+):", inner) if m.group(1) != "self"]


def test_torch_has_what_the_cuda_paths_use() -> None:
    from torch._C._distributed_c10d import _SymmetricMemory
    from torch.distributed import _symmetric_memory as symm

    inspect.signature(symm.empty).bind(1 << 20, dtype=torch.uint8, device=torch.device("cpu"))
    inspect.signature(symm.rendezvous).bind(torch.empty(1), dist.group.WORLD)
    assert _pybind_params(_SymmetricMemory.get_buffer)[:4] == ["rank", "sizes", "dtype", "storage_offset"]
    assert _pybind_params(_SymmetricMemory.barrier) == ["channel", "timeout_ms"]
    assert isinstance(_SymmetricMemory.rank, property) and isinstance(_SymmetricMemory.world_size, property)
    inspect.signature(torch.cuda.Event.__new__).bind(torch.cuda.Event, enable_timing=True)
    for name in ("record", "query", "elapsed_time", "synchronize"):
        assert callable(getattr(torch.cuda.Event, name)), name
    for name in ("wait_stream", "wait_event", "synchronize"):
        assert callable(getattr(torch.cuda.Stream, name)), name
    inspect.signature(torch.cuda.Stream.__new__).bind(torch.cuda.Stream, device=torch.device("cuda", 0), priority=-1)
    for fn in (torch.cuda.current_stream, torch.cuda.synchronize):
        inspect.signature(fn).bind(torch.device("cuda", 0))
    inspect.signature(torch.cuda.can_device_access_peer).bind(torch.device("cuda", 0), 1)
    assert callable(torch.cuda.stream) and callable(torch.Tensor.record_stream)
    # the virtual backend's device-side spin (a kernel of so many clock cycles)
    assert list(inspect.signature(torch.cuda._sleep).parameters) == ["cycles"]
    inspect.signature(torch.cuda.device).bind(torch.device("cuda", 0))  # CudaRuntime.device_context
    inspect.signature(dist.get_backend_config).bind(dist.group.WORLD)
    inspect.signature(dist.all_gather_object).bind([None], None, group=None)
    assert "timeout" in (dist.Work.wait.__doc__ or "") and callable(dist.Work.is_completed)
    # bench/kernel_profile.py: a kernel's row of key_averages, by its device type
    from torch.autograd import DeviceType
    from torch.autograd.profiler_util import FunctionEventAvg

    assert DeviceType.CUDA != DeviceType.CPU
    for name in ("self_device_time_total", "self_cpu_time_total", "device_type", "key", "count"):
        assert hasattr(FunctionEventAvg(), name), name


# ---- point by point ---------------------------------------------------------------------
def test_fp32_sums_never_write_a_peer_buffer() -> None:
    """The fp32 all-reduce once summed into rank 0's scratch (``peer.float()`` is the
    peer itself when it is fp32) while the other ranks still read it."""
    for dtype in (torch.float32, torch.bfloat16):
        peers = [torch.full((5,), float(r + 1), dtype=dtype) for r in range(3)]
        before = [p.clone() for p in peers]
        out = torch.empty(5, dtype=dtype)
        cuda_symm.sum_into(peers, out)
        assert all(torch.equal(p, b) for p, b in zip(peers, before)), dtype
        assert torch.equal(out, torch.full((5,), 6.0, dtype=dtype))


def test_fp64_and_int64_sums_keep_their_precision() -> None:
    """An fp64 or int64 all-reduce (a validation total) was added in fp32: fp64 sums
    kept 24 bits and int64 ones past 2**24 lost their low bits."""
    cases = {torch.float64: ([1.0, 1e-9], [1e-12, 1.0]), torch.int64: ([2**40 + 1, 3], [1, 2**25 + 1])}
    for dtype, (a, b) in cases.items():
        peers = [torch.tensor(a, dtype=dtype), torch.tensor(b, dtype=dtype)]
        out = torch.empty(2, dtype=dtype)
        cuda_symm.sum_into(peers, out)
        assert torch.equal(out, peers[0] + peers[1]), (dtype, out.tolist())


def test_nccl_is_known_from_the_groups_device_config(monkeypatch) -> None:
    """``init_process_group()`` without a backend says "undefined" to get_backend and
    "cpu:gloo,cuda:nccl" to get_backend_config: CUDA collectives are NCCL's, and
    their handles must not block the host."""
    assert backend_for("cpu:gloo,cuda:nccl", "cuda") == "nccl"
    assert backend_for("cpu:gloo,cuda:nccl", "cpu") == "gloo"
    assert backend_for("nccl", "cuda") == "nccl" and backend_for("gloo", "cuda") == "gloo"
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "undefined")
    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: "cpu:gloo,cuda:nccl")
    assert runs_on_nccl(object(), torch.device("cuda", 0))
    assert not runs_on_nccl(object(), torch.device("cpu"))


def test_building_the_reference_llama_leaves_gpu_generators_alone(monkeypatch) -> None:
    """``torch.manual_seed`` reseeds every CUDA generator: a per-rank CUDA seed set
    before building the model (dropout) would be lost on every rank."""
    from isp_comm.models.llama import LlamaConfig, build

    calls = []
    monkeypatch.setattr(torch.cuda, "manual_seed_all", lambda seed: calls.append(seed))
    cfg = LlamaConfig(vocab_size=11, hidden=16, ffn_hidden=24, n_layers=1, n_heads=2, n_kv_heads=1, max_seq_len=8)
    a, b = build(cfg, seed=3), build(cfg, seed=3)
    assert calls == []
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_cuda_backends_reach_cuda_only_through_the_runtime(monkeypatch) -> None:
    """Streams and events of the CUDA backends come from one runtime (an event made
    elsewhere without timing once broke the tracer's ``elapsed_time``)."""
    allowed = {"get_device_properties", "can_device_access_peer", "device_count", "current_device"}
    for mod in (cuda_symm, nvshmem_backend):
        tree = ast.parse(inspect.getsource(mod))
        used = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and ast.unparse(n.value) == "torch.cuda"}
        assert used <= allowed, (mod.__name__, used - allowed)

    made = []

    class Recorder:
        def __init__(self, **kw) -> None:
            made.append(kw)

    monkeypatch.setattr(torch.cuda, "Event", Recorder)
    CudaRuntime().event()
    assert made == [{"enable_timing": True}]


def test_bench_gpu_profile_writes_its_files(tmp_path) -> None:
    """``--profile`` once wrote into the results folder before creating it."""
    import subprocess
    import sys

    out = tmp_path / "new" / "gpu.json"
    cmd = [sys.executable, os.path.join(ROOT, "bench", "gpu.py"), "--device", "cpu", "--dtype", "fp32", "--small"]
    cmd += ["--runs", "plain", "--steps", "1", "--windows", "1", "--seq", "16", "--batch", "1"]
    cmd += ["--profile", "plain", "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_PORT": str(free_port())}
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-2000:]
    assert out.exists() and (out.parent / "gpu_profile_plain.txt").exists()


def test_gpu_tests_take_free_ports_and_leave_the_environment_alone() -> None:
    """tests/gpu runs on shared GPU machines: a fixed rendezvous port meets another
    job's (or fails as taken), and a test that sets ``os.environ`` in the pytest
    process leaves RANK/MASTER_* to every later test. The GPU tests cannot run here;
    their source can be read."""
    fixed = re.compile(r"master[-_]port\W{1,3}\d|MASTER_PORT\W{1,3}\d", re.IGNORECASE)
    leaks = re.compile(r"os\.environ\.update|os\.environ\[[^]]+\]\s*=|os\.putenv")
    folder = os.path.join(ROOT, "tests", "gpu")
    found = []
    for dirpath, _, names in os.walk(folder):
        for name in sorted(n for n in names if n.endswith(".py")):
            text = open(os.path.join(dirpath, name)).read()
            found += [f"{name}: {m.group(0)}" for m in (*fixed.finditer(text), *leaks.finditer(text))]
    assert not found, found


def test_a_late_cuda_handle_names_its_collective_and_the_normal_wait_only_queries() -> None:
    """Finding: a dead peer on CUDA is seldom ``ISPCommTimeout`` (see [Note: what a
    dead peer looks like on CUDA]). What the handle can do without a host sync: when
    the host waits past the deadline on a pending event, raise naming the collective;
    in time, or once the event has completed, only ``query`` and ``wait_event`` run
    (no ``synchronize``, which the fake event refuses)."""
    from isp_comm.backends.streams import CudaEventHandle
    from isp_comm.errors import ISPCommTimeout

    class Event:
        def __init__(self, done: bool) -> None:
            self.done, self.queries = done, 0

        def query(self) -> bool:
            self.queries += 1
            return self.done

        def synchronize(self) -> None:
            raise AssertionError("a handle's wait synchronised the host")

    cpu = torch.device("cpu")
    pending = Event(False)
    CudaEventHandle(pending, cpu, 5.0, HostRuntime(), "nvshmem gather collective").wait(5.0)  # in time
    late = CudaEventHandle(pending, cpu, 5.0, HostRuntime(), "nvshmem gather collective")
    late._issued -= 10.0
    with pytest.raises(ISPCommTimeout, match=r"nvshmem gather collective did not complete within 5\.0s"):
        late.wait(30.0)
    done = CudaEventHandle(Event(True), cpu, 5.0, HostRuntime(), "x")
    done._issued -= 10.0
    done.wait(1.0)  # finished long ago: no error


# ---- the backends' own code against the fakes, over gloo ----------------------------------
def _check_collectives(backend, rank: int, world: int) -> int:
    """Every collective, fp32 and bf16, sizes shrinking then growing (a scratch that
    only grows is then larger than a later collective), against torch.distributed.
    The first size runs under ``torch.inference_mode`` (an evaluation before training):
    what the backend makes then and keeps is written outside it afterwards."""
    group, checked = dist.group.WORLD, 0
    for dtype, n in itertools.product((torch.float32, torch.bfloat16), (4099, 1000, 1, 3, 150_000)):
        with torch.inference_mode(checked == 0):
            g = torch.Generator().manual_seed(rank * 7919 + n)
            x = torch.randn(n, generator=g).to(dtype)
            out, ref = torch.empty(world * n, dtype=dtype), torch.empty(world * n, dtype=dtype)
            backend.all_gather(out, x, group).wait(60)
            dist.all_gather_into_tensor(ref, x)
            assert torch.equal(out, ref), ("all_gather", dtype, n)
            big = torch.randn(world * n, generator=g).to(dtype)
            rs, rs_ref = torch.empty(n, dtype=dtype), torch.empty(n, dtype=dtype)
            backend.reduce_scatter(rs, big, group).wait(60)
            dist.reduce_scatter_tensor(rs_ref, big)
            # sums of `world` N(0, 1) values in another order (the symm backend adds in
            # fp32 and rounds once): an fp32 ulp or two; bf16 keeps 8 mantissa bits
            tol = dict(rtol=1e-2, atol=2e-2) if dtype != torch.float32 else dict(rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(rs, rs_ref, **tol)
            ar, ar_ref = big.clone(), big.clone()
            backend.all_reduce(ar, group).wait(60)
            dist.all_reduce(ar_ref)
            torch.testing.assert_close(ar, ar_ref, **tol)
            a2a, a2a_ref = torch.empty_like(big), torch.empty_like(big)
            backend.all_to_all(a2a, big, group).wait(60)
            dist.all_to_all_single(a2a_ref, big)
            assert torch.equal(a2a, a2a_ref), ("all_to_all", dtype, n)
        checked += 4
    return checked


def _nvshmem_worker(rank: int, world: int) -> dict:
    from cuda.core import Device

    from tests.fakes import Checked, FakeNvshmem, _Device

    fake = FakeNvshmem()
    api = nvshmem_backend.NvshmemApi(Checked(fake, nvshmem), _Device)
    assert Device.set_current  # the fake stands for this
    backend = nvshmem_backend.NvshmemBackend(torch.device("cpu"), 60.0, api=api, runtime=HostRuntime())
    checked = _check_collectives(backend, rank, world)
    made_in_inference = sum(t.is_inference() for t in backend._scratch.values())
    pair = dist.new_group([0, 1])  # not the world (at world 4): NCCL's, through the fallback
    if world > 2 and rank < 2:
        x, out = torch.full((3,), float(rank)), torch.empty(6)
        backend.all_gather(out, x, pair).wait(60)
        assert out.tolist() == [0.0] * 3 + [1.0] * 3
    backend.close()  # frees every scratch: the fake's finalize refuses one left
    return {
        "checked": checked, "calls": len(fake.calls), "streams": set(fake.streams_seen), "inference": made_in_inference
    }  # fmt: skip


@pytest.mark.timeout(200)
@pytest.mark.parametrize("world", [2, 4])
def test_nvshmem_backend_against_fake_nvshmem4py(world: int) -> None:
    for r in run_ranks(_nvshmem_worker, world, timeout_s=180):
        assert r["checked"] == 40 and r["calls"] == 40, r  # 5 sizes x 2 dtypes x 4 collectives
        assert r["inference"] == 0, r  # scratch kept from the inference-mode collectives: normal tensors
        # one side stream for every lane (and group): see [Note: one stream for a team]
        assert 0 not in r["streams"] and len(r["streams"]) == 1, r


def test_nvshmem_binds_the_parameters_gpu_not_the_current_one(monkeypatch) -> None:
    """A model on cuda:1 while cuda:0 is current (no ``set_device``): NVSHMEM binds GPU 1.
    Only a bare ``cuda`` asks which device is current."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert nvshmem_backend.device_index(torch.device("cuda", 1)) == 1
    assert nvshmem_backend.device_index(torch.device("cuda")) == 0
    assert nvshmem_backend.device_index(torch.device("cpu")) == 0


def _nvshmem_backend_on_fakes(rank: int, **fake_kw):
    from tests.fakes import Checked, FakeBindings, FakeNvshmem, _Device

    fake = FakeNvshmem(**fake_kw)
    api = nvshmem_backend.NvshmemApi(Checked(fake, nvshmem), _Device, Checked(FakeBindings(fake), nvshmem_bindings))
    return fake, nvshmem_backend.NvshmemBackend(torch.device("cpu"), 60.0, api=api, runtime=HostRuntime())


def _team_order_worker(rank: int, world: int) -> dict:
    """A prefetch gather, a reduce-scatter and an all-reduce of another world-sized
    group (another group name, the same team), all issued before any is waited."""
    fake, backend = _nvshmem_backend_on_fakes(rank)
    other = dist.new_group(list(range(world)))  # world-sized: served by nvshmem, on TEAM_WORLD
    x, gathered = torch.full((3,), float(rank)), torch.empty(3 * world)
    big, rs = torch.arange(4.0 * world), torch.empty(4)
    bucket = torch.ones(5)
    handles = [
        backend.all_gather(gathered, x, dist.group.WORLD),
        backend.reduce_scatter(rs, big, other),
        backend.all_reduce(bucket, dist.group.WORLD),
        backend.all_to_all(torch.empty_like(big), big, other),
    ]
    for h in handles:
        h.wait(60)
    backend.close()
    ok = gathered.tolist() == [float(r) for r in range(world) for _ in range(3)]
    ok = ok and rs.tolist() == [world * (4.0 * rank + i) for i in range(4)] and bucket.tolist() == [world] * 5
    return {"ok": ok, "streams": set(fake.streams_seen)}


@pytest.mark.timeout(120)
def test_nvshmem_collectives_of_every_lane_and_group_share_one_stream() -> None:
    """Finding: nvshmem collectives of the gather, reduce and all-to-all lanes, and of
    world-sized groups of other names, all run on TEAM_WORLD; on per-(group, lane)
    streams a GPU may run two at once, or in another order on each PE (NVSHMEM allows
    one collective at a time per team). The fake runs collectives on the host, so it
    cannot overlap them; it refuses one team's collectives on two streams instead,
    which this test meets unless the backend issues them all on one side stream."""
    for r in run_ranks(_team_order_worker, 2, timeout_s=100):
        assert r["ok"] and len(r["streams"]) == 1 and 0 not in r["streams"], r


def _landing_worker(rank: int, world: int) -> dict:
    """Per-parameter landing: same-size gathers back to back, then same-size reduce-scatters."""
    fake, backend = _nvshmem_backend_on_fakes(rank)
    outs = [torch.empty(4 * world) for _ in range(5)]
    handles = [
        backend.all_gather(out, torch.full((4,), 10.0 * rank + i), dist.group.WORLD) for i, out in enumerate(outs)
    ]
    rs = [torch.empty(4) for _ in range(3)]
    handles += [
        backend.reduce_scatter(o, torch.full((4 * world,), float(i)), dist.group.WORLD) for i, o in enumerate(rs)
    ]
    for h in handles:
        h.wait(60)
    backend.close()
    want = [[10.0 * r + i for r in range(world) for _ in range(4)] for i in range(5)]
    ok = [o.tolist() for o in outs] == want and [o.tolist() for o in rs] == [[world * float(i)] * 4 for i in range(3)]
    return {"ok": ok, "dsts": fake.dsts}


@pytest.mark.timeout(120)
def test_nvshmem_same_size_collectives_alternate_their_destination_scratch() -> None:
    """Finding: fcollect and alltoall push straight into the peers' ``dest`` and meet
    only at their end, so with one scratch per size a peer that left collective k
    pushes k+1 into this PE's scratch while this PE still copies k out (back-to-back
    same-size gathers: per-parameter landing). The fake cannot race on the host; it
    refuses a collective into the previous one's destination, which this test meets
    unless the backend alternates two destinations per size (double-buffering)."""
    for r in run_ranks(_landing_worker, 2, timeout_s=100):
        d = r["dsts"]
        assert r["ok"] and all(a != b for a, b in zip(d, d[1:])), r
        assert len(set(d[:5])) == 2 and len(set(d[5:])) == 2, r  # two scratches per size, not one per collective


def _alloc_beside_worker(rank: int, world: int) -> dict:
    """A gather waited, then a gather and a reduce-scatter of new sizes issued while an
    earlier collective is still on the team stream: each new size makes heap buffers."""
    from isp_comm.backends import streams
    from tests.fakes import Checked, FakeBindings, FakeNvshmem, _Device

    class InFlight(FakeNvshmem):
        """Counts a collective in flight from its issue until the team stream is
        synchronised, and refuses ``nvshmem_malloc`` (collective, with a barrier on a
        stream of NVSHMEM's own) while one is."""

        in_flight = False

        def _call(self, *args, **kwargs):
            self.in_flight = True
            return super()._call(*args, **kwargs)

        def binding_fcollect(self, *args):
            self.in_flight = True
            return super().binding_fcollect(*args)

        def binding_sum_reducescatter(self, *args):
            self.in_flight = True
            return super().binding_sum_reducescatter(*args)

        def tensor(self, *args, **kwargs):
            if self.in_flight:
                raise AssertionError("nvshmem_malloc while a collective of TEAM_WORLD may still run")
            return super().tensor(*args, **kwargs)

    fake = InFlight()

    class Stream(streams._HostStream):
        def synchronize(self) -> None:
            fake.in_flight = False

    class Runtime(HostRuntime):
        def stream(self, _device: torch.device, priority: int = 0) -> Stream:
            self.streams.append(Stream(len(self.streams) + 1, priority))
            return self.streams[-1]

    api = nvshmem_backend.NvshmemApi(Checked(fake, nvshmem), _Device, Checked(FakeBindings(fake), nvshmem_bindings))
    backend = nvshmem_backend.NvshmemBackend(torch.device("cpu"), 60.0, api=api, runtime=Runtime())
    first = torch.empty(3 * world)
    backend.all_gather(first, torch.full((3,), float(rank)), dist.group.WORLD).wait(60)
    second, rs = torch.empty(5 * world), torch.empty(7)
    handles = [
        backend.all_gather(second, torch.full((5,), float(rank)), dist.group.WORLD),
        backend.reduce_scatter(rs, torch.ones(7 * world), dist.group.WORLD),
    ]
    for h in handles:
        h.wait(60)
    backend.close()
    ok = second.tolist() == [float(r) for r in range(world) for _ in range(5)] and rs.tolist() == [float(world)] * 7
    return {"ok": ok}


@pytest.mark.timeout(120)
def test_nvshmem_allocates_heap_buffers_only_with_no_collective_in_flight() -> None:
    """Finding (a review against NVSHMEM's malloc): a heap buffer is made when a
    collective of a new size is issued, while earlier ones may still run on the team
    stream; ``nvshmem_malloc`` ends with a barrier on a stream of NVSHMEM's own, two
    collectives of one team at once. The fake refuses an allocation between a
    collective's issue and the team stream's next synchronisation, which this test
    meets unless the backend drains the stream first ([Note: no allocation beside a
    collective])."""
    for r in run_ranks(_alloc_beside_worker, 2, timeout_s=100):
        assert r["ok"], r


def test_nvshmem_heap_size_is_read_as_nvshmem_reads_it() -> None:
    """``NVSHMEM_SYMMETRIC_SIZE``: bytes or a k/m/g/t suffix (powers of 1024); unset, 1 GiB."""
    assert nvshmem_backend.heap_bytes({}) == 1 << 30
    assert nvshmem_backend.heap_bytes({"NVSHMEM_SYMMETRIC_SIZE": "4G"}) == 4 << 30
    assert nvshmem_backend.heap_bytes({"NVSHMEM_SYMMETRIC_SIZE": "512m"}) == 512 << 20
    assert nvshmem_backend.heap_bytes({"NVSHMEM_SYMMETRIC_SIZE": "65536"}) == 65536
    with pytest.raises(ValueError, match="NVSHMEM_SYMMETRIC_SIZE"):
        nvshmem_backend.heap_bytes({"NVSHMEM_SYMMETRIC_SIZE": "lots"})


def _heap_worker(rank: int, world: int) -> dict:
    from isp_comm.errors import SymmetricHeapError

    os.environ["NVSHMEM_SYMMETRIC_SIZE"] = "64k"  # read at init, by NVSHMEM and by the backend
    fake, backend = _nvshmem_backend_on_fakes(rank, heap_bytes=64 << 10)
    said = {}
    world_group = dist.group.WORLD
    for what, call in (  # 16 KiB gathered: 16 KiB in, 2 x 16 KiB x world out
        ("plan", lambda: backend.plan_symmetric(world_group, 1024, [(world_group, "all_gather", [16 << 10])])),
        ("step", lambda: backend.all_gather(torch.empty(8192 * world), torch.ones(8192), world_group)),
    ):
        try:
            call()
        except SymmetricHeapError as exc:
            said[what] = str(exc)
        if what == "plan":
            said["initialized after the refused plan"] = fake.pe is not None
            backend.plan_symmetric(world_group, 1024, [(world_group, "all_gather", [1024])])  # fits
    backend.close()
    return said


@pytest.mark.timeout(120)
def test_nvshmem_heap_overrun_is_named_at_wrap_time_and_at_allocation() -> None:
    """Finding: scratch is exact-size per collective size and kept, while NVSHMEM's heap
    is fixed at init (``NVSHMEM_SYMMETRIC_SIZE``, 1 GiB unset). The fake's heap fails
    an allocation past it as ``nvshmem_malloc`` does, naming nothing; the backend must
    say instead, on every rank, which variable to set and to what: at wrap time
    (``plan_symmetric``) when the plan alone needs more, and at the allocation
    otherwise. A variable that is set starts NVSHMEM when the backend is made (the GPU
    tests read its init status then)."""
    for said in run_ranks(_heap_worker, 2, timeout_s=100):
        assert set(said) == {"plan", "step", "initialized after the refused plan"}, said
        assert said.pop("initialized after the refused plan") is True, said  # set: NVSHMEM started with it
        assert all("NVSHMEM_SYMMETRIC_SIZE=64k" in m and "at least" in m for m in said.values()), said
        assert f"needs {1024 + (16 << 10) + 2 * (32 << 10)} bytes" in said["plan"], said  # 2 ranks: 16 KiB + 2 x 32 KiB


def _symm_worker(rank: int, world: int) -> dict:
    from torch._C._distributed_c10d import _SymmetricMemory
    from torch.distributed import _symmetric_memory as symm

    from tests.fakes import Checked, FakeSymm

    class CheckedSymm(FakeSymm):
        def rendezvous(self, tensor, group):
            handle = super().rendezvous(tensor, group)
            for method in ("get_buffer", "barrier"):
                names, fn = _pybind_params(getattr(_SymmetricMemory, method)), getattr(handle, method)

                def call(*a, _names=names, _fn=fn, **kw):
                    assert len(a) <= len(_names) and set(kw) <= set(_names[len(a) :]), (_names, a, kw)
                    return _fn(*a, **kw)

                setattr(handle, method, call)
            return handle

    from isp_comm.backends import streams

    synced = []  # host waits for a device or a stream: growing scratch must make none
    streams._HostStream.synchronize = lambda self: synced.append("stream")  # this rank's process only
    runtime = HostRuntime()
    runtime.synchronize = lambda device: synced.append("device")
    checks = (lambda device: f"gpu{rank}", lambda device, uuids: len(set(uuids)) == len(uuids))
    fake = CheckedSymm()
    backend = cuda_symm.CudaSymmBackend(60.0, symm=Checked(fake, symm), runtime=runtime, peer_check=checks)
    cpu = torch.device("cpu")
    try:
        backend.reserve(dist.group.WORLD, 4099 * 4, cpu, "gather")
        backend.reserve(dist.group.WORLD, 0, cpu, "all_to_all")  # decided, not sized: grows at first use
        checked = _check_collectives(backend, rank, world)
    finally:
        fake.close()
    lanes = sorted({lane for _, lane in backend._buffers})
    inference = sum(buf.is_inference() for buf, _ in [*backend._buffers.values(), *backend._retired])
    grown, synced_in_use = len(backend._retired), list(synced)
    backend.close()
    streams_made = len(backend._rt.streams)
    return {
        "checked": checked, "lanes": lanes, "grown": grown, "streams": streams_made, "synced": synced_in_use,
        "inference": inference,
    }  # fmt: skip


def _symm_device_worker(rank: int, world: int) -> list:
    from tests.fakes import FakeSymm

    rt, seen = HostRuntime(), []
    real_gather = dist.all_gather_object

    class Watched(FakeSymm):
        def empty(self, *size, dtype=None, device=None):
            seen.append(("empty", rt.device))
            return super().empty(*size, dtype=dtype, device=device)

        def rendezvous(self, tensor, group):
            seen.append(("rendezvous", rt.device))
            return super().rendezvous(tensor, group)

    def gather(*a, **kw):
        seen.append(("all_gather_object", rt.device))
        return real_gather(*a, **kw)

    dist.all_gather_object = gather
    checks = (lambda device: f"gpu{rank}", lambda device, uuids: len(set(uuids)) == len(uuids))
    fake = Watched()
    backend = cuda_symm.CudaSymmBackend(60.0, symm=fake, runtime=rt, peer_check=checks)
    params = torch.device("cpu")  # the parameters' device; the runtime's current one starts as None
    try:
        backend.reserve(dist.group.WORLD, 1024, params, "gather")
        out = torch.empty(4 * world)
        backend.all_gather(out, torch.ones(4), dist.group.WORLD).wait(60)  # the first growth of nothing
        backend.all_to_all(torch.empty(4 * world), torch.ones(4 * world), dist.group.WORLD).wait(60)  # lazy
    finally:
        dist.all_gather_object = real_gather
        fake.close()
    backend.close()
    return [(what, str(dev)) for what, dev in seen]


@pytest.mark.timeout(120)
def test_cuda_symm_allocates_and_meets_under_the_parameters_device() -> None:
    """Finding: ``symm.empty`` routes to the symmetric pool of the *current* device, and
    NCCL's ``all_gather_object`` uses the current device unless its group was bound,
    so both must run with the parameters' device current (a model on cuda:1 while
    cuda:0 is current). The host runtime keeps the device its ``device_context`` made
    current; every allocation, rendezvous and object gather must see the parameters'."""
    for seen in run_ranks(_symm_device_worker, 2, timeout_s=100):
        kinds = {what for what, _ in seen}
        assert kinds == {"empty", "rendezvous", "all_gather_object"}, seen
        assert all(dev == "cpu" for _, dev in seen), seen


@pytest.mark.timeout(200)
@pytest.mark.parametrize("world", [2, 4])
def test_cuda_symm_backend_against_fake_symmetric_memory(world: int) -> None:
    for r in run_ranks(_symm_worker, world, timeout_s=180):
        assert r["checked"] == 40, r
        assert r["inference"] == 0, r  # buffers kept from the inference-mode collectives: normal tensors
        assert r["lanes"] == ["all_to_all", "gather", "reduce"] and r["streams"] == 3, r
        assert r["grown"] >= 1, r  # the 150,000-element collectives outgrew the 1 MiB start
        assert r["synced"] == [], r  # ... without a host wait: the old buffer is retired, not waited for


def _gloo_worker(rank: int, world: int) -> bool:
    backend = TorchBackend()
    t = torch.ones(2)
    h = backend.all_reduce(t, dist.group.WORLD)
    h.wait(30)
    return h._host_wait and t.tolist() == [2.0, 2.0]


def test_torch_backend_handles_of_gloo_wait_on_the_host() -> None:
    assert run_ranks(_gloo_worker, 2, timeout_s=60) == [True, True]


# ---- the engine on the CUDA backends' code ---------------------------------------------
def _engine_worker(rank: int, world: int) -> dict:
    """ISP training through each CUDA backend (on the fakes) against single-process
    training, with sequence parallelism: the engine's whole use of the backend."""
    import isp_comm.communicator as communicator
    from tests.fakes import FakeBindings, FakeNvshmem, FakeSymm, _Device
    from tests.test_sequence_parallel import _sp_worker

    class Recording(cuda_symm.CudaSymmBackend):
        """Says which groups were decided outside ``reserve`` (lazily, in a step)."""

        def __init__(self, *a, **kw) -> None:
            super().__init__(*a, **kw)
            self.lazy, self._reserving = [], False

        def reserve(self, *a, **kw) -> None:
            self._reserving = True
            try:
                super().reserve(*a, **kw)
            finally:
                self._reserving = False

        def _symmetric(self, group, device) -> bool:
            if group.group_name not in self._local and not self._reserving:
                self.lazy.append(dist.get_process_group_ranks(group))
            return super()._symmetric(group, device)

    made, fakes, errors = [], [], {}
    checks = (lambda device: f"gpu{rank}", lambda device, uuids: len(set(uuids)) == len(uuids))

    def symm_backend(name, device, timeout_s):
        fakes.append(FakeSymm())
        made.append(Recording(timeout_s, symm=fakes[-1], runtime=HostRuntime(), peer_check=checks))
        return made[-1]

    def nvshmem_backend_(name, device, timeout_s):
        fake = FakeNvshmem()
        api = nvshmem_backend.NvshmemApi(fake, _Device, FakeBindings(fake))
        made.append(nvshmem_backend.NvshmemBackend(device, timeout_s, api=api, runtime=HostRuntime()))
        return made[-1]

    try:
        for label, factory, (sp, wp, outer) in (
            ("symm sp2 wp2", symm_backend, (2, 2, True)),
            ("symm wp4", symm_backend, (1, 4, False)),
            ("nvshmem wp4", nvshmem_backend_, (1, 4, True)),
        ):
            communicator.make_backend = factory
            errors[label] = _sp_worker(rank, world, sp, wp, "llama", outer, False, None)
    finally:
        for f in fakes:
            f.close()
    return {"errors": errors, "lazy": [b.lazy for b in made if isinstance(b, Recording)]}


@pytest.mark.timeout(300)
def test_engine_on_the_cuda_backends_code_matches_single_process_training() -> None:
    for r in run_ranks(_engine_worker, 4, timeout_s=280):
        # fp32 SGD parity, as in tests/test_sequence_parallel.py
        assert all(e < 2e-6 for e in r["errors"].values()), r
        assert r["lazy"] == [[], []], r  # every group, SP's too, was decided at wrap time


# ---- sizes that do not fit, on both CUDA backends' own code --------------------------------
def _unfit_issues(world: int) -> list:
    """Collectives whose output and input do not fit: each backend ran them on,
    taking its counts from one side (see [Note: sizes that do not fit on CUDA])."""
    return [
        ("reduce-scatter short input", lambda b, g: b.reduce_scatter(torch.empty(3), torch.ones(world * 3 - 1), g)),
        ("all-to-all indivisible", lambda b, g: b.all_to_all(torch.empty(world + 1), torch.ones(world + 1), g)),
        ("all-gather long output", lambda b, g: b.all_gather(torch.empty(world * 2 + 1), torch.ones(2), g)),
        ("all-gather dtypes", lambda b, g: b.all_gather(torch.empty(world * 2), torch.ones(2, dtype=torch.float64), g)),
    ]


def _unfit_worker(rank: int, world: int, name: str) -> list[str]:
    from cuda.core import Device

    from tests.fakes import Checked, FakeNvshmem, FakeSymm, _Device

    cpu, group, said = torch.device("cpu"), dist.group.WORLD, []
    if name == "symm":
        fake = FakeSymm()
        checks = (lambda device: f"gpu{rank}", lambda device, uuids: True)
        backend = cuda_symm.CudaSymmBackend(60.0, symm=fake, runtime=HostRuntime(), peer_check=checks)
        backend.reserve(group, 1 << 12, cpu, "reduce")
    else:
        assert Device.set_current  # the fake stands for this
        api = nvshmem_backend.NvshmemApi(Checked(FakeNvshmem(), nvshmem), _Device)
        backend = nvshmem_backend.NvshmemBackend(cpu, 60.0, api=api, runtime=HostRuntime())
    try:
        backend.all_reduce(torch.full((world * 3,), 7.0), group).wait(30)  # stale bytes in the scratch
        for what, issue in _unfit_issues(world):
            try:
                issue(backend, group).wait(30)
                said.append(f"{what}: no error")
            except ValueError:
                said.append(f"{what}: refused")
        total = torch.ones(3)
        backend.all_reduce(total, group).wait(30)  # the group is still in step
        said.append(f"in step {total.tolist() == [float(world)] * 3}")
    finally:
        backend.close()
        if name == "symm":
            fake.close()
    return said


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["symm", "nvshmem"])
def test_sizes_that_do_not_fit_are_refused_at_issue_on_cuda(name: str) -> None:
    """See [Note: sizes that do not fit on CUDA]: a ValueError on every rank, before
    the collective; the group stays in step."""
    for said in run_ranks(_unfit_worker, 2, name, timeout_s=100):
        assert said == [f"{what}: refused" for what, _ in _unfit_issues(2)] + ["in step True"], said
