"""Run a function on several CPU ranks (gloo) from pytest or a script, with a deadline.

Each rank is a spawned process with one intra-op thread; the function's return
values come back in rank order, and any rank's exception fails the caller with that
rank's traceback. Past ``timeout_s`` every rank is killed and the test fails.
:func:`run_main` runs a command line's main the same way, on ranks that meet as
torchrun's workers do, and returns what a launcher's process would have.
"""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import pickle
import queue
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

START_ENV = "ISP_COMM_RANKS_START"
"""How :func:`run_ranks` starts its processes when the caller does not say:
``spawn`` (the default) or ``forkserver`` (the test suite's, see [Note: how ranks start])."""
START_METHODS = ("spawn", "forkserver")
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "isp_comm.communicator", "isp_comm.memory_forecast"]
"""What a forkserver imports once, before it forks the ranks: the modules every rank
loads. ``isp_comm`` alone is not enough, its names loading on first use; nor is torch
alone, dynamo loading with the first meta tensor or optimizer step (a second or two a
rank, each on its own, without it)."""


def _entry(
    fn: Callable[..., Any],
    rank: int,
    world: int,
    store_path: str,
    results: Any,
    args: tuple,
    backend: str,
    gpu: int,
    released: Any,
    env: dict[str, str] | None = None,
) -> None:
    import torch
    import torch.distributed as dist

    if env is not None:  # a forked rank: the caller's environment now, not the server's
        os.environ.clear()
        os.environ.update(env)
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    # a rank killed by a signal (a crash in native code) leaves every thread's Python
    # stack in a file that run_ranks puts in its error: a forked rank's stderr is the
    # forkserver's, which may be an earlier test's captured output, long gone
    try:
        fault_file = open(_fault_path(store_path, rank), "w")  # noqa: SIM115 - open for the process's life
        faulthandler.enable(fault_file, all_threads=True)
        store = dist.FileStore(store_path, world)
        kw = {"device_id": torch.device("cuda", rank if gpu < 0 else gpu)} if backend == "nccl" else {}
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, **kw)
        _all_joined(store, world)
        out = fn(rank, world, *args)
        # bytes, not tensors: torch would share tensors through /dev/shm and file
        # descriptors that die with this process
        results.put((rank, "ok", pickle.dumps(out)))
        released.wait(RELEASE_S)  # [Note: leaving together]
    except BaseException:  # noqa: BLE001 - the traceback is the point
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


# [Note: leaving together]
# A rank that has returned its result leaves (destroy_process_group closes its gloo
# connections) only once run_ranks has every rank's result, or its first error, or
# RELEASE_S has passed. ``new_group``'s connectFullMesh can return on one rank before
# a peer has finished connecting to it; a rank whose function then returned at once
# tore the group down under that peer, whose new_group failed with "Connection closed
# by peer" (a group made and not used, at world 2, on the CI tier under load,
# 2026-12-01). The wait is an Event's: no polling.
RELEASE_S = 30.0
"""How long a rank that has returned its result waits for its peers' before it leaves
anyway ([Note: leaving together])."""


def _all_joined(store: Any, world: int, timeout_s: float = 60.0) -> None:
    """Return once every rank's ``init_process_group`` has returned. Without it a rank
    whose function returns at once could close its gloo connections while a peer was
    still connecting to it: the peer's init then fails with "Connection closed by
    peer" (seen once on CI with forked ranks, which start within a millisecond of each
    other). Through the store, not a collective, so that it asks nothing of a device."""
    joined = store.add("isp_comm.testing.joined", 1)
    deadline = time.monotonic() + timeout_s
    while joined < world:
        if time.monotonic() > deadline:
            raise TimeoutError(f"run_ranks: {joined} of {world} ranks joined the process group within {timeout_s}s")
        time.sleep(0.005)
        joined = store.add("isp_comm.testing.joined", 0)


def _fault_path(store_path: str, rank: int) -> str:
    """Where rank ``rank``'s faulthandler writes (beside the store, in run_ranks' folder)."""
    return os.path.join(os.path.dirname(store_path), f"rank{rank}.fault")


def _exits(procs: list[Any], ranks: list[int], store_path: str) -> str:
    """How ``ranks`` ended: exit codes, or the signal that killed a rank and the Python
    stacks its threads were in then (faulthandler's, see :func:`_entry`)."""
    said = []
    for r in ranks:
        code = procs[r].exitcode
        if code >= 0:
            said.append(f"rank {r}: exit code {code}")
            continue
        try:
            with open(_fault_path(store_path, r)) as f:
                stacks = f.read().strip()
        except OSError:
            stacks = ""
        try:
            name = signal.Signals(-code).name
        except ValueError:  # a real-time signal has no name
            name = f"signal {-code}"
        said.append(f"rank {r}: killed by {name}" + (f"\n{stacks}" if stacks else ""))
    return "; ".join(said)


