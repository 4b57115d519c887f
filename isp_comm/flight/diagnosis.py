"""The diagnosis when a wait passes its deadline: which rank is not responding,
behind or out of step, and what the others wait for.

[Note: the diagnosis without the stuck collective]
The rank whose wait timed out cannot use the process group (its collective is the
stuck one), but the c10d store every rank already has still works. It publishes its
record there and asks for everyone's; every rank's heartbeat thread answers with its
own (see [Note: why a thread answers for the rank]). After a short window:

- a rank that did not answer is **not responding** (stopped or dead); its last
  heartbeat says where it was;
- a rank whose collective at some sequence number of a group differs from the
  majority's at the same number is **out of step** (it issued something else); where
  no majority can judge (two ranks, or a tie), the first number at which the ranks
  **parted** is named with what each issued there (one rank alone called
  ``comm.full_state_dict()`` while its peer trained on: the collectives of the two
  matched in size and paired up until they did not, and the wait that timed out was
  far past the cause);
- a rank that answered but has not yet issued what the others wait for is **behind**
  when it computes, and **held up** when it waits itself (on a rank named on its own
  line: it is not the cause).

The first rank whose wait passed its deadline (an atomic count in the store) prints the
diagnosis once and writes ``hang.json`` and ``hang.txt`` (every rank's record and Python
stacks) to the diagnosis folder; every rank that timed out puts it in its
:class:`~isp_comm.errors.ISPCommTimeout`.
"""

from __future__ import annotations

import itertools
import json
import os
import socket
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from isp_comm.backends.shm import pid_alive
from isp_comm.flight.heartbeat import POLL_S, Heartbeat, StoreKeys
from isp_comm.flight.record import describe
from isp_comm.flight.watchdog import Watchdog

WINDOW_S = 5.0
"""Seconds at most the waiting ranks give the others to answer (heartbeats poll every
0.5 s); half the deadline when that is shorter, and never under 2 s. A rank whose
process is known gone (same host, its pid) is not waited for."""


def window_for(deadline_s: float) -> float:
    return min(WINDOW_S, max(2.0, deadline_s / 2))


def _gone(beat: dict[str, Any] | None) -> bool:
    """The rank's process is known to have ended (it ran on this host)."""
    return beat is not None and beat.get("host") == socket.gethostname() and not pid_alive(int(beat["pid"]))


HANG_JSON, HANG_TXT = "hang.json", "hang.txt"


def _ranks(rs: list[int]) -> str:
    rs = sorted(rs)
    if len(rs) == 1:
        return f"rank {rs[0]}"
    return "ranks " + ", ".join(map(str, rs[:-1])) + f" and {rs[-1]}"


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB" if nbytes >= 2**16 else f"{nbytes} B"


def _what(e: dict[str, Any]) -> str:
    """``an all-gather of block 0 (forward, 1.0 MiB)``."""
    where = f"block {e['block']}" if e["block"] >= 0 else "the outer parameters or the loop"
    article = "an" if e["kind"][0] in "aeiou" else "a"
    return f"{article} {e['kind']} of {where} ({e['phase']}, {_mib(e['bytes'])}, {e['dtype']})"


def _where(w: dict[str, Any], world: int) -> str:
    """``block 0 forward all-gather #4``, with its group when that is not the world's:
    sequence numbers count per group, and two groups' waits are told apart."""
    group = w["group"]
    return describe(w) + (f" over ranks [{group}]" if group.count(",") + 1 < world else "")


def _blocked(w: dict[str, Any], rank: int, records: dict[int, dict[str, Any]]) -> bool:
    """Whether ``rank``'s wait ``w`` waits on another rank: one of its group that did not
    answer, or has not issued that collective yet (else the wait is slow, not blocked)."""
    others = [int(p) for p in w["group"].split(",") if int(p) != rank]
    return any(p not in records or records[p].get("issued", {}).get(w["group"], 0) < w["seq"] for p in others)


def _signature(e: dict[str, Any]) -> tuple:
    return (e["kind"], e["bytes"], e["dtype"], e["block"], e["phase"])


