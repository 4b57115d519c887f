"""isp-train's checkpoints: the sharded state dicts through torch.distributed.checkpoint.

Every rank writes only its own shards (``comm.state_dict()`` /
``comm.optimizer_state_dict(opt)``: DTensors on the live shards), for any optimizer, so
saving costs no more memory than training and a run can resume on another WP size.

[Note: commit protocol]
A checkpoint is written into ``step_N.partial/``. When DCP returns (every rank's data
and the ``.metadata`` are written), each rank records a CRC-32 of the files it wrote,
rank 0 writes them to ``checksums.json`` and renames the folder to ``step_N/`` (an
atomic rename), then points ``latest`` at it (written to a temporary file and renamed
too). A run killed at any moment therefore leaves either a complete ``step_N/`` or a
``.partial`` folder that :func:`latest` never picks; a fresh run removes them.
Resume verifies the checksums (each rank reads a share of the files) before loading,
so a truncated or corrupted file stops the run with its name.

With ``async_save`` DCP's own stager first copies the state (this rank's shards only,
the one extra copy asynchronous saving needs; into pinned CPU memory on CUDA, kept
and reused by the stager across saves), then DCP writes the copy in a background
thread over a process group of its own, so its collectives never interleave with
training's; the commit happens when the next save or the end of training waits for
it. (The state dicts hand out one storage per tensor for this: see [Note: one
storage per state-dict tensor] in isp_comm/state.py.)
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import zlib
from concurrent.futures import Future

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from isp_comm import ISPCommunicator
from isp_comm.groups import first_error

LATEST = "latest"
FLAGS = "flags.json"
"""In each checkpoint: the flags of the run that saved it (``--resume`` takes them)."""
PARTIAL = ".partial"
CHECKSUMS = "checksums.json"
DATA_ORDER, DATA_ORDER_FIELDS = "data_order", ("position", "seed", "n_rows")
WINDOWS = "data_windows"
"""A random-window run's data: [seq, tokens, checksum] (``TrainData.windows``)."""
DATA_TOKENS = "data_tokens"
"""A packed run's tokens: [count, checksum] (``TrainData.identity``; not in a
checkpoint written before it, whose resume does not compare them)."""
DATA_SEQ = "data_seq"
"""A packed run's row length, [--seq] (not in a checkpoint written before it): two
lengths can cut a small corpus into as many rows, which the data order alone accepted."""
# Test-only fault injection: rank 1 kills itself when about to commit step N (its data
# and DCP's metadata are written, the folder not yet renamed).
KILL_AT_COMMIT_ENV = "ISP_COMM_TEST_KILL_AT_COMMIT"


class CheckpointError(ValueError):
    """A checkpoint that cannot be written or used (one line for the user, naming the
    path and the cause); raised on every rank alike."""


# Below this many free bytes, a save that failed without an OSError ran out of space.
FULL_BYTES = 1 << 20


def root_cause(exc: BaseException, folder: str | None = None) -> str:
    """The root cause of a failed save or load, e.g. ``[Errno 28] No space left on device``
    (DCP wraps every rank's failure in a ``CheckpointException``).

    torch's zip writer can lose the ``OSError`` of a short write and raise only
    ``unexpected pos``; when no ``OSError`` is in the chain and the file system holding
    ``folder`` (the save's target) is full, the cause is named as a full disk."""
    seen: list[BaseException] = []
    todo = [exc]
    while todo:
        e = todo.pop()
        if any(e is s for s in seen):
            continue
        seen.append(e)
        for sub in getattr(e, "failures", {}).values():  # CheckpointException: rank -> failure
            for part in sub if isinstance(sub, tuple) else (getattr(sub, "exc", sub),):
                if isinstance(part, BaseException):
                    todo.append(part)
        todo += [x for x in (e.__cause__, e.__context__) if x is not None]
    for e in seen:
        if isinstance(e, OSError):
            return f"{e.strerror or e} ({type(e).__name__}, errno {e.errno})" if e.errno else str(e)
    lines = str(exc).strip().splitlines()
    said = lines[-1] if lines else type(exc).__name__
    free = _free_bytes(folder) if folder else None
    if free is not None and free < FULL_BYTES:
        return f"No space left on device ({free} bytes free where it was written; torch said: {said})"
    return said


def _free_bytes(folder: str) -> int | None:
    """Free bytes on the file system holding ``folder`` (or its nearest existing parent)."""
    path = os.path.abspath(folder)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def _agree(error: str | None, remove: str | None = None) -> None:
    """Collective: a ``CheckpointError`` on every rank when any rank had one (the first
    rank's message); rank 0 first removes the folder ``remove`` (a partial checkpoint)."""
    first = first_error(error)
    if first:
        if remove is not None and dist.get_rank() == 0:
            shutil.rmtree(remove, ignore_errors=True)
        raise CheckpointError(first)


