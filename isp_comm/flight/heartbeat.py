"""The heartbeat: a thread per rank, off the hot path, that leaves the rank's
position in the c10d store every few seconds, answers a diagnosis request with the
rank's whole record, and answers ``isp-comm doctor --live`` through a trigger file.

[Note: why a thread answers for the rank]
A diagnosis starts on the rank whose wait passed its deadline; the other ranks may
still be waiting (with a later deadline), computing, or stopped. The ones that can
answer do so from this thread, whatever their main thread is doing; a rank that
answers nothing within the window is not responding (stopped: its threads stop with
it; dead; or its interpreter wedged). A stopped rank still leaves its last heartbeat
behind, so the diagnosis says where it was.

Launchers do not forward signals to workers and schedulers use SIGUSR1 themselves,
so ``--live`` asks through a file in the run folder (``LIVE_TRIGGER``) that this
thread polls: each rank then writes ``live/rank<r>.json`` there.
"""

from __future__ import annotations

import faulthandler
import json
import os
import socket
import tempfile
import threading
import time
import weakref
from typing import Any

from isp_comm.flight.record import FlightRecord

BEAT_S = 3.0
"""Seconds between two heartbeats in the store while the rank's position stands
still; when it moves, one every :data:`POLL_S` at most (so a rank that stops leaves a
position at most that old)."""
POLL_S = 0.5
"""Seconds between two looks for a diagnosis request or a live trigger, and at least
between two heartbeats of a moving position."""
LIVE_TRIGGER = ".isp-doctor-live"
"""The trigger file ``isp-comm doctor --live`` writes in the run folder."""
LIVE_DIR = "live"


def python_stacks() -> str:
    """Every thread's Python stack, as ``faulthandler`` writes it (it needs a real file)."""
    with tempfile.TemporaryFile(mode="w+") as f:
        faulthandler.dump_traceback(f, all_threads=True)
        f.seek(0)
        return f.read()


def stop_thread(thread: threading.Thread, timeout_s: float, *events: threading.Event) -> None:
    """Set ``events`` (the thread's stop and wake) and join ``thread`` for up to
    ``timeout_s``, unless it is the caller; what ``close`` and the exit do for the
    flight record's daemon threads ([Note: the heartbeat at interpreter exit])."""
    for e in events:
        e.set()
    if thread.is_alive() and thread is not threading.current_thread():
        thread.join(timeout=timeout_s)


class StoreKeys:
    """The keys of one communicator's heartbeats and records in the store (every rank
    creates its communicators in the same order, so ``instance`` agrees), under the
    launcher's attempt: torchrun's agent keeps one store for every attempt of a job
    (``--max-restarts``), and an earlier attempt's keys read as this one's would make
    a stopped rank's old record an answer."""

    def __init__(self, instance: int) -> None:
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self.prefix = f"isp-flight/attempt_{attempt}/{instance}/"
        self.request = self.prefix + "request"

    def beat(self, rank: int) -> str:
        return f"{self.prefix}beat/{rank}"

    def record(self, rank: int) -> str:
        return f"{self.prefix}record/{rank}"

    @property
    def teller(self) -> str:
        """Counts the ranks that began a diagnosis: the first one prints it."""
        return self.prefix + "teller"


def _trigger_time(run_dir: str | None) -> float:
    """The modification time of ``run_dir``'s live trigger, 0 where there is none."""
    try:
        return os.stat(os.path.join(run_dir, LIVE_TRIGGER)).st_mtime if run_dir else 0.0
    except OSError:
        return 0.0


