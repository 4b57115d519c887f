"""Know before you launch: every rank's memory, phase by phase, from a meta-built model.

``isp_comm.forecast(model_on_meta, config, world, wp, sp, batch, seq)`` needs no
process group and no real memory. What the engine would allocate is read from the
engine's own decisions, not re-derived: :func:`~isp_comm.discovery.unit_specs` says
what each unit shards, :class:`~isp_comm.layout.BlockLayout` how large its flat
shard, gathered slot and reduce buffers are, and :func:`~isp_comm.memory_pool.make_plan`
sizes the pool exactly as wrapping does. Activations come from one forward of the
meta model at the rank's local shape, with ``saved_tensors_hooks`` counting what
autograd keeps for backward (meta tensors: nothing is computed); for compiled blocks,
what inductor's partition keeps ([Note: what a compiled block saves]).

[Note: what the forecast counts]
All figures are bytes on one rank (rank 0, whose shards are the largest), above the
process's baseline (torch imported, process groups made, model built on meta). The
steady state of a step is counted: from the second step on, the optimizer state
exists in every phase. A unit's gradient shard (one flat buffer, freed by
``zero_grad(set_to_none=True)`` as FSDP2's are) exists from its block's backward to
the optimizer step; with ``grad_accum`` > 1, through the later micro-steps' forwards
and backwards too, or the deferred sums in its place ([Note: what an accumulation
holds] in :mod:`.phases`). The phases and what each adds to the persistent parts (master
shards, replicated parameters, pool):

* ``wrap``: one module's full weights, materialised before its rows are taken;
* ``forward``: cast copies and the outer gather, the saved activations of every
  block (only the input of a checkpointed one), then the logits and the loss;
* ``backward``: the largest moment of the walk from the loss back to the
  embedding: the activations still to be used, the gradient shards of the blocks
  already walked, the block's full (unsharded) weight gradients before they are
  packed, a checkpointed block's recomputation, and the replicated parameters'
  gradients (full size, master dtype); and its end, every gradient shard written;
* ``optimizer``: gradients of everything plus the optimizer's temporaries;
* ``save`` / ``async_save`` / ``load``: DCP's per-item copies; the async save's
  staging holds a whole copy of the model and optimizer shards (on CUDA these are
  host memory, ``host_staging``, not the GPU's);
* ``evaluate`` (only with ``evaluate=True``: isp-train's ``--eval-every``): a
  validation pass under ``no_grad`` after the step's ``zero_grad``: the larger of one
  block's intermediates and the logits and loss, with no gradient shard.

On the CPU shared-memory backend a rank's RSS also counts the shared pages it touches
beyond its own pool: its chunk of every peer's landing and reduce-scatter buffers, and
the scratch of collectives that do not run on the pool (:func:`.pool.shared_pages`).

Modelled, not traced: the loss (logits held by the loop, their fp32 copy and
log-softmax; in its backward, the backward's highest moment, three fp32
logits-sized tensors, two for the vocab-parallel loss: [Note: the loss's backward]),
the activation gradients inside a block's backward (two hidden states and the
block's largest saved tensor), and the optimizer's temporaries (torch's for-each
AdamW on CUDA: one ``sqrt`` of every second moment; the per-parameter one on CPU: the
largest one's sqrt and quotient).
On CUDA, the allocator also serves two cuBLAS workspaces from the first backward on,
which no tensor holds ([Note: cuBLAS's workspaces], :func:`.weights.cuda_runtime`).
On CPU, two parts are measured constants rather than counts: what gloo and the bf16
kernels keep outside tensors (:func:`.weights.cpu_runtime`). ``bench/forecast.py`` measures how
close this comes; ``isp_comm.memory_breakdown`` measures each part beside its line.

[Note: the package]
One module per thing modelled, each importing only the ones above it:
:mod:`.result` (the forecast's type and table), :mod:`.weights` (shards, replicated
parameters, gradients and optimizer state), :mod:`.activations` (the meta trace),
:mod:`.pool` (slots, reduce-scatter buffers, shared memory) and :mod:`.phases`
(what each phase holds, and :func:`forecast`).
"""

from isp_comm.memory_forecast.phases import forecast
from isp_comm.memory_forecast.result import KNOBS, PHASES, MemoryForecast, Optimizer

__all__ = ["KNOBS", "PHASES", "MemoryForecast", "Optimizer", "forecast"]
