"""``isp-comm doctor RUN``: a run folder's hang diagnosis; ``--live``: where each rank
of a running job is now, asked through the trigger file its heartbeat threads poll
(see [Note: why a thread answers for the rank])."""

from __future__ import annotations

import glob
import json
import os
import time
from typing import Any

from isp_comm.errors import need_folder
from isp_comm.flight.diagnosis import HANG_JSON, classify
from isp_comm.flight.heartbeat import LIVE_DIR, LIVE_TRIGGER, POLL_S
from isp_comm.flight.record import describe

PREVIOUS_JSON = "hang.previous.json"
"""Where isp-train sets an earlier run's ``hang.json`` aside when the folder's run is
restarted or resumed (``isp_comm/train/run_folder.py``)."""


def show(run: str) -> str:
    """The diagnosis a hang left in ``run`` (``hang.json``), else the one an earlier run
    of the folder left before a restart or resume set it aside, said so; ``ValueError``
    without either."""
    need_folder(run, "the run's folder (isp-train's --out, or the diagnosis_dir)")
    path, note = os.path.join(run, HANG_JSON), []
    if not os.path.isfile(path) and os.path.isfile(os.path.join(run, PREVIOUS_JSON)):
        path = os.path.join(run, PREVIOUS_JSON)
        note = [f"(no {HANG_JSON} from the run now in {run}: an earlier run's, set aside when the next one started)"]
    if not os.path.isfile(path):
        raise ValueError(f"{run}: no {HANG_JSON} (no wait there passed its deadline, or no --out / diagnosis_dir)")
    with open(path) as f:
        doc = json.load(f)
    return "\n".join([*note, doc["header"]] + [f"  {line}" for line in doc["lines"]])


def _world(run: str) -> int | None:
    """The run's world size from isp-train's ``run.json`` (``None`` for a library run)."""
    try:
        with open(os.path.join(run, "run.json")) as f:
            return int(json.load(f)["world"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _position(rec: dict[str, Any], now: float) -> str:
    step = f"step {rec['step']}, " if rec.get("step") is not None else ""
    w = rec.get("waiting")
    if w is not None:
        return f"rank {rec['rank']}: {step}waits in {describe(w)} (issued {now - w['issued']:.1f} s ago)"
    last = rec["entries"][-1] if rec.get("entries") else None
    if last is None:
        return f"rank {rec['rank']}: {step}no collective yet"
    return f"rank {rec['rank']}: {step}computing; its last collective {describe(last)} completed"


def live(run: str, wait_s: float = 4 * POLL_S + 3.0) -> str:
    """Ask the job writing to ``run`` where each rank is: touch the trigger, collect the
    answers its ranks write to ``run/live/`` for up to ``wait_s`` seconds. A
    ``ValueError`` when no rank answers (``isp-comm doctor`` exits 2: it printed the
    line and exited 0, and a script took the silence for an answer)."""
    need_folder(run, "the folder of the running job (isp-train's --out)")
    trigger = os.path.join(run, LIVE_TRIGGER)
    with open(trigger, "w") as f:
        f.write(f"{time.time()}\n")
    asked = os.stat(trigger).st_mtime
    world = _world(run)
    records: dict[int, dict[str, Any]] = {}
    end = time.monotonic() + wait_s
    while time.monotonic() < end and (world is None or len(records) < world):
        for path in glob.glob(os.path.join(run, LIVE_DIR, "rank*.json")):
            try:
                with open(path) as f:
                    rec = json.load(f)
            except (OSError, ValueError):
                continue  # being replaced
            if rec.get("asked", 0) >= asked:
                records[int(rec["rank"])] = rec
        time.sleep(0.2)
    now = time.time()
    if not records:
        raise ValueError(
            f"no rank of a job in {run} answered within {wait_s:.0f} s: is it running? (a job that has ended "
            f"answers nothing; isp-comm doctor {run}, without --live, shows the diagnosis a hang left)"
        )
    n = world if world is not None else max(records) + 1
    lines = [_position(records[r], now) for r in sorted(records)]
    d = classify(records, {}, n, now)
    lines += [d.out_of_step[r] for r in sorted(d.out_of_step)]  # "behind" needs one instant: answers differ
    lines += [d.parted] if d.parted and not d.out_of_step else []
    lines += [f"rank {r} did not answer within {wait_s:.0f} s (stopped, dead or finished)" for r in d.not_responding]
    return "\n".join([f"isp-comm doctor: {len(records)} of {n} ranks of {run}, now"] + [f"  {x}" for x in lines])
