"""``torchrun --nproc-per-node N -m isp_comm.train``: train the reference llama, or a
transformers model (``--model DIR``), with ISP.

Writes ``OUT/metrics.jsonl`` (one object per optimizer step), ``OUT/trace.json`` and
``OUT/timeline.png`` (the last steps' compute and communication per rank),
``OUT/run.json`` (the flags and rank 0's parameter shard shapes), DCP checkpoints
under ``OUT/checkpoints`` and, with ``--model``, ``OUT/hf_model`` (the model's
config.json and the tokenizer, for ``isp-export --hf``), and with ``--report-to``
``OUT/tensorboard/`` and ``OUT/wandb/``; ``--resume`` continues from the latest one.

The modules, from the bottom: the data chain (data, store, packing, sources,
batching, evaluate), the model and its ISP config (model), the warnings before the
first step (preflight), the trackers of ``--report-to`` (reporting/), the job and its
setup (job), what a run writes (outputs), the loop (loop), signals (signals), and
``--plan`` (plan). This file only starts the ranks and ends the process.
"""

from __future__ import annotations

if __name__ == "__main__":  # python -m isp_comm.train: signals set before torch's import (seconds)
    from isp_comm.processes import leave_on_signals
    from isp_comm.train.survive import restart_refused, said_before_handlers

    # until the run's own handlers (launch.Stopping, signals.Signals); one line says why it stops
    leave_on_signals(said=said_before_handlers())
    restart_refused()  # before torch's import: [Note: no restart for a mistake]

import contextlib
import dataclasses
import datetime
import faulthandler
import gc
import os
import re
import sys
from typing import NoReturn

import torch
import torch.distributed as dist

from isp_comm.errors import ISPCommTimeout
from isp_comm.processes import die_with_parent, die_with_parent_if_asked, leave_on_signals
from isp_comm.train.config import TrainConfig, check_layout, fail, job_world, parse_config, resolve_device
from isp_comm.train.launch import launch, worker_argv
from isp_comm.train.reporting.names import check_imports, parse_report_to
from isp_comm.train.survive import stopped_before_ranks


def dist_backend(device: torch.device) -> str:
    """NCCL for one process per GPU; gloo on CPU, and when several local ranks share a
    GPU (NCCL refuses that: "Duplicate GPU detected"; gloo carries CUDA tensors)."""
    if device.type != "cuda":
        return "gloo"
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if local_world > torch.cuda.device_count():
        if os.environ.get("LOCAL_RANK", "0") == "0":
            print(f"isp-train: {local_world} ranks share {torch.cuda.device_count()} GPU(s): gloo, not NCCL")
        return "gloo"
    return "nccl"


def main(argv: list[str] | None = None) -> NoReturn:
    """Run the job and end the process: exit code 0, or 2 after one line."""
    die_with_parent_if_asked()  # a calibration's run or plan: not past the calibration
    cfg = parse_config(argv)  # exits 2 with one line on a bad flag
    if cfg.plan:  # no process group, no launch: the forecast for the world the flags describe
        from isp_comm.train.plan import plan

        world = int(os.environ.get("WORLD_SIZE", 0)) or (cfg.nproc_per_node or 1) * cfg.nnodes
        try:
            plan(cfg, world)
        except ValueError as exc:
            fail(str(exc), every_rank=True)
        sys.exit(0)
    launching = bool(cfg.nproc_per_node) and "LOCAL_RANK" not in os.environ
    if launching:  # a count from --config too: until launch.Stopping, a signal's line says no rank started
        leave_on_signals(said=stopped_before_ranks)
    started = int(os.environ.get("LOCAL_WORLD_SIZE", 0))  # a launcher's ranks a machine (ours, or torchrun's)
    given = any(a.split("=")[0] == "--nproc-per-node" for a in (sys.argv[1:] if argv is None else argv))
    # on the command line only: isp-train's launcher takes the flag off its ranks' lines, but
    # not out of a --config file, whose count it already started
    if given and "LOCAL_RANK" in os.environ and started and started != cfg.nproc_per_node:
        fail(  # torchrun ... -m isp_comm.train --nproc-per-node 4 once ran at torchrun's world, without a word
            f"--nproc-per-node {cfg.nproc_per_node}: this rank was started by a launcher of {started} ranks a "
            "machine (torchrun's --nproc-per-node): give the count to the one launcher"
        )
    try:  # before any rank starts: one line, exit 2
        check_layout(cfg, job_world(cfg))
        if launching or "LOCAL_RANK" not in os.environ:  # a launcher, or a process alone: no rank has started
            check_imports(parse_report_to(cfg.report_to))
    except ValueError as exc:
        fail(str(exc))
    if launching:  # launch the ranks ourselves
        args = worker_argv(sys.argv[1:] if argv is None else argv)
        sys.exit(launch(cfg.nproc_per_node, cfg.nnodes, cfg.rdzv_endpoint, args, cfg.max_restarts))
    rank_main(cfg)