@dataclass
class Diagnosis:
    """The finding: one line per rank that is the cause, one per group of waiters."""

    world: int
    not_responding: dict[int, dict[str, Any] | None] = field(default_factory=dict)
    finished: dict[int, str] = field(default_factory=dict)
    out_of_step: dict[int, str] = field(default_factory=dict)
    parted: str | None = None
    """Where no majority names a rank out of step: the first collective at which the ranks differ."""
    behind: dict[int, str] = field(default_factory=dict)
    held_up: dict[int, str] = field(default_factory=dict)
    waiting: dict[str, list[int]] = field(default_factory=dict)
    lines: list[str] = field(default_factory=list)

    def text(self, header: str) -> str:
        return "\n".join([header] + [f"  {line}" for line in self.lines])


def _not_responding_line(r: int, beat: dict[str, Any] | None, now: float) -> str:
    if beat is None:
        return f"rank {r} is not responding (stopped or dead; never heard from)"
    if _gone(beat):
        return f"rank {r} is dead (its process {beat['pid']} is gone; last heard {now - beat['time']:.1f} s ago)"
    where = []
    if beat.get("step") is not None:
        where.append(f"step {beat['step']}")
    if beat.get("waiting") is not None:
        w = beat["waiting"]
        where.append(f"waiting in {describe(w)}, issued {now - w['issued']:.1f} s ago")
    elif beat.get("last") is not None:
        last = beat["last"]
        done = f"completed {now - last['done']:.1f} s ago" if last.get("done") else "issued"
        where.append(f"its last collective {describe(last)} {done}")
    # the heartbeat publishes a moving position every POLL_S at most: the rank may have gone further since
    tail = f", when it was at {', '.join(where)}; it may have gone up to {POLL_S} s further" if where else ""
    return f"rank {r} is not responding (stopped or dead; last heard {now - beat['time']:.1f} s ago{tail})"


def _by_seq(records: dict[int, dict[str, Any]]) -> dict[tuple[str, int], dict[int, dict[str, Any]]]:
    """Every rank's entry at each ``(group, seq)``."""
    at: dict[tuple[str, int], dict[int, dict[str, Any]]] = {}
    for r, rec in records.items():
        for e in rec.get("entries", []):
            at.setdefault((e["group"], e["seq"]), {})[r] = e
    return at


def _first_divergence(records: dict[int, dict[str, Any]]) -> tuple[dict[int, str], str | None]:
    """Per rank out of step: the first (group, seq) where its collective differs from
    the majority's of the ranks that recorded that number. Then, where ranks differ
    with no majority to judge by (two ranks, a tie), the first such collective, said
    with what each rank issued there (see the module's note)."""
    found: dict[int, tuple[float, str]] = {}
    parted: tuple[float, str] | None = None
    for (group, seq), by_rank in _by_seq(records).items():
        if len(by_rank) < 2:
            continue
        votes = Counter(_signature(e) for e in by_rank.values())
        (major, n_major), *rest = votes.most_common()
        if not rest:  # all agree
            continue
        if n_major * 2 <= len(by_rank):  # no majority to judge by
            first = min(e["issued"] for e in by_rank.values())
            if parted is None or first < parted[0]:
                said = "; ".join(f"rank {r} issued {_what(e)}" for r, e in sorted(by_rank.items()))
                parted = (first, f"the ranks parted at collective #{seq} over ranks [{group}]: {said}. {_SAME_CALLS}")
            continue
        majority = sorted(r for r, e in by_rank.items() if _signature(e) == major)
        example = by_rank[majority[0]]
        for r, e in by_rank.items():
            if _signature(e) == major or (r in found and found[r][0] <= e["issued"]):
                continue
            found[r] = (
                e["issued"],
                f"rank {r} is out of step: its collective #{seq} over ranks [{group}] is {_what(e)} "
                f"where {_ranks(majority)} issued {_what(example)}",
            )
    return {r: line for r, (_, line) in found.items()}, (parted[1] if parted else None)


_SAME_CALLS = (
    "Every rank makes the same calls in the same order: forwards and backwards, and "
    "comm.full_state_dict(), comm.save_hf_checkpoint() and comm.clip_grad_norm_(), "
    "which are collective (not under `if rank == 0`)"
)