def free_port() -> int:
    """A TCP port free on this host now, for a launcher's rendezvous (never a fixed
    one: two jobs on one host would meet each other)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _context(start: str | None) -> tuple[Any, dict[str, str] | None]:
    """The multiprocessing context that starts the ranks, and the environment a forked
    rank takes on (``None`` for spawn, whose ranks inherit it).

    [Note: how ranks start]
    A spawned rank is a new interpreter that imports torch: 1.5-2 s of CPU a rank, 6 s
    for four ranks on two cores, more than most tests' work. A forkserver imports torch
    once (:data:`PRELOAD`) and forks every rank from it: 0.1 s for four. The suite runs
    that way (tests/conftest.py). A forked rank gets the caller's environment as it is
    now, but what a process reads only when it starts (glibc's ``MALLOC_*``, torch's
    import-time settings) and its memory at start are the server's: a caller that
    measures a fresh process's memory, or sets such a variable, says ``start="spawn"``,
    as the planner's calibration and the benchmarks do."""
    start = start or os.environ.get(START_ENV) or "spawn"
    if start not in START_METHODS:
        raise ValueError(f"run_ranks: start {start!r} is not one of {START_METHODS} (from ${START_ENV}?)")
    ctx = mp.get_context(start)
    if start == "spawn":
        return ctx, None
    ctx.set_forkserver_preload(PRELOAD)
    return ctx, dict(os.environ)


def run_ranks(
    fn: Callable[..., Any],
    world: int,
    *args: Any,
    timeout_s: float = 120.0,
    may_die: frozenset[int] = frozenset(),
    backend: str = "gloo",
    gpu: int = -1,
    start: str | None = None,
) -> list[Any]:
    """``fn(rank, world, *args)`` on ``world`` processes; returns the per-rank results.

    Ranks in ``may_die`` are allowed to exit without a result (fault-injection tests);
    their result is their exit code. ``backend="nccl"``: rank r on GPU r, or every
    rank on GPU ``gpu`` when it is given (NCCL 2.30+ with NCCL_MULTI_RANK_GPU_ENABLE=1).
    ``start``: ``"spawn"`` or ``"forkserver"``; by default ``$ISP_COMM_RANKS_START``,
    else spawn (see :func:`_context`)."""
    ctx, env = _context(start)
    results, released = ctx.Queue(), ctx.Event()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [
            ctx.Process(target=_entry, args=(fn, r, world, store, results, args, backend, gpu, released, env))
            for r in range(world)
        ]
        for p in procs:
            p.start()
        out: dict[int, Any] = {}
        errors: list[str] = []
        deadline = time.monotonic() + timeout_s
        try:
            while len(out) + len(errors) < world:
                for r in may_die:
                    if r not in out and procs[r].exitcode not in (None, 0):
                        out[r] = procs[r].exitcode
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = sorted(set(range(world)) - set(out))
                    raise TimeoutError(f"ranks {missing} did not finish within {timeout_s}s")
                try:
                    rank, status, value = results.get(timeout=min(left, 1.0))
                except queue.Empty:
                    dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in out]
                    dead = [r for r in dead if r not in may_die]
                    if dead and errors == []:
                        # give the others a moment to report, then fail
                        time.sleep(1.0)
                        if results.empty():
                            raise RuntimeError(f"ranks {dead} died ({_exits(procs, dead, store)})") from None
                    continue
                if status == "ok":
                    out[rank] = pickle.loads(value)
                else:
                    errors.append(f"--- rank {rank} ---\n{value}")
                    break
        finally:
            released.set()
            for p in procs:
                p.join(timeout=5 if not errors else 0.5)
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join()
        if errors:
            raise AssertionError("a rank failed:\n" + "\n".join(errors))
        return [out[r] for r in range(world)]


