"""A hang names its rank (isp_comm/flight): the flight record, the heartbeat, the
diagnosis, ``isp-comm doctor`` and the CUDA watchdog; then whole jobs under torchrun
and isp-train whose rank 1 stops (SIGSTOP) or runs one extra forward."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque

import pytest
import torch

from isp_comm import ISPCommTimeout
from isp_comm.context import CommContext
from isp_comm.flight import doctor
from isp_comm.flight.diagnosis import HANG_JSON, HANG_TXT, Diagnoser, classify
from isp_comm.flight.heartbeat import LIVE_DIR, LIVE_TRIGGER, POLL_S, Heartbeat, StoreKeys
from isp_comm.flight.record import FlightRecord
from isp_comm.flight.watchdog import Watchdog
from isp_comm.testing import run_ranks
from isp_comm.train.hang import FAULT_ENV
from tests.parity import Case, batches, loss_fn

# alone under pytest -n (tests/conftest.py): deadlines of seconds and heartbeat windows that name the silent rank
pytestmark = pytest.mark.serial


class DictStore:
    """The c10d store calls the flight code makes (set, get, check, add), in memory and
    shared by the threads of one test (several "ranks" in one process)."""

    def __init__(self) -> None:
        self.d: dict[str, bytes] = {}
        self.lock = threading.Lock()

    def set(self, key: str, value: str) -> None:
        with self.lock:
            self.d[key] = value.encode()

    def get(self, key: str) -> bytes:
        with self.lock:
            return self.d[key]

    def check(self, keys: list[str]) -> bool:
        with self.lock:
            return all(k in self.d for k in keys)

    def add(self, key: str, n: int) -> int:
        with self.lock:
            v = int(self.d.get(key, b"0")) + n
            self.d[key] = str(v).encode()
            return v


class Pending:
    """A handle that never completes: its wait passes the deadline."""

    def wait(self, timeout_s: float) -> None:
        raise ISPCommTimeout(f"did not complete within {timeout_s:.1f}s")

    def is_completed(self) -> bool:
        return False


class Done:
    def wait(self, timeout_s: float) -> None:
        return None


GROUP = "0,1,2"


def _record(rank: int, kinds: list[tuple[str, int, str]], waited: int) -> FlightRecord:
    """Rank ``rank``'s record after issuing ``kinds`` ((kind, block, phase)) on ranks
    0-2, of which the first ``waited`` completed and the next one is being waited for."""
    rec = FlightRecord(rank)
    rec._labels[None] = GROUP
    handles = [object() for _ in kinds]
    for h, (kind, block, phase) in zip(handles, kinds):
        rec.issue(h, kind, None, torch.empty(4), block, phase)
    for h in handles[:waited]:
        rec.complete(h)
    if waited < len(handles):
        rec.begin_wait(handles[waited])
    return rec


STEP = [("all-gather", 0, "forward"), ("all-gather", 1, "forward"), ("reduce-scatter", 1, "backward")]


def test_the_record_keeps_the_last_k_with_sequence_numbers_per_group() -> None:
    rec = FlightRecord(0, capacity=4)
    rec._labels.update({"a": "0,1", "b": "0,2"})
    handles = [object() for _ in range(6)]
    for i, h in enumerate(handles):
        rec.issue(h, "all-gather", "a" if i % 2 == 0 else "b", torch.empty(3, dtype=torch.bfloat16), i, "forward")
    assert [(e.group, e.seq) for e in rec.entries] == [("0,1", 2), ("0,2", 2), ("0,1", 3), ("0,2", 3)]
    assert rec.seqs == {"0,1": 3, "0,2": 3}
    rec.begin_wait(handles[4])
    assert rec.waiting().block == 4  # the wait in progress, not the oldest pending
    rec.complete(handles[4])
    assert rec.completed == {"0,1": 3} and rec.current is None
    assert rec.waiting().block == 0  # now the oldest issued and never waited
    snap = json.loads(json.dumps(rec.snapshot()))
    e = snap["entries"][-1]
    assert (e["kind"], e["bytes"], e["dtype"], e["block"], e["phase"]) == ("all-gather", 6, "bfloat16", 5, "forward")
    assert snap["entries"][2]["done"] >= snap["entries"][2]["issued"]


def test_classify_names_the_rank_not_responding_and_what_the_others_wait_for() -> None:
    now = time.time()
    records = {r: _record(r, STEP * 2, 3).snapshot() for r in (0, 2)}
    beat = Heartbeat(_record(1, STEP, 3), None, StoreKeys(0)).position()
    beat["time"] = now - 7.0
    d = classify(records, {1: beat}, 3, now)
    assert list(d.not_responding) == [1] and not d.out_of_step and not d.behind
    assert d.lines[0].startswith("rank 1 is not responding (stopped or dead; last heard 7.0 s ago, when it was at ")
    assert d.lines[0].endswith("; it may have gone up to 0.5 s further)")  # the heartbeat's pace, not a position
    assert "its last collective block 1 backward reduce-scatter #3 completed" in d.lines[0]
    assert d.lines[1] == "ranks 0 and 2 wait in block 0 forward all-gather #4"


def test_classify_names_the_rank_out_of_step_and_the_one_behind() -> None:
    extra = STEP[:2] + STEP[:2] + STEP  # rank 1 ran its forward twice
    records = {0: _record(0, STEP * 2, 5), 1: _record(1, extra, 2), 2: _record(2, STEP * 2, 5)}
    d = classify({r: rec.snapshot() for r, rec in records.items()}, {}, 3, time.time())
    assert list(d.out_of_step) == [1] and not d.not_responding
    assert d.out_of_step[1] == (
        "rank 1 is out of step: its collective #3 over ranks [0,1,2] is an all-gather of block 0 "
        "(forward, 16 B, float32) where ranks 0 and 2 issued a reduce-scatter of block 1 (backward, 16 B, float32)"
    )
    # in step but slower: rank 2 has issued 4 collectives where ranks 0 and 1 wait for #6
    records = {0: _record(0, STEP * 2, 5), 1: _record(1, STEP * 2, 5), 2: _record(2, STEP + STEP[:1], 3)}
    d = classify({r: rec.snapshot() for r, rec in records.items()}, {}, 3, time.time())
    assert list(d.behind) == [2] and not d.out_of_step
    assert (
        d.lines[0] == "rank 2 is behind: it has issued collective #4 over ranks [0,1,2], where rank 0 waits for #6 "
        "(waiting in block 0 forward all-gather #4)"
    )


def test_classify_names_where_two_ranks_parted_with_no_majority_to_judge_by() -> None:
    """Rank 0 alone gathered the full state dict (as under ``if rank == 0:``) while
    rank 1 trained on: same-sized gathers paired up, and the wait that timed out came
    later. Before, two ranks had no majority, and the diagnosis only said where each
    waited, not where they parted."""
    alone = [("all-gather", 0, "full state"), ("all-gather", 1, "full state")] + STEP
    records = {0: _record(0, STEP + alone, 6), 1: _record(1, STEP * 3, 8)}
    snaps = {r: rec.snapshot() for r, rec in records.items()}
    for e in snaps[0]["entries"] + snaps[1]["entries"]:
        e["group"] = "0,1"
    d = classify(snaps, {}, 2, time.time())
    assert not d.out_of_step
    assert d.parted is not None and d.parted.startswith(
        "the ranks parted at collective #4 over ranks [0,1]: rank 0 issued an all-gather of block 0 "
        "(full state, 16 B, float32); rank 1 issued an all-gather of block 0 (forward, 16 B, float32). "
        "Every rank makes the same calls"
    ), d.parted
    assert "comm.full_state_dict()" in d.parted and d.parted in d.lines


def test_classify_tells_a_rank_held_up_from_one_behind_and_each_groups_waits_apart() -> None:
    """World 4 at WP 2, rank 3 silent. Rank 1 waits in its replica group's gather with
    rank 3, so it has not issued what rank 0 waits for in their WP group: held up, not
    behind (it computes nothing; the cause is on rank 3's line). Ranks 1 and 2 wait in
    the same-named collective of two groups: two lines, each with its group."""
    recs = {r: FlightRecord(r) for r in (0, 1, 2)}
    for rec, wp, rep in ((recs[0], "0,1", "0,2"), (recs[1], "0,1", "1,3"), (recs[2], "2,3", "0,2")):
        rec._labels.update({"wp": wp, "rep": rep})
    first, second, third = object(), object(), object()
    recs[0].issue(first, "all-gather", "wp", torch.empty(4), 0, "forward")
    recs[0].complete(first)
    recs[0].issue(second, "all-gather", "wp", torch.empty(4), 1, "forward")
    recs[0].begin_wait(second)
    recs[1].issue(first, "all-gather", "wp", torch.empty(4), 0, "forward")
    recs[1].complete(first)
    recs[1].issue(third, "all-gather", "rep", torch.empty(4), 0, "forward")
    recs[1].begin_wait(third)
    recs[2].issue(first, "all-gather", "wp", torch.empty(4), 0, "forward")
    recs[2].begin_wait(first)
    d = classify({r: rec.snapshot() for r, rec in recs.items()}, {}, 4, time.time())
    assert not d.behind and list(d.held_up) == [1], d.lines
    assert d.lines == [
        "rank 3 is not responding (stopped or dead; never heard from)",
        "rank 1 is held up: it waits in block 0 forward all-gather #1 over ranks [1,3], before collective #2 over "
        "ranks [0,1] that rank 0 waits for",
        "rank 0 waits in block 1 forward all-gather #2 over ranks [0,1]",
        "rank 1 waits in block 0 forward all-gather #1 over ranks [1,3]",
        "rank 2 waits in block 0 forward all-gather #1 over ranks [2,3]",
    ], d.lines


def test_a_timed_out_wait_carries_the_diagnosis_printed_once_with_the_files(tmp_path, capsys) -> None:
    """Three "ranks" in one process: rank 1 never answers (stopped), rank 2 answers
    from its heartbeat thread, rank 0's wait passes its deadline."""
    store = DictStore()
    records = {r: _record(r, STEP * 2, 3) for r in range(3)}
    beat1 = Heartbeat(records[1], store, StoreKeys(7))
    beat1.set(StoreKeys(7).beat(1), beat1.position())  # its last heartbeat, then it stopped
    hb2 = Heartbeat(records[2], store, StoreKeys(7))
    hb2.start()
    ctx = CommContext(0, timeout_s=0.5)
    ctx.flight = records[0]
    hb0 = Heartbeat(ctx.flight, store, StoreKeys(7), str(tmp_path))
    ctx.diagnose = Diagnoser(hb0, 3, str(tmp_path), window_s=2.0)
    h = Pending()
    ctx.flight.issue(h, "all-gather", None, torch.empty(4), 0, "forward")
    t0 = time.monotonic()
    with pytest.raises(ISPCommTimeout) as info:
        ctx.wait(h, "all-gather of block 0")
    assert time.monotonic() - t0 < 5.0  # the 2 s window, not more
    hb2.close()
    assert not hb2.alive
    first, *rest = str(info.value).splitlines()
    assert first.startswith("all-gather of block 0 (rank 0): did not complete within 0.5s")
    assert info.value.told and info.value.diagnosis == "\n".join(rest)
    assert rest[1].startswith("  rank 1 is not responding (stopped or dead; last heard")
    assert "rank 0 waits in block 0 forward all-gather #7" in info.value.diagnosis
    assert "rank 2 waits in block 0 forward all-gather #4" in info.value.diagnosis
    assert capsys.readouterr().err.count("isp-comm: hang diagnosis") == 1
    doc = json.loads((tmp_path / HANG_JSON).read_text())
    assert doc["not_responding"] == [1] and sorted(doc["records"]) == ["0", "2"]
    assert "Thread" in doc["records"]["2"]["stacks"]  # faulthandler's stacks of every thread
    assert "=== rank 1 ===" in (tmp_path / HANG_TXT).read_text()
    assert doctor.show(str(tmp_path)) == info.value.diagnosis
    # one diagnosis per communicator: a second failure does not wait again
    with pytest.raises(ISPCommTimeout) as again:
        ctx.wait(Pending(), "all-reduce")
    assert again.value.diagnosis is None


def test_a_slow_lowest_rank_does_not_silence_the_diagnosis(tmp_path, capsys) -> None:
    """Rank 0 is alive and answers from its heartbeat but never timed out (slow, not
    stopped); rank 1's wait passes its deadline: rank 1, the first to time out, says
    it and writes the files (a review found the lowest answering rank chosen, which
    never printed)."""
    store = DictStore()
    records = {r: _record(r, STEP * 2, 3) for r in range(3)}
    hb0 = Heartbeat(records[0], store, StoreKeys(8))
    hb0.start()
    ctx = CommContext(1, timeout_s=0.5)
    ctx.flight = records[1]
    ctx.diagnose = Diagnoser(Heartbeat(ctx.flight, store, StoreKeys(8), str(tmp_path)), 3, str(tmp_path), window_s=1.0)
    h = Pending()
    ctx.flight.issue(h, "all-gather", None, torch.empty(4), 0, "forward")
    try:
        with pytest.raises(ISPCommTimeout) as info:
            ctx.wait(h, "all-gather of block 0")
    finally:
        hb0.close()
    assert info.value.told
    assert capsys.readouterr().err.count("isp-comm: hang diagnosis (3 ranks, deadline 0.5 s, from rank 1)") == 1
    assert (tmp_path / HANG_TXT).is_file() and json.loads((tmp_path / HANG_JSON).read_text())["not_responding"] == [2]


def test_doctor_live_asks_through_the_trigger_file(tmp_path) -> None:
    (tmp_path / "run.json").write_text(json.dumps({"world": 2}))
    beats = [Heartbeat(_record(r, STEP * 2, 4 + 2 * r), None, StoreKeys(0), str(tmp_path)) for r in range(2)]
    for b in beats:
        b.start()
    try:
        text = doctor.live(str(tmp_path), wait_s=10.0)
    finally:
        for b in beats:
            b.close()
    assert not any(b.alive for b in beats)
    assert (tmp_path / LIVE_TRIGGER).exists() and len(os.listdir(tmp_path / LIVE_DIR)) == 2
    lines = text.splitlines()
    assert lines[0] == f"isp-comm doctor: 2 of 2 ranks of {tmp_path}, now"
    assert lines[1].startswith("  rank 0: waits in block 1 forward all-gather #5 (issued ")
    assert lines[2].startswith("  rank 1: computing; its last collective block 1 backward reduce-scatter #6")
    with pytest.raises(ValueError, match="no hang.json"):
        doctor.show(str(tmp_path))
    # a restart set the dead run's diagnosis aside: the doctor shows it, and says whose it is
    (tmp_path / "hang.previous.json").write_text(json.dumps({"header": "hang diagnosis", "lines": ["rank 1 died"]}))
    assert doctor.show(str(tmp_path)).splitlines()[1:] == ["hang diagnosis", "  rank 1 died"]
    assert "an earlier run's, set aside when the next one started" in doctor.show(str(tmp_path))


def test_a_trigger_left_by_an_unanswered_doctor_is_not_answered_by_the_next_run(tmp_path) -> None:
    """``isp-comm doctor --live`` on a folder with no job left its trigger file, and the
    next run into the folder answered it unasked, writing live/ at its start; it
    answers only a trigger written after it began."""
    (tmp_path / LIVE_TRIGGER).write_text("0\n")  # an earlier doctor's, no job then
    beat = Heartbeat(_record(0, STEP, 2), None, StoreKeys(0), str(tmp_path))
    beat.start()
    try:
        time.sleep(3 * POLL_S)
        assert not (tmp_path / LIVE_DIR).exists()
        (tmp_path / "run.json").write_text(json.dumps({"world": 1}))
        text = doctor.live(str(tmp_path), wait_s=10.0)  # a question asked now is answered
    finally:
        beat.close()
    assert text.splitlines()[0] == f"isp-comm doctor: 1 of 1 ranks of {tmp_path}, now"


def test_doctor_live_with_no_job_answering_exits_2(tmp_path, capsys) -> None:
    # it printed "no rank ... answered" and exited 0, which a script took for an answer
    from isp_comm.cli import main as isp_comm_main

    (tmp_path / "run.json").write_text(json.dumps({"world": 2}))
    assert isp_comm_main(["doctor", "--live", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"isp-comm doctor: no rank of a job in {tmp_path} answered"), err
    assert f"isp-comm doctor {tmp_path}, without --live, shows the diagnosis" in err[0]


class FakeEvent:
    def __init__(self) -> None:
        self.fired = False

    def query(self) -> bool:  # the only call the watchdog may make: never synchronises
        return self.fired


def test_the_cuda_watchdog_diagnoses_the_oldest_collective_past_its_deadline() -> None:
    rec = FlightRecord(0)
    rec._labels[None] = GROUP
    now = [100.0]
    events = []
    for i in range(3):
        e = rec.issue(object(), "all-gather", None, torch.empty(4), i, "forward")
        e.issued = 100.0 + i
        events.append(FakeEvent())
        rec.watch(e, events[-1])
    asked, hung = [], []
    dog = Watchdog(rec, 10.0, lambda what, s: asked.append(what) or "the diagnosis", hung.append, clock=lambda: now[0])
    assert not dog.poll()
    events[0].fired = True
    now[0] = 111.5  # the first is done; the second (issued at 101) is 10.5 s old
    assert dog.poll()
    assert asked == ["block 1 forward all-gather #2 (on the GPU)"] and hung == ["the diagnosis"]
    assert [e.block for e in rec.inflight] == [1, 2]


# ---- whole ranks ------------------------------------------------------------------------------
def _step_worker(rank: int, world: int, backend: str) -> list:
    from isp_comm import ISPCommunicator, ISPConfig, ParallelGroups

    case = Case(steps=1)
    model = case.build()
    comm = ISPCommunicator(model, ParallelGroups.create(wp_size=world), ISPConfig(backend=backend))
    comm.set_step(1)
    for x, y in batches(case, world)[0]:
        loss = loss_fn(model(x.chunk(world)[rank]), y.chunk(world)[rank])
        loss.backward()
    comm.clip_grad_norm_(1.0)
    comm.all_reduce(loss.detach(), what="the loss")
    beat = comm._flight.heartbeat
    alive = beat.alive
    comm.close()
    threads = [t.name for t in threading.enumerate() if t.name.startswith(("isp-heartbeat", "isp-watchdog"))]
    entries = [e.to_dict() for e in comm.ctx.flight.entries]
    return [alive, beat.alive, threads, entries]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", ["torch", "symm"])
def test_every_collective_of_a_step_is_recorded_alike_on_every_rank(backend: str) -> None:
    out = run_ranks(_step_worker, 2, backend, timeout_s=100)
    for alive, alive_after, threads, _ in out:
        assert alive and not alive_after and threads == [], threads  # stopped and joined by close()
    entries = out[0][3]
    seen = {(e["kind"], e["phase"]) for e in entries}
    assert {("all-gather", "forward"), ("reduce-scatter", "backward"), ("all-reduce", "outer")} <= seen
    assert all(e["done"] is not None and e["step"] == 1 for e in entries)  # every one waited
    sig = [[(e["group"], e["seq"], e["kind"], e["bytes"], e["block"], e["phase"]) for e in o[3]] for o in out]
    assert sig[0] == sig[1]


# ---- jobs: rank 1 stops, or runs one extra forward ----------------------------------------------
_ENV = {**os.environ, "PYTHONPATH": "."}


def _children(parent: int) -> dict[int, str]:
    """The live children of ``parent`` and their states (``T``: stopped), from /proc."""
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                state, ppid = f.read().rsplit(")", 1)[1].split()[:2]
        except (OSError, ValueError, IndexError):
            continue
        if int(ppid) == parent and state not in "ZX":
            found[int(pid)] = state
    return found


@contextlib.contextmanager
def _last_stopped_rank_killed(launcher: int):
    """Once the stopped rank (the fault) is the launcher's last child, after its peers
    have diagnosed the hang and left, kill it: torch's agent sends the ranks of a failed
    job SIGTERM and then waits 30 s for one that cannot answer (a stopped process),
    whatever TORCH_ELASTIC_SHUTDOWN_TIMEOUT says (``_stop_workers`` takes the default):
    30 s of each test spent on torch's wait, which is not what the test checks."""
    done = threading.Event()

    def watch() -> None:
        while not done.wait(0.2):
            children = _children(launcher)
            if children and set(children.values()) == {"T"}:
                for pid in children:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                return

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        watcher.join()


def _end(folder: str) -> None:
    """No rank outlives the test: a stopped one is continued and killed."""
    pids = os.path.join(folder, "pids")
    for name in os.listdir(pids) if os.path.isdir(pids) else []:
        pid = int(open(os.path.join(pids, name)).read())
        for sig in (signal.SIGCONT, signal.SIGKILL):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                break


def _expect(out: str, fault: str) -> None:
    if fault == "stop":
        assert "rank 1 is not responding" in out, out[-4000:]
        # one line for one group's waits; a line each where they wait in two groups (WP 2 of a world of 4)
        together = "ranks 0 and 2 wait in block" in out
        assert together or ("rank 0 waits in block" in out and "rank 2 waits in block" in out), out[-4000:]
    else:
        assert "rank 1 is out of step" in out or "rank 1 is behind" in out, out[-4000:]
        assert " wait in " in out or " waits in " in out, out[-4000:]


DEADLINE = "5"


@pytest.mark.timeout(150)
@pytest.mark.parametrize(
    "backend,fault",
    [
        ("symm", "extra"),  # the CI tier: this, and isp-train's stopped rank on gloo below
        pytest.param("torch", "stop", marks=pytest.mark.slow),
        pytest.param("symm", "stop", marks=pytest.mark.slow),
        pytest.param("torch", "extra", marks=pytest.mark.slow),
    ],
)
def test_a_torchrun_job_names_the_rank_that_hangs(tmp_path, backend: str, fault: str) -> None:
    folder = str(tmp_path / "diag")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3"]
    cmd += ["tests/scripts/hang_job.py", backend, fault, folder, DEADLINE]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_ENV)
    try:
        with _last_stopped_rank_killed(proc.pid):
            stdout, stderr = proc.communicate(timeout=130)
    finally:
        _end(folder)
        proc.kill()
    assert proc.returncode != 0
    assert time.monotonic() - t0 < 120
    out = stdout + stderr
    if (backend, fault) == ("symm", "extra"):  # the backend checks what each rank issued: no wait, no hang
        assert "collectives out of step in group [0, 1, 2]" in out and "rank 1: all-gather" in out, out[-4000:]
        return
    assert out.count("isp-comm: hang diagnosis") >= 1
    _expect(out, fault)
    _expect(doctor.show(folder), fault)  # the files the lowest answering rank wrote


SMALL = ["--layers", "2", "--hidden", "32", "--heads", "4", "--kv-heads", "2", "--batch", "3", "--seq", "32"]


@pytest.mark.timeout(150)
@pytest.mark.parametrize(
    "fault, world, flags",
    [
        ("stop", 3, []),
        pytest.param("extra", 3, [], marks=pytest.mark.slow),
        # pieces: the waits include the replica all-gathers that refresh the WP shards
        ("stop", 4, ["--batch", "4", "--wp", "2", "--state-sharding", "world"]),
    ],
    ids=["stop", "extra", "stop-state-over-world"],
)
def test_isp_train_ends_a_hang_with_one_line_and_the_diagnosis(
    tmp_path, fault: str, world: int, flags: list[str]
) -> None:
    out = str(tmp_path / "run")
    cmd = [sys.executable, "-m", "isp_comm.train", "--nproc-per-node", str(world), *SMALL, "--steps", "8"]
    cmd += ["--no-trace", "--backend", "torch", "--comm-timeout", DEADLINE, "--out", out, *flags]
    env = {**_ENV, FAULT_ENV: f"{fault}:1:3"}
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        with _last_stopped_rank_killed(proc.pid):
            _, err = proc.communicate(timeout=130)
    finally:
        _kill_ranks_of(proc.pid)
        proc.kill()
    assert proc.returncode not in (0, None)
    assert time.monotonic() - t0 < 120
    assert "Traceback" not in err, err[-4000:]
    _expect(err, fault)
    said = [line for line in err.splitlines() if line.startswith("isp-train: stopped: ")]
    assert len(said) == 1 and f"{out}/hang.txt" in said[0], err[-3000:]
    diagnosis = [line for line in err.splitlines() if line.startswith(("isp-comm: hang diagnosis", "  "))]
    # the watcher's own SIGKILL of the stopped rank, when torch's agent sees it beside the
    # diagnosing rank's exit (within 5 s), is named by the launcher: a kill from outside,
    # which a real hang would not have (the agent waits 30 s for a stopped rank)
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith(KILLED_BY_THE_WATCHER)]
    assert len(lines) == 1 + len(diagnosis), err[-3000:]
    res = subprocess.run([sys.executable, "-m", "isp_comm.cli", "doctor", out], capture_output=True, text=True)
    assert res.returncode == 0
    _expect(res.stdout, fault)


