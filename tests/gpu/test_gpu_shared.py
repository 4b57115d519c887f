"""Every CUDA backend across ranks on ONE GPU: 2 and 4 ranks share the device, so the
multi-rank CUDA paths run for real on a one-GPU machine (for correctness, not speed).

- ``symm``: torch symmetric memory maps ranks on one GPU only with
  ``TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1``, which these tests set. The default
  process group is gloo (NCCL refuses two ranks on one GPU before 2.30).
- ``nvshmem``: under a private MPS daemon the module starts and stops
  (``tests/gpu/mps.py``), checked once to serve a CUDA process, each PE with ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` 100 /
  world, so that NVSHMEM runs the PEs in full mode (``STATUS_FULL_MPG``). Skipped,
  with the reason, when MPS is missing or NVSHMEM stays limited: its on-stream
  collectives would abort the process then. nvshmem serves world-sized groups only
  (smaller ones go to gloo here), so its parity runs at wp = world.
- NCCL at world 2 on one GPU needs NCCL 2.30 (``NCCL_MULTI_RANK_GPU_ENABLE=1``);
  older versions skip, naming theirs.
- A whole step with no host synchronisation (``tests/gpu/scripts/sync_step.py``):
  symm at wp 2 x sp 2, nvshmem at wp = world.

The contract compares each backend with gloo's all-gather of the same inputs on the
CPU; parity compares training with single-process training on the same GPU.
Everything here skips without CUDA; ``tests/test_shared_gpu.py`` checks on CPU that
it collects and that its skip reasons are right.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from isp_comm.backends.cuda_symm import OVERLAP_VARIABLE
from isp_comm.testing import free_port, run_ranks
from tests.gpu.mps import PrivateMps, nvshmem_status, pe_share
from tests.parity import Case, batches, loss_fn, make_optim

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEV = torch.device("cuda", 0)
NCCL_SHARED = (2, 30)
"""The first NCCL that lets ranks share a GPU (with ``NCCL_MULTI_RANK_GPU_ENABLE=1``)."""
HEAP = "512M"
"""Each PE's NVSHMEM heap (its granularity): 4 PEs hold 2 GiB of the GPU together."""


def nvshmem_missing() -> str | None:
    """Why the nvshmem tests cannot run here, or None."""
    try:
        import nvshmem.core  # noqa: F401
    except ImportError as exc:
        return f"nvshmem4py not installed ({exc})"
    return None


def nccl_refusal(version: tuple[int, ...] | None) -> str | None:
    """Why NCCL cannot put two ranks on one GPU (the skip reason), or None."""
    if version is None:
        return "NCCL unavailable in this torch"
    if tuple(version[:2]) < NCCL_SHARED:
        have, need = ".".join(map(str, version)), ".".join(map(str, NCCL_SHARED))
        return f"NCCL {have} < {need}: two ranks on one GPU need NCCL >= {need} (NCCL_MULTI_RANK_GPU_ENABLE=1)"
    return None


FULL, LIMITED = "STATUS_FULL_MPG", "STATUS_LIMITED_MPG"
"""nvshmem4py's ``InitStatus`` names: several PEs on one GPU in full mode (under MPS),
or limited (its on-stream collectives and team syncs abort the process)."""


def limited_reason(statuses: list[str | None]) -> str | None:
    """The skip reason when NVSHMEM ran a PE limited, or None (any other status than
    full mode is then a failure, not a skip)."""
    if LIMITED not in statuses:
        return None
    return f"NVSHMEM ran the PEs sharing the GPU as {LIMITED}, not {FULL}, even under MPS"


def _nccl_version() -> tuple[int, ...] | None:
    try:
        return tuple(torch.cuda.nccl.version())
    except Exception:  # noqa: BLE001 - a build without NCCL
        return None


# ---- the workers (one per rank, all on cuda:0) -------------------------------------


class _Limited(Exception):
    def __init__(self, status: str) -> None:
        super().__init__(status)
        self.status = status


def _full_or_limited(make_backend):
    """``make_backend`` that raises :class:`_Limited` right after NVSHMEM's init when it
    runs this PE limited: wrapping would then allocate in the heap, a collective that
    aborts the process in limited mode."""

    def make(name: str, device: torch.device, timeout_s: float):
        backend = make_backend(name, device, timeout_s)
        if name == "nvshmem" and nvshmem_status() == LIMITED:
            raise _Limited(LIMITED)
        return backend

    return make


