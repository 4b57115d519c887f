"""One contract for every backend: results equal gloo's, odd sizes, aliasing, reuse."""

from __future__ import annotations

import os
import random
import time
import warnings

import pytest
import torch
import torch.distributed as dist

from isp_comm.backends import SymmCpuBackend, TorchBackend
from isp_comm.backends.base import symmetric_refusal
from isp_comm.backends.symm_cpu import HOST_ENV, SymmHandle
from isp_comm.errors import ISPCommTimeout
from isp_comm.testing import run_ranks

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SIZES = (0, 1, 7, 1000, 4099)
TIMEOUT = 60.0


def _make(name: str):
    return TorchBackend() if name == "torch" else SymmCpuBackend(timeout_s=TIMEOUT)


def _data(rank: int, n: int, dtype: torch.dtype, salt: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * salt + rank)
    return torch.randn(n, generator=g).to(dtype)


def _check_reduce(got: torch.Tensor, exact: torch.Tensor, dtype: torch.dtype, gloo: torch.Tensor, name: str) -> None:
    if dtype == torch.float32:
        # fp32: gloo and the backend may add in different orders: a few ulps of the sum.
        torch.testing.assert_close(got, gloo, rtol=1e-6, atol=1e-6)
    elif name == "symm":
        # bf16/fp16 accumulated in fp32, as the README promises: the sum of a few bf16 /
        # fp16 inputs is exact in fp32, so the result is the exact (fp64) sum rounded
        # once, bitwise; accumulating in bf16 / fp16 rounds after every addition and
        # differs in some elements
        assert torch.equal(got, exact.to(dtype)), (dtype, (got.double() - exact).abs().max())
    else:
        # gloo adds in the dtype itself: compare with the exact (fp64) sum, a few units of
        # the last place (one rounding per addition)
        eps = torch.finfo(dtype).eps
        assert ((got.double() - exact).abs() <= 4 * eps * exact.abs() + 4 * eps).all()


def _contract_worker(rank: int, world: int, name: str) -> None:
    backend = _make(name)
    group = dist.new_group(list(range(world)))
    with warnings.catch_warnings(record=True) as caught:  # torch 2.13 deprecates names 2.11 has
        warnings.simplefilter("always")
        backend.all_gather(torch.empty(world * 3), torch.ones(3), group).wait(TIMEOUT)
        backend.reduce_scatter(torch.empty(3), torch.ones(world * 3), group).wait(TIMEOUT)
    assert not [w for w in caught if issubclass(w.category, FutureWarning)], [str(w.message) for w in caught]
    for salt, (dtype, n) in enumerate((d, n) for d in DTYPES for n in SIZES):
        inp = _data(rank, n, dtype, salt)
        # all-gather: bitwise equal to gloo
        out, ref = torch.empty(world * n, dtype=dtype), torch.empty(world * n, dtype=dtype)
        backend.all_gather(out, inp, group).wait(TIMEOUT)
        dist.all_gather_into_tensor(ref, inp, group=group)
        assert torch.equal(out, ref), (dtype, n)
        # all-gather whose input is a view of its output (in place)
        inplace = torch.empty(world * n, dtype=dtype)
        inplace[rank * n : (rank + 1) * n] = inp
        backend.all_gather(inplace, inplace[rank * n : (rank + 1) * n], group).wait(TIMEOUT)
        assert torch.equal(inplace, ref), (dtype, n)
        # reduce-scatter
        big = _data(rank, world * n, dtype, salt + 500)
        rs, rs_ref = torch.empty(n, dtype=dtype), torch.empty(n, dtype=dtype)
        sent = big.clone()
        backend.reduce_scatter(rs, big, group).wait(TIMEOUT)
        assert torch.equal(big, sent), (dtype, n)  # the input is left as it was
        dist.reduce_scatter_tensor(rs_ref, big, group=group)
        exact = sum(_data(r, world * n, dtype, salt + 500).double() for r in range(world))
        _check_reduce(rs, exact[rank * n : (rank + 1) * n], dtype, rs_ref, name)
        # all-reduce
        ar = inp.clone()
        backend.all_reduce(ar, group).wait(TIMEOUT)
        ar_ref = inp.clone()
        dist.all_reduce(ar_ref, group=group)
        _check_reduce(ar, sum(_data(r, n, dtype, salt).double() for r in range(world)), dtype, ar_ref, name)
        # all-to-all
        a2a, a2a_ref = torch.empty(world * n, dtype=dtype), torch.empty(world * n, dtype=dtype)
        backend.all_to_all(a2a, big, group).wait(TIMEOUT)
        dist.all_to_all_single(a2a_ref, big, group=group)
        assert torch.equal(a2a, a2a_ref), (dtype, n)
    backend.barrier(group, TIMEOUT)
    backend.close()


