"""Measured memory, phase by phase, of a small ISP training on CPU (or CUDA) ranks:
what the forecast (isp_comm/memory_forecast/) is checked against, by tests/test_forecast.py
and bench/forecast.py.

Each rank measures each phase's peak above its baseline (taken after the process
groups and the meta model exist): the peak is reset (``/proc/self/clear_refs``)
before the phase and read (``VmHWM``) after it, at the second step, when the
gradient shards and the optimizer state exist. Pages of files (the code of torch's
kernels, faulted in as each runs for the first time: about 20 MiB over a first step)
are left out: the peak is ``VmHWM`` less ``RssFile`` at the phase's end, so what the
run allocates is compared. glibc is told to return every allocation of 64 KiB or
more to the system when freed (``MALLOC_MMAP_THRESHOLD_``), so that RSS follows what
is live rather than what the allocator keeps. The ranks use the torch backend (the
shared-memory backend's pages are the host's, forecast apart). On CUDA the peak is
``torch.cuda.max_memory_allocated``, reset per phase.
"""

from __future__ import annotations

import gc
import os
import tempfile
import threading
import time
from dataclasses import dataclass

from isp_comm.train.metrics import proc_status_bytes, reset_peak_rss

MMAP_THRESHOLD = "65536"


@dataclass(frozen=True)
class Point:
    """One grid point: a model, the run's sizes and knobs."""

    world: int = 2
    wp: int = 2
    sp: int = 1
    ckpt: float = 0.0
    shard_outer: bool = False
    vocab_parallel: bool = False
    bf16: bool = False
    state_sharding: str = "wp"
    release_reduce_buffers: bool | None = None
    memory_pool: bool = True
    optimizer: str = "adamw"
    model: str = "llama"  # or "qwen2" (transformers)
    batch: int = 4
    seq: int = 256
    hidden: int = 256
    layers: int = 4
    vocab: int = 4096
    heads: int = 8
    kv_heads: int = 2
    ffn: int = 0  # 0: hidden x 8 / 3

    def label(self) -> str:
        knobs = [f"w{self.world} wp{self.wp} sp{self.sp}", self.model, self.optimizer]
        knobs += [f"ckpt {self.ckpt:g}"] if self.ckpt else []
        knobs += ["shard-outer"] if self.shard_outer else []
        knobs += ["vocab-par"] if self.vocab_parallel else []
        knobs += ["bf16"] if self.bf16 else []
        knobs += [f"state over {self.state_sharding}"] if self.state_sharding != "wp" else []
        knobs += ["pairs released"] if self.release_reduce_buffers else []
        knobs += ["no pool"] if not self.memory_pool else []
        return ", ".join(knobs)


def build_model(pt: Point):
    """The point's model, on meta."""
    import torch

    with torch.device("meta"):
        if pt.model == "qwen2":
            from transformers import Qwen2Config, Qwen2ForCausalLM

            cfg = Qwen2Config(
                vocab_size=pt.vocab,
                hidden_size=pt.hidden,
                intermediate_size=pt.ffn or pt.hidden * 8 // 3,
                num_hidden_layers=pt.layers,
                num_attention_heads=pt.heads,
                num_key_value_heads=pt.kv_heads,
                tie_word_embeddings=False,
                attn_implementation="sdpa",
            )
            return Qwen2ForCausalLM(cfg)
        from isp_comm.models.llama import LlamaConfig, build

        return build(
            LlamaConfig(
                vocab_size=pt.vocab, hidden=pt.hidden, ffn_hidden=pt.ffn or pt.hidden * 8 // 3, n_layers=pt.layers,
                n_heads=pt.heads, n_kv_heads=pt.kv_heads, max_seq_len=max(pt.seq, 2048),
            )
        )  # fmt: skip


def isp_config(pt: Point):
    import torch

    from isp_comm import ISPConfig

    mp = {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32} if pt.bf16 else {}
    return ISPConfig(
        backend="torch",
        activation_checkpointing=pt.ckpt,
        shard_outer_params=pt.shard_outer,
        vocab_parallel=pt.vocab_parallel,
        state_sharding=pt.state_sharding,
        release_reduce_buffers=pt.release_reduce_buffers,
        memory_pool=pt.memory_pool,
        init_seed=0,
        **mp,
    )