def _late_peer(
    d: Diagnosis, peer: int, pw: dict[str, Any] | None, at: int, r: int, w: dict[str, Any], records: dict
) -> None:
    """``peer`` has issued ``at`` collectives of the group in which rank ``r`` waits for
    number ``w["seq"]``: held up when its own wait ``pw`` waits on another rank (not a
    cause), else behind (computing, or in a slow collective)."""
    if pw is not None and _blocked(pw, peer, records):
        d.held_up[peer] = (
            f"rank {peer} is held up: it waits in {_where(pw, d.world)}, before collective #{w['seq']} "
            f"over ranks [{w['group']}] that {_ranks([r])} waits for"
        )
        return
    doing = f"waiting in {describe(pw)}" if pw else "computing"
    d.behind[peer] = (
        f"rank {peer} is behind: it has issued collective #{at} over ranks [{w['group']}], "
        f"where {_ranks([r])} waits for #{w['seq']} ({doing})"
    )


def classify(
    records: dict[int, dict[str, Any]], beats: dict[int, dict[str, Any] | None], world: int, now: float
) -> Diagnosis:
    """The diagnosis from the records of the ranks that answered and the last
    heartbeats of those that did not (see the module's note)."""
    d = Diagnosis(world)
    for r in range(world):
        if r not in records:
            d.not_responding[r] = beats.get(r)
    d.out_of_step, d.parted = _first_divergence(records)
    for r, rec in records.items():
        if rec.get("closed"):
            last = ", ".join(f"#{n} over ranks [{g}]" for g, n in sorted(rec.get("issued", {}).items()))
            d.finished[r] = f"rank {r} has finished its run (its last collectives: {last})"
        w = rec.get("waiting")
        if w is None or rec.get("closed"):
            continue
        step = f" (step {w['step']})" if w.get("step") is not None else ""
        d.waiting.setdefault(_where(w, world) + step, []).append(r)
        for peer in map(int, w["group"].split(",")):  # who has not issued what r waits for
            prec = records.get(peer)
            if peer == r or prec is None or peer in d.out_of_step or peer in d.behind or prec.get("closed"):
                continue
            at = prec.get("issued", {}).get(w["group"], 0)
            if at < w["seq"]:
                _late_peer(d, peer, prec.get("waiting"), at, r, w, records)
    d.lines = [_not_responding_line(r, b, now) for r, b in sorted(d.not_responding.items())]
    d.lines += [d.out_of_step[r] for r in sorted(d.out_of_step)]
    d.lines += [d.parted] if d.parted and not d.out_of_step else []
    d.lines += [d.behind[r] for r in sorted(d.behind) if r not in d.out_of_step]
    d.lines += [d.held_up[r] for r in sorted(d.held_up) if r not in d.out_of_step and r not in d.behind]
    d.lines += [d.finished[r] for r in sorted(d.finished)]
    for where, rs in sorted(d.waiting.items(), key=lambda kv: min(kv[1])):
        d.lines.append(f"{_ranks(rs)} {'wait' if len(rs) > 1 else 'waits'} in {where}")
    if not d.lines:
        d.lines.append("every rank answered and none waits: the deadline passed in a slow collective")
    return d


def write_files(folder: str, header: str, d: Diagnosis, records: dict, beats: dict) -> None:
    """``hang.json`` (the finding, every rank's record and last heartbeat) and
    ``hang.txt`` (the same for people: the finding, then each rank's record and stacks)."""
    os.makedirs(folder, exist_ok=True)
    doc = {
        "header": header,
        "lines": d.lines,
        "world": d.world,
        "not_responding": sorted(d.not_responding),
        "out_of_step": sorted(d.out_of_step),
        "behind": sorted(d.behind),
        "held_up": sorted(d.held_up),
        "finished": sorted(d.finished),
        "records": {str(r): rec for r, rec in sorted(records.items())},
        "heartbeats": {str(r): b for r, b in sorted(beats.items())},
    }
    with open(os.path.join(folder, HANG_JSON), "w") as f:
        json.dump(doc, f, indent=1)
    with open(os.path.join(folder, HANG_TXT), "w") as f:
        f.write(d.text(header) + "\n")
        for r in range(d.world):
            f.write(f"\n=== rank {r} ===\n")
            rec = records.get(r)
            if rec is None:
                f.write("did not answer; last heartbeat: " + json.dumps(beats.get(r)) + "\n")
                continue
            f.write(f"state: {rec.get('state')}\n")
            for e in rec.get("entries", []):
                done = f"done +{e['done'] - e['issued']:.3f} s" if e["done"] is not None else "PENDING"
                f.write(f"  [{e['group']}] {describe(e)}  step {e['step']}  {_mib(e['bytes'])} {e['dtype']}  {done}\n")
            f.write(rec.get("stacks", "") + "\n")