def checkpoints_folder(out: str) -> str:
    """The run folder ``out``'s folder of checkpoints."""
    return os.path.join(out, "checkpoints")


def _step_dir(out: str, step: int) -> str:
    return os.path.join(checkpoints_folder(out), f"step_{step:06d}")


def complete_steps(root: str) -> list[str]:
    """The complete checkpoints (``step_N`` with their ``.metadata``) of a checkpoints
    folder, oldest first by step (``step_1000000`` after ``step_999999``); none when the
    folder is missing. A folder renamed aside (``step_N.bad``) is not one."""
    if not os.path.isdir(root):
        return []
    steps = []
    for d in os.listdir(root):
        n = d[len("step_") :]
        if d.startswith("step_") and n.isdigit() and os.path.isfile(os.path.join(root, d, ".metadata")):
            steps.append((int(n), d))
    return [d for _, d in sorted(steps)]


def _crc(path: str) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            crc = zlib.crc32(chunk, crc)
    return crc


def _state(
    comm: ISPCommunicator,
    opt: torch.optim.Optimizer,
    step: int,
    saved: set[str] | None = None,
    data_order: dict | None = None,
) -> dict:
    """What a checkpoint holds: the sharded model and optimizer state, the step, and
    each rank's RNG states under keys of its own (``rng/RANK``; with parameters on a
    GPU also ``cuda_rng/RANK``), so that dropout after a resume draws what it would
    have drawn on every rank. A tensor under one key on every rank would be saved
    once, by one rank, and loaded by all. ``saved``: the keys of the checkpoint being
    loaded; a rank it has no RNG state of (a resume on more ranks) takes rank 0's.
    ``data_order``: the data order's state (``DataOrder.state_dict()``: the same on
    every rank, saved once as ``data_order``, [position, seed, n_rows]), or a
    random-window run's ``{"windows": [seq, tokens, checksum]}``, as ``data_windows``."""
    state = {
        "model": comm.state_dict(),
        "optim": comm.optimizer_state_dict(opt),
        "meta": {"step": torch.tensor(step)},
    }
    if data_order is not None and "windows" in data_order:
        state[WINDOWS] = torch.tensor(data_order["windows"], dtype=torch.int64)
    elif data_order is not None:
        state[DATA_ORDER] = torch.tensor([data_order[k] for k in DATA_ORDER_FIELDS], dtype=torch.int64)
        if "tokens" in data_order:
            state[DATA_TOKENS] = torch.tensor(data_order["tokens"], dtype=torch.int64)
        if "seq" in data_order:
            state[DATA_SEQ] = torch.tensor([data_order["seq"]], dtype=torch.int64)
    device, rank = comm.units[0].device, dist.get_rank()
    for kind, get in (("rng", torch.get_rng_state), ("cuda_rng", lambda: torch.cuda.get_rng_state(device))):
        if kind == "cuda_rng" and device.type != "cuda":
            continue
        key = f"{kind}/{rank}"
        if saved is not None and key not in saved:
            key = f"{kind}/0" if f"{kind}/0" in saved else None
        if key is not None:
            state[key] = get()
    return state