@pytest.mark.timeout(200)
@pytest.mark.parametrize(
    "name, world",
    [(n, w) if w < 4 else pytest.param(n, w, marks=pytest.mark.slow) for w in (2, 3, 4) for n in ("torch", "symm")],
)
def test_backend_contract(name: str, world: int) -> None:
    run_ranks(_contract_worker, world, name, timeout_s=180)  # every check is an assert inside, on every rank


def _back_to_back_worker(rank: int, world: int, name: str) -> None:
    # 200 collectives issued without waiting, random sizes, random per-rank delays:
    # a fast rank must never overwrite a buffer a slow peer is still reading.
    backend = _make(name)
    group = dist.group.WORLD
    rng = random.Random(7)  # same sequence of sizes on every rank
    delay = random.Random(rank)
    pending = []
    for i in range(200):
        n = rng.choice((1, 13, 4096, 30001))
        if delay.random() < 0.3:
            time.sleep(delay.random() * 0.003)
        if i % 2 == 0:
            inp = torch.full((n,), float(rank * 1000 + i))
            out = torch.empty(world * n)
            pending.append(("ag", i, n, out, backend.all_gather(out, inp, group)))
        else:
            inp = torch.arange(world * n, dtype=torch.float32) + i
            out = torch.empty(n)
            pending.append(("rs", i, n, out, backend.reduce_scatter(out, inp, group)))
    for kind, i, n, out, h in pending:
        h.wait(TIMEOUT)
        if kind == "ag":
            want = torch.cat([torch.full((n,), float(r * 1000 + i)) for r in range(world)])
        else:
            want = (torch.arange(rank * n, (rank + 1) * n, dtype=torch.float32) + i) * world
        assert torch.equal(out, want), (kind, i, n)
    backend.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["torch", "symm"])
def test_back_to_back_with_delays(name: str) -> None:
    run_ranks(_back_to_back_worker, 4, name, timeout_s=110)


