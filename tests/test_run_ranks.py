"""isp_comm.testing.run_ranks and run_main: how their ranks start (see [Note: how ranks start])."""

from __future__ import annotations

import os

import pytest

from isp_comm.testing import run_main, run_ranks

VAR = "ISP_COMM_TEST_RUN_RANKS_VAR"


def _seen(rank: int, world: int) -> str | None:
    return os.environ.get(VAR)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("start", ["forkserver", "spawn"])
def test_ranks_see_the_environment_of_the_moment_they_start(start: str, monkeypatch) -> None:
    # the forkserver started earlier in the session (or now) with another environment:
    # a forked rank must still see what the caller set just before; a spawned rank is a
    # new interpreter (seconds to start), checked with one value and its removal
    forked = start == "forkserver"
    if forked:
        run_ranks(_seen, 2, start=start)
    for value in ("one", "two") if forked else ("one",):
        monkeypatch.setenv(VAR, value)
        assert run_ranks(_seen, 2, start=start) == [value, value]
    monkeypatch.delenv(VAR)
    assert run_ranks(_seen, 2, start=start) == [None, None]


def test_an_unknown_start_method_is_one_line(monkeypatch) -> None:
    monkeypatch.setenv("ISP_COMM_RANKS_START", "fork")
    with pytest.raises(ValueError, match=r"start 'fork' is not one of \('spawn', 'forkserver'\)"):
        run_ranks(_seen, 2)


def test_a_rank_waits_for_every_rank_to_join_before_its_function_runs(tmp_path) -> None:
    """``_all_joined``: returns once ``world`` ranks have come through, and a rank left
    alone ends at its deadline saying how many joined (not waiting for ever)."""
    import threading

    import torch.distributed as dist

    from isp_comm.testing import _all_joined

    store = dist.FileStore(str(tmp_path / "store"), 2)
    with pytest.raises(TimeoutError, match="1 of 2 ranks joined"):
        _all_joined(store, 2, timeout_s=0.2)
    store2 = dist.FileStore(str(tmp_path / "store2"), 2)
    done: list[str] = []
    late = threading.Thread(target=lambda: (_all_joined(store2, 2), done.append("late")))
    late.start()
    _all_joined(store2, 2, timeout_s=10.0)
    late.join(timeout=10.0)
    assert done == ["late"]


def _crash(rank: int, world: int) -> int:
    """Rank 1 reads address 0 (a crash in native code, as a segfault in a backend's)."""
    if rank == 1:
        import ctypes

        ctypes.string_at(0)
    return rank


@pytest.mark.timeout(120)
def test_a_rank_killed_by_a_signal_is_named_with_it_and_its_stack() -> None:
    """A crash in a rank says which signal ended it and the Python stack it crashed in
    (faulthandler's), not only an exit code, however the ranks were started."""
    with pytest.raises(RuntimeError, match=r"ranks \[1\] died \(rank 1: killed by SIGSEGV") as e:
        run_ranks(_crash, 2)
    assert "Fatal Python error: Segmentation fault" in str(e.value) and "in _crash" in str(e.value), e.value


# ---- run_main ----------------------------------------------------------------------------
def _cli(argv: list[str]) -> int:
    """A command line's main: says where it runs, leaves a file from an exit callback,
    then returns its exit code, exits, raises, or sleeps, as ``argv`` asks."""
    import atexit
    import sys
    import time

    rank = os.environ.get("RANK", "-")
    print(f"out {rank} {os.environ.get('WORLD_SIZE', '-')} {os.getcwd()}", flush=True)
    print(f"err {rank}", file=sys.stderr, flush=True)
    what, folder = argv[0], argv[1]
    atexit.register(lambda: open(os.path.join(folder, f"exited.{rank}"), "w").close())
    mine = what.split(",")[int(rank) if rank != "-" else 0]
    if mine == "sleep":
        time.sleep(600)
    if mine == "raise":
        raise RuntimeError("from main")
    if mine.startswith("exit"):
        sys.exit(int(mine[4:]))
    return int(mine)


@pytest.mark.timeout(120)
def test_run_main_runs_a_main_as_torchruns_workers(tmp_path) -> None:
    """Every rank's output in one result, each rank with its RANK and WORLD_SIZE, the
    exit code a main returns or exits with, and its exit callbacks run."""
    res = run_main(_cli, ["0,0", str(tmp_path)], world=2, cwd=str(tmp_path))
    assert res.returncode == 0, res.stderr
    assert sorted(res.stdout.splitlines()) == [f"out 0 2 {tmp_path}", f"out 1 2 {tmp_path}"]
    assert sorted(res.stderr.splitlines()) == ["err 0", "err 1"]
    assert sorted(os.listdir(tmp_path)) == ["exited.0", "exited.1"]
    assert run_main(_cli, ["3", str(tmp_path)]).returncode == 3  # one process: no RANK
    assert run_main(_cli, ["0,exit5", str(tmp_path)], world=2).returncode == 5
    res = run_main(_cli, ["raise", str(tmp_path)])
    assert res.returncode == 1 and "RuntimeError: from main" in res.stderr and "Traceback" in res.stderr


@pytest.mark.timeout(120)
def test_run_main_stops_the_others_when_a_rank_fails_and_keeps_its_deadline(tmp_path) -> None:
    """A rank that fails ends its sleeping peer at once (SIGTERM, as torchrun's agent),
    with the failure's exit code; ranks past the deadline are killed and it raises."""
    import subprocess
    import time

    start = time.monotonic()
    res = run_main(_cli, ["sleep,exit7", str(tmp_path)], world=2, timeout_s=100)
    assert res.returncode == 7 and time.monotonic() - start < 60, res.stderr
    start = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        run_main(_cli, ["sleep", str(tmp_path)], timeout_s=3)
    assert time.monotonic() - start < 60
