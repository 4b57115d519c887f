"""Calibrating this machine for --plan (issue 55): under a launcher the calibration's
own runs are jobs of their own, one process calibrates while the others wait for it
and read its profile, a noisy calibration is repeated and then not cached, and
--recalibrate measures again. Every test calibrates into a cache folder of its own
(tests/conftest.py keeps the user's cache out of reach too)."""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from isp_comm.planner import calibrate
from isp_comm.planner import profile as profiles
from isp_comm.planner.targets import parse_target

TORCHRUN_ENV = {  # what torchrun gives rank 3 of 4 (the port: nobody listens there)
    "RANK": "3",
    "LOCAL_RANK": "3",
    "WORLD_SIZE": "4",
    "LOCAL_WORLD_SIZE": "4",
    "GROUP_RANK": "0",
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "9",
    "TORCHELASTIC_RUN_ID": "outer-job",
    "TORCHELASTIC_USE_AGENT_STORE": "True",
}


@pytest.mark.timeout(150)
def test_a_calibration_run_started_from_a_launched_rank_is_a_job_of_its_own(monkeypatch, tmp_path) -> None:
    """The cause of the silent exit: started from rank 3 of a torchrun job, the
    calibration's 2-rank isp-train run took itself for that rank of the outer job (it
    hung on the outer job's store, or left with status 2). It now runs its own job."""
    for k, v in TORCHRUN_ENV.items():
        monkeypatch.setenv(k, v)
    flags = [*calibrate.TINY, "--layers", "1", "--batch", "4", "--device", "cpu", "--no-bf16"]
    try:
        got = calibrate.measure_run(flags, 2, 4, str(tmp_path / "run"), timeout=100)
    except subprocess.TimeoutExpired:
        pytest.fail("the calibration's run joined the launcher's job and hung")
    assert got["step_s"] > 0 and got["peak_rss_mib"] > 0 and got["step_spread"] >= 0


def _entry(cache: str, local_world: int) -> tuple[str, str]:
    """The cache entry of ``local_world`` ranks: (profile path, the host's calibration lock)."""
    return os.path.join(cache, profiles.machine_key(local_world)), profiles.calibration_lock(cache)


def _plan(cache: str, *flags: str, **env: str) -> subprocess.Popen:
    full = {**os.environ, "ISP_COMM_CACHE_DIR": cache, "ISP_COMM_PLAN_CALIBRATE": "1", "CUDA_VISIBLE_DEVICES": ""}
    cmd = [sys.executable, "-m", "isp_comm.train", "--plan", "--nproc-per-node", "2", "--layers", "2", *flags]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**full, **env})


def _read_until(stream, text: str, timeout_s: float) -> str:
    seen, stop = "", time.monotonic() + timeout_s
    while text not in seen and time.monotonic() < stop:
        line = stream.readline()
        if not line:
            break
        seen += line
    return seen