def _two_host_worker(rank: int, world: int) -> bool:
    os.environ[HOST_ENV] = f"host{rank // 2}"  # ranks 0,1 on host0; 2,3 on host1
    backend = SymmCpuBackend(timeout_s=TIMEOUT)
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3]), dist.new_group([0, 1, 2, 3])]
    mine = groups[rank // 2]
    for group, members in ((mine, 2), (groups[2], 4)):
        out = torch.empty(members * 3)
        backend.all_gather(out, torch.full((3,), float(rank)), group).wait(TIMEOUT)
        first = 0 if members == 4 else rank - rank % 2
        assert torch.equal(out, torch.arange(first, first + members).float().repeat_interleave(3))
    used_symm = backend._groups[(rank - rank % 2, rank - rank % 2 + 1)] is not None
    fell_back = backend._groups[(0, 1, 2, 3)] is None
    backend.close()
    return used_symm and fell_back


@pytest.mark.timeout(60)
def test_group_across_hosts_falls_back_to_torch() -> None:
    assert all(run_ranks(_two_host_worker, 4, timeout_s=50))


def test_symmetric_refusal_per_group() -> None:
    """The one decision both symmetric-memory backends take per group (the CPU one
    above with two simulated hosts; the CUDA one adds each rank's peer access)."""
    assert symmetric_refusal(["a", "a"]) is None
    assert symmetric_refusal(["a", "a"], [True, True]) is None
    assert "spans hosts ['a', 'b']" in symmetric_refusal(["a", "b", "a"])
    assert "peer access" in symmetric_refusal(["a", "a"], [True, False])
    assert "spans hosts" in symmetric_refusal(["a", "b"], [False, False])  # the host decides first


def _stalled_peer_worker(rank: int, world: int) -> str:
    backend = SymmCpuBackend(timeout_s=2.0)
    group = dist.group.WORLD
    out = torch.empty(world * 4)
    backend.all_gather(out, torch.ones(4), group).wait(10)  # set-up done: segments mapped
    if rank == 1:  # alive, but never joins the next collective
        time.sleep(6)
        backend.close()
        return ""
    t0 = time.monotonic()
    with pytest.raises(ISPCommTimeout) as info:
        backend.all_gather(out, torch.ones(4), group).wait(10)
    backend.close()
    return f"{time.monotonic() - t0:.2f} {info.value}"


@pytest.mark.serial  # a 2 s deadline, timed
@pytest.mark.timeout(60)
def test_stalled_peer_times_out_naming_it() -> None:
    msg = run_ranks(_stalled_peer_worker, 2, timeout_s=40)[0]
    elapsed, text = msg.split(" ", 1)
    assert 1.9 < float(elapsed) < 5.0, msg  # the 2 s deadline, plus a little
    assert "all-gather" in text and "ranks [1]" in text, msg


def _waited_at_the_backends_deadline_worker(rank: int, world: int, wait_s: float = 2.0, told_s: float = 0.0) -> str:
    """Rank 0 waits ``wait_s`` for an all-gather rank 1 never joins, under the backend's
    2 s deadline; ``told_s``: the worker's error reaches the handle that much later."""
    if told_s:  # this rank's process only (each rank is a fresh one)
        finish = SymmHandle._finish

        def told_late(handle: SymmHandle, error: BaseException | None = None) -> None:
            if error is not None:
                time.sleep(told_s)
            finish(handle, error)

        SymmHandle._finish = told_late
    backend = SymmCpuBackend(timeout_s=2.0)
    group = dist.group.WORLD
    backend.all_gather(torch.empty(world * 4), torch.ones(4), group).wait(10)  # set-up done
    if rank == 1:  # alive, but never joins the next collective
        time.sleep(5)
        backend.close()
        return ""
    with pytest.raises(ISPCommTimeout) as info:
        backend.all_gather(torch.empty(world * 4), torch.ones(4), group).wait(wait_s)  # as CommContext waits
    backend.close()
    return str(info.value)


@pytest.mark.serial  # a 2 s deadline that must pass
@pytest.mark.timeout(60)
def test_a_wait_as_long_as_the_backends_deadline_names_the_late_rank() -> None:
    """See [Note: a deadline names who is late]."""
    text = run_ranks(_waited_at_the_backends_deadline_worker, 2, timeout_s=40)[0]
    assert "ranks [1] of group [0, 1]" in text, text
    # the worker's deadline passed first and its error had not reached the handle when
    # the handle's own passed: the worker had cleared the ranks it waited for, and the
    # error said only "did not complete within" (a CI run's flake, made certain here)
    text = run_ranks(_waited_at_the_backends_deadline_worker, 2, 2.2, 0.5, timeout_s=40)[0]
    assert "did not complete within 2.2s" in text and "ranks [1] of group [0, 1]" in text, text


def _out_of_step_worker(rank: int, world: int, dtypes: bool = False) -> str:
    backend = SymmCpuBackend(timeout_s=TIMEOUT)
    group = dist.group.WORLD
    backend.all_gather(torch.empty(world * 4), torch.ones(4), group).wait(10)  # set-up done
    try:
        if dtypes:  # the same bytes in another dtype: summed as this rank's, silently wrong
            backend.all_reduce(torch.ones(4, dtype=torch.float32 if rank == 0 else torch.int32), group).wait(10)
        elif rank == 0:  # an extra collective on one rank: paired by order, a peer's all-reduce meets it
            backend.all_gather(torch.empty(world * 4), torch.ones(4), group).wait(10)
        else:
            backend.all_reduce(torch.ones(6), group).wait(10)
    except RuntimeError as exc:
        return str(exc)
    finally:
        backend.close()
    return "no error"


@pytest.mark.timeout(60)
def test_collectives_out_of_step_fail_on_every_rank_naming_each() -> None:
    """The symm backend pairs collectives by their order: a rank that issues another
    kind or size than its peers fails with them, naming what each issued, instead of
    every rank going on with the bytes of a collective it never meant."""
    for text in run_ranks(_out_of_step_worker, 2, timeout_s=40):
        assert "collectives out of step in group [0, 1]" in text, text
        assert "rank 0: all-gather of 16 bytes (torch.float32), rank 1: all-reduce of 24 bytes (torch.float32)" in text
    said = "rank 0: all-reduce of 16 bytes (torch.float32), rank 1: all-reduce of 16 bytes (torch.int32)"
    assert all(said in text for text in run_ranks(_out_of_step_worker, 2, True, timeout_s=40))


def _mixed_paths_worker(rank: int, world: int) -> str:
    backend = SymmCpuBackend(timeout_s=TIMEOUT)
    group = dist.group.WORLD
    buf = backend.empty(world * 4, torch.float32, torch.device("cpu"), group=group)
    buf.fill_(-1.0)  # rank 1's: a live buffer that no collective below may write
    out = buf if rank == 0 else torch.empty(world * 4)  # rank 0 gathers into a symmetric buffer, rank 1 not
    try:
        backend.all_gather(out, torch.ones(4), group).wait(10)
        return "no error" + ("" if rank == 0 or torch.equal(buf, torch.full_like(buf, -1.0)) else ", buffer written")
    except RuntimeError as exc:
        return str(exc)
    finally:
        backend.close()


@pytest.mark.timeout(60)
def test_a_gather_into_a_symmetric_buffer_on_some_ranks_only_is_out_of_step() -> None:
    """See [Note: what each rank issued]: the path is part of what each rank issued."""
    said = "rank 0: all-gather into a symmetric buffer of 16 bytes (torch.float32), rank 1: all-gather of 16 bytes ("
    for text in run_ranks(_mixed_paths_worker, 2, timeout_s=40):
        assert said in text, text


def _sizes_that_do_not_fit_worker(rank: int, world: int) -> list[str]:
    backend = SymmCpuBackend(timeout_s=TIMEOUT)
    group = dist.group.WORLD
    buf = backend.empty(world * 4 + 2, torch.float32, torch.device("cpu"), group=group)
    buf.fill_(-1.0)
    said = []
    for issue in (
        lambda: backend.all_gather(buf[: world * 4 - 1], torch.ones(4), group),  # peers would write past it
        lambda: backend.all_gather(torch.empty(world * 4 + 1), torch.ones(4), group),
        lambda: backend.reduce_scatter(torch.empty(3), buf[: world * 4], group),
        lambda: backend.all_to_all(torch.empty(world * 3 + 1), torch.ones(world * 3 + 1), group),
    ):
        try:
            issue().wait(5)
            said.append("no error")
        except ValueError as exc:
            said.append(str(exc))
    untouched = torch.equal(buf[world * 4 - 1 :], torch.full((3,), -1.0))
    backend.all_gather(torch.empty(world * 4), torch.ones(4), group).wait(TIMEOUT)  # still in step
    backend.close()
    return said + [f"untouched {untouched}"]


@pytest.mark.timeout(60)
def test_sizes_that_do_not_fit_are_refused_at_issue() -> None:
    """See [Note: sizes checked at issue]."""
    for said in run_ranks(_sizes_that_do_not_fit_worker, 2, timeout_s=50):
        assert all("do not fit each other" in s for s in said[:4]) and said[4] == "untouched True", said


def _grown_by_one_rank_worker(rank: int, world: int) -> str:
    backend = SymmCpuBackend(timeout_s=5.0)
    group = dist.group.WORLD
    backend.all_gather(torch.empty(world * 4), torch.ones(4), group).wait(10)  # set-up done: a 64 KiB scratch
    n = 1000 if rank == 0 else 20000  # rank 1's 80 KB outgrow the scratch: it alone grows it
    try:
        backend.all_gather(torch.empty(world * n), torch.ones(n), group).wait(10)
    except (RuntimeError, ISPCommTimeout) as exc:
        return str(exc)
    finally:
        backend.close()
    return "no error"


@pytest.mark.timeout(90)
def test_a_size_that_outgrows_the_scratch_on_one_rank_is_out_of_step() -> None:
    """See [Note: a scratch grown by some ranks only]: every rank says what each issued
    (before, the growing rank waited in gloo past the deadline)."""
    for text in run_ranks(_grown_by_one_rank_worker, 2, timeout_s=80):
        assert "rank 0: all-gather of 4000 bytes (torch.float32), rank 1: all-gather of 80000 bytes (" in text, text


def _symmetric_worker(rank: int, world: int) -> int:
    # all-gathers into symmetric buffers (peers write straight into them): equal to
    # gloo, also at an offset inside the buffer and in place
    backend = SymmCpuBackend(timeout_s=TIMEOUT)
    group = dist.new_group(list(range(world)))
    for salt, (dtype, n) in enumerate((d, n) for d in DTYPES for n in SIZES):
        inp = _data(rank, n, dtype, salt)
        ref = torch.empty(world * n, dtype=dtype)
        dist.all_gather_into_tensor(ref, inp, group=group)
        buf = backend.empty(world * n + 5, dtype, torch.device("cpu"), group=group)
        for off in (0, 5):
            out = buf[off : off + world * n]
            out.fill_(7)
            backend.all_gather(out, inp, group).wait(TIMEOUT)
            assert torch.equal(out, ref), (dtype, n, off)
        inplace = buf[: world * n]
        inplace[rank * n : (rank + 1) * n] = inp
        backend.all_gather(inplace, inplace[rank * n : (rank + 1) * n], group).wait(TIMEOUT)
        assert torch.equal(inplace, ref), (dtype, n)
        # reduce-scatter reading every peer's input straight from its symmetric buffer
        big = _data(rank, world * n, dtype, salt + 500)
        src = buf[5 : 5 + world * n]
        src.copy_(big)
        rs, rs_ref = torch.empty(n, dtype=dtype), torch.empty(n, dtype=dtype)
        backend.reduce_scatter(rs, src, group).wait(TIMEOUT)
        dist.reduce_scatter_tensor(rs_ref, big, group=group)
        exact = sum(_data(r, world * n, dtype, salt + 500).double() for r in range(world))
        _check_reduce(rs, exact[rank * n : (rank + 1) * n], dtype, rs_ref, "symm")
    # two slots reused alternately, random per-rank delays: a fast rank may write into
    # a slot only once its slow owner has issued the gather into it
    slots = [backend.empty(world * 4099, torch.float32, torch.device("cpu"), group=group) for _ in range(2)]
    delay, prev = random.Random(rank), None
    for i in range(200):
        if delay.random() < 0.3:
            time.sleep(delay.random() * 0.003)
        h = backend.all_gather(slots[i % 2], torch.full((4099,), float(rank * 1000 + i)), group)
        if prev is not None:
            j, hp = prev
            hp.wait(TIMEOUT)
            want = torch.cat([torch.full((4099,), float(r * 1000 + j)) for r in range(world)])
            assert torch.equal(slots[j % 2], want), j
        prev = (i, h)
    prev[1].wait(TIMEOUT)
    # reduce-scatter inputs: one buffer refilled at once after each completes, so a
    # reduce-scatter must not complete while a slow peer still reads its input
    for i in range(200):
        if delay.random() < 0.3:
            time.sleep(delay.random() * 0.003)
        slots[0].copy_(torch.arange(world * 4099, dtype=torch.float32) + i)
        out = torch.empty(4099)
        h = backend.reduce_scatter(out, slots[0], group)
        h.wait(TIMEOUT)
        want = (torch.arange(rank * 4099, (rank + 1) * 4099, dtype=torch.float32) + i) * world
        assert torch.equal(out, want), i
    direct = backend.direct_all_gathers + backend.direct_reduce_scatters
    backend.close()
    return direct


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 3, pytest.param(4, marks=pytest.mark.slow)])
def test_symmetric_buffers_are_written_by_peers(world: int) -> None:
    counts = run_ranks(_symmetric_worker, world, timeout_s=100)
    # every non-empty one took the direct path (an empty tensor has no address in a buffer)
    assert counts == [4 * len(DTYPES) * (len(SIZES) - 1) + 400] * world