def forecast_point(pt: Point, device: str = "cpu"):
    from isp_comm.memory_forecast import forecast

    return forecast(
        build_model(pt),
        isp_config(pt),
        world=pt.world,
        wp=pt.wp,
        sp=pt.sp,
        batch=pt.batch,
        seq=pt.seq,
        optimizer=pt.optimizer,  # type: ignore[arg-type]
        device=device,  # type: ignore[arg-type]
        evaluate=True,
    )


def _measure(rank: int, world: int, pt: Point, folder: str, device: str) -> dict:
    """Train ``pt`` for two steps and measure each phase's peak above the baseline."""
    import torch
    import torch.distributed.checkpoint as dcp

    from isp_comm import ISPCommunicator, ParallelGroups

    torch.set_num_threads(1)
    dev = torch.device(device)
    groups = ParallelGroups.create(wp_size=pt.wp, sp_size=pt.sp)
    model = build_model(pt)
    cuda = dev.type == "cuda"

    def reset() -> None:
        gc.collect()  # what earlier phases left in reference cycles (DCP's staged copies) is not this phase's
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        else:
            reset_peak_rss()

    def peak() -> int:
        if cuda:
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated()
        return proc_status_bytes("VmHWM") - proc_status_bytes("RssFile")  # see the module note

    base = torch.cuda.memory_allocated() if cuda else proc_status_bytes("VmRSS") - proc_status_bytes("RssFile")
    out: dict[str, float] = {}
    reset()
    comm = ISPCommunicator(model, groups, isp_config(pt))
    out["wrap"] = peak() - base
    params = [p for p in model.parameters() if p.requires_grad]
    if pt.optimizer == "adamw":
        opt = torch.optim.AdamW(params, lr=1e-4)
    else:
        opt = torch.optim.SGD(params, lr=1e-2, momentum=0.9 if pt.optimizer == "sgd_momentum" else 0.0)
    dp, per = world // pt.sp, pt.batch // (world // pt.sp)
    dp_rank, sp_rank = groups.rank // pt.sp, groups.sp_rank
    lo, hi = sp_rank * pt.seq // pt.sp, (sp_rank + 1) * pt.seq // pt.sp
    g = torch.Generator().manual_seed(dp_rank)
    positions = torch.arange(lo, hi, device=dev)
    hook = comm.scheduler_hook()
    for _ in (1, 2):
        x = torch.randint(0, pt.vocab, (per, pt.seq + 1), generator=g)[:, lo : hi + 1].to(dev)
        ids, labels = x[:, :-1], x[:, 1:]
        reset()
        hook.before_forward()
        if pt.model == "qwen2":
            logits = model(input_ids=ids, position_ids=positions[None], use_cache=False).logits
        else:
            logits = model(ids, position_ids=positions)
        loss = comm.cross_entropy(logits, labels)
        out["forward"] = peak() - base
        reset()
        hook.before_backward()
        loss.backward()
        hook.after_backward()
        out["backward"] = peak() - base
        del logits, loss
        reset()
        comm.clip_grad_norm_(1.0)
        opt.step()
        out["optimizer"] = peak() - base
        opt.zero_grad()
    reset()  # a validation pass after the step, as isp-train's --eval-every runs it
    with torch.no_grad():
        if pt.model == "qwen2":
            logits = model(input_ids=ids, position_ids=positions[None], use_cache=False).logits
        else:
            logits = model(ids, position_ids=positions)
        comm.cross_entropy(logits, labels)
    out["evaluate"] = peak() - base
    del logits, dp
    state = {"model": comm.state_dict(), "optim": comm.optimizer_state_dict(opt)}
    reset()
    dcp.save(state, checkpoint_id=os.path.join(folder, "sync"))
    out["save"] = peak() - base
    reset()
    threads = threading.active_count()
    dcp.async_save(state, checkpoint_id=os.path.join(folder, "async")).result()
    out["async_save"] = peak() - base
    _join_save_worker(threads)
    reset()
    dcp.load(state, checkpoint_id=os.path.join(folder, "sync"))
    out["load"] = peak() - base
    comm.close()
    return {"rank": rank, "baseline": base, "measured": out}


