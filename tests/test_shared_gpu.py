"""The CPU half of the shared-GPU tests (tests/gpu/test_gpu_shared.py): the symm
backend's decision for ranks that share a GPU, the private MPS daemon's start and
stop (with a fake ``nvidia-cuda-mps-control``), and that tests/gpu collects and
skips with the right reasons where there is no GPU."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from isp_comm.backends import cuda_symm
from isp_comm.backends.cuda_symm import OVERLAP_VARIABLE, overlapping_allowed, shared_gpu_refusal
from isp_comm.backends.streams import HostRuntime
from isp_comm.testing import run_ranks
from tests.gpu import test_gpu_shared as shared
from tests.gpu.mps import PrivateMps, _alive, pe_share

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---- the symm backend's decision ---------------------------------------------------
def test_ranks_sharing_a_gpu_are_refused_in_one_line_naming_the_variable() -> None:
    same = [("h", "GPU-a"), ("h", "GPU-a"), ("h", "GPU-b"), ("h", "GPU-b")]
    said = shared_gpu_refusal(same, allowed=False)
    assert said is not None and "\n" not in said and f"{OVERLAP_VARIABLE}=1" in said, said
    assert "[[0, 1], [2, 3]]" in said, said  # which ranks share which GPU
    assert shared_gpu_refusal(same, allowed=True) is None
    assert shared_gpu_refusal([("h", "GPU-a"), ("h", "GPU-b")], allowed=False) is None
    # the same UUID seen from two hosts is two GPUs (a host's ids are its own)
    assert shared_gpu_refusal([("h1", "GPU-a"), ("h2", "GPU-a")], allowed=False) is None


def test_the_variable_counts_only_when_it_is_1() -> None:
    assert overlapping_allowed({OVERLAP_VARIABLE: "1"})
    assert overlapping_allowed({OVERLAP_VARIABLE: " 1 "})
    assert not any(overlapping_allowed(env) for env in ({}, {OVERLAP_VARIABLE: "0"}, {OVERLAP_VARIABLE: ""}))


class _Props:
    def __init__(self, uuid: str) -> None:
        self.uuid = uuid


def test_peer_ok_takes_a_shared_gpu_as_its_own(monkeypatch) -> None:
    """Two GPUs a and b with peer access one way only (a reaches b), c without any."""
    uuids = ["GPU-a", "GPU-b", "GPU-c"]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: _Props(uuids[torch.device(d).index]))
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda d, i: (torch.device(d).index, i) == (0, 1))
    a, b = torch.device("cuda", 0), torch.device("cuda", 1)
    assert cuda_symm._peer_ok(a, ["GPU-a"])  # ranks sharing a: their own GPU
    assert cuda_symm._peer_ok(a, ["GPU-a", "GPU-b"])
    assert not cuda_symm._peer_ok(b, ["GPU-a", "GPU-b"])
    assert not cuda_symm._peer_ok(a, ["GPU-a", "GPU-c"])
    assert not cuda_symm._peer_ok(a, ["GPU-a", "GPU-z"])  # not visible to this process


def _shared_worker(rank: int, world: int, allowed: bool) -> dict:
    """Wrapping through the CUDA symm backend (on the fake symmetric memory) with every
    rank's GPU the same: refused without the variable, symmetric memory with it."""
    import isp_comm.communicator as communicator
    from isp_comm import ISPCommunicator, ISPConfig, ParallelGroups
    from tests.fakes import FakeSymm
    from tests.parity import Case, batches, loss_fn

    if allowed:
        os.environ[OVERLAP_VARIABLE] = "1"
    else:
        os.environ.pop(OVERLAP_VARIABLE, None)
    fake, made = FakeSymm(), []
    checks = (lambda device: "GPU-same", lambda device, uuids: uuids == ["GPU-same"])

    def factory(name, device, timeout_s):
        made.append(cuda_symm.CudaSymmBackend(timeout_s, symm=fake, runtime=HostRuntime(), peer_check=checks))
        return made[-1]

    communicator.make_backend = factory
    case = Case(steps=2)
    model = case.build()
    try:
        try:
            comm = ISPCommunicator(model, ParallelGroups.create(wp_size=world), ISPConfig(backend="symm"))
        except ValueError as exc:
            return {"refused": str(exc)}
        for step in batches(case, world):
            x, y = (t.chunk(world)[rank] for t in step[0])
            loss_fn(model(x), y).backward()
        local = dict(made[0]._local)
        buffers = len(made[0]._buffers)
        comm.close()
    finally:
        fake.close()
    return {"local": local, "buffers": buffers}