@contextlib.contextmanager
def _calibrating(lock: str) -> Iterator[None]:
    """Hold the cache entry's lock as a calibrating process does (process 4242)."""
    with open(lock, "a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        held.write("process 4242 on the test's host")
        held.flush()
        try:
            yield
        finally:
            fcntl.flock(held, fcntl.LOCK_UN)


@pytest.mark.timeout(120)
def test_a_plan_waits_for_the_process_calibrating_and_plans_on_its_profile(tmp_path) -> None:
    """While another process holds the cache entry's lock (it is calibrating), --plan
    waits; the profile that process writes is the one it plans on: no second
    calibration."""
    cache = str(tmp_path)
    path, lock = _entry(cache, 2)
    with _calibrating(lock):
        proc = _plan(cache)
        said = _read_until(proc.stderr, "waiting for", 90)
        assert "waiting for process 4242 on the test's host" in said, said
        measured = profiles.from_target(parse_target("cpu"))
        dataclasses.replace(measured, name="measured by the other process").save(path)
    out, err = proc.communicate(timeout=90)
    assert proc.returncode == 0, err[-2000:]
    assert "on measured by the other process" in out.splitlines()[0]
    assert "calibrating this machine once" not in said + err
    assert set(os.listdir(cache)) == {os.path.basename(path), os.path.basename(lock)}


@pytest.mark.timeout(120)
def test_one_calibration_at_a_time_on_a_host_and_an_unreadable_cache_says_so(tmp_path) -> None:
    """A plan of another cache entry (one rank, not two) waits for the calibration
    holding the host's lock too: it would time that one's work. And a cache entry that
    cannot be read is named as the cache's, with the way out."""
    cache = str(tmp_path)
    single, lock = _entry(cache, 1)
    with _calibrating(lock):
        proc = _plan(cache, "--nproc-per-node", "1", ISP_COMM_CALIBRATION_WAIT_S="2")
        _, err = proc.communicate(timeout=90)
    assert proc.returncode == 2 and "process 4242 on the test's host has been calibrating" in err, err
    with open(single, "w") as f:
        f.write("{not json")
    proc = _plan(cache, "--nproc-per-node", "1")
    _, err = proc.communicate(timeout=90)
    (line,) = err.strip().splitlines()
    assert proc.returncode == 2 and f"the cached calibration {single} cannot be read" in line, err
    assert "--recalibrate" in line and "--profile" not in line, line


@pytest.mark.timeout(120)
def test_a_plan_that_waits_past_its_deadline_says_who_holds_the_calibration(tmp_path) -> None:
    cache = str(tmp_path)
    _, lock = _entry(cache, 2)
    with _calibrating(lock):
        proc = _plan(cache, ISP_COMM_CALIBRATION_WAIT_S="2")
        out, err = proc.communicate(timeout=90)
    assert proc.returncode == 2 and not out
    last = err.strip().splitlines()[-1]
    assert last.startswith("isp-train: error: --plan: process 4242 on the test's host has been calibrating"), err
    assert "for over 2 s" in last and lock in last and "--profile FILE or --target" in last


def _profile(**noise) -> profiles.Profile:
    full = {"probe_spread": 0.01, "run_spread": 0.02, "repeat_spread": 0.03, "limit": 0.1, "steady": True, **noise}
    return dataclasses.replace(profiles.from_target(parse_target("cpu")), noise=full)


def test_noise_is_the_largest_disagreement_of_a_calibration_with_itself() -> None:
    run = {"step_s": 0.1, "step_spread": 0.04}
    quiet = calibrate.noise([1.0, 1.05, 1.02], {2: [run, run, run]}, {2: {"step_s": 0.105}})
    assert quiet["probe_spread"] == pytest.approx(0.05) and quiet["repeat_spread"] == pytest.approx(0.05)
    assert quiet["run_spread"] == pytest.approx(0.04) and quiet["steady"]
    slow_minute = calibrate.noise([1.0, 1.05], {2: [run, run, run]}, {2: {"step_s": 0.2}})
    assert slow_minute["repeat_spread"] == pytest.approx(1.0) and not slow_minute["steady"]
    busy_probe = calibrate.noise([1.0, 1.3], {2: [run]}, {})
    assert busy_probe["probe_spread"] == pytest.approx(0.3) and not busy_probe["steady"]
    stretch = calibrate.noise([1.0], {1: [{"step_s": 0.1, "step_spread": 0.25}]}, {})
    assert not stretch["steady"]
    assert calibrate.spread([1.0, 1.0, 1.0, 1.0, 1.0, 5.0]) < 0.5  # one slow step does not count
    assert calibrate.spread([1.0, 1.0, 1.0, 2.0, 2.0, 2.0]) > 0.5  # a slow stretch does


def test_a_noisy_calibration_is_repeated_and_the_least_noisy_kept(monkeypatch) -> None:
    made = iter([_profile(run_spread=0.5, steady=False), _profile(run_spread=0.3, steady=False), _profile()])
    monkeypatch.setattr(calibrate, "calibrate", lambda *a, **k: next(made))
    said: list[str] = []
    two = calibrate.steady_calibration((2,), 2, quick=True, progress=said.append)
    assert two.noise["attempt"] == 2 and two.noise["run_spread"] == 0.3 and not two.noise["steady"]
    assert len(said) == 2 and "steps of a run 50%" in said[0]
    assert calibrate.steady_calibration((2,), 2, quick=True).noise == {**_profile().noise, "attempt": 1}


def test_a_noisy_calibration_is_not_cached_but_kept_beside_the_cache(tmp_path) -> None:
    path, noisy = str(tmp_path / "entry.json"), str(tmp_path / "entry.noisy.json")
    _profile(repeat_spread=0.4, steady=False).save(str(tmp_path / "m1"))
    said: list[str] = []
    prof = profiles.keep(str(tmp_path / "m1"), path, noisy, said.append)
    assert not prof.noise["steady"] and not os.path.exists(path) and os.path.exists(noisy)
    assert "not cached" in said[0] and "the large run repeated 40%" in said[0] and f"--profile {noisy}" in said[0]
    _profile().save(str(tmp_path / "m2"))
    profiles.keep(str(tmp_path / "m2"), path, noisy, said.append)
    assert os.listdir(tmp_path) == ["entry.json"] and len(said) == 1
    # --recalibrate over that entry, noisy: the entry it was asked to replace goes too,
    # so that the next plan measures again rather than read it
    _profile(repeat_spread=0.4, steady=False).save(str(tmp_path / "m3"))
    profiles.keep(str(tmp_path / "m3"), path, noisy, said.append)
    assert os.listdir(tmp_path) == ["entry.noisy.json"] and len(said) == 2


def test_a_plan_on_a_noisy_profile_says_so_in_its_header(tmp_path) -> None:
    # a noisy calibration is kept beside the cache for --profile, and a plan on it
    # said so only in the profile's JSON: its header read as a steady one's
    path = str(tmp_path / "noisy.json")
    _profile(probe_spread=0.18, steady=False).save(path)
    cmd = [sys.executable, "-m", "isp_comm.train", "--plan", "--profile", path, "--layers", "2", "--hidden", "64"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    header = res.stdout.splitlines()[0]
    assert "a noisy calibration: speed probes 18% apart" in header and "the limit is 10%" in header, header
    _profile().save(path)
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and "noisy" not in res.stdout.splitlines()[0], res.stdout[:500]


def test_recalibrate_is_a_plan_of_this_machine() -> None:
    for flags, ok in ((["--recalibrate"], False), (["--plan", "--recalibrate", "--target", "h100"], False),
                      (["--plan", "--recalibrate"], True)):  # fmt: skip
        res = subprocess.run([sys.executable, "-m", "isp_comm.train", *flags, "--layers", "2"],
                             capture_output=True, text=True, timeout=100,
                             env={**os.environ, "ISP_COMM_PLAN_CALIBRATE": "0"})  # fmt: skip
        assert (res.returncode == 0) == ok, res.stderr[-2000:]
        if not ok:
            assert res.stderr.strip().endswith("give it with --plan, without --target or --profile"), res.stderr


def _calibrations(stderr: str) -> int:
    """The calibrations a run began: the calibrating process says so, whichever rank it
    is (rank 0, when another rank took the lock first, says it waits for it)."""
    return stderr.count("calibrating this machine once (") + stderr.count("calibrating this machine again (")


@pytest.mark.serial  # a calibration times this machine and judges its noise
@pytest.mark.slow  # a quick calibration (under a minute on 2 cores) and four ranks
@pytest.mark.timeout(300)
def test_torchrun_plan_on_four_ranks_calibrates_once(tmp_path) -> None:
    """Issue 55's report: ``torchrun --nproc-per-node 4 -m isp_comm.train --plan`` on a
    machine without a cached calibration, where a rank left with status 2 and no
    message. One rank calibrates, rank 0 prints one plan, and the profile is cached
    when steady (kept beside the cache when noisy: a busy machine); a later plan for
    4 local ranks over a steady cached profile reads it, whichever way the first one
    went. A quick calibration: the full one goes the same path with more sizes and
    steps and a second attempt when noisy; tests/test_forecast.py's
    ``calibrated_profile`` measures it, bench/calibrate.py times it."""
    cache = str(tmp_path)
    env = {**os.environ, "ISP_COMM_CACHE_DIR": cache, "ISP_COMM_PLAN_CALIBRATE": "quick", "CUDA_VISIBLE_DEVICES": ""}
    env.pop("ISP_COMM_CALIBRATION_WAIT_S", None)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4"]
    res = subprocess.run([*torchrun, "-m", "isp_comm.train", "--plan", "--layers", "2"],
                         capture_output=True, text=True, timeout=400, env=env)  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    assert _calibrations(res.stderr) == 1, res.stderr
    plans = [line for line in res.stdout.splitlines() if line.startswith("{")]
    assert len(plans) == 1 and json.loads(plans[0])["step_s"] > 0
    name = profiles.machine_key(4).removesuffix(".json") + "-quick"
    kept = [f for f in os.listdir(cache) if not f.endswith(".lock")]
    assert kept in ([f"{name}.json"], [f"{name}.noisy.json"]), kept
    (first,) = kept
    measured = profiles.load(os.path.join(cache, first))
    assert measured.noise["attempt"] >= 1 and "quick" in measured.source
    assert measured.host_step_s and measured.runtime_bytes and "multi" in measured.transient_share  # ranks > 1
    assert first.endswith(".noisy.json") != measured.noise["steady"]
    assert measured.noise["steady"] or "not cached" in res.stderr
    if not measured.noise["steady"]:  # as if it had been: the measured profile, cached
        steady = dataclasses.replace(measured, noise={**measured.noise, "steady": True})
        steady.save(os.path.join(cache, f"{name}.json"))
    plan = [sys.executable, "-m", "isp_comm.train", "--plan", "--layers", "2", "--nproc-per-node", "4"]
    again = subprocess.run(plan, capture_output=True, text=True, timeout=100, env=env)
    assert again.returncode == 0 and _calibrations(again.stderr) == 0, again.stderr[-3000:]
    assert json.loads(again.stdout.splitlines()[-1])["step_s"] == json.loads(plans[0])["step_s"]


@pytest.mark.serial  # a calibration times this machine and judges its noise
@pytest.mark.slow  # a quick calibration of one rank: half a minute on 2 cores
@pytest.mark.timeout(200)
def test_recalibrate_measures_over_a_steady_cached_profile(tmp_path) -> None:
    """``--plan --recalibrate`` measures again although the cache holds a steady
    profile, which a plan without the flag reads (see the test below for that)."""
    cache = str(tmp_path)
    entry = os.path.join(cache, profiles.machine_key(1).removesuffix(".json") + "-quick.json")
    dataclasses.replace(_profile(), name="the seeded profile").save(entry)
    env = {**os.environ, "ISP_COMM_CACHE_DIR": cache, "ISP_COMM_PLAN_CALIBRATE": "quick", "CUDA_VISIBLE_DEVICES": ""}
    cmd = [sys.executable, "-m", "isp_comm.train", "--plan", "--layers", "2"]
    read = subprocess.run(cmd, capture_output=True, text=True, timeout=100, env=env)
    assert read.returncode == 0 and _calibrations(read.stderr) == 0, read.stderr[-3000:]
    assert "on the seeded profile" in read.stdout.splitlines()[0], read.stdout
    again = subprocess.run([*cmd, "--recalibrate"], capture_output=True, text=True, timeout=250, env=env)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stderr.count("calibrating this machine again (") == 1, again.stderr
    assert "the seeded profile" not in again.stdout
    # steady: it replaced the entry; noisy: it removed it, kept beside (not cached)
    now = [f for f in os.listdir(cache) if not f.endswith(".lock")]
    assert now == [os.path.basename(entry)] or now == [os.path.basename(entry).replace(".json", ".noisy.json")], now
    assert "quick" in profiles.load(os.path.join(cache, now[0])).source


def test_the_cache_is_read_recalibrated_and_measured_again_after_a_noisy_profile(tmp_path, monkeypatch) -> None:
    """``profiles.cached`` with the calibration's process replaced by one that writes a
    profile (steady or noisy, in turn): the first call calibrates and caches, the next
    reads the cache, ``recalibrate`` measures again, and after a noisy calibration
    (kept beside the cache, not in it) the next call measures again."""
    monkeypatch.setenv("ISP_COMM_CACHE_DIR", str(tmp_path))
    made = iter([_profile(), _profile(run_spread=0.3, steady=False), _profile()])
    calls: list[list[str]] = []

    def calibration(cmd, **_kw):  # the calibration process: writes its profile where told
        calls.append(cmd)
        dataclasses.replace(next(made), name=f"calibration {len(calls)}").save(cmd[cmd.index("--profile") + 1])
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(subprocess, "run", calibration)
    said: list[str] = []
    entry = os.path.join(str(tmp_path), profiles.machine_key(2))
    noisy = entry.replace(".json", ".noisy.json")  # kept beside the cache, as cached() names it
    assert profiles.cached(2, said.append).name == "calibration 1" and os.path.exists(entry)
    assert "calibrating this machine once" in said[0] and calls[0][calls[0].index("--worlds") + 1] == "2"
    assert calls[0][calls[0].index("--attempts") + 1] == "2" and "--quick" not in calls[0]
    assert profiles.cached(2, said.append).name == "calibration 1" and len(calls) == 1  # read, not measured
    assert profiles.cached(2, said.append, recalibrate=True).name == "calibration 2"  # noisy
    assert "calibrating this machine again" in said[1] and "not cached" in said[2]
    assert not os.path.exists(entry) and os.path.exists(noisy)
    assert profiles.cached(2, said.append).name == "calibration 3" and len(calls) == 3  # measured again
    assert "calibrating this machine once" in said[3] and os.path.exists(entry)
    assert not os.path.exists(noisy)


def _descendants(root: int) -> set[int]:
    """The live processes below ``root`` (children, theirs, ...), from /proc."""
    parent = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] not in "ZX":
            parent[int(pid)] = int(fields[1])
    found, frontier = set(), {root}
    while frontier:
        frontier = {p for p, pp in parent.items() if pp in frontier} - found
        found |= frontier
    return found


def _alive(pids: set[int]) -> set[int]:
    alive = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] not in "ZX":
                    alive.add(pid)
        except OSError:
            pass
    return alive