# ---- a command line's main as a launcher's workers ----
def _main_entry(
    main: Callable[[list[str]], Any], argv: list[str], env: dict[str, str], cwd: str | None, out: str, err: str
) -> None:
    """A worker of :func:`run_main`: ``main(argv)`` in ``cwd`` (if given), its stdout
    and stderr appended to the files ``out`` and ``err``, ended as an interpreter ends
    (threads joined, then exit callbacks) with the exit code it would have had."""
    import atexit
    import threading

    os.environ.clear()  # a forked worker: the caller's environment now, not the server's
    os.environ.update(env)
    if cwd is not None:
        os.chdir(cwd)
    for fd, path in ((1, out), (2, err)):
        opened = os.open(path, os.O_WRONLY | os.O_APPEND)
        os.dup2(opened, fd)
        os.close(opened)
    sys.argv = [getattr(main, "__module__", "main"), *argv]
    try:
        code: Any = main(list(argv))  # a console script's sys.exit(main())
    except SystemExit as exc:
        code = exc.code
    except BaseException:  # noqa: BLE001 - printed as the interpreter prints it
        sys.excepthook(*sys.exc_info())
        code = 1
    if code is not None and not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    # as Py_FinalizeEx: non-daemon threads joined, then the exit callbacks (weakref
    # finalizers among them); not the module teardown, which :func:`run_main` says
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)


def agent_env(world: int, port: int) -> dict[str, str]:
    """What torchrun's agent gives each of ``world`` workers but its rank: the
    rendezvous on a store the agent hosts at ``port`` on this host (every worker joins
    it as a client, so no worker's exit ends it), the first attempt. Add ``RANK`` and
    ``LOCAL_RANK`` per worker."""
    env = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    env.update(TORCHELASTIC_USE_AGENT_STORE="True", TORCHELASTIC_RESTART_COUNT="0", TORCHELASTIC_MAX_RESTARTS="0")
    return env


def _wait_as_a_launcher(procs: list[Any], timeout_s: float) -> tuple[bool, int]:
    """Wait for ``procs`` as torchrun's agent does: once one exits non-zero the others
    get SIGTERM, then SIGKILL after the agent's shutdown timeout
    (``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``, 30 s). Returns whether the deadline passed
    with a worker running and no worker failed, and the first failure's exit code (0
    if none)."""
    from multiprocessing.connection import wait

    deadline = time.monotonic() + timeout_s
    running = {p.sentinel: p for p in procs}
    code = 0
    try:
        while running and (left := deadline - time.monotonic()) > 0:
            for sentinel in wait(list(running), timeout=left):
                p = running.pop(sentinel)
                p.join()
                if p.exitcode != 0 and code == 0:
                    code = p.exitcode
                    for other in running.values():
                        other.terminate()
                    grace = float(os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", 30))
                    deadline = min(deadline, time.monotonic() + grace)
    finally:
        for p in running.values():
            p.kill()
            p.join()
    return bool(running) and code == 0, code


def run_main(
    main: Callable[[list[str]], Any],
    argv: list[str],
    *,
    world: int = 1,
    env: dict[str, str] | None = None,
    cwd: str | None = None,
    timeout_s: float = 120.0,
    start: str | None = None,
) -> subprocess.CompletedProcess:
    """``main(argv)`` (a command line's entry point, such as ``isp_comm.train.main``,
    which exits or returns its exit code) on ``world`` processes that meet as
    torchrun's workers do: ``RANK``, ``WORLD_SIZE``,
    ``MASTER_ADDR``/``MASTER_PORT`` of a store this process hosts, as torchrun's agent
    hosts it. Returns what ``subprocess.run(..., capture_output=True, text=True)``
    returns for a launcher: every worker's stdout and stderr, interleaved, and the exit
    code of the first worker that failed (torchrun says 1), else 0. Past ``timeout_s``
    every worker is killed and ``subprocess.TimeoutExpired`` raised.

    Forked from the server of :func:`run_ranks` (``start``), a worker starts in
    milliseconds, not the seconds of an interpreter that imports torch (and what a
    process reads only when it starts is the server's: [Note: how ranks start]). It
    ends as an interpreter does, threads joined and exit callbacks run, but without
    the interpreter's teardown: what tests that teardown runs a real launcher."""
    import torch.distributed as dist

    ctx, _ = _context(start)
    base = dict(os.environ if env is None else env)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False) if world > 1 else None
    if store is not None:
        base.update(agent_env(world, store.port))
    with tempfile.TemporaryDirectory() as tmp:
        out, err = os.path.join(tmp, "out"), os.path.join(tmp, "err")
        for path in (out, err):
            open(path, "w").close()
        procs = []
        for r in range(world):
            rank_env = {**base, "RANK": str(r), "LOCAL_RANK": str(r)} if store is not None else base
            procs.append(ctx.Process(target=_main_entry, args=(main, argv, rank_env, cwd, out, err)))
            procs[-1].start()
        late, code = _wait_as_a_launcher(procs, timeout_s)
        with open(out) as f_out, open(err) as f_err:
            stdout, stderr = f_out.read(), f_err.read()
    del store
    cmd = [getattr(main, "__module__", "main"), *argv]
    if late:
        raise subprocess.TimeoutExpired(cmd, timeout_s, output=stdout, stderr=stderr)
    return subprocess.CompletedProcess(cmd, code, stdout, stderr)