def _join_save_worker(threads: int, deadline_s: float = 10.0) -> None:
    """Wait (at most ``deadline_s``) until no more threads are alive than ``threads``.

    [Note: the async save's worker] ``async_save(...).result()`` returns when the
    future is set, before the thread that wrote the checkpoint has let go of the
    staged copy of the state and exited: measured right after ``result()``, RSS held
    25.8 MiB more with that thread still alive, 2 MiB more 0.2 s later with it gone.
    On a busy machine the load's peak then held the copy (-16% against the forecast,
    in one of two full test runs)."""
    stop = time.monotonic() + deadline_s
    while threading.active_count() > threads and time.monotonic() < stop:
        time.sleep(0.01)


def measure(pt: Point, device: str = "cpu", timeout_s: float = 600.0) -> list[dict]:
    """Every rank's measured phase peaks (bytes above its baseline) for ``pt``."""
    from isp_comm.testing import run_ranks

    os.environ["MALLOC_MMAP_THRESHOLD_"] = MMAP_THRESHOLD  # read by each spawned rank's glibc
    with tempfile.TemporaryDirectory(prefix="isp-forecast-") as folder:
        return run_ranks(_measure, pt.world, pt, folder, device, timeout_s=timeout_s, start="spawn")


def breakdown_steps(model, comm, opt, pt: Point, rank_seed: int, steps: int = 2, device: str = "cpu"):
    """Train ``steps`` steps of ``pt``'s batch under a :class:`MemoryBreakdown` attached
    to ``comm`` and ``opt`` (the peaks from the second step on: the steady state the
    forecast describes); its result. The loop holds the logits until the backward ends
    and frees them before clipping and the step, as the forecast assumes."""
    import torch

    from isp_comm.memory_breakdown import MemoryBreakdown

    tracker = MemoryBreakdown()
    dp_rank, per = rank_seed, pt.batch // (pt.world // pt.sp)
    g = torch.Generator().manual_seed(dp_rank)
    sp_rank = comm.groups.sp_rank
    lo, hi = sp_rank * pt.seq // pt.sp, (sp_rank + 1) * pt.seq // pt.sp
    positions = torch.arange(lo, hi, device=device)
    with tracker:
        tracker.attach(comm, opt)
        for step in range(steps):
            if step == 1:
                tracker.reset_peaks()
            x = torch.randint(0, pt.vocab, (per, pt.seq + 1), generator=g)[:, lo : hi + 1].to(device)
            if pt.model == "qwen2":
                logits = model(input_ids=x[:, :-1], position_ids=positions[None], use_cache=False).logits
            else:
                logits = model(x[:, :-1], position_ids=positions)
            loss = comm.cross_entropy(logits, x[:, 1:])
            loss.backward()
            del logits, loss
            comm.clip_grad_norm_(1.0)
            opt.step()
            opt.zero_grad()
    return tracker.result()


def _breakdown_rank(rank: int, world: int, pt: Point) -> dict:
    import torch

    from isp_comm import ISPCommunicator, ParallelGroups

    torch.set_num_threads(1)
    groups = ParallelGroups.create(wp_size=pt.wp, sp_size=pt.sp)
    model = build_model(pt)
    comm = ISPCommunicator(model, groups, isp_config(pt))
    params = [p for p in model.parameters() if p.requires_grad]
    if pt.optimizer == "adamw":
        opt = torch.optim.AdamW(params, lr=1e-4)
    else:
        opt = torch.optim.SGD(params, lr=1e-2, momentum=0.9 if pt.optimizer == "sgd_momentum" else 0.0)
    try:
        return breakdown_steps(model, comm, opt, pt, groups.rank // pt.sp).as_dict()
    finally:
        comm.close()


def measure_breakdown(pt: Point, timeout_s: float = 300.0) -> list:
    """Every rank's :class:`~isp_comm.memory_breakdown.Breakdown` of ``pt`` (two steps).
    The ranks start as :func:`~isp_comm.testing.run_ranks` does by default (in the
    suite forked from its server, not spawned): the breakdown counts the
    storages made inside it, which a rank's start does not change (79 s for
    tests/test_memory_breakdown.py with spawned ranks, 23 s forked); only the CPU's
    device line reads the process's memory, and what it grew by, not its size."""
    from isp_comm.memory_breakdown import Breakdown
    from isp_comm.testing import run_ranks

    return [Breakdown(**d) for d in run_ranks(_breakdown_rank, pt.world, pt, timeout_s=timeout_s)]