KILLED_BY_THE_WATCHER = "isp-train: error: rank 1 was killed by SIGKILL (from outside the job"
"""The launcher's line for the stopped rank :func:`_last_stopped_rank_killed` kills."""


def _kill_ranks_of(launcher: int) -> None:
    """isp-train's ranks (children of its launcher): continued and killed if any is left."""
    for pid in _children(launcher):
        for sig in (signal.SIGCONT, signal.SIGKILL):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                break


def test_fault_env_is_test_only_and_checked() -> None:
    from isp_comm.train.hang import inject_fault

    called = deque()
    os.environ[FAULT_ENV] = "extra:1:3"
    try:
        cpu = torch.device("cpu")
        inject_fault(0, 3, lambda: called.append(0), cpu)
        inject_fault(1, 2, lambda: called.append(0), cpu)
        inject_fault(1, 3, lambda: called.append(torch.is_grad_enabled()), cpu)
        os.environ[FAULT_ENV] = "bogus:1:3"
        with pytest.raises(ValueError, match="unknown fault"):
            inject_fault(1, 3, lambda: None, cpu)
    finally:
        del os.environ[FAULT_ENV]
    assert list(called) == [False]  # once, at its rank and step, without autograd


def test_each_launcher_attempt_keeps_its_own_flight_keys(monkeypatch) -> None:
    """torchrun's agent keeps one store for every attempt (--max-restarts): the second
    attempt's heartbeats, records and requests must not meet the first's, or a stopped
    rank's old record reads as its answer and no diagnosis is printed."""
    from isp_comm.flight.heartbeat import StoreKeys

    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    first = StoreKeys(0)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    second = StoreKeys(0)
    assert first.request != second.request and first.record(1) != second.record(1)
    assert first.beat(1) != second.beat(1) and first.teller != second.teller