@pytest.mark.serial  # its killed runs may leave segments, which a test beside would take for its own leak
@pytest.mark.timeout(120)
def test_a_killed_plan_takes_its_calibration_with_it(tmp_path) -> None:
    """A --plan killed while it calibrates (SIGKILL: no handler runs; torchrun's SIGTERM
    to a failed job's other ranks ends the same way) leaves no calibration, nor any of
    its runs, loading the cores the next plan's calibration would time."""
    temp = tmp_path / "temp"  # the killed run's launcher cannot remove its agent folder: the test's, not /tmp's
    temp.mkdir()
    proc = _plan(str(tmp_path), "--nproc-per-node", "2", TMPDIR=str(temp))
    said = _read_until(proc.stderr, "calibrating this machine", 60)
    assert "calibrating this machine once" in said, said
    below: set[int] = set()
    deadline = time.monotonic() + 30
    while len(below) < 3 and time.monotonic() < deadline:  # the calibration, a run and its ranks
        below |= _descendants(proc.pid)
        time.sleep(0.2)
    assert len(below) >= 3, below
    proc.kill()
    proc.communicate(timeout=30)
    deadline = time.monotonic() + 20
    while _alive(below) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive(below)


def test_the_cores_a_plan_counts_are_capped_by_the_cgroup_quota(tmp_path) -> None:
    """A container limited to fewer CPUs than its affinity shows (docker --cpus,
    a Kubernetes limit): the plan counted the affinity, giving each rank a core it did
    not have. The cgroup's quota caps it, v2's cpu.max or v1's CFS quota; no quota, or
    no cgroup files, leaves the affinity."""
    from isp_comm.processes import usable_cores

    affinity = len(os.sched_getaffinity(0))
    assert usable_cores(str(tmp_path)) == affinity  # no cgroup files
    (tmp_path / "cpu.max").write_text("50000 100000\n")
    assert usable_cores(str(tmp_path)) == 1
    (tmp_path / "cpu.max").write_text(f"{100000 * (affinity + 3)} 100000\n")
    assert usable_cores(str(tmp_path)) == affinity  # a quota above the affinity: the affinity
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert usable_cores(str(tmp_path)) == affinity
    (tmp_path / "cpu.max").unlink()
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("150000\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert usable_cores(str(tmp_path)) == min(2, affinity)  # 1.5 CPUs: two cores run, at a share
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert usable_cores(str(tmp_path)) == affinity
    (tmp_path / "cpu.max").write_text("not a quota\n")  # malformed: not a crash, the next file
    assert usable_cores(str(tmp_path)) == affinity