def test_backend_selection_on_cpu_and_the_nvshmem_wheel_hint() -> None:
    """CPU parameters: auto is the shared-memory backend, nvshmem is refused; the
    install hint follows the CUDA major of the torch build (cu12 / cu13)."""
    from isp_comm.backends import make_backend, nvshmem_backend

    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match="nvshmem"):
        make_backend("nvshmem", cpu, 10.0)
    assert make_backend("torch", cpu, 10.0).name == "torch"
    assert "nvshmem4py-cu13" in nvshmem_backend.install_hint("13.0")
    assert "nvshmem4py-cu12" in nvshmem_backend.install_hint("12.8")
    assert "cu12 and cu13 only" in nvshmem_backend.install_hint("11.8")
    if torch.version.cuda is None:
        assert "without CUDA" in nvshmem_backend.install_hint()


def test_the_forecast_reads_the_class_make_backend_builds() -> None:
    """``backend_class`` (what the memory forecast reads, e.g. whether the pool's
    buffers are symmetric) is the class ``make_backend`` builds, for every name on CPU;
    on CUDA, the symmetric-buffer backends are NVSHMEM's alone."""
    from isp_comm.backends import backend_class, make_backend
    from isp_comm.backends.nvshmem_backend import NvshmemBackend
    from isp_comm.config import BACKENDS

    cpu = torch.device("cpu")
    for name in set(BACKENDS) - {"nvshmem"}:
        backend = make_backend(name, cpu, 10.0)
        try:
            assert type(backend) is backend_class(name, "cpu"), name
        finally:
            backend.close()
    assert backend_class("auto", "cpu").symmetric_buffers and not backend_class("torch", "cpu").symmetric_buffers
    cuda = {name: backend_class(name, "cuda") for name in BACKENDS}
    assert {n for n, cls in cuda.items() if cls.symmetric_buffers} == {"nvshmem"} and cuda["nvshmem"] is NvshmemBackend