@pytest.mark.timeout(120)
def test_wrapping_refuses_ranks_sharing_a_gpu_without_the_variable() -> None:
    for r in run_ranks(_shared_worker, 2, False, timeout_s=100):
        said = r["refused"]
        assert f"{OVERLAP_VARIABLE}=1" in said and "\n" not in said, said


@pytest.mark.timeout(120)
def test_ranks_sharing_a_gpu_use_symmetric_memory_with_the_variable() -> None:
    for r in run_ranks(_shared_worker, 2, True, timeout_s=100):
        assert r["local"] and all(r["local"].values()) and r["buffers"] > 0, r


# ---- the private MPS daemon, with a fake binary ------------------------------------
FAKE_MPS = """\
#!{python}
# A stand-in for nvidia-cuda-mps-control: "-d" forks a detached daemon that writes
# its pid in the pipe folder and leaves when "quit" arrives on a later call's stdin
# (FAKE_MPS_DEAF: never), or after 60 s in any case.
import os, sys, time
pipe = os.environ["CUDA_MPS_PIPE_DIRECTORY"]
pid_file, quit_file = os.path.join(pipe, "nvidia-cuda-mps-control.pid"), os.path.join(pipe, "quit")
if sys.argv[1:] == ["-d"]:
    if os.environ.get("FAKE_MPS_FAIL"):
        sys.exit("cannot start: " + os.environ["FAKE_MPS_FAIL"])
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            null = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(null, fd)
            with open(pid_file + ".tmp", "w") as f:
                f.write(str(os.getpid()))
            os.replace(pid_file + ".tmp", pid_file)
            end = time.monotonic() + 60
            while time.monotonic() < end and not os.path.exists(quit_file):
                time.sleep(0.05)
            os._exit(0)
        os._exit(0)
    while not os.path.exists(pid_file):
        time.sleep(0.01)
elif sys.stdin.read().strip() == "quit" and not os.environ.get("FAKE_MPS_DEAF"):
    open(quit_file, "w").close()
"""


@pytest.fixture
def fake_mps(tmp_path, monkeypatch):
    folder = tmp_path / "bin"
    folder.mkdir()
    binary = folder / "nvidia-cuda-mps-control"
    binary.write_text(FAKE_MPS.format(python=sys.executable))
    binary.chmod(0o755)
    monkeypatch.setenv("PATH", f"{folder}{os.pathsep}{os.environ['PATH']}")
    for name in ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY", "FAKE_MPS_FAIL", "FAKE_MPS_DEAF"):
        monkeypatch.delenv(name, raising=False)
    return binary