class Checkpointer:
    """Saves (synchronously or not) and commits checkpoints under ``OUT/checkpoints``."""

    def __init__(
        self, out: str, async_save: bool = False, pinned: bool = False, keep: int = 0, flags: dict | None = None
    ) -> None:
        self.out = out
        self.async_save = async_save
        self.keep = keep
        """Complete checkpoints kept: older ones go once a newer one is committed (0: all)."""
        self.flags = flags
        """The run's flags, written into each checkpoint (``FLAGS``): what ``--resume`` takes."""
        self._group = dist.new_group(backend="gloo") if async_save else None  # collective: every rank
        # staged in the caller (so the state written is the one at the call), pinned on CUDA
        options = StagingOptions(pinned, False, False, False)
        self._stager = DefaultStager(options) if async_save else None
        self._pending: tuple[Future, str] | None = None
        self._comm: ISPCommunicator | None = None
        """The communicator of the last save: the commit's checksum gather goes through it
        (recorded, under its deadline) while it is open."""
        error = None
        if dist.get_rank() == 0:
            try:
                os.makedirs(checkpoints_folder(out), exist_ok=True)
                for name in os.listdir(checkpoints_folder(out)):  # a killed run's unfinished writes
                    if name.endswith(PARTIAL):
                        shutil.rmtree(os.path.join(checkpoints_folder(out), name), ignore_errors=True)
            except OSError as exc:
                error = f"cannot create the checkpoint folder {checkpoints_folder(out)}: {root_cause(exc)}"
        _agree(error)

    def save(
        self, step: int, comm: ISPCommunicator, opt: torch.optim.Optimizer, data_order: dict | None = None
    ) -> None:
        """Write step ``step`` (and the data order's state, when given); with
        ``async_save`` return once the state is staged."""
        self.wait()  # the previous save first: one in flight at a time
        self._comm = comm
        path = _step_dir(self.out, step) + PARTIAL
        state = _state(comm, opt, step, data_order=data_order)
        if self.async_save:
            future = dcp.async_save(state, checkpoint_id=path, process_group=self._group, async_stager=self._stager)
            self._pending = (future, path)
            return
        try:
            dcp.save(state, checkpoint_id=path)
        except (Exception, CheckpointException) as exc:  # DCP raises every rank's failure on every rank
            self._failed(path, exc)
        self._commit(path)

    def close(self, failed: bool = False) -> None:
        """Wait for a save in flight and commit it, then free the stager's copies.

        ``failed``: the run ends on a lost or stalled peer. The save in flight is then
        left as it is, its ``.partial`` folder never resumed from (the next run removes
        it): its commit is a collective that peer never joins, whose error replaced the
        run's one line with a traceback (``--async-save``, a rank killed)."""
        if failed and self._pending is not None:
            self._pending = None
            return  # its thread may still use the group and the stager: they end with the process
        self.wait()
        if self._stager is not None:
            self._stager.close()
            self._stager = None
        if self._group is not None:  # its threads end with the job, not in the interpreter's teardown
            dist.destroy_process_group(self._group)
            self._group = None

    def wait(self) -> None:
        """Wait for an asynchronous save in flight, then commit it."""
        if self._pending is not None:
            future, path = self._pending
            self._pending = None
            try:
                future.result()
            except (Exception, CheckpointException) as exc:
                self._failed(path, exc)
            self._commit(path)

    def _failed(self, path: str, exc: BaseException) -> None:
        """Remove the partial checkpoint and raise, on every rank, one line naming the
        path, the cause and the checkpoint ``--resume`` would still use."""
        cause = root_cause(exc, folder=path)  # before the removal frees the space
        if dist.get_rank() == 0:  # DCP raised the same failure on every rank: no agreement needed
            shutil.rmtree(path, ignore_errors=True)
        final = path[: -len(PARTIAL)]
        raise CheckpointError(f"saving checkpoint {final} failed: {cause}; {self._kept()}") from exc

    def _kept(self) -> str:
        good = latest(self.out)
        return f"the last complete checkpoint is {good}" if good else "there is no complete checkpoint"

    def _commit(self, path: str) -> None:
        rank = dist.get_rank()
        if rank == 1 and os.environ.get(KILL_AT_COMMIT_ENV) == path[: -len(PARTIAL)].rsplit("_", 1)[-1].lstrip("0"):
            os.kill(os.getpid(), signal.SIGKILL)
        final = path[: -len(PARTIAL)]
        failed = f"saving checkpoint {final} failed"
        try:
            mine, error = {n: _crc(os.path.join(path, n)) for n in os.listdir(path) if n.startswith(f"__{rank}_")}, None
        except OSError as exc:
            mine, error = {}, f"{failed}: {root_cause(exc)}"
        _agree(error, remove=path)
        comm = self._comm
        if comm is not None and not comm.closed:
            every = comm.all_gather_object(mine, what=f"the checksums of {final}")
        else:
            every = [None] * dist.get_world_size()
            dist.all_gather_object(every, mine)
        if rank == 0:
            try:
                sums = {k: v for d in every for k, v in (d or {}).items()}
                sums[".metadata"] = _crc(os.path.join(path, ".metadata"))
                with open(os.path.join(path, CHECKSUMS), "w") as f:
                    json.dump(sums, f, indent=0, sort_keys=True)
                if self.flags is not None:
                    with open(os.path.join(path, FLAGS), "w") as f:
                        json.dump(self.flags, f, indent=1)
                if os.path.exists(final):  # the same step saved again (e.g. after a resume)
                    shutil.rmtree(final)
                os.replace(path, final)
                tmp = os.path.join(checkpoints_folder(self.out), LATEST + ".tmp")
                with open(tmp, "w") as f:
                    f.write(os.path.basename(final))
                os.replace(tmp, os.path.join(checkpoints_folder(self.out), LATEST))
            except OSError as exc:
                shutil.rmtree(path, ignore_errors=True)
                error = f"{failed}: {root_cause(exc)}; {self._kept()}"
        _agree(error)
        if rank == 0:  # after the others go on: removing old checkpoints is no part of this save
            self._prune(os.path.basename(final))

    def _prune(self, committed: str) -> None:
        """Rank 0, once ``committed`` is complete and ``latest`` names it: remove the
        complete checkpoints beyond the newest ``keep`` (never ``committed``); a removal
        that fails leaves the folder for the next one to try."""
        if not self.keep:
            return
        root = checkpoints_folder(self.out)
        try:
            done = complete_steps(root)
        except OSError:
            return
        for name in done[: -self.keep]:
            if name != committed:
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def latest(out: str) -> str | None:
    """The run folder ``out``'s newest committed checkpoint (:func:`newest`)."""
    return newest(checkpoints_folder(out))