def _contract(backend, group, gloo, rank: int, world: int) -> int:
    """all-gather, reduce-scatter, all-reduce and all-to-all of ``backend`` on cuda:0,
    fp32 and bf16, sizes that divide nothing, against gloo's all-gather of the same
    inputs on the CPU (the sums taken there in fp32)."""
    done = 0
    for dtype in (torch.float32, torch.bfloat16):
        # sums of `world` N(0, 1) values in another order: a few fp32 ulps; bf16 keeps
        # 8 mantissa bits (a backend may round each partial sum), so 1e-2 of O(1) values
        tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=3e-2)
        for n in (4099, 1, 1000, 65_537):
            g = torch.Generator().manual_seed(rank * 31 + n)
            x, big = torch.randn(n, generator=g).to(dtype), torch.randn(world * n, generator=g).to(dtype)
            xs = [torch.empty(n) for _ in range(world)]
            bigs = [torch.empty(world * n) for _ in range(world)]
            dist.all_gather(xs, x.float(), group=gloo)
            dist.all_gather(bigs, big.float(), group=gloo)
            total = torch.stack(bigs).sum(0)

            out = torch.empty(world * n, device=DEV, dtype=dtype)
            backend.all_gather(out, x.to(DEV), group).wait(60)
            assert torch.equal(out.cpu().float(), torch.cat(xs)), ("all_gather", dtype, n)
            rs = torch.empty(n, device=DEV, dtype=dtype)
            backend.reduce_scatter(rs, big.to(DEV), group).wait(60)
            torch.testing.assert_close(rs.cpu().float(), total.chunk(world)[rank], **tol)
            ar = big.to(DEV, copy=True)  # all-reduce is in place
            backend.all_reduce(ar, group).wait(60)
            torch.testing.assert_close(ar.cpu().float(), total, **tol)
            a2a = torch.empty(world * n, device=DEV, dtype=dtype)
            backend.all_to_all(a2a, big.to(DEV), group).wait(60)
            want = torch.cat([b.chunk(world)[rank] for b in bigs])
            assert torch.equal(a2a.cpu().float(), want), ("all_to_all", dtype, n)
            done += 4
    torch.cuda.synchronize(DEV)
    return done


def _contract_worker(rank: int, world: int, name: str) -> dict:
    from isp_comm.backends import make_backend

    torch.cuda.set_device(DEV)
    gloo = dist.new_group(backend="gloo")  # the reference (the default group is NCCL in the NCCL test)
    backend = make_backend(name, DEV, 60.0)  # NVSHMEM starts here: NVSHMEM_SYMMETRIC_SIZE is set
    if name == "nvshmem" and nvshmem_status() == LIMITED:
        # limited mode: collectives and team syncs abort the process, finalize too
        # (it syncs): the rank says so and leaves without them
        return {"status": LIMITED}
    try:
        checked = _contract(backend, dist.group.WORLD, gloo, rank, world)
        status = nvshmem_status() if name == "nvshmem" else None
        # the symm backend decides once per group: symmetric memory, never a fallback
        symmetric = all(backend._local.values()) if name == "symm" else None
    finally:
        backend.close()
    return {"status": status, "checked": checked, "symmetric": symmetric}


