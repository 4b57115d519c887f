"""bench/gpu_check.py without a GPU: the dry run's lines and budget, --only, and the
runner's timeouts, kills and report on fake steps; bench/plan_gpu.py at a tiny size
on the CPU (its measured runs leave no checkpoint)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from bench import gpu_check as gc
from tests.gpu.mps import _alive
from tests.test_shared_gpu import fake_mps  # noqa: F401 - the fixture

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LINE = re.compile(r"^([a-z][a-z-]*) timeout=(\d+): (\S.*)$")


def _dry(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "bench/gpu_check.py", "--dry-run", *args]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=120)


def _parse(stdout: str) -> tuple[list[tuple[str, int, str]], int]:
    lines = stdout.strip().splitlines()
    steps = []
    for line in lines[:-1]:
        m = LINE.match(line)
        assert m, line
        steps.append((m.group(1), int(m.group(2)), m.group(3)))
    last = re.fullmatch(r"total timeout=(\d+)", lines[-1])
    assert last, lines[-1]
    return steps, int(last.group(1))


def test_dry_run_lists_every_default_step_within_540_s() -> None:
    res = _dry()
    assert res.returncode == 0, res.stderr
    steps, total = _parse(res.stdout)
    names = [n for n, _, _ in steps]
    assert names[:3] == ["wheels", "probe", "shared-symm"], names  # the preamble, then the most valuable
    assert {"bench-gpu", "shared-nvshmem", "isp-train", "forecast", "plan-gpu"} <= set(names), names
    assert "tests-gpu" not in names  # it does not fit beside them: --only tests-gpu
    assert total == sum(t for _, t, _ in steps) and total <= 540, total
    cmds = dict((n, c) for n, _, c in steps)
    assert "--runs fsdp2,isp,fsdp2+compile,isp+compile" in cmds["bench-gpu"], cmds["bench-gpu"]
    assert "--device cuda --compile" in cmds["isp-train"] and "--device cuda" in cmds["forecast"], cmds
    assert all(c.startswith(("python ", "echo ")) for c in cmds.values()), cmds  # as one types it


def test_only_runs_the_preamble_and_the_named_steps() -> None:
    steps, total = _parse(_dry("--only", "tests-gpu,bench-gpu").stdout)
    assert [n for n, _, _ in steps] == ["wheels", "probe", "bench-gpu", "tests-gpu"]  # priority order kept
    assert total == sum(t for _, t, _ in steps) <= 540
    res = _dry("--only", "bench-gpu,nonsense")
    assert res.returncode == 2 and "unknown step ['nonsense']" in res.stderr, res.stderr
    every = ",".join(s.name for s in gc.steps("out", "work", []))
    res = _dry("--only", every)
    assert res.returncode == 2 and "over 540 s" in res.stderr, res.stderr


def test_carried_wheels_are_installed_without_an_index_or_dependencies(tmp_path) -> None:
    (tmp_path / "b").mkdir()
    for name in ("nvshmem4py_cu13-0.4.1-cp312-manylinux.whl", "cuda_core-1.2.2-cp312-manylinux.whl"):
        (tmp_path / "b" / name).write_text("")
    found = gc.find_wheels([str(tmp_path / "a"), str(tmp_path / "b")])
    assert [os.path.basename(w) for w in found] == sorted(os.listdir(tmp_path / "b"))
    (wheels,) = [s for s in gc.steps("out", "work", found) if s.name == "wheels"]
    assert wheels.argv[1:6] == ["-m", "pip", "install", "-q", "--no-index"] and "--no-deps" in wheels.argv
    assert wheels.argv[-2:] == found


# ---- the runner, on fake steps ---------------------------------------------------------
def _py(code: str) -> list[str]:
    return [sys.executable, "-c", code]


CHILD_THEN_SLEEP = """
import subprocess, sys, time, signal
{ignore}
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
open({pid_file!r}, "w").write(str(child.pid))
print("started", flush=True)
time.sleep(60)
"""


@pytest.mark.serial  # signals and graces timed in seconds
@pytest.mark.parametrize(
    "ignore_sigint, runner_ignores", [(False, False), (True, False), (False, True)], ids=["int", "step-ignores", "bg"]
)
def test_a_step_past_its_timeout_is_killed_with_its_whole_group(
    tmp_path, ignore_sigint: bool, runner_ignores: bool
) -> None:
    """``runner_ignores``: the runner was started with SIGINT ignored (in the background
    of a non-interactive shell, as a CI run here once was): the step must still end at
    SIGINT, not at the grace's SIGKILL."""
    pid_file = str(tmp_path / "child.pid")
    ignore = "signal.signal(signal.SIGINT, signal.SIG_IGN)" if ignore_sigint else ""
    step = gc.Step("slow", 2, _py(CHILD_THEN_SLEEP.format(ignore=ignore, pid_file=pid_file)), "a fake step")
    before = signal.signal(signal.SIGINT, signal.SIG_IGN if runner_ignores else signal.default_int_handler)
    t0 = time.monotonic()
    try:
        with open(tmp_path / "log", "wb") as log:
            rec = gc.run_step(step, dict(os.environ), log)
    finally:
        signal.signal(signal.SIGINT, before)
    took = time.monotonic() - t0
    assert rec["status"] == "timeout" and "started" in rec["output_tail"], rec
    # SIGINT ends the step at once; one that ignores it is killed after the grace
    assert took < 2 + (gc.GRACE_S + 3 if ignore_sigint else 3), took
    child = int(open(pid_file).read())
    end = time.monotonic() + 5
    while _alive(child) and time.monotonic() < end:
        time.sleep(0.05)
    assert not _alive(child), "the step's child outlived its timeout"