def test_mps_missing_binary_is_a_reason_not_a_failure(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    with PrivateMps() as mps:
        assert mps.reason is not None and "nvidia-cuda-mps-control is not on PATH" in mps.reason
        assert mps.env == {} and mps._root is None


@pytest.mark.serial  # the daemon stopped within seconds
def test_mps_daemon_starts_in_its_own_folder_and_stops(fake_mps) -> None:
    with PrivateMps() as mps:
        assert mps.reason is None, mps.reason
        pipe = mps.env["CUDA_MPS_PIPE_DIRECTORY"]
        assert os.path.isdir(pipe) and os.path.isdir(mps.env["CUDA_MPS_LOG_DIRECTORY"])
        pid = mps._pid()
        assert pid is not None and _alive(pid)
    assert not _wait_alive(pid) and not os.path.exists(pipe)
    assert "CUDA_MPS_PIPE_DIRECTORY" not in os.environ  # the helper sets nothing in this process


@pytest.mark.serial  # the daemon stopped within seconds
def test_mps_daemon_stops_when_the_test_raises(fake_mps) -> None:
    with pytest.raises(RuntimeError, match="the test failed"), PrivateMps() as mps:
        pid = mps._pid()
        raise RuntimeError("the test failed")
    assert not _wait_alive(pid)


@pytest.mark.serial  # the daemon stopped within seconds
def test_mps_daemon_that_ignores_quit_is_killed_by_its_pid(fake_mps, monkeypatch) -> None:
    monkeypatch.setenv("FAKE_MPS_DEAF", "1")
    t0 = time.monotonic()
    with PrivateMps(timeout_s=1.0) as mps:
        pid = mps._pid()
    assert not _wait_alive(pid) and time.monotonic() - t0 < 10


def test_mps_daemon_that_fails_to_start_gives_its_reason(fake_mps, monkeypatch) -> None:
    monkeypatch.setenv("FAKE_MPS_FAIL", "no GPU here")
    with PrivateMps() as mps:
        assert "exited 1" in mps.reason and "no GPU here" in mps.reason, mps.reason
        root = mps._root
    assert not os.path.exists(root)


def _wait_alive(pid: int, within_s: float = 5.0) -> bool:
    """Whether ``pid`` still runs after up to ``within_s`` (a daemon leaves in its own time)."""
    end = time.monotonic() + within_s
    while _alive(pid) and time.monotonic() < end:
        time.sleep(0.05)
    return _alive(pid)


def test_pe_shares_sum_to_at_most_100() -> None:
    assert all(pe_share(w) * w <= 100 for w in (1, 2, 3, 4, 8))


# ---- tests/gpu on a machine without one --------------------------------------------
def test_skip_reasons_name_what_is_missing() -> None:
    said = shared.nccl_refusal((2, 28, 9))
    assert "NCCL 2.28.9 < 2.30" in said and "NCCL_MULTI_RANK_GPU_ENABLE=1" in said, said
    assert shared.nccl_refusal((2, 30, 1)) is None and shared.nccl_refusal((3, 0, 0)) is None
    assert shared.nccl_refusal(None) == "NCCL unavailable in this torch"
    assert shared.limited_reason(["STATUS_FULL_MPG", "STATUS_FULL_MPG"]) is None
    said = shared.limited_reason(["STATUS_FULL_MPG", "STATUS_LIMITED_MPG"])
    assert "STATUS_LIMITED_MPG" in said and "MPS" in said, said
    # another status is no reason to skip: the test asserts full mode and fails
    assert shared.limited_reason(["STATUS_IS_INITIALIZED", None]) is None


def test_the_status_names_are_nvshmem4pys() -> None:
    """The names the tests compare with are the installed nvshmem4py's own."""
    pytest.importorskip("nvshmem.core")
    import nvshmem.core

    assert {shared.FULL, shared.LIMITED} <= set(nvshmem.core.InitStatus.__members__)
    assert callable(nvshmem.core.init_status)


def test_the_status_is_read_by_name_from_the_int_init_status_returns(monkeypatch) -> None:
    """``init_status()`` returns the binding's plain int (it needs libnvshmem, so a fake
    returns one here): the tests' name for it comes through ``InitStatus``."""
    pytest.importorskip("nvshmem.core")
    import nvshmem.core

    from tests.gpu.mps import nvshmem_status

    full = int(nvshmem.core.InitStatus.STATUS_FULL_MPG)
    monkeypatch.setattr(nvshmem.core, "init_status", lambda: full)
    assert nvshmem_status() == shared.FULL


@pytest.mark.timeout(300)
def test_tests_gpu_collect_and_skip_for_want_of_cuda() -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: tests/gpu runs for real")
    cmd = [sys.executable, "-m", "pytest", "tests/gpu", "-q", "-rs", "-p", "no:cacheprovider"]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=280)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]
    tail = res.stdout.strip().splitlines()[-1]
    assert "skipped" in tail and "passed" not in tail and "error" not in tail, tail
    reasons = [line for line in res.stdout.splitlines() if line.startswith("SKIPPED")]
    assert reasons and all("needs CUDA" in line or "needs 2 CUDA devices" in line for line in reasons), reasons
    assert any("test_gpu_shared.py" in line and "needs CUDA" in line for line in reasons), reasons
    collected = subprocess.run([*cmd[:4], "--collect-only", "-q"], capture_output=True, text=True, cwd=ROOT)
    names = collected.stdout
    for name in (
        "test_symm_contract_ranks_sharing_one_gpu[4]",
        "test_nvshmem_contract_pes_sharing_one_gpu_under_mps[2]",
    ):
        assert name in names, names[-2000:]