def _parity_worker(rank: int, world: int, name: str, wp: int, sp: int, bf16: bool) -> dict:
    """ISP training (shard_outer, checkpointing; vocab-parallel with SP) against
    single-process training of the same global batch, both on cuda:0."""
    import isp_comm.communicator as communicator
    from isp_comm import ISPCommunicator, ISPConfig, ParallelGroups

    communicator.make_backend = _full_or_limited(communicator.make_backend)
    torch.cuda.set_device(DEV)
    case = Case(optim="adamw", steps=3, seq=16, bias=True)
    ref = case.build().to(DEV)
    ref_opt, ref_losses = make_optim(case.optim, ref.parameters()), []
    for step in batches(case, world):
        x, y = (t.to(DEV) for t in step[0])
        loss = loss_fn(ref(x), y)
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(loss.item())

    model = case.build().to(DEV)
    mp = {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32} if bf16 else {}
    cfg = ISPConfig(backend=name, shard_outer_params=True, activation_checkpointing=0.5, vocab_parallel=sp > 1, **mp)
    try:
        comm = ISPCommunicator(model, ParallelGroups.create(wp_size=wp, sp_size=sp), cfg)
    except _Limited as exc:
        return {"status": exc.status}
    opt, losses = make_optim(case.optim, model.parameters()), []
    dp, sp_rank, dp_rank = world // sp, rank % sp, rank // sp
    lo, hi = sp_rank * case.seq // sp, (sp_rank + 1) * case.seq // sp
    positions = torch.arange(lo, hi, device=DEV)
    for step in batches(case, world):
        x, y = (t.to(DEV).chunk(dp)[dp_rank][:, lo:hi] for t in step[0])
        loss = comm.cross_entropy(model(x, position_ids=positions), y)  # this rank's mean; tokens alike per rank
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    sd = comm.full_state_dict()
    symmetric = all(comm.backend._local.values()) if name == "symm" else None
    status = nvshmem_status() if name == "nvshmem" else None  # before close: it finalizes
    comm.close()
    ref_sd = ref.state_dict()
    return {
        "status": status,
        "symmetric": symmetric,
        "loss": max(abs(a - b) for a, b in zip(losses, ref_losses)),
        "weights": max((sd[k].float() - v.float()).abs().max().item() for k, v in ref_sd.items()),
    }


def _check_parity(results: list[dict], bf16: bool) -> None:
    for r in results:
        if bf16:
            # bf16 compute of every parameter against fp32 training: bf16 rounding (2^-9
            # relative) per operation, compounded over 3 AdamW steps (as test_gpu_engine)
            assert r["loss"] < 2e-2, r
        else:
            # fp32: the same GEMMs on a part of the batch, summed in another order (cuBLAS
            # may split K differently): a few ulps of a loss of ~3.6 after 3 AdamW steps;
            # AdamW's normalised updates (lr 1e-2) amplify ulps of tiny gradients
            assert r["loss"] < 1e-5 and r["weights"] < 1e-4, r


def _skip_if_limited(results: list[dict]) -> None:
    """Skips when NVSHMEM ran a PE limited; else every PE must have run in full mode."""
    reason = limited_reason([r["status"] for r in results])
    if reason is not None:
        pytest.skip(reason)
    assert all(r["status"] == FULL for r in results), results


# ---- symm: torch symmetric memory with the overlap variable ------------------------
@pytest.mark.timeout(200)
@pytest.mark.parametrize("world", [2, 4])
def test_symm_contract_ranks_sharing_one_gpu(monkeypatch, world: int) -> None:
    monkeypatch.setenv(OVERLAP_VARIABLE, "1")
    for r in run_ranks(_contract_worker, world, "symm", timeout_s=180):
        assert r["checked"] == 32 and r["symmetric"], r


@pytest.mark.timeout(200)
@pytest.mark.parametrize("world, wp, sp, bf16", [(2, 2, 1, False), (4, 2, 2, True)], ids=["wp2", "wp2-sp2-bf16"])
def test_symm_engine_parity_ranks_sharing_one_gpu(monkeypatch, world: int, wp: int, sp: int, bf16: bool) -> None:
    monkeypatch.setenv(OVERLAP_VARIABLE, "1")
    results = run_ranks(_parity_worker, world, "symm", wp, sp, bf16, timeout_s=180)
    assert all(r["symmetric"] for r in results), results
    _check_parity(results, bf16)


def _refusal_worker(rank: int, world: int) -> str:
    from isp_comm import ISPCommunicator, ISPConfig, ParallelGroups

    torch.cuda.set_device(DEV)
    try:
        ISPCommunicator(Case().build().to(DEV), ParallelGroups.create(wp_size=world), ISPConfig(backend="symm"))
    except ValueError as exc:
        return str(exc)
    return ""


@pytest.mark.timeout(120)
def test_symm_refuses_ranks_sharing_a_gpu_without_the_variable(monkeypatch) -> None:
    monkeypatch.delenv(OVERLAP_VARIABLE, raising=False)
    for said in run_ranks(_refusal_worker, 2, timeout_s=100):
        assert OVERLAP_VARIABLE in said and "\n" not in said, said