@pytest.mark.serial  # signals and graces timed in seconds
def test_an_interrupted_runner_ends_its_step_and_its_children(tmp_path, monkeypatch) -> None:
    """Ctrl-C reaches the runner alone (the step's group is not the terminal's): the
    runner ends the step's group before it leaves."""
    import signal
    import threading

    monkeypatch.setattr(gc, "GRACE_S", 0.5)
    pid_file = str(tmp_path / "child.pid")
    step = gc.Step("long", 60, _py(CHILD_THEN_SLEEP.format(ignore="", pid_file=pid_file)), "a fake step")

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    def once_started() -> None:  # Ctrl-C once the step's child runs
        end = time.monotonic() + 50
        while not os.path.exists(pid_file) and time.monotonic() < end:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGUSR1)

    old = signal.signal(signal.SIGUSR1, interrupt)
    threading.Thread(target=once_started, daemon=True).start()
    try:
        with pytest.raises(KeyboardInterrupt), open(tmp_path / "log", "wb") as log:
            gc.run_step(step, dict(os.environ), log)
    finally:
        signal.signal(signal.SIGUSR1, old)
    child = int(open(pid_file).read())
    end = time.monotonic() + 5
    while _alive(child) and time.monotonic() < end:
        time.sleep(0.05)
    assert not _alive(child), "the step's child outlived the interrupted runner"


def test_statuses_summaries_and_the_report(tmp_path, monkeypatch) -> None:
    pytest_like = "print('SKIPPED [1] x.py:3: needs CUDA'); print('===== 3 skipped in 0.10s =====')"
    probe = "import json; print('a warning'); print(json.dumps({'torch': 'x', 'mps_binary': None})); print('another')"
    fake = [
        gc.Step("wheels", 5, ["echo", "no wheels carried"], "w"),
        gc.Step("probe", 5, _py(probe), "p"),
        gc.Step("ok", 5, _py("print('=== 2 passed, 1 skipped in 1.0s ===')"), "passes"),
        gc.Step("skips", 5, _py(pytest_like), "skips all"),
        gc.Step("fails", 5, _py("import sys; print('boom'); sys.exit(3)"), "fails"),
        gc.Step("late", 1, _py("import time; time.sleep(30)"), "times out"),
        gc.Step("extra", 5, _py("print('not run')"), "not in the default", default=False),
    ]
    monkeypatch.setattr(gc, "steps", lambda out, work, wheels, no_wheels="": fake)
    written, real = [], gc.write_report
    monkeypatch.setattr(gc, "write_report", lambda out, head, recs: written.append(len(recs)) or real(out, head, recs))
    out = tmp_path / "out"
    assert gc.main(["--out", str(out)]) == 1  # a failure and a timeout
    assert written == [1, 2, 3, 4, 5, 6, 6]  # after every step: a run cut short keeps its report
    report = json.loads((out / "gpu_check.json").read_text())
    got = {r["name"]: r for r in report["steps"]}
    assert list(got) == ["wheels", "probe", "ok", "skips", "fails", "late"], list(got)
    assert {n: r["status"] for n, r in got.items()} == {
        "wheels": "passed", "probe": "passed", "ok": "passed", "skips": "skipped", "fails": "failed",
        "late": "timeout",
    }  # fmt: skip
    assert got["ok"]["summary"] == "2 passed, 1 skipped in 1.0s" and got["fails"]["returncode"] == 3
    assert got["fails"]["summary"] == "boom" and got["late"]["seconds"] < 1 + gc.GRACE_S + 2
    assert report["probe"] == {"torch": "x", "mps_binary": None} and report["budget_s"] == 540
    assert got["probe"]["summary"] == "torch x, mps_binary None, disk unknown", got["probe"]
    table = (out / "gpu_check.md").read_text()
    assert "| late | timeout |" in table and "| skips | skipped |" in table, table
    log = (out / "gpu_check.log").read_text()
    assert log.count("===== ") >= 6 and "boom" in log
    assert gc.main(["--out", str(out), "--only", "ok"]) == 0
    ran = [r["name"] for r in json.loads((out / "gpu_check.json").read_text())["steps"]]
    assert ran == ["wheels", "probe", "ok"], ran