WATCHDOG_FIRES = """
import torch, torch.distributed as dist
from isp_comm.flight.diagnosis import Diagnoser
from isp_comm.flight.heartbeat import Heartbeat, StoreKeys
from isp_comm.flight.record import FlightRecord
from isp_comm.flight.watchdog import Watchdog

class NeverDone:
    def query(self):
        return False

rec = FlightRecord(0)
rec._labels[None] = "0"
hb = Heartbeat(rec, dist.HashStore(), StoreKeys(0))
e = rec.issue(object(), "all-gather", None, torch.zeros(4), 0, "forward")
rec.watch(e, NeverDone())
e.issued -= 10
Watchdog(rec, deadline_s=1.0, diagnose=Diagnoser(hb, world=1, folder=None, window_s=0.2)).poll()
"""


@pytest.mark.timeout(60)
def test_the_cuda_watchdog_prints_the_diagnosis_once() -> None:
    """The rank whose watchdog fires tells the diagnosis, then exits 1 without printing
    it again (a never-completing event stands for the GPU's collective)."""
    res = subprocess.run([sys.executable, "-c", WATCHDOG_FIRES], capture_output=True, text=True, timeout=50)
    assert res.returncode == 1, res.stderr[-2000:]
    assert res.stderr.count("isp-comm: hang diagnosis") == 1, res.stderr