# ---- what a step asks of the host (CPU proxies for CUDA synchronisation) ----
class HostReads(torch.overrides.TorchFunctionMode):
    """Use as a context manager: ``calls`` lists the Python calls that read a tensor's
    values to the host (on CUDA each one waits for the GPU), ``copies`` the tensors
    made from Python data on a given device (on CUDA a blocking host-to-device copy);
    ``within``: only those called from files under this folder. A proxy that CPU ranks
    can run: a read inside a C++ op is not seen (tests/gpu runs a step under
    ``set_sync_debug_mode("error")`` for that)."""

    NAMES = frozenset({"tolist", "item", "__bool__", "__int__", "__float__", "__index__"})
    COPIES = frozenset({"tensor", "as_tensor"})

    def __init__(self, within: str | None = None) -> None:
        super().__init__()
        self.within = within
        self.calls: list[str] = []
        self.copies: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if self.within is not None and not sys._getframe(1).f_code.co_filename.startswith(self.within):
            pass  # called from outside the code under test (torch.optim's CPU step counters, say)
        elif name in self.NAMES:
            self.calls.append(name)
        elif name in self.COPIES and (kwargs or {}).get("device") is not None:
            self.copies.append(name)
        return func(*args, **(kwargs or {}))


# ---- tiny Hugging Face folders (tests, the README's worked example; nothing downloaded) ----
def tiny_hf_config(model_type: str = "llama", vocab_size: int = 300, tied: bool = False, **overrides: Any) -> Any:
    """A transformers config of ``model_type`` small enough for CPU tests: 2 blocks,
    width 48, 6 query and 2 key/value heads (qwen3: head_dim 8). Any type
    ``AutoConfig.for_model`` knows is taken; the tests build llama, mistral, qwen2,
    qwen3 and the other families of ``sequence_parallel.hf.SUPPORTED_MODEL_TYPES`` with
    it. The family's other defaults stay, for ``overrides`` to shrink (as
    ``tests/test_train.py``'s ``FOLDER_FAMILIES`` does): Gemma 2 and 3's head_dim of
    256, GPT-OSS's of 64 and its 128 experts, Qwen3-MoE's 128 (OLMoE's 64), and Phi-3's
    and GLM's ``pad_token_id`` past a small vocabulary (their model does not build
    without ``pad_token_id=0``)."""
    from transformers import AutoConfig

    kw: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=48,
        intermediate_size=100,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=tied,
    )
    if model_type == "qwen3":
        kw["head_dim"] = 8
    kw.update(overrides)
    return AutoConfig.for_model(model_type, **kw)


def tiny_tokenizer(folder: str, text: str, vocab_size: int = 300) -> Any:
    """Train a byte-level BPE tokenizer of at most ``vocab_size`` tokens on ``text``
    (with the ``tokenizers`` package) and save it in ``folder`` for AutoTokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator([text], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    fast.save_pretrained(folder)
    return fast


def _virtual_entry(fn: Callable[..., Any], world: int, rank: int, results: Any, args: tuple) -> None:
    import torch
    import torch.distributed as dist

    from isp_comm.virtual import init_virtual_world

    torch.set_num_threads(1)
    try:
        init_virtual_world(world, rank)
        results.put(("ok", pickle.dumps(fn(rank, world, *args))))
    except BaseException:  # noqa: BLE001 - the traceback is the point
        results.put(("error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_virtual(fn: Callable[..., Any], world: int, rank: int, *args: Any, timeout_s: float = 120.0) -> Any:
    """``fn(rank, world, *args)`` in one process of its own, as ``rank`` of a virtual
    world of ``world`` ranks (:func:`isp_comm.virtual.init_virtual_world`); its result,
    or an ``AssertionError`` with its traceback, or a ``TimeoutError`` (the process is
    killed) past ``timeout_s``."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    proc = ctx.Process(target=_virtual_entry, args=(fn, world, rank, results, args))
    proc.start()
    try:
        status, value = results.get(timeout=timeout_s)
    except queue.Empty:
        raise TimeoutError(f"virtual rank {rank} of {world} did not finish within {timeout_s}s") from None
    finally:
        proc.join(timeout=5)
        if proc.is_alive():
            proc.kill()
            proc.join()
    if status != "ok":
        raise AssertionError(f"virtual rank {rank} of {world} failed:\n{value}")
    return pickle.loads(value)
