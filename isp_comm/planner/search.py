"""``--plan --search``: every layout of a world, the fastest that fit first.

For a global batch (``--batch`` x ``--grad-accum``) and sequence length, the
layouts are: ``wp`` and ``sp`` among the world's divisors (``sp`` also dividing the
heads and the sequence), the replicas that follow, with replicas the state
sharding (gradients and optimizer state over WP, or over the whole job: see
docs/sharding.md) and, with accumulation, when gradients cross the replicas (every
micro-step, or once a step), ``shard_outer`` off / on, ``vocab_parallel`` off / on (the
reference llama, wp > 1), and the micro-batch: sequences per rank per micro-step,
with ``--grad-accum`` making up the global batch. Each is forecast (memory, on the
profile's device) and timed (:mod:`isp_comm.planner.step`); a layout fits when the
device holds at most ``1 - MARGIN`` of its memory at its highest phase.

Activation checkpointing is not a dimension of the list but a setting of each
layout: the least of it that fits, a block at a time (:func:`least_checkpointing`),
since recomputing a block is never faster than keeping its activations. Fitting
layouts come first, by predicted step time; those that cannot fit even with every
block checkpointed come after, marked.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from isp_comm.planner.memory import MARGIN, DeviceMemory
from isp_comm.planner.step import StepTime
from isp_comm.sequence_parallel.attention import kv_repeats


@dataclasses.dataclass(frozen=True)
class Layout:
    """One way to run the job."""

    world: int
    wp: int
    sp: int
    ckpt: float
    shard_outer: bool
    vocab_parallel: bool
    batch: int
    """Sequences per micro-step over the job (isp-train's --batch)."""
    grad_accum: int
    state_sharding: str = "wp"
    """Over which ranks gradients and optimizer state are split (``ISPConfig.state_sharding``)."""
    replica_sync: str = "micro"
    """When gradients cross the replicas: every micro-step, or once a ``step`` (isp-train's --replica-sync)."""

    def flags(self) -> list[str]:
        out = ["--wp", str(self.wp), "--sp", str(self.sp), "--batch", str(self.batch)]
        out += ["--grad-accum", str(self.grad_accum), "--ckpt", f"{self.ckpt:g}"]
        out += ["--shard-outer"] if self.shard_outer else []
        out += ["--vocab-parallel"] if self.vocab_parallel else []
        out += ["--state-sharding", self.state_sharding] if self.state_sharding != "wp" else []
        out += ["--replica-sync", self.replica_sync] if self.replica_sync != "micro" else []
        return out


@dataclasses.dataclass(frozen=True)
class Ranked:
    layout: Layout
    step: StepTime | None
    """The predicted step (``None`` for a layout that cannot fit: not timed)."""
    memory: DeviceMemory

    @property
    def fits(self) -> bool:
        return self.memory.fits


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layouts(
    world: int,
    global_batch: int,
    seq: int,
    heads: int,
    *,
    kv_heads: int | None = None,
    vocab_parallel: bool = True,
    max_sp: int = 64,
) -> list[Layout]:
    """Every layout isp-train would run for this world and global batch, each with
    every block checkpointed (:func:`rank` finds the least checkpointing that fits).
    SP sizes that cannot split the heads and ``kv_heads`` key/value heads (default:
    ``heads``) are left out, by the rule SP applies (``kv_repeats``)."""
    out = []
    for sp in divisors(world):
        if sp > max_sp or seq % sp or not _splits(heads, kv_heads or heads, sp):
            continue
        dp = world // sp
        micro = [m for m in (1, 2, 4, 8, 16, 32) if global_batch % (dp * m) == 0]
        for wp in divisors(world):
            for m in micro:
                for outer in (False, True):
                    for vp in (False, True) if vocab_parallel and wp > 1 else (False,):
                        batch = dp * m
                        accum = global_batch // batch
                        for state in ("wp", "world") if wp < world else ("wp",):  # one replica: the same
                            for sync in ("micro", "step") if wp < world and accum > 1 else ("micro",):
                                out.append(Layout(world, wp, sp, 1.0, outer, vp, batch, accum, state, sync))
    return out


def _splits(heads: int, kv_heads: int, sp: int) -> bool:
    try:
        kv_repeats(heads, kv_heads, sp)
    except ValueError:
        return False
    return True


def least_checkpointing(
    layout: Layout, memory: Callable[[Layout], DeviceMemory], blocks: int
) -> tuple[Layout, DeviceMemory]:
    """``layout`` with the fewest of its ``blocks`` checkpointed that fits (``ckpt`` =
    k / blocks: isp-train checkpoints the first ``round(ckpt * blocks)``), and its
    memory; when none fits, the one of the two most checkpointed that holds less.

    A bisection on k: the forecast's peak falls as more blocks are checkpointed (each
    keeps its input instead of its activations), so the k that fit are those from
    some k0 up; except at the top, where checkpointing the last block too can cost
    one hidden state more at that block's own moment than keeping it (its kept input
    lives beside its recomputed activations, which do not hold it where the block
    saves an upcast copy instead, as a norm in bf16 does), so ``blocks - 1`` is tried
    when ``blocks`` does not fit. At most ``3 + log2(blocks)`` forecasts."""
    if blocks < 1:
        raise ValueError(f"least_checkpointing: a model of {blocks} blocks has nothing to checkpoint")
    at = lambda k: dataclasses.replace(layout, ckpt=k / blocks)  # noqa: E731
    hi, hi_mem = blocks, memory(at(blocks))  # invariant: k = hi fits, k = lo does not
    if not hi_mem.fits and blocks > 1:
        below = memory(at(blocks - 1))
        if below.fits or below.device_total < hi_mem.device_total:
            hi, hi_mem = blocks - 1, below
    if not hi_mem.fits:
        return at(hi), hi_mem
    lo, lo_mem = 0, memory(at(0))
    if lo_mem.fits:
        return at(0), lo_mem
    while hi - lo > 1:
        mid = (lo + hi) // 2
        mid_mem = memory(at(mid))
        if mid_mem.fits:
            hi, hi_mem = mid, mid_mem
        else:
            lo = mid
    return at(hi), hi_mem


def rank(
    candidates: list[Layout],
    memory: Callable[[Layout], DeviceMemory],
    step: Callable[[Layout], StepTime],
    top: int = 5,
    blocks: int = 2,
) -> list[Ranked]:
    """Every layout at its least checkpointing that fits, in steps of one block of
    ``blocks`` (2: ``ckpt`` 0, 0.5 or 1); those that fit timed and ranked by
    predicted step time, then those that do not, smallest first (only the ``top``
    smallest timed)."""
    mems = [least_checkpointing(lay, memory, blocks) for lay in candidates]
    fitting = sorted((Ranked(lay, step(lay), m) for lay, m in mems if m.fits), key=lambda r: r.step.step_s)
    others = sorted(((lay, m) for lay, m in mems if not m.fits), key=lambda lm: lm[1].device_total)
    return fitting + [Ranked(lay, step(lay) if i < top else None, m) for i, (lay, m) in enumerate(others)]


def table(ranked: list[Ranked], command: Callable[[Layout], str], top: int = 5) -> str:
    """The ``top`` fastest that fit (or, when none does, the smallest), with the
    command line of each."""
    fitting = [r for r in ranked if r.fits]
    tried = f"{len(ranked)} layouts searched (the layout flags given set only the plan above)"
    lines = [
        f"{tried}, {len(fitting)} fit (at most {100 * (1 - MARGIN):.0f}% of the device's memory at "
        "their highest phase); the fastest:"
    ]
    shown = fitting[:top]
    if not shown:
        lines[0] = f"{tried}, none fits; the smallest:"
        shown = ranked[:top]
    lines.append("| # | wp | sp | replicas | state over | ckpt | shard-outer | vocab-parallel | micro-batch x accum | "
                 "replica sync | step s | tokens/s | MFU % | device MiB | fits |")  # fmt: skip
    lines.append("|---:|---:|---:|---:|---|---:|---|---|---:|---|---:|---:|---:|---:|---|")
    for i, r in enumerate(shown, 1):
        lay, st = r.layout, r.step
        assert st is not None  # the shown ones are timed
        step = f"{st.step_s:.3f}" if st.step_s >= 1 else f"{st.step_s:.4g}"  # a toy's steps all read 0.009
        lines.append(
            f"| {i} | {lay.wp} | {lay.sp} | {lay.world // lay.wp} | {lay.state_sharding} | {lay.ckpt:g} | "
            f"{'yes' if lay.shard_outer else 'no'} | "
            f"{'yes' if lay.vocab_parallel else 'no'} | {lay.batch} x {lay.grad_accum} | {lay.replica_sync} | "
            f"{step} | "
            f"{st.tokens_per_s:,.0f} | {st.mfu_pct:.1f} | {r.memory.device_total / 2**20:,.0f} | "
            f"{'yes' if r.fits else '**no**'} |"
        )
    lines.append("")
    for i, r in enumerate(shown, 1):
        lines.append(f"{i}: {command(r.layout)}")
    return "\n".join(lines)
