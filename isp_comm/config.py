"""ISPConfig: every knob of the ISP engine, validated once at construction."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, get_args

import torch

BackendName = Literal["auto", "torch", "symm", "nvshmem"]
CommGranularity = Literal["block", "module"]
StateSharding = Literal["wp", "world"]
BACKENDS: tuple[str, ...] = get_args(BackendName)
"""Every backend name, the one list (``make_backend`` and isp-train read it too)."""

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""The dtypes isp-comm trains in: of parameters, gathers and reductions."""

FLAGS = (
    "overlap",
    "shard_outer_params",
    "vocab_parallel",
    "memory_pool",
    "find_unused_parameters",
    "sync_module_states",
)
"""The fields that are True or False: a string such as ``"False"`` would read as true."""

MAX_TIMEOUT_S = 1e9
"""The longest deadline taken (about 31 years): a wait's deadline becomes a
``timedelta`` and a thread wait, which overflow long before a float does."""


def _number(value: object) -> bool:
    """An int or float, not a bool (nor a string: ``"0.5"`` would fail later, after sharding)."""
    return isinstance(value, int | float) and not isinstance(value, bool)


@dataclass(kw_only=True)
class ISPConfig:
    """Configuration of an :class:`~isp_comm.ISPCommunicator`."""

    overlap: bool = True
    """Prefetch the next block's weights and reduce-scatter gradients asynchronously.
    With ``False`` every collective is issued when needed and waited at once (useful
    to measure what overlap buys)."""

    activation_checkpointing: float = 0.0
    """Fraction of blocks, from the first, whose activations are recomputed in
    backward (non-reentrant ``torch.utils.checkpoint``): ``round(r * n_blocks)``."""

    param_dtype: torch.dtype | None = None
    """Dtype every parameter computes in (e.g. ``torch.bfloat16``), as FSDP2's
    ``MixedPrecisionPolicy`` on the root: the blocks' gathered weights, their
    replicated norms, and the embedding, final norm and head (replicated or sharded).
    ``None`` keeps the parameters' own dtype. Master weights, their gradients and the
    optimizer state stay in the parameters' dtype. The model's output (the logits) is
    then in ``param_dtype``: compute the loss in fp32 (``logits.float()``, as
    :meth:`ISPCommunicator.cross_entropy` does)."""

    reduce_dtype: torch.dtype | None = None
    """Dtype in which weight gradients are reduce-scattered. ``None`` means
    ``param_dtype`` (as FSDP2 does)."""

    shard_outer_params: bool = False
    """Also shard the parameters outside the blocks across the WP group (embeddings
    along the hidden dim, the head and the rest along dim 0, a tied embedding with its
    head along the vocab), so their gradients and optimizer state are sharded too. An
    untied embedding is looked up without ever being gathered (see
    :mod:`isp_comm.embedding`); the rest is gathered once per step outside the slot
    pool and reduce-scattered like a block. The lookup all-gathers the WP group's
    token ids, so the group's ranks feed ids of one shape. ``False`` keeps them
    replicated and all-reduces their gradients."""

    vocab_parallel: bool = False
    """Split the output head's weight along the vocab over the WP group and never
    gather it: the head returns vocab-sharded logits ``[wp, batch, seq, vocab/wp]``
    for every token of the WP group, and :meth:`ISPCommunicator.cross_entropy` gives
    each rank's loss from them (see :mod:`isp_comm.vocab_parallel`). For large
    vocabularies; the head must be an ``nn.Linear`` without bias, not tied, and the
    WP group's ranks feed inputs of one shape."""

    state_sharding: StateSharding = "wp"
    """Over which ranks the sharded parameters' gradients and optimizer state are
    split (the weights are gathered over WP either way). ``"wp"``: over the WP group;
    ranks holding the same WP shard (the replica group) all-reduce its gradient and
    each keeps the whole shard's master and optimizer state. ``"world"``: over the
    whole job (InternEvo's independent sharding): the WP shard's gradient is
    reduce-scattered over the replica group, each rank keeps and steps 1/world of
    every parameter (``model.parameters()`` are those pieces), and the updated pieces
    are all-gathered over the replicas, in the gather dtype, into the WP shard
    before its next gather (see docs/sharding.md). Parameters no unit shards (norms,
    and the outer ones without ``shard_outer_params``) stay replicated either way."""

    comm_granularity: CommGranularity = "block"
    """``"block"``: one all-gather and one reduce-scatter per block (flat, through a
    landing buffer). ``"module"``: one collective per sharded parameter (weight, bias)
    of every linear, each landing straight in its place in the slot; more, smaller
    collectives and no landing copy. The outer parameters are always one collective."""

    memory_pool: bool = True
    """Gather blocks into a fixed pool of ``n_slots`` buffers sized by the largest
    block (MaxPool). ``False`` allocates per gather (for comparison)."""

    n_slots: int = 2
    """Number of gathered-block slots in the pool (at least 2: one computing, one
    prefetching)."""

    max_inflight_reduce_scatter: int = 2
    """Reduce-scatters in flight at once; an older one is waited before a new one is
    issued, which bounds gradient-buffer memory."""

    release_reduce_buffers: bool | None = None
    """Give the reduce-scatter buffer pairs back to the allocator when a backward ends,
    and make them again as the next backward's first blocks reduce (at most
    ``max_inflight_reduce_scatter`` pairs, each as large as the pooled ones), so that
    the forward, the loss and its backward, and the optimizer step can use their bytes:
    FSDP2 likewise allocates its reduce-scatter buffers per collective. ``None``: on
    for CUDA parameters where the backend's buffers are ordinary device memory
    (torch.distributed, CUDA symmetric memory, the virtual backend), where the
    caching allocator hands the bytes back at no cost; off on CPU, where a buffer
    that large goes back to the operating system and faults its pages in again every
    step, and with NVSHMEM, whose pool is symmetric heap allocated by every rank
    together. ``True`` with a backend whose buffers are symmetric is a ``ValueError``
    at wrap (see [Note: reduce-scatter pairs between backwards] in
    ``isp_comm/memory_pool/slots.py``)."""

    bucket_mb: float = 25.0
    """Size of the buckets in which the gradients autograd leaves whole (replicated
    parameters over the world, the vocab-parallel head's and hidden-split
    embedding's shards over replicas) are all-reduced as soon as each bucket's
    gradients exist, during backward, as DDP's ``bucket_cap_mb``. Larger buckets mean
    fewer, later collectives."""

    find_unused_parameters: bool = False
    """Leave ``None`` the gradient of a parameter that no rank used since the last
    optimizer step (a sub-module a step skipped, a head the loop does not train), as a
    plain model, DDP and FSDP2 do, so the optimizer skips it. ``False``: such a
    parameter gets a zero gradient, which AdamW's weight decay and momentum still
    move. ``True`` costs one all-reduce of a flag per parameter and a host read of it
    before each optimizer step, as DDP's option of that name does (see [Note: unused
    parameters] in ``isp_comm/hooks/unused.py``), and the whole gradients' buckets
    wait for the backward's end, so that ranks may use different parameters (see
    [Note: bucketed whole gradients] in ``isp_comm/hooks/reductions.py``); a block
    whose weights some ranks left unused gets zeros reduced there (see [Note: a
    block's backward that ends unseen] in ``isp_comm/hooks/engine.py``)."""

    backend: BackendName = "auto"
    """Collective backend: ``"torch"`` (torch.distributed: gloo on CPU, NCCL on CUDA),
    ``"symm"`` (symmetric memory: POSIX shared memory between the ranks of one host
    on CPU, ``torch.distributed._symmetric_memory`` on CUDA), ``"nvshmem"``
    (nvshmem4py, CUDA) or ``"auto"`` (symm on CPU where shared memory allows and the
    host has libatomic or an x86 CPU, torch otherwise; on CUDA always torch, i.e. NCCL)."""

    init_seed: int | None = None
    """For a model built under ``torch.device("meta")``: initialise each module with a
    generator seeded from ``init_seed`` and its FQN, so the initial weights depend on
    the seed and the names only, never on the WP size or which parameters are
    sharded (:func:`isp_comm.materialize.init_weights` gives an unwrapped model the
    same weights). ``None``: each module's ``reset_parameters()`` on the global RNG.
    The seeded draw runs on the host's one generator, whatever the device (so CPU and
    GPU runs start from the same weights), and every rank draws every module: about 4
    to 5 s per billion parameters on one core of the 2-core CPU machine, minutes for a
    70B model."""

    sync_module_states: bool = False
    """Broadcast rank 0's parameters and buffers to every rank before sharding (for
    models built on one rank's seed). ``False``: wrapping checks that every rank holds
    the same weights (a checksum per parameter) and names the first that differs."""

    timeout_s: float = 300.0
    """Deadline for every wait on communication after wrapping. The wrap's own
    agreements (the same weights on every rank, shared-memory segments, groups) are
    ``torch.distributed`` calls under the process group's timeout, which
    ``init_process_group(timeout=...)`` sets."""

    diagnosis_dir: str | None = None
    """Folder where, when a wait passes its deadline, the lowest surviving rank writes
    the hang's diagnosis (``hang.json``, ``hang.txt``: every rank's last collectives
    and Python stacks) and where ``isp-comm doctor --live`` asks a running job where
    each rank is. ``None``: the diagnosis is printed only (see docs/reliability.md)."""

    debug_delay_s: float = 0.0
    """Test-only: before issuing a collective, sleep a random time in
    ``[0, debug_delay_s)`` drawn from a per-rank generator, to show that timing
    cannot change results."""

    def checkpointed_blocks(self, n_blocks: int) -> int:
        """How many of ``n_blocks`` blocks, from the first, ``activation_checkpointing``
        recomputes: the fraction of them, rounded (0.1 of 4 blocks is none). The
        communicator, the memory forecast and the step model all count with it."""
        return round(self.activation_checkpointing * n_blocks)

    def __post_init__(self) -> None:
        for name in FLAGS:
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if not _number(self.activation_checkpointing) or not 0.0 <= self.activation_checkpointing <= 1.0:
            raise ValueError(
                f"activation_checkpointing must be a number in [0, 1], got {self.activation_checkpointing!r}"
            )
        for name in ("param_dtype", "reduce_dtype"):
            dtype = getattr(self, name)
            if dtype is not None and dtype not in FLOAT_DTYPES:
                raise ValueError(f"{name} must be one of {FLOAT_DTYPES} or None, got {dtype}")
        if isinstance(self.n_slots, bool) or not isinstance(self.n_slots, int) or self.n_slots < 2:
            raise ValueError(f"n_slots must be an integer >= 2, got {self.n_slots!r}")
        k = self.max_inflight_reduce_scatter
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"max_inflight_reduce_scatter must be an integer >= 1, got {k!r}")
        if self.release_reduce_buffers is not None and not isinstance(self.release_reduce_buffers, bool):
            raise ValueError(f"release_reduce_buffers must be True, False or None, got {self.release_reduce_buffers!r}")
        if not _number(self.bucket_mb) or not self.bucket_mb > 0:
            raise ValueError(f"bucket_mb must be a number > 0, got {self.bucket_mb!r}")
        if self.state_sharding not in get_args(StateSharding):
            raise ValueError(f"state_sharding must be 'wp' or 'world', got {self.state_sharding!r}")
        if self.comm_granularity not in get_args(CommGranularity):
            raise ValueError(f"comm_granularity must be 'block' or 'module', got {self.comm_granularity!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.init_seed is not None and (isinstance(self.init_seed, bool) or not isinstance(self.init_seed, int)):
            raise ValueError(f"init_seed must be an int or None, got {self.init_seed!r}")
        if not _number(self.timeout_s) or not 0 < self.timeout_s <= MAX_TIMEOUT_S:
            raise ValueError(f"timeout_s must be a number of seconds in (0, {MAX_TIMEOUT_S:g}], got {self.timeout_s!r}")
        if not _number(self.debug_delay_s) or not 0 <= self.debug_delay_s < math.inf:
            raise ValueError(f"debug_delay_s must be a finite number >= 0, got {self.debug_delay_s!r}")