def newest(root: str) -> str | None:
    """The newest committed checkpoint of a checkpoints folder: the one ``latest`` names
    when it is complete, else the highest complete ``step_N``; ``.partial`` folders
    never count; none when ``root`` is not a folder (a file in its place)."""
    try:
        with open(os.path.join(root, LATEST)) as f:
            name = f.read().strip()
        if name and os.path.isfile(os.path.join(root, name, ".metadata")):
            return os.path.join(root, name)
    except OSError:  # no ``latest`` (or unreadable, or not a file): the steps decide
        pass
    done = complete_steps(root)
    return os.path.join(root, done[-1]) if done else None


def verify(path: str) -> None:
    """Check every file of ``path`` against ``checksums.json`` (each rank reads a
    share); a ``CheckpointError`` on every rank names the first bad file."""
    bad = first_bad_file(path, dist.get_rank(), dist.get_world_size())
    _agree(f"checkpoint {path}: {bad}{way_on(path)}" if bad else None)


def way_on(path: str) -> str:
    """What to do about a bad checkpoint ``path``: the newest complete one before it, if
    any (not checked here), and how a resume or an export comes to take it."""
    root, name = os.path.split(os.path.abspath(path))
    done = complete_steps(root)
    earlier = done[: done.index(name)] if name in done else []
    if not earlier:
        return " (no earlier checkpoint)"
    return (
        f"; the newest before it is {earlier[-1]} (not checked): move {name} out of {root} and a resume or an "
        "export of the run takes that one"
    )


def first_bad_file(path: str, rank: int = 0, world: int = 1) -> str | None:
    """What is wrong with the first file of ``path`` (of this rank's share of them)
    that ``checksums.json`` does not match, or ``None``; read by one process, isp-export."""
    try:
        with open(os.path.join(path, CHECKSUMS)) as f:
            sums = json.load(f)
    except (OSError, ValueError) as exc:
        return f"{os.path.join(path, CHECKSUMS)} is unreadable ({exc})"
    for name in sorted(sums)[rank::world]:
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            return f"{file} is missing"
        if _crc(file) != sums[name]:
            return f"{file} is corrupted or truncated (checksum mismatch)"
    return None


def load(path: str, comm: ISPCommunicator, opt: torch.optim.Optimizer, data_order: dict | None = None) -> int:
    """Load ``path`` into the wrapped model and ``opt`` (any WP size); returns its step.
    ``data_order``: a dict filled with the saved data order's state when the
    checkpoint has one (left empty otherwise)."""
    verify(path)
    saved = set(dcp.FileSystemReader(path).read_metadata().state_dict_metadata)
    wanted = {k: 0 for k in DATA_ORDER_FIELDS} if data_order is not None and DATA_ORDER in saved else None
    if data_order is not None and WINDOWS in saved:
        wanted = {"windows": [0] * 3}
    elif wanted is not None:
        wanted |= {"tokens": [0, 0]} if DATA_TOKENS in saved else {}
        wanted |= {"seq": 0} if DATA_SEQ in saved else {}
    state = _state(comm, opt, 0, saved, wanted)
    try:
        dcp.load(state, checkpoint_id=path)
    except (Exception, CheckpointException) as exc:  # DCP wraps every rank's failure (a BaseException)
        raise CheckpointError(f"checkpoint {path} cannot be loaded: {root_cause(exc)}") from exc
    comm.load_state_dict(state["model"])
    comm.load_optimizer_state_dict(opt, state["optim"])
    if wanted is not None and data_order is not None:
        if WINDOWS in state:
            data_order["windows"] = state[WINDOWS].tolist()
        else:
            data_order.update(zip(DATA_ORDER_FIELDS, state[DATA_ORDER].tolist()))
            if DATA_TOKENS in state:
                data_order["tokens"] = state[DATA_TOKENS].tolist()
            if DATA_SEQ in state:
                data_order["seq"] = int(state[DATA_SEQ][0])
    for key, value in state.items():
        if key.startswith("rng/"):
            torch.set_rng_state(value)
        elif key.startswith("cuda_rng/"):
            torch.cuda.set_rng_state(value, comm.units[0].device)
    return int(state["meta"]["step"])
