"""Suite-wide checks."""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile

import pytest

from isp_comm.backends.shm import pid_alive

# isp-train --plan calibrates this machine on first use (a minute of timing runs): the
# tests plan on the nominal cpu target instead (tests/test_planner.py sets its own).
os.environ.setdefault("ISP_COMM_PLAN_CALIBRATE", "0")
# Ranks fork from a server that imported torch once, not each a new interpreter: 0.1 s
# for four ranks, not 6 (isp_comm/testing.py: [Note: how ranks start]). A test that
# measures a fresh process's memory asks run_ranks for spawn.
os.environ.setdefault("ISP_COMM_RANKS_START", "forkserver")
# A test that calibrates writes into a folder of the session's, never into the user's
# cache (isp_comm/planner/profile.py: cache_dir); a test may give its own.
CACHE_DIR = os.environ["ISP_COMM_CACHE_DIR"] = tempfile.mkdtemp(prefix="isp-comm-test-cache-")


def pytest_sessionfinish(session, exitstatus) -> None:
    shutil.rmtree(CACHE_DIR, ignore_errors=True)


def _segments() -> set[str]:
    try:
        return {n for n in os.listdir("/dev/shm") if n.startswith("isp_")}
    except FileNotFoundError:
        return set()


def _ours(name: str) -> bool:
    """Whether a segment may be this test's: created by this process, or by one that
    has exited (the test's ranks have, by teardown). A segment whose creator is still
    running elsewhere (``isp_<pid>_...``) belongs to another job on the machine."""
    try:
        pid = int(name[len("isp_") :].split("_", 1)[0])
    except ValueError:
        return True
    return pid == os.getpid() or not pid_alive(pid)


@pytest.fixture(autouse=True)
def no_leaked_shared_memory():
    """A test that leaves an isp-comm segment in /dev/shm fails."""
    before = _segments()
    yield
    # exists again after _ours: a peer job's segment unlinked just before its creator
    # exited, between the listing and the pid's check, is not this test's
    left = {n for n in _segments() - before if _ours(n) and os.path.exists(f"/dev/shm/{n}")}
    assert not left, f"shared-memory segments left behind: {sorted(left)}"


# [Note: serial tests under pytest -n]
# CI runs the suite on two pytest-xdist workers (``-n 2``, handed tests one by one):
# most tests are ranks that share the cores and their own temporary folders, and run
# fine beside another test. A test marked ``serial`` does not: it times a deadline, a
# window or a calibration, or plants segments of a dead job in /dev/shm that another
# test's run would clean up (and another test's teardown take for its own leak). It
# runs with no other test beside it: every test holds a lock on this file around its
# whole run (set-up, call, teardown), shared for most, exclusive for a serial one.
# - The gate (this folder) favours the waiting serial test: a worker passes the gate
#   before it asks for its lock, and a serial test holds the gate while it waits, so
#   the other worker cannot keep taking shared locks ahead of it.
# - The serial tests are one xdist group, so one worker runs them in a row, and it
#   keeps its exclusive lock while its next test is serial too: one wait for the other
#   worker's test, not one per serial test.
# - They come first (collection puts them ahead, and ``--no-loadscope-reorder`` keeps
#   xdist's order), so the wait is for one test of the other worker's: the next in
#   line. xdist's own order puts larger groups first, and the slow tier's forecast
#   group, whose first test calibrates for two minutes, came second: the other worker
#   took it, and the serial run waited 114 s for it (2026-12-03, while neither worker
#   ran anything else beside).
# - Both are taken before pytest-timeout's timer starts (``tryfirst``): a wait counts
#   against no test.
# - Only an xdist worker locks (``config.workerinput``; not an environment variable,
#   which a pytest that a serial test starts would inherit, and wait for its parent).
# Python opens files close-on-exec: the ranks a test starts (spawned, or forked from a
# server that was itself spawned) hold neither.
_LOCK, _GATE = __file__, os.path.dirname(__file__)
_held: list[int] = []  # this worker's exclusive lock, while a run of serial tests lasts


def _serial(item) -> bool:
    return item is not None and item.get_closest_marker("serial") is not None


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    if not hasattr(item.config, "workerinput"):
        return (yield)
    if _held:  # the previous test was serial, and so is this one
        lock = _held.pop()
    else:
        lock, gate = os.open(_LOCK, os.O_RDONLY), os.open(_GATE, os.O_RDONLY)
        fcntl.flock(gate, fcntl.LOCK_EX)
        fcntl.flock(lock, fcntl.LOCK_EX if _serial(item) else fcntl.LOCK_SH)
        os.close(gate)  # closing releases a lock
    try:
        return (yield)
    finally:
        if _serial(item) and _serial(nextitem):
            _held.append(lock)
        else:
            os.close(lock)


SLOW_ENV = "ISP_SLOW"


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(config, items) -> None:
    """Tests marked ``slow`` run with ``ISP_SLOW=1`` only: the suite must stay under 15
    minutes on CI's 2 cores; what is in that tier is listed in the README. Serial tests
    are one xdist group, first: one worker runs them in a row (see [Note: serial tests
    under pytest -n])."""
    for item in items:
        if _serial(item):
            item.add_marker(pytest.mark.xdist_group("serial"))
    items[:] = sorted(items, key=lambda item: not _serial(item))  # stable: the serial run first
    if os.environ.get(SLOW_ENV) == "1":
        return
    skip = pytest.mark.skip(reason=f"slow tier: run with {SLOW_ENV}=1")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