def _closing(rank: int, world: int) -> list:
    """Each rank trains a step, then rank 1 closes as a failed run (isp-train's exit on
    an error or a stop), rank 0 as a finished one; what the store says of each."""
    import torch.distributed as dist

    from isp_comm import ISPCommunicator, ISPConfig, ParallelGroups
    from isp_comm.models.llama import LlamaConfig, build
    from tests.parity import TINY

    model = build(LlamaConfig(**TINY), seed=0)
    comm = ISPCommunicator(model, ParallelGroups.create(wp_size=world), ISPConfig())
    x = torch.randint(0, TINY["vocab_size"], (1, 8), generator=torch.Generator().manual_seed(rank))
    comm.cross_entropy(model(x), x).backward()
    hb = comm._flight.heartbeat
    comm.close(failed=rank == 1)
    dist.barrier()
    return [(hb.get(hb.keys.record(r)) or {}).get("closed", False) for r in range(world)]


@pytest.mark.timeout(60)
def test_a_rank_that_ends_on_an_error_is_not_recorded_as_finished() -> None:
    """isp-train closes the communicator with ``failed`` when its run ends on an
    exception or a stop: a peer's later diagnosis must not read that rank's record as
    a finished run's ("has finished its run" beside "rank 1 died")."""
    for seen in run_ranks(_closing, 2, timeout_s=50):
        assert seen == [True, False], seen