class Diagnoser:
    """Runs the diagnosis on a rank whose wait passed its deadline (once per
    communicator); ``folder``: where the first rank to time out writes the files."""

    def __init__(self, heartbeat: Heartbeat, world: int, folder: str | None, window_s: float | None = None) -> None:
        self.hb, self.world, self.folder, self.window_s = heartbeat, world, folder, window_s
        self.result: str | None = None
        self.told = False
        """Whether this rank printed the diagnosis."""
        self._lock = threading.Lock()  # the training thread's timeout and the CUDA watchdog's

    def __call__(self, what: str, deadline_s: float) -> str | None:
        with self._lock:
            return self._diagnose(what, deadline_s)

    def _diagnose(self, what: str, deadline_s: float) -> str | None:
        if self.result is not None:
            return self.result
        hb, rank = self.hb, self.hb.record.rank
        if hb.store is None:  # no store: this rank's own position only
            return None
        hb.set(hb.keys.record(rank), hb.full(f"timed out waiting in {what}"))
        tells = hb.first_to(hb.keys.teller)  # the first rank whose deadline passed says it, once
        hb.request()
        records: dict[int, dict[str, Any]] = {}
        gone: set[int] = set()
        end = time.monotonic() + (self.window_s if self.window_s is not None else window_for(deadline_s))
        while True:
            for r in set(range(self.world)) - set(records) - gone:
                got = hb.get(hb.keys.record(r))
                if got is not None:
                    records[r] = got
                elif _gone(hb.get(hb.keys.beat(r))):
                    gone.add(r)
            if len(records) + len(gone) == self.world or time.monotonic() > end:
                break
            time.sleep(0.2)
        records[rank] = hb.full(f"timed out waiting in {what}")  # its own, as of now
        beats = {r: hb.get(hb.keys.beat(r)) for r in range(self.world)}
        d = classify(records, beats, self.world, time.time())
        header = f"isp-comm: hang diagnosis ({self.world} ranks, deadline {deadline_s:.1f} s, from rank {rank})"
        self.result = d.text(header)
        if tells:  # said once: a rank that answers but never timed out (slow, not stopped) does not
            self.told = True
            print(self.result, file=sys.stderr, flush=True)
            if self.folder is not None:
                try:
                    write_files(self.folder, header, d, records, beats)
                except OSError as exc:
                    print(f"isp-comm: could not write the diagnosis to {self.folder}: {exc}", file=sys.stderr)
        return self.result


_instances = itertools.count()
"""Communicators made by this process so far: every rank makes them in the same
order, so the n-th one's keys in the store agree across ranks."""


def default_store() -> Any:
    """The c10d store the default process group met through (torchrun's TCPStore, a
    FileStore, ...), or ``None`` without one."""
    if not dist.is_available() or not dist.is_initialized():
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - a process group without a store: no heartbeat
        return None


class Flight:
    """A communicator's heartbeat, diagnosis and (CUDA) watchdog, started together by
    :func:`attach` and closed together by ``comm.close()``."""

    def __init__(self, heartbeat: Heartbeat, watchdog: Watchdog | None) -> None:
        self.heartbeat, self.watchdog = heartbeat, watchdog

    def close(self, failed: bool) -> None:
        if self.watchdog is not None:
            self.watchdog.close()
        self.heartbeat.close(failed)


def attach(ctx: Any, world: int, folder: str | None) -> Flight:
    """Start ``ctx``'s heartbeat (and on CUDA its watchdog) and arm its diagnosis
    (``ctx.diagnose``). One rank alone publishes nothing."""
    store = default_store() if world > 1 else None
    hb = Heartbeat(ctx.flight, store, StoreKeys(next(_instances)), folder)
    ctx.diagnose = Diagnoser(hb, world, folder)
    watchdog = Watchdog(ctx.flight, ctx.timeout_s, ctx.diagnose, device=ctx.clock.device) if ctx.clock.cuda else None
    hb.start()
    if watchdog is not None:
        watchdog.start()
    return Flight(hb, watchdog)