class Heartbeat:
    """Publishes ``record``'s position to ``store`` every :data:`BEAT_S` seconds; see the
    module's docstring. ``store`` may be ``None`` (no process group): then only the
    live trigger is polled. Start with :meth:`start`, end with :meth:`close`."""

    def __init__(self, record: FlightRecord, store: Any, keys: StoreKeys, run_dir: str | None = None) -> None:
        self.record, self.store, self.keys, self.run_dir = record, store, keys, run_dir
        self.lock = threading.Lock()
        """Serialises this process's store operations (the thread's and a diagnosis's)."""
        self._stop = threading.Event()
        self.wake = threading.Event()
        """Set to publish the position now (a new step began)."""
        self._thread = threading.Thread(target=self._run, name=f"isp-heartbeat-{record.rank}", daemon=True)
        self._answered_live = _trigger_time(run_dir)
        """The trigger last answered: at first the one already there, which a ``doctor
        --live`` that no job answered left behind (this run did not exist to be asked:
        it wrote live/ unasked at its start)."""
        self.failures = 0
        """Store operations that raised (a store gone at the end of a job): counted, not raised."""

    def start(self) -> None:
        self._thread.start()
        # [Note: the heartbeat at interpreter exit] A script that leaves without
        # ``comm.close()`` (a short script, an error path) must not leave this daemon
        # thread running into the interpreter's finalisation: inside a store call then,
        # a rank aborted in teardown ("terminate called without an active exception",
        # SIGABRT) in 5 of 8 such exits on the torch backend. As the shared-memory
        # worker ([Note: the worker at interpreter exit] in ``backends/symm_cpu.py``),
        # it is stopped and joined at exit, before finalisation (the finalizer holds no
        # reference to ``self``); the CUDA watchdog's thread too.
        self._stop_at_exit = weakref.finalize(self, stop_thread, self._thread, 2 * POLL_S + 5.0, self._stop, self.wake)

    def close(self, failed: bool = False) -> None:
        """Stop the thread and join it (idempotent; called by ``comm.close()``). After a
        run that did not fail, the rank's final record stays in the store: a peer's
        later diagnosis compares against it rather than calling the rank not
        responding (a backend that pairs collectives by their order may let a rank that
        is out of step finish: gloo's all-gathers of equal sizes do; the shared-memory
        backend refuses a collective of another kind or size, [Note: what each rank
        issued] in ``backends/symm_cpu.py``; see [Note: the diagnosis without the stuck
        collective])."""
        if self._stop.is_set():
            return
        stop_thread(self._thread, 2 * POLL_S + 5.0, self._stop, self.wake)
        if not failed and self.record.entries:
            self.set(self.keys.record(self.record.rank), {**self.record.snapshot(), "state": "closed", "closed": True})

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # ---- what the thread publishes ------------------------------------------------
    def position(self) -> dict[str, Any]:
        """The rank's last issued and completed sequence numbers and its position."""
        rec = self.record
        last = rec.entries[-1] if rec.entries else None
        waiting = rec.waiting()
        return {
            "rank": rec.rank,
            "time": time.time(),
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "step": rec.step,
            "issued": dict(rec.seqs),
            "completed": dict(rec.completed),
            "last": last.to_dict() if last is not None else None,
            "waiting": waiting.to_dict() if waiting is not None else None,
        }

    def full(self, state: str) -> dict[str, Any]:
        """The whole record, the Python stacks and ``state`` (what the rank is doing)."""
        snap = self.record.snapshot()
        snap.update(state=state, stacks=python_stacks(), pid=os.getpid(), host=socket.gethostname())
        return snap

    def set(self, key: str, value: dict[str, Any]) -> bool:
        if self.store is None:
            return False
        try:
            with self.lock:
                self.store.set(key, json.dumps(value))
            return True
        except Exception:  # noqa: BLE001 - a store that is gone must not kill the rank
            self.failures += 1
            return False

    def get(self, key: str) -> dict[str, Any] | None:
        """``key``'s value, or ``None`` when it is not there (never blocks on it)."""
        if self.store is None:
            return None
        try:
            with self.lock:
                if not self.store.check([key]):
                    return None
                return json.loads(self.store.get(key))
        except Exception:  # noqa: BLE001
            self.failures += 1
            return None

    def first_to(self, key: str) -> bool:
        """Whether this rank is the first to add to ``key`` (atomic in the store; a
        store that is gone answers yes, so that someone still says it)."""
        if self.store is None:
            return True
        try:
            with self.lock:
                return int(self.store.add(key, 1)) == 1
        except Exception:  # noqa: BLE001
            self.failures += 1
            return True

    def requested(self) -> bool:
        if self.store is None:
            return False
        try:
            with self.lock:
                return bool(self.store.check([self.keys.request]))
        except Exception:  # noqa: BLE001
            self.failures += 1
            return False

    def request(self) -> None:
        """Ask every rank's heartbeat for its record (a diagnosis starts)."""
        if self.store is None:
            return
        try:
            with self.lock:
                self.store.add(self.keys.request, 1)
        except Exception:  # noqa: BLE001
            self.failures += 1

    # ---- the thread -----------------------------------------------------------------
    def _run(self) -> None:
        last_beat, last_at = 0.0, None
        while True:
            now = time.monotonic()
            rec = self.record
            last = rec.entries[-1] if rec.entries else None
            at = (id(last), last.done if last is not None else None, id(rec.current))
            since = now - last_beat  # moving: one beat per POLL_S at most, however short the steps
            if since >= BEAT_S or (at != last_at and since >= POLL_S):
                self.set(self.keys.beat(rec.rank), self.position())
                last_beat, last_at = now, at
            if self.requested():
                self.set(self.keys.record(self.record.rank), self.full("running (answered from its heartbeat)"))
            self._poll_live()
            self.wake.wait(POLL_S)
            self.wake.clear()
            if self._stop.is_set():
                return

    def _poll_live(self) -> None:
        if self.run_dir is None:
            return
        try:
            asked = os.stat(os.path.join(self.run_dir, LIVE_TRIGGER)).st_mtime
        except OSError:
            return
        if asked <= self._answered_live:
            return
        self._answered_live = asked
        out = os.path.join(self.run_dir, LIVE_DIR)
        try:
            os.makedirs(out, exist_ok=True)
            path = os.path.join(out, f"rank{self.record.rank}.json")
            with open(path + ".tmp", "w") as f:
                json.dump({**self.full("running (asked live)"), "asked": asked}, f)
            os.replace(path + ".tmp", path)
        except OSError:
            self.failures += 1