def rank_main(cfg: TrainConfig) -> NoReturn:
    """One rank's run, and the end of its process. Its modules are imported here, not by
    the launcher, which would spend seconds loading them before any rank starts."""
    from isp_comm.train import virtual
    from isp_comm.train.hang import hang_exit
    from isp_comm.train.loop import run
    from isp_comm.train.memory.oom import OutOfMemory
    from isp_comm.train.run_folder import Finished
    from isp_comm.train.signals import Interrupted, Stopped

    if "LOCAL_RANK" in os.environ:  # a launched rank dies with its launcher
        die_with_parent()
    # a crash in native code (a segfault, an abort) prints where every thread was
    # first, where the launcher could otherwise say only the signal's name
    faulthandler.enable(all_threads=True)
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if restart > 0:
        if os.environ.get("RANK", "0") == "0":  # said once, before the resume line
            of = os.environ.get("TORCHELASTIC_MAX_RESTARTS", "?")
            print(
                f"isp-train: restart {restart} of {of}: a rank of the last attempt failed (its line is above; "
                f"isp-comm doctor {cfg.out} shows a hang's diagnosis); the ranks go on from the latest checkpoint, "
                "or from the start without one",
                flush=True,
            )
        if not cfg.resume:
            cfg = dataclasses.replace(cfg, resume="auto")  # a restarted rank continues the run
    torch.set_num_threads(1)
    device = resolve_device(cfg)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if cfg.virtual_world:
        virtual.start(cfg)
    if not dist.is_initialized():
        form_process_group(cfg, device)
    try:
        with contextlib.ExitStack() as closing:
            run(cfg, device, closing)
    except ValueError as exc:  # one before the first step has said no_restart() in run()
        dist.destroy_process_group()
        fail(str(exc), restart=True)
    except ISPCommTimeout as exc:
        hang_exit(exc, cfg.out)
    except OutOfMemory as exc:  # said by the rank it happened on, each such rank
        print(f"isp-train: error: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)
    except (Finished, Interrupted, Stopped) as exc:  # one line, from rank 0
        if dist.get_rank() == 0:
            print(f"isp-train: {exc}", file=sys.stderr, flush=True)
        dist.destroy_process_group()
        sys.exit(0 if isinstance(exc, Finished) else 128 + exc.signum)
    gc.collect()  # process groups held in reference cycles go while torch is whole
    dist.destroy_process_group()
    sys.exit(0)


def form_process_group(cfg: TrainConfig, device: torch.device) -> None:
    """Join the job's process group. A rank that never joins (stopped or stuck while it
    starts) made every other rank end, at the timeout, in torch's 20-line traceback
    and the launcher in silence; each waiting rank now ends with one line naming the
    rank it waited for (:func:`not_joined`), exit code 1, which a restart may mend."""
    from isp_comm.train import survive

    if "RANK" not in os.environ:
        port = str(survive.free_port())
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    store = survive.restart_store()  # None but in a restarted rank: torch's env:// rendezvous
    # what waits outside the communicator (a checkpoint's gathers, making groups) ends
    # as a hang does, not after torch's 30 minutes; a minute later than the
    # communicator's deadline, so that a hang inside it is diagnosed first
    timeout = datetime.timedelta(seconds=cfg.comm_timeout + 60)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    try:
        if store is None:
            dist.init_process_group(dist_backend(device), timeout=timeout)
        else:
            dist.init_process_group(dist_backend(device), store=store, rank=rank, world_size=world, timeout=timeout)
    except dist.DistError as exc:
        print(f"isp-train: error: rank {rank}: {not_joined(exc, timeout.total_seconds())}", file=sys.stderr, flush=True)
        sys.exit(1)


def not_joined(exc: BaseException, timeout_s: float) -> str:
    """What a process group that did not form says: the rank waited for, from the key
    torch names (gloo's ``/default_pg/0//cpu//0/R`` holds rank R's address), the
    timeout and what to do."""
    lines = str(exc).strip().splitlines()
    said = lines[-1] if lines else type(exc).__name__
    found = re.search(r"keys: \S*/(\d+)\b", said)
    who = f"rank {found.group(1)} did not join" if found else "a rank did not join"
    return (
        f"the process group did not form within {timeout_s:.0f} s (--comm-timeout + 60 s): {who} (stopped, stuck "
        f"or still starting; its own line, if any, is above; a slow start needs a larger --comm-timeout); torch: {said}"
    )


if __name__ == "__main__":
    sys.exit(main())
