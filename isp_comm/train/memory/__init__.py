"""isp-train --memory-breakdown: the run's steps under the library's
:class:`~isp_comm.memory_breakdown.MemoryBreakdown`, and at the end every rank's peaks
by part beside the memory forecast's lines for the same flags: all of them in
``memory_breakdown.json`` in the run folder, rank 0's printed.

The peaks are the steady state's, as the forecast's: they start again after the run's
first step, whose optimizer step creates the optimizer's state (a run of one step
keeps its warm-up). Checkpoint saves are not counted; an evaluation is a phase of its
own. A run stopped by a signal at a step boundary (``--save-on-signal``) reports its
steps so far; one that leaves at once writes none. A diagnosis, not a way to train:
the breakdown sees every operator from Python, which slows each step.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from typing import Any

from isp_comm.memory_breakdown import MemoryBreakdown
from isp_comm.memory_breakdown.parts import tensor_parts
from isp_comm.memory_breakdown.result import MIB, Breakdown
from isp_comm.train import virtual

FILE = "memory_breakdown.json"
"""Written in the run folder (``--out``) by the process that writes metrics.jsonl."""
PHASES = ("forward", "backward", "optimizer", "evaluate")
"""The phases reported, in this order, where the run had them."""


class RunBreakdown:
    """One rank's breakdown of its run: :meth:`tracking` around the steps,
    :meth:`step_done` after each, :meth:`report` once the last has run (collective over
    the world, unless the world is virtual). ``forecast``: the memory forecast of the
    run's flags on the rank that reports (``None`` elsewhere, or where the model could
    not be traced: the table then has no forecast column)."""

    def __init__(self, job: Any, forecast: Any) -> None:
        self.job, self.forecast = job, forecast
        self.tracker = MemoryBreakdown()
        self.result: Breakdown | None = None
        self.steps: tuple[int, int] | None = None  # the first and last step of the peaks

    @contextlib.contextmanager
    def tracking(self) -> Iterator[RunBreakdown]:
        """The steps run inside: the model, the communicator's buffers and the
        optimizer's state are counted from here; the result is taken on the way out."""
        with self.tracker:
            self.tracker.attach(self.job.comm, self.job.opt)
            yield self
            self.result = self.tracker.result()

    def untracked(self) -> contextlib.AbstractContextManager:
        """Around a checkpoint's save: not counted (its staged copies are not a step's)."""
        return self.tracker.untracked()

    def evaluating(self) -> contextlib.AbstractContextManager:
        """Around an evaluation: its own phase, left when it ends."""
        return self.tracker.phase("evaluate")

    def step_done(self, step: int, first: bool) -> None:
        """After the run's first step (when another follows), the peaks start again;
        ``steps`` holds the first and last step measured (a signal may end the run early)."""
        if first and step < self.job.cfg.steps:
            self.tracker.reset_peaks()
            self.steps = (step + 1, step)  # none measured yet
        elif first:
            self.steps = (step, step)
        elif self.steps is not None:
            self.steps = (self.steps[0], step)

    def report(self) -> None:
        """Every rank's breakdown to rank 0, which writes them with the forecast and
        prints its own (after the trace stopped: the gather is not a step's)."""
        job = self.job
        mine = self.result.as_dict()
        if job.cfg.virtual_world:  # one real rank: a virtual group's gather would only model it
            ranks = [mine]
        else:
            ranks = job.comm.all_gather_object(mine, what="the memory breakdowns")
        if not virtual.leads(job.rank):
            return
        phases = [ph for ph in PHASES if ph in self.result.tracked]
        forecast = None
        if self.forecast is not None:
            forecast = {ph: dict(self.forecast.phases[ph]) for ph in phases if ph in self.forecast.phases}
        with open(os.path.join(job.cfg.out, FILE), "w") as f:
            json.dump({"steps": self.steps, "phases": phases, "forecast": forecast, "ranks": ranks}, f)
        print(self.text(phases, forecast), flush=True)

    def text(self, phases: list[str], forecast: dict[str, dict[str, int]] | None) -> str:
        """Rank 0's lines: each phase's tracked peak (and the forecast's), then the
        highest phase's table, part by part."""
        b = self.result
        if not phases or self.steps is None:
            return f"isp-train: memory breakdown: no step ran, nothing measured ({FILE})"
        if self.steps[0] > self.steps[1]:  # stopped by a signal after the warm-up step, whose peaks are not kept
            return f"isp-train: memory breakdown: no step ran after the first, nothing measured ({FILE})"
        first, last = self.steps
        head = f"isp-train: memory breakdown of rank {self.job.rank}, steps {first}-{last}"
        lines = [f"{head} (every rank's in {FILE}; the forecast is rank 0's):"]
        for ph in phases:
            fc = ""
            if forecast and ph in forecast:  # a tracker sees tensors: the forecast's runtime lines apart
                tensors = sum(tensor_parts(forecast[ph]).values())
                runtime = sum(forecast[ph].values()) - tensors
                fc = f", forecast {tensors / MIB:.1f} MiB of tensors" + (
                    f" (and {runtime / MIB:.1f} MiB of runtime no tensor holds)" if runtime else ""
                )
            lines.append(f"  {ph}: tracked peak {b.tracked[ph] / MIB:.1f} MiB{fc}")
        top = max(phases, key=lambda ph: b.tracked[ph])
        lines += ["", f"the {top} phase's peak, by part:", b.table(top, forecast.get(top) if forecast else None)]
        return "\n".join(lines)