def _in_place_reduce_scatter_worker(rank: int, world: int) -> list[bool]:
    # the output is the rank's own chunk of its input, in a symmetric buffer (the
    # direct path) and in an ordinary tensor (the scratch path), as gloo allows
    backend = SymmCpuBackend(timeout_s=TIMEOUT)
    group = dist.group.WORLD
    n, ok = 5, []
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        full = [torch.arange(world * n).to(dtype) + 10 * r for r in range(world)]
        want = sum(f.double() for f in full)[rank * n : (rank + 1) * n].to(dtype)
        for direct in (True, False):
            if direct:
                inp = backend.empty(world * n, dtype, torch.device("cpu"), group=group)
            else:
                inp = torch.empty(world * n, dtype=dtype)
            inp.copy_(full[rank])
            out = inp[rank * n : (rank + 1) * n]
            backend.reduce_scatter(out, inp, group).wait(TIMEOUT)
            ok.append(torch.equal(out, want))
    backend.close()
    return ok


@pytest.mark.timeout(60)
def test_reduce_scatter_in_place_into_its_own_chunk() -> None:
    """See [Note: a reduce-scatter in place]: every rank's sum, on both paths."""
    assert run_ranks(_in_place_reduce_scatter_worker, 2, timeout_s=50) == [[True] * 6] * 2