def test_archive_packs_the_folder_after_every_step(tmp_path, monkeypatch) -> None:
    """``--archive FILE``: the whole output folder as one .tar.gz, rewritten after each
    step (a lent GPU machine sends back few files), never packing itself."""
    import tarfile

    fake = [
        gc.Step("wheels", 5, ["echo", "no wheels carried"], "w"),
        gc.Step("probe", 5, _py("print('{}')"), "p"),
        gc.Step("ok", 5, _py("print('=== 1 passed in 0.1s ===')"), "passes"),
    ]
    monkeypatch.setattr(gc, "steps", lambda out, work, wheels, no_wheels="": fake)
    packed, real = [], gc.archive
    monkeypatch.setattr(gc, "archive", lambda out, path: packed.append(path) or real(out, path))
    out = tmp_path / "out"
    (out / "sub").mkdir(parents=True)
    (out / "sub" / "virtual.json").write_text("{}")  # what a step's own command wrote there
    path = str(out / "run.tgz")
    assert gc.main(["--out", str(out), "--archive", path]) == 0
    assert packed == [path] * 4  # after each of the 3 steps, and at the end
    with tarfile.open(path) as tar:
        names = set(tar.getnames())
    assert names == {"gpu_check.json", "gpu_check.md", "gpu_check.log", "sub/virtual.json"}, names
    assert not os.path.exists(path + ".tmp")


KILLED_UNDER_MPS = """
import signal, sys, time
sys.path.insert(0, {root!r})
from tests.gpu.mps import PrivateMps
signal.signal(signal.SIGINT, signal.SIG_IGN)  # killed, so the with never ends
mps = PrivateMps().__enter__()
assert mps.reason is None, mps.reason
print("daemon", mps._pid(), flush=True)
time.sleep(60)
"""


@pytest.mark.serial  # signals and graces timed in seconds
def test_a_daemon_left_by_a_killed_step_is_stopped(tmp_path, fake_mps, monkeypatch) -> None:  # noqa: F811
    monkeypatch.setattr(gc, "GRACE_S", 0.5)
    step = gc.Step("mps", 3, _py(KILLED_UNDER_MPS.format(root=ROOT)), "leaves its daemon")
    out = tmp_path / "out"
    out.mkdir()
    (rec,) = gc.run([step], str(out), str(tmp_path / "tmp"), dict(os.environ))
    assert rec["status"] == "timeout", rec
    pid = int(re.search(r"daemon (\d+)", rec["output_tail"]).group(1))
    assert rec["mps_daemons_stopped"] == [pid]
    end = time.monotonic() + 5
    while _alive(pid) and time.monotonic() < end:
        time.sleep(0.05)
    assert not _alive(pid)


# ---- bench/plan_gpu.py at a tiny size on the CPU ---------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_plan_gpu_measures_without_a_final_checkpoint(tmp_path, monkeypatch) -> None:
    from bench import plan_gpu

    seen, outs = [], []
    real = plan_gpu.measure_run

    def measure_run(flags, world, steps, out, timeout):
        assert not any(os.path.exists(earlier) for earlier in outs), outs  # removed once measured
        outs.append(out)
        got = real(flags, world, steps, out, timeout)
        saved = os.path.join(out, "checkpoints")
        seen.append((flags, sorted(os.listdir(out)), os.listdir(saved) if os.path.isdir(saved) else []))
        return got

    monkeypatch.setattr(plan_gpu, "measure_run", measure_run)
    monkeypatch.setattr(plan_gpu, "SIZES", {"tiny": (32, 2, 2, 1)})
    monkeypatch.setattr(plan_gpu, "VOCAB", 64)
    monkeypatch.setattr(plan_gpu, "FLAGS", ["--device", "cpu", "--seq", "16", "--batch", "2", "--no-trace"])
    monkeypatch.setattr(plan_gpu, "PEAK", "peak_rss_mib")  # the CPU's peak in place of CUDA's
    args = ["plan_gpu.py", "--sizes", "tiny", "--repeats", "2", "--steps", "3", "--out", str(tmp_path)]
    monkeypatch.setattr(sys, "argv", args)
    plan_gpu.main()
    assert len(seen) == 2
    for flags, files, saved in seen:
        assert "--no-final-save" in flags and not any(n.startswith("step_") for n in saved), (flags, saved)
        assert "metrics.jsonl" in files
    rows = json.loads((tmp_path / "plan_gpu.json").read_text())["rows"]
    assert len(rows) == 1 and rows[0]["name"] == "tiny", rows