# ---- nvshmem under a private MPS daemon --------------------------------------------
@pytest.fixture(scope="module")
def mps_daemon():
    """One private MPS daemon for this module's nvshmem tests, stopped after them:
    ``(env, reason)``, the reason (else None) why MPS cannot serve the ranks here."""
    missing = nvshmem_missing()
    if missing:
        yield {}, missing
        return
    with PrivateMps() as mps:
        yield mps.env, mps.reason or _serves_a_client(mps.env)


def _serves_a_client(env: dict[str, str]) -> str | None:
    """Why a CUDA process under the daemon fails (a hang is a reason too), or None:
    asked once, so that no test waits out its timeout on a server that never serves."""
    code = "import torch; torch.ones(1, device='cuda').sum().item()"
    try:
        res = subprocess.run(
            [sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True, timeout=60
        )
    except subprocess.TimeoutExpired:
        return "a CUDA process under the private MPS daemon did not finish within 60 s"
    if res.returncode:
        return f"a CUDA process failed under the private MPS daemon: {res.stderr.strip()[-300:]}"
    return None


def _under_mps(monkeypatch, mps_daemon, world: int) -> None:
    """The ranks spawned next are the daemon's clients, each PE with its share and heap;
    skips when MPS cannot serve them."""
    env, reason = mps_daemon
    if reason:
        pytest.skip(reason)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", str(pe_share(world)))
    monkeypatch.setenv("NVSHMEM_SYMMETRIC_SIZE", HEAP)
    monkeypatch.setenv("NVSHMEM_DISABLE_NCCL", "1")  # NVSHMEM turns NCCL off under MPS anyway, with a warning


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [2, 4])
def test_nvshmem_contract_pes_sharing_one_gpu_under_mps(monkeypatch, mps_daemon, world: int) -> None:
    _under_mps(monkeypatch, mps_daemon, world)
    results = run_ranks(_contract_worker, world, "nvshmem", timeout_s=200)
    _skip_if_limited(results)
    assert all(r["checked"] == 32 for r in results), results


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world, bf16", [(2, False), (4, True)], ids=["wp2", "wp4-bf16"])
def test_nvshmem_engine_parity_pes_sharing_one_gpu_under_mps(monkeypatch, mps_daemon, world: int, bf16: bool) -> None:
    _under_mps(monkeypatch, mps_daemon, world)
    results = run_ranks(_parity_worker, world, "nvshmem", world, 1, bf16, timeout_s=200)
    _skip_if_limited(results)
    _check_parity(results, bf16)


# ---- NCCL: two ranks on one GPU from 2.30 ------------------------------------------
@pytest.mark.timeout(200)
def test_nccl_two_ranks_on_one_gpu(monkeypatch) -> None:
    reason = nccl_refusal(_nccl_version())
    if reason:
        pytest.skip(reason)
    monkeypatch.setenv("NCCL_MULTI_RANK_GPU_ENABLE", "1")
    for r in run_ranks(_contract_worker, 2, "torch", backend="nccl", gpu=0, timeout_s=180):
        assert r["checked"] == 32, r


# ---- a whole step without a host synchronisation -----------------------------------
def _sync_step(world: int, args: list[str], timeout: float = 200) -> subprocess.CompletedProcess:
    script = os.path.join(ROOT, "tests", "gpu", "scripts", "sync_step.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={world}", f"--master-port={free_port()}"]
    return subprocess.run([*cmd, script, "--one-gpu", *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT)


@pytest.mark.timeout(240)
def test_symm_step_at_wp2_sp2_on_one_gpu_never_synchronises_the_host(monkeypatch) -> None:
    monkeypatch.setenv(OVERLAP_VARIABLE, "1")
    res = _sync_step(4, ["--backend", "symm", "--wp", "2", "--sp", "2"])
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.count("without a host synchronisation") == 4, res.stdout


@pytest.mark.timeout(240)
def test_nvshmem_step_at_wp_world_on_one_gpu_never_synchronises_the_host(monkeypatch, mps_daemon) -> None:
    _under_mps(monkeypatch, mps_daemon, 2)
    res = _sync_step(2, ["--backend", "nvshmem", "--wp", "2", "--sp", "1"])
    statuses = [line.split()[-1] for line in res.stdout.splitlines() if "NVSHMEM status" in line]
    reason = limited_reason(statuses)
    if reason is not None:
        pytest.skip(reason)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.count("without a host synchronisation") == 2, res.stdout
    assert statuses == [FULL, FULL], res.stdout