@pytest.mark.parametrize("machine", ["aarch64", "x86_64"])
def test_flags_that_could_be_read_out_of_order_keep_the_shared_memory_backend_off(monkeypatch, machine) -> None:
    """See [Note: publication order]: without libatomic a flag is a plain store and a
    plain load, in order on x86 only. On a weakly ordered CPU ``"auto"`` is gloo and
    ``"symm"`` is refused, saying what to install; on x86 both are the backend."""
    from isp_comm.backends import backend_class, shm

    monkeypatch.setattr(shm, "_libatomic", lambda: None)
    monkeypatch.setattr(shm.platform, "machine", lambda: machine)
    if machine == "x86_64":
        assert backend_class("auto", "cpu") is SymmCpuBackend is backend_class("symm", "cpu")
        return
    assert backend_class("auto", "cpu") is TorchBackend
    for refused in (lambda: backend_class("symm", "cpu"), SymmCpuBackend):
        with pytest.raises(ValueError, match="needs libatomic on this aarch64 CPU.*libatomic1"):
            refused()


def test_a_segment_that_cannot_be_mapped_is_a_shared_memory_error_and_leaves_nothing(monkeypatch) -> None:
    """A creation that fails past ``shm_open`` (here ``mmap``: ENOMEM) removes the
    segment it made and is a ``SharedMemoryError``, the error the creation's agreement
    over the group carries to every rank; before, an ``OSError`` left the segment in
    /dev/shm and the peers waiting in gloo for the agreement."""
    from isp_comm.backends import shm
    from isp_comm.errors import SharedMemoryError

    def no_memory(*_args, **_kwargs):
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(shm.mmap, "mmap", no_memory)
    name = shm.segment_name(os.getpid(), "t0", "scratch", 0, 0)
    with pytest.raises(SharedMemoryError, match="cannot create the shared-memory segment .*Cannot allocate memory"):
        shm.Segment(name, 4096, create=True)
    assert not os.path.exists(os.path.join(shm.SHM_DIR, name))


def test_waiting_ranks_yield_less_when_the_container_gives_fewer_cores_than_the_host(monkeypatch) -> None:
    """A group of 4 ranks in a container given 2 CPUs on a bigger host: its waiting
    ranks spun 1000 yields before sleeping, as if each had a core (``os.cpu_count()``
    counts the host's), taking the cores a peer copies on. The group counts the cores
    the cgroup's quota allows (``usable_cores``)."""
    from isp_comm.backends import symm_cpu

    monkeypatch.setattr(symm_cpu.os, "cpu_count", lambda: 64)
    group = dict(me=0, token="t", pids=[0] * 4, ctrl=None, flags=None)
    monkeypatch.setattr(symm_cpu, "usable_cores", lambda: 2)
    assert symm_cpu._Group(ranks=(0, 1, 2, 3), **group).spin_budget == 200
    monkeypatch.setattr(symm_cpu, "usable_cores", lambda: 4)
    assert symm_cpu._Group(ranks=(0, 1, 2, 3), **group).spin_budget == 1000