def test_sync_step_script_says_its_flags() -> None:
    res = subprocess.run(
        [sys.executable, "tests/gpu/scripts/sync_step.py", "--help"], capture_output=True, text=True, cwd=ROOT
    )
    assert res.returncode == 0 and "--one-gpu" in res.stdout and "nvshmem" in res.stdout, res.stderr


# ---- the shared-GPU tests' own logic, on CPU against the CUDA symm backend's code ----
def _on_cpu(rank: int) -> tuple:
    """tests/gpu/test_gpu_shared.py's workers made to run on CPU tensors: its device is
    the CPU, torch.cuda's device calls do nothing, and every backend made is the CUDA
    symm backend on the fake symmetric memory, each rank on a GPU of its own."""
    import isp_comm.communicator as communicator
    from tests.fakes import FakeSymm

    shared.DEV = torch.device("cpu")
    torch.cuda.set_device = lambda device: None
    torch.cuda.synchronize = lambda device=None: None
    fakes = []
    checks = (lambda device: f"GPU-{rank}", lambda device, uuids: True)

    def factory(name, device, timeout_s):
        fakes.append(FakeSymm())
        return cuda_symm.CudaSymmBackend(timeout_s, symm=fakes[-1], runtime=HostRuntime(), peer_check=checks)

    communicator.make_backend = factory
    return fakes, factory


def _gpu_test_logic_worker(rank: int, world: int, what: str, args: tuple):
    import torch.distributed as dist

    fakes, factory = _on_cpu(rank)
    try:
        if what == "contract":
            backend = factory("symm", shared.DEV, 60.0)
            got = shared._contract(backend, dist.group.WORLD, dist.new_group(backend="gloo"), rank, world)
            backend.close()
            return got
        return shared._parity_worker(rank, world, "symm", *args)
    finally:
        for f in fakes:
            f.close()


@pytest.mark.timeout(200)
def test_the_shared_gpu_contract_passes_against_a_correct_backend() -> None:
    """The references and tolerances of the GPU contract, on the CUDA symm backend's
    code over fakes: what fails on the GPU is then the GPU's, not the test's."""
    assert run_ranks(_gpu_test_logic_worker, 2, "contract", (), timeout_s=180) == [32] * 2


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world, args", [(2, (2, 1, False)), (4, (2, 2, True))], ids=["wp2", "wp2-sp2-bf16"])
def test_the_shared_gpu_parity_passes_on_cpu(world: int, args: tuple) -> None:
    results = run_ranks(_gpu_test_logic_worker, world, "parity", args, timeout_s=280)
    assert all(r["symmetric"] for r in results), results
    shared._check_parity(results, bf16=args[2])
