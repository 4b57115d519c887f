"""How long an optimizer step takes: the engine's schedule, replayed on a profile.

The same inputs as the memory forecast: the unit layouts (what each block gathers and
reduce-scatters), the configuration (checkpointing, slots, reduce-scatters in flight)
and a meta trace at the rank's local shape (:mod:`isp_comm.planner.ops`). A
micro-step is replayed on the compute stream's clock and the links' (each tier of
links, NVLink and InfiniBand, on a clock of its own, each group's collectives in
issue order: [Note: tiers of links] in ``isp_comm/backends/tiers.py``; what a
collective asks of each tier: :mod:`isp_comm.planner.links`), as
:mod:`isp_comm.hooks.engine` issues them:

* forward: block i waits for its gather, lands it in its slot (a copy, unless the
  peers write the slot), issues block i+1's, computes; SP's all-to-alls sit on the
  compute path (each block waits for them);
* the outside (embedding, final norm, head, loss) forward and backward; with the
  vocab-parallel head, its collectives over the WP group on the compute path (the
  hidden states and labels gathered, the softmax's maxima and sums, and in backward
  the loss gradients gathered and the hidden states' gradient reduce-scattered);
* backward, in reverse: block i waits for its re-gather (the last block's is issued
  when backward begins), issues block i-1's, recomputes its forward when it is
  checkpointed, computes its backward, packs its gradients, then issues its
  reduce-scatter after waiting for the oldest when ``max_inflight_reduce_scatter``
  are in flight (the reduced shard is written to ``.grad`` by a copy), and the
  previous block's shard over the replicas (all-reduced; with
  ``state_sharding="world"`` reduce-scattered, and all-gathered back in the next
  step's first forward, :data:`REPLICA_GATHER_AHEAD`);
* the end of backward waits for every reduce-scatter; the gradients autograd leaves
  whole are all-reduced (bucketed; counted after the last block, exposed).

Then, once per optimizer step: the gradient-norm clip (a read of every gradient shard
and one all-reduce), AdamW (memory-bound: parameters, gradients and both moments, and
a fixed host cost per parameter tensor), the loss's all-reduce, and the loop's host
cost. A compute piece costs its GEMMs and attention by FLOPs over the profile's
throughput at that size, its element-wise operators by bytes over bandwidth, and one
host dispatch per operator: on CPU these add up (the calibrated curves are whole
calls, dispatch included, so views alone add a dispatch); on a GPU the host issues
while the device runs, so a piece takes the longer of the two. The kernels take
longer inside a step than alone, by the profile's calibrated slowdown. Attention
costs its heads one after another at one head's rate (its FLOPs and head dim). On
CPU, communication takes the cores the compute uses and adds to it
(``Profile.overlap``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from torch import nn

from isp_comm.backends.tiers import NONE, Demand, TierSchedule
from isp_comm.config import ISPConfig
from isp_comm.discovery import find_blocks
from isp_comm.hooks.reductions import divide_factors
from isp_comm.memory_forecast.weights import unit_layouts
from isp_comm.memory_pool.plan import gather_landing
from isp_comm.model_flops import flops_per_token
from isp_comm.planner.links import collective_demand, slowest_group
from isp_comm.planner.ops import Ops, StepOps, trace_ops
from isp_comm.planner.profile import Profile, interp

ADAMW_BYTES_PER_ELEMENT = 28
"""AdamW (fp32): parameter read and write, gradient read, two moments read and written."""


@dataclasses.dataclass(frozen=True)
class StepTime:
    """The predicted step of one rank: seconds per phase, exposed communication per phase."""

    step_s: float
    """Seconds per optimizer step (all micro-steps, the clip, the optimizer, the loop)."""
    tokens_per_s: float
    """Tokens per second of the whole job."""
    mfu_pct: float
    """Model FLOPs (6N + 12 L d s per token, as isp-train counts) over the peak bf16 FLOP/s."""
    phases: dict[str, float]
    """Seconds per step: ``forward``, ``backward`` (recompute included), ``optimizer``
    (clip and AdamW), ``host`` (the loop's own cost), summed over micro-steps."""
    exposed_comm: dict[str, float]
    """Seconds per step the compute waited on communication, by phase."""
    comm_s: dict[str, float]
    """Seconds per step of each kind of collective (all_gather, reduce_scatter,
    all_to_all, all_reduce), hidden or not."""
    compute_s: dict[str, float]
    """Seconds per step of each kind of compute (:data:`COMPUTE_KINDS`), recompute
    included: with the exposed communication, they make up forward and backward."""
    link_busy_s: dict[str, float] = dataclasses.field(default_factory=dict)
    """Seconds per step each tier of links moves bytes (``intra``: NVLink, ``inter``:
    InfiniBand; see [Note: tiers of links] in ``isp_comm/backends/tiers.py``)."""

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def _precision(low: bool) -> str:
    return "bf16" if low else "fp32"


KERNELS = ("gemm", "attention", "elementwise", "copies")
"""The kinds of compute that run kernels (and take ``Profile.compute_scale`` longer
inside a step than alone): matrix products, fused attention, element-wise operators,
and the engine's own copies (a gather landed in its slot, a block's gradients packed
for their reduce-scatter and the reduced shard written to ``.grad``)."""

COMPUTE_KINDS = (*KERNELS, "dispatch", "engine")
"""What a step's compute is made of (:attr:`StepTime.compute_s`): the kernels, what
the operators' dispatch adds, and the engine's host cost per block
(``Profile.host_block_s``)."""


def compute_parts(ops: Ops, prof: Profile, slowdown: float = 1.0) -> dict[str, float]:
    """Seconds of a piece of compute by kind (see the module note); ``copies`` and
    ``engine`` are the schedule's, not a piece's (``_costs`` adds them).
    ``slowdown``: how much longer the kernels take inside a step than alone
    (``Profile.compute_scale``)."""
    gemm = sum(f / interp(prof.gemm[_precision(lp)], f) for f, lp in ops.gemm)
    attention = 0.0
    for f, lp, back, heads, dim in ops.attention:
        attention += f / prof.attention_rate(lp, back, f / heads, dim)
    elementwise = sum(b / interp(prof.elementwise, b) for b in ops.moved)
    gemm, attention, elementwise = slowdown * gemm, slowdown * attention, slowdown * elementwise
    kernels = len(ops.gemm) + len(ops.attention) + len(ops.moved)
    if prof.device == "cpu":  # the curves hold whole calls (dispatch included); views cost a dispatch
        dispatch = (ops.dispatches - kernels) * prof.op_host_s
    else:  # launches, and where the host issuing is slower than the device running
        dev = gemm + attention + elementwise + kernels * prof.op_device_s
        dispatch = max(dev, ops.dispatches * prof.op_host_s) - (gemm + attention + elementwise)
    return {"gemm": gemm, "attention": attention, "elementwise": elementwise, "dispatch": dispatch}


def collective_time(prof: Profile, backend: str, op: str, group: int, nbytes: float, span: int = 0) -> float:
    """Seconds for one collective over ``group`` ranks of a buffer of ``nbytes`` (the
    gathered size for all-gather and reduce-scatter), alone on its links: the link
    model's (:func:`~isp_comm.planner.links.collective_demand`) latency and longest
    tier, for the slowest of the groups. ``span``: the world the groups are strided
    over (a replica group); default: contiguous groups of a world of ``group``."""
    return slowest_group(prof, backend, op, group, span or group, span > 0, nbytes).seconds


@dataclasses.dataclass
class _Clock:
    """The compute stream's time, and the links' (one :class:`TierSchedule`: each
    tier of links on a clock of its own, each group in issue order); ``overlap``
    off: every collective is waited for at once."""

    overlap: bool
    t: float = 0.0
    exposed: float = 0.0
    links: TierSchedule = dataclasses.field(default_factory=TierSchedule)

    def issue(self, demand: Demand, group: str, after: float = 0.0) -> float:
        """Issue a collective of ``group`` now, not to start before ``after`` (a
        stream wait on another collective); returns when it completes."""
        if not demand:
            return max(self.t, after)
        done = self.links.place(self.t, group, demand, after)
        if not self.overlap:
            self.wait(done)
        return done

    def wait(self, done: float) -> None:
        if done > self.t:
            self.exposed += done - self.t
            self.t = done


def _sizes(model: nn.Module, blocks: Sequence[nn.Module], config: ISPConfig, wp: int, memo: dict):
    """Bytes each block gathers and reduce-scatters, the outer unit's, and the
    gradients all-reduced whole (from the engine's layouts, as the forecast reads them)."""
    key = ("layouts", wp, config.shard_outer_params, config.vocab_parallel, config.param_dtype, config.reduce_dtype)
    if key not in memo:
        memo[key] = unit_layouts(model, list(blocks), config, None, wp)
    layouts, replicated = memo[key]
    gather, reduce = [], []
    outer_gather = outer_reduce = summed = 0
    for i, lay, tr in layouts:
        g = lay.gathered_numel * lay.gather_dtype.itemsize
        r = sum(grp.gathered_numel * grp.dtype.itemsize for grp in lay.full_groups) if any(tr) else 0
        if i >= 0:
            gather.append(g)
            reduce.append(r)
        elif i == -1:
            outer_gather, outer_reduce = g, r
        elif any(tr):  # the vocab-parallel head and split embedding: their shards all-reduced over replicas
            summed += sum(sp_.valid_rows * sp_.inner for sp_ in lay.params) * 4
    rd = config.reduce_dtype.itemsize if config.reduce_dtype is not None else 4
    repl = sum(p.numel() for p in replicated if p.requires_grad) * rd
    return gather, reduce, outer_gather, outer_reduce, repl, summed


@dataclasses.dataclass
class _Costs:
    """Seconds of each compute piece of a micro-step on one rank, and what each
    collective asks of the links (:class:`Demand`), in the engine's order."""

    fwd: list[float]  # per block: forward compute (with its share of the host cost)
    bwd: list[float]  # per block: backward compute
    outer: float  # embedding, final norm, head and loss, forward and backward
    compute: dict[str, float]  # the micro-step's compute by kind (recompute included)
    land: list[float]  # per block: landing its gather in the slot (each gather)
    pack: list[float]  # per block: packing its gradients, and writing the reduced shard
    outer_land: float  # the same for the sharded outer unit
    outer_pack: float
    send: list[float]  # per block: its shard cast into the gather dtype before each WP gather (masters apart)
    outer_send: float  # the same for the sharded outer unit
    piece_send: list[float]  # "world": per block, its pieces cast for the replica all-gather
    unpack: list[float]  # "world": per block, that gather unpacked into the WP shard
    outer_refresh: float  # "world": the outer unit's piece cast and unpack
    grads: list[bool]  # per block: whether it has gradients to reduce
    ag: list[Demand]  # per block: its all-gather over WP
    rs: list[Demand]  # per block: its reduce-scatter over WP
    rep: list[Demand]  # per block: its shard over the replicas (all-reduce; "world": reduce-scatter)
    rep_ag: list[Demand]  # "world": per block, its updated shard all-gathered over the replicas
    a2a: Demand  # per block and direction: Ulysses' four all-to-alls
    vocab_fwd: dict[str, list[Demand]]  # the vocab-parallel head's collectives by kind, forward
    vocab_bwd: dict[str, list[Demand]]  # and backward (all waited for on the compute path)
    outer_ag: Demand  # the sharded outer unit's gather (shard_outer)
    outer_rs: Demand  # and its reduce-scatter
    outer_rep: Demand  # its shard over the replicas (as ``rep``)
    outer_rep_ag: Demand  # "world": its shard all-gathered over the replicas
    repl_ar: Demand  # the gradients autograd leaves whole, all-reduced over the world
    summed: Demand  # the shards WP-summed by their own backward, over the replicas (as ``rep``)
    summed_ag: Demand  # "world": those shards all-gathered over the replicas
    n_ckpt: int  # blocks checkpointed (the first ones)
    max_inflight: int  # max_inflight_reduce_scatter


STATE_SHARDINGS = ("wp", "world")
"""How gradients and optimizer state are sharded (``ISPConfig.state_sharding``):
over the WP group, replicas all-reducing the shard (``wp``), or over the whole
job, replicas reduce-scattering it and all-gathering the updated pieces (``world``)."""

REPLICA_GATHER_AHEAD = 2
"""``state_sharding="world"``: blocks ahead of compute at which a block's updated
shard is all-gathered over the replicas, in the first forward after the optimizer
step: at the start of block i's compute (as block i+1's WP gather is issued), block
i+2's replica gather is issued (blocks 0 and 1's at the forward's start); before
block j's WP gather is issued, the compute stream waits for it (on the device, not
the host) and unpacks it into the WP shard. The WP gather itself is one block ahead,
so the replica gather has one block's compute to itself before it is needed."""


def _costs(
    model: nn.Module,
    config: ISPConfig,
    prof: Profile,
    sizes: tuple[int, int, int, int, int],
    memo: dict,
    world_sharded: bool,
    compiled: bool = False,
) -> _Costs:
    """The pieces' costs (``sizes``: world, wp, sp, sequences and tokens per rank);
    ``world_sharded``: ``state_sharding="world"``; ``compiled``: the blocks compiled
    ([Note: fused regions] in ``isp_comm/planner/fusion.py``)."""
    world, wp, sp, batch, seq = sizes
    blocks = memo["blocks"]
    tkey = ("ops", batch, seq, config.param_dtype, compiled)
    if tkey not in memo:
        memo[tkey] = trace_ops(model, blocks, batch, seq, config.param_dtype, copies=memo, compiled=compiled)
    traced: StepOps = memo[tkey]
    skey = ("sizes", wp, config.shard_outer_params, config.vocab_parallel, config.param_dtype, config.reduce_dtype)
    if skey not in memo:
        memo[skey] = (_sizes(model, blocks, config, wp, memo), _elements_per_rank(model, config, wp, memo))
    gather, reduce, outer_gather, outer_reduce, _, _ = memo[skey][0]
    multi = "multi" if world > 1 else "single"
    host_block = prof.host_block_s.get(multi, 0.0)
    slowdown = prof.compute_scale.get(multi, 1.0)
    timed: dict[int, dict[str, float]] = {}  # twins share their Ops: each is timed once

    def piece(o: Ops) -> dict[str, float]:
        if id(o) not in timed:
            timed[id(o)] = {**compute_parts(o.scaled_attention(sp), prof, slowdown), "engine": host_block / 2}
        return timed[id(o)]

    fwd, bwd = [piece(o) for o in traced.block_fwd], [piece(o) for o in traced.block_bwd]
    outer = [compute_parts(traced.outer_fwd, prof, slowdown), compute_parts(traced.outer_bwd, prof, slowdown)]
    n_ckpt = config.checkpointed_blocks(len(blocks))

    cp = _copies(config, prof, (world, wp), slowdown, memo[skey][0], memo[("layouts", *skey[1:])][0], world_sharded)
    compute = {k: sum(p.get(k, 0.0) for p in [*fwd, *bwd, *fwd[:n_ckpt], *outer]) for k in COMPUTE_KINDS}
    compute["copies"] = 2 * sum(cp["land"]) + 2 * sum(cp["send"]) + sum(cp["pack"])
    compute["copies"] += cp["outer_land"] + cp["outer_send"] + cp["outer_pack"]
    return _Costs(
        fwd=[sum(p.values()) for p in fwd],
        bwd=[sum(p.values()) for p in bwd],
        outer=sum(sum(p.values()) for p in outer),
        compute=compute,
        **cp,
        grads=[r > 0 for r in reduce],
        **_demands(model, config, prof, sizes, memo[skey][0], world_sharded),
        n_ckpt=n_ckpt,
        max_inflight=config.max_inflight_reduce_scatter,
    )


def _copies(
    config: ISPConfig,
    prof: Profile,
    sizes: tuple[int, int],
    slowdown: float,
    nbytes: tuple,
    units: list,
    world_sharded: bool,
) -> dict[str, object]:
    """The engine's copies and casts on the compute stream, in seconds (:class:`_Costs`'
    fields): ``sizes``: world and wp; ``nbytes``: :func:`_sizes`' figures; ``units``:
    the layouts (index, layout, trainable flags), without pieces."""
    world, wp = sizes
    gather, reduce, outer_gather, outer_reduce, _, _ = nbytes

    def copy(nbytes: float) -> float:  # read once and written once
        return slowdown * 2 * nbytes / interp(prof.elementwise, 2 * nbytes) if nbytes else 0.0

    # [Note: the engine's copies] a gather lands in the slot by a copy (wp 1: from the
    # shard; "staging": from the rank-major buffer; "per-parameter": the peers write the
    # slot, no copy); with masters in another dtype than the gather's, each WP gather
    # first casts the shard (BlockState.unshard); each reduce packs the block's
    # gradients (and divides them first in a low-precision reduce dtype), and the
    # reduced part is divided (world > 1) and copied into .grad (HookEngine,
    # Reductions). With the state over the world the WP shard is in the gather dtype
    # (no cast per gather), the reduced WP shard is packed replica-major before its
    # replica reduce-scatter and the piece, not the shard, is divided and written; once
    # a step each unit's pieces are cast for the replica all-gather, which is unpacked
    # into the WP shard (WeightRefresh)
    replicas = world // wp if world_sharded else 1
    pre = divide_factors(world)[0] > 1

    def packed(nbytes: float, lay) -> float:  # a low-precision reduce divides the packed gradients first
        low = pre and lay is not None and any(g.dtype in (torch.bfloat16, torch.float16) for g in lay.full_groups)
        out = (1 + low) * copy(nbytes) + (1 + (world > 1)) * copy(nbytes / wp / replicas)
        return out + (copy(nbytes / wp) if replicas > 1 else 0.0)

    def cast(lay, gathered: float, parts: int) -> float:  # masters (their own dtypes) into the gather dtype
        master = sum(sp_.shard_numel * sp_.dtype.itemsize for sp_ in lay.params)
        return copy((master + gathered / wp) / 2 / parts)

    block_lays = [lay for i, lay, _ in units if i >= 0]
    outer_lay = next((lay for i, lay, _ in units if i == -1), None)
    per_parameter = gather_landing(wp, config.comm_granularity) == "per-parameter"
    land = [0.0 if per_parameter else copy(b) for b in gather]
    pack = [packed(r, lay) for r, lay in zip(reduce, block_lays)]
    root = config.shard_outer_params and outer_lay is not None  # it lands by a copy (HookEngine._root_forward)
    outer_land, outer_pack = (copy(outer_gather), packed(outer_reduce, outer_lay)) if root else (0.0, 0.0)
    casts = wp > 1 and replicas == 1  # a per-gather cast: masters apart from the flat shard
    send = [cast(lay, g, 1) if casts and lay.dtype != lay.gather_dtype else 0.0 for lay, g in zip(block_lays, gather)]
    outer_casts = root and casts and outer_lay.dtype != outer_lay.gather_dtype
    outer_send = cast(outer_lay, outer_gather, 1) if outer_casts else 0.0
    piece_send = [cast(lay, g, replicas) if replicas > 1 else 0.0 for lay, g in zip(block_lays, gather)]
    unpack = [copy(g / wp) if replicas > 1 else 0.0 for g in gather]
    outer_refresh = cast(outer_lay, outer_gather, replicas) + copy(outer_gather / wp) if root and replicas > 1 else 0.0
    return {
        "land": land,
        "pack": pack,
        "outer_land": outer_land,
        "outer_pack": outer_pack,
        "send": send,
        "outer_send": outer_send,
        "piece_send": piece_send,
        "unpack": unpack,
        "outer_refresh": outer_refresh,
    }


def _demands(
    model: nn.Module, config: ISPConfig, prof: Profile, sizes: tuple[int, ...], nbytes: tuple, world_sharded: bool
) -> dict[str, object]:
    """What each collective of a micro-step asks of the links (:class:`_Costs`' fields);
    ``nbytes``: :func:`_sizes`' figures."""
    world, wp, sp, batch, seq = sizes
    gather, reduce, outer_gather, outer_reduce, repl, summed = nbytes
    backend = backend_of(config.backend, prof)
    replicas = world // wp
    root = config.shard_outer_params

    def coll(op: str, group: int, size: float, strided: bool = False) -> Demand:  # the slowest group's
        return slowest_group(prof, backend, op, group, world, strided, size)

    def over_replicas(size: float) -> Demand:  # a shard's gradient: all-reduced, or reduce-scattered
        return coll("reduce_scatter" if world_sharded else "all_reduce", replicas, size, strided=True)

    def gathered_over_replicas(size: float) -> Demand:  # an updated shard, gathered back ("world")
        return coll("all_gather", replicas, size, strided=True) if world_sharded else NONE

    # Ulysses: q, k, v in and the output back, each counted at a [tokens, hidden]
    # activation's size (an upper bound for k and v under GQA)
    a2a_bytes = batch * seq * _token_bytes(model, config.param_dtype)  # [batch, seq/sp, hidden]
    vp = wp if config.vocab_parallel else 1
    vocab_fwd, vocab_bwd = _vocab_parallel(coll, vp, batch * seq, _token_bytes(model, config.param_dtype))
    low = config.param_dtype.itemsize / 4 if config.param_dtype else 1.0  # summed: fp32 bytes
    return {
        "ag": [coll("all_gather", wp, b) for b in gather],
        "rs": [coll("reduce_scatter", wp, b) for b in reduce],
        "rep": [over_replicas(b / wp) for b in reduce],
        "rep_ag": [gathered_over_replicas(b / wp) for b in gather],
        "a2a": coll("all_to_all", sp, a2a_bytes).times(4) if sp > 1 else NONE,
        "vocab_fwd": vocab_fwd,
        "vocab_bwd": vocab_bwd,
        "outer_ag": coll("all_gather", wp, outer_gather) if root else NONE,
        "outer_rs": coll("reduce_scatter", wp, outer_reduce) if root else NONE,
        "outer_rep": over_replicas(outer_reduce / wp) if root else NONE,
        "outer_rep_ag": gathered_over_replicas(outer_gather / wp) if root else NONE,
        "repl_ar": coll("all_reduce", world, repl),
        "summed": over_replicas(summed),
        "summed_ag": gathered_over_replicas(summed * low),
    }


WP, SP, REPLICA, WORLD = "wp", "sp", "replica", "world"
"""The groups a rank issues on (each runs its collectives in issue order)."""


def _forward(clock: _Clock, c: _Costs, first: bool) -> float:
    """One micro-step's forward (and the outside's backward); returns when the last
    block's re-gather, issued as backward begins, completes. ``first``: the first
    micro-step after the optimizer step (``state_sharding="world"``'s replica
    gathers; see :data:`REPLICA_GATHER_AHEAD`)."""
    n = len(c.fwd)
    replica_done: dict[int, float] = {}

    def replica_gather(j: int) -> None:  # its pieces cast, then gathered between nodes
        if first and 0 <= j < n and c.rep_ag[j]:
            clock.t += c.piece_send[j]
            replica_done[j] = clock.issue(c.rep_ag[j], REPLICA)

    def wp_gather(j: int) -> float:  # the compute stream waits for the replica gather and unpacks it first
        if j in replica_done:
            clock.wait(replica_done.pop(j))
            clock.t += c.unpack[j]
        clock.t += c.send[j]
        return clock.issue(c.ag[j], WP)

    if first and c.outer_rep_ag:
        clock.wait(clock.issue(c.outer_rep_ag, REPLICA))
        clock.t += c.outer_refresh
    if first:  # the vocab-parallel head's and split embedding's pieces, brought up to date before block 0's
        clock.wait(clock.issue(c.summed_ag, REPLICA))
    clock.t += c.outer_send
    clock.wait(clock.issue(c.outer_ag, WP))
    clock.t += c.outer_land
    for j in range(REPLICA_GATHER_AHEAD):
        replica_gather(j)
    done = wp_gather(0) if n else 0.0
    for i in range(n):
        clock.wait(done)
        if i + 1 < n:
            done = wp_gather(i + 1)
        replica_gather(i + REPLICA_GATHER_AHEAD)
        clock.t += c.land[i] + c.fwd[i]
        if c.a2a:
            clock.wait(clock.issue(c.a2a, SP))
    for d in (d for ds in c.vocab_fwd.values() for d in ds):
        clock.wait(clock.issue(d, WP))
    last = wp_gather(n - 1) if n else 0.0  # backward begins with the last block
    clock.t += c.outer
    for d in (d for ds in c.vocab_bwd.values() for d in ds):
        clock.wait(clock.issue(d, WP))
    return last


def _backward(clock: _Clock, c: _Costs, last: float, sync: bool = True) -> None:
    """One micro-step's backward through the blocks, to the last reduction: each
    block's reduce-scatter over WP, then (issued when the next one is, or when room
    is made, and started when it completes: a stream wait) its shard over the replicas;
    at most ``max_inflight`` reduces in flight (see ``isp_comm/hooks/reductions.py``).
    Not ``sync``: a micro-step whose replica reductions are deferred ([Note: replica
    reductions deferred]): the WP stage alone, no replica or whole-gradient collective."""
    done, inflight = last, []  # inflight: [WP reduce-scatter's end, replica demand, replica's end or None]

    def to_replicas(entry: list) -> None:  # the compute stream waits for the WP stage (and packs the pieces)
        if entry[2] is None:
            clock.wait(entry[0] if entry[1] else 0.0)
            entry[2] = clock.issue(entry[1], REPLICA, entry[0])

    def complete_oldest() -> None:
        entry = inflight.pop(0)
        clock.wait(entry[0])
        to_replicas(entry)
        clock.wait(entry[2])

    for i in reversed(range(len(c.bwd))):
        clock.wait(done)
        if i > 0:
            clock.t += c.send[i - 1]
            done = clock.issue(c.ag[i - 1], WP)
        clock.t += c.land[i] + c.bwd[i] + (c.fwd[i] if i < c.n_ckpt else 0.0)
        if i < c.n_ckpt and c.a2a:
            clock.wait(clock.issue(c.a2a, SP))
        if c.a2a:
            clock.wait(clock.issue(c.a2a, SP))
        clock.t += c.pack[i]
        if c.grads[i]:
            while len(inflight) >= c.max_inflight:
                complete_oldest()
            rs_end = clock.issue(c.rs[i], WP)
            for entry in inflight:
                to_replicas(entry)
            inflight.append([rs_end, c.rep[i] if sync else None, None])
            if not clock.overlap:
                complete_oldest()
    while inflight:
        complete_oldest()
    clock.t += c.outer_pack
    if not sync:
        clock.wait(clock.issue(c.outer_rs, WP))
        return
    clock.wait(clock.issue(c.outer_rep, REPLICA, clock.issue(c.outer_rs, WP)))
    whole = clock.issue(c.repl_ar, WORLD)
    clock.wait(clock.issue(c.summed, REPLICA))
    clock.wait(whole)


def _optimizer(clock: _Clock, prof: Profile, n_params: int, elements: int, small_ar: Demand) -> None:
    """Once per optimizer step: the clip (a read of every gradient and one all-reduce),
    AdamW, and the all-reduce of the loss and the signal flag."""
    clock.t += n_params * 3 * prof.op_host_s + elements * 4 / interp(prof.elementwise, elements * 4)
    clock.wait(clock.issue(small_ar, WORLD))
    clock.t += n_params * prof.optimizer_tensor_s + elements * ADAMW_BYTES_PER_ELEMENT / prof.optimizer_bytes_per_s
    clock.wait(clock.issue(small_ar, WORLD))


STEADY_TOLERANCE_S = 1e-9
"""How far two micro-steps' states may differ and still count as one (float rounding
of absolute times: a few ulps of a step's seconds)."""


def _micro_steps(clock: _Clock, c: _Costs, grad_accum: int, phases: dict, exposed: dict, defer: bool = False) -> None:
    """The step's ``grad_accum`` micro-steps, forward then backward, their time and
    exposed time added to ``phases`` and ``exposed``; ``defer``: all but the last
    defer their replica reductions (the last then runs on its own, after the repeats).

    [Note: micro-steps repeat]
    Every micro-step after the first issues the same collectives after the same
    compute. Once one ends with the links as the one before it ended, relative to the
    compute clock (:meth:`TierSchedule.ahead`; in practice every collective done, as
    the backward waits for its reductions), each later one starts alike and takes the
    same time: they are added at once, not replayed (a 70B step of 64 micro-steps,
    80 blocks each, replays 3 of them)."""
    before, micro = None, 0
    while micro < grad_accum:
        t_start, e_start, busy_start = clock.t, clock.exposed, dict(clock.links.busy)
        phases_start, exposed_start = dict(phases), dict(exposed)
        sync = not defer or micro == grad_accum - 1
        for phase in ("forward", "backward"):
            t0, e0 = clock.t, clock.exposed
            if phase == "forward":
                last = _forward(clock, c, first=micro == 0)
            else:
                _backward(clock, c, last, sync)
            phases[phase] += clock.t - t0
            exposed[phase] += clock.exposed - e0
        ahead = clock.links.ahead(clock.t)
        left = grad_accum - micro - 1 - (1 if defer else 0)  # alike to come (the syncing one is not)
        if micro >= 2 and left > 0 and _same(ahead, before):
            shift = clock.t - t_start
            clock.links.repeat(shift, {k: v - busy_start.get(k, 0.0) for k, v in clock.links.busy.items()}, left)
            clock.t += left * shift
            clock.exposed += left * (clock.exposed - e_start)
            for totals, then in ((phases, phases_start), (exposed, exposed_start)):
                for key in totals:
                    totals[key] += left * (totals[key] - then[key])
            micro += left
            ahead = None
        before, micro = ahead, micro + 1


def _same(a: tuple | None, b: tuple | None) -> bool:
    """Whether two :meth:`TierSchedule.ahead` states are one, up to float rounding."""
    return (
        a is not None
        and b is not None
        and len(a) == len(b)
        and all(ka == kb and abs(va - vb) <= STEADY_TOLERANCE_S for (ka, va), (kb, vb) in zip(a, b))
    )


def step_time(
    model: nn.Module,
    config: ISPConfig | None,
    prof: Profile,
    *,
    world: int,
    wp: int | None,
    sp: int,
    batch: int,
    seq: int,
    grad_accum: int = 1,
    memo: dict | None = None,
    state_sharding: str | None = None,
    deferred_replica_sync: bool = False,
    compiled: bool = False,
) -> StepTime:
    """The predicted step (see the module note). ``batch``: sequences per micro-step over
    the whole job (each rank gets ``batch / (world / sp)`` of ``seq / sp`` tokens, as
    isp-train splits them); ``model``: built on meta; ``memo``: reused across calls on
    the same model (traces and layouts); ``state_sharding``: one of
    :data:`STATE_SHARDINGS` (default: the config's, else ``"wp"``);
    ``deferred_replica_sync``: the micro-steps but the last defer their replica
    reductions (``ISPCommunicator.set_requires_replica_sync``); ``compiled``: every
    block compiled, as ``isp-train --compile`` runs them (the outside stays eager): their
    element-wise operators fused into kernels ([Note: fused regions] in
    ``isp_comm/planner/fusion.py``)."""
    config = config or ISPConfig()
    memo = {} if memo is None else memo
    sharding = state_sharding or getattr(config, "state_sharding", "wp")
    if sharding not in STATE_SHARDINGS:
        raise ValueError(f"state_sharding must be one of {', '.join(STATE_SHARDINGS)}, got {sharding!r}")
    world_sharded = sharding == "world" and world // (wp or world // sp) > 1
    wp = wp or world // sp
    dp = world // sp
    if world % wp or world % sp or batch % dp or seq % sp:
        raise ValueError(f"world {world}, wp {wp}, sp {sp}, batch {batch}, seq {seq}: not a layout isp-train runs")
    if "blocks" not in memo:
        memo["blocks"] = list(find_blocks(model))
    if "n_params" not in memo:
        memo["n_params"] = sum(1 for p in model.parameters() if p.requires_grad)
    c = _costs(model, config, prof, (world, wp, sp, batch // dp, seq // sp), memo, world_sharded, compiled)
    clock = _Clock(prof.overlap)
    exposed = {"forward": 0.0, "backward": 0.0, "optimizer": 0.0}
    phases = {"forward": 0.0, "backward": 0.0, "optimizer": 0.0, "host": 0.0}
    defer = deferred_replica_sync and grad_accum > 1 and world > wp
    _micro_steps(clock, c, grad_accum, phases, exposed, defer)
    t0, e0 = clock.t, clock.exposed
    skey = ("sizes", wp, config.shard_outer_params, config.vocab_parallel, config.param_dtype, config.reduce_dtype)
    small_ar = collective_demand(prof, backend_of(config.backend, prof), "all_reduce", tuple(range(world)), 8)
    sharded, whole = memo[skey][1]
    elements = (-(-sharded // (world // wp)) if world_sharded else sharded) + whole
    _optimizer(clock, prof, memo["n_params"], elements, small_ar)
    phases["optimizer"], exposed["optimizer"] = clock.t - t0, clock.exposed - e0
    phases["host"] = prof.host_step_s.get("multi" if world > 1 else "single", 0.0)
    step = sum(phases.values())
    tokens = batch * grad_accum * seq
    per_token = memo.get(("flops", seq)) or memo.setdefault(("flops", seq), flops_per_token(model, seq))
    peak = prof.peak_flops.get("bf16" if config.param_dtype in (torch.bfloat16, torch.float16) else "fp32", 0.0)

    def total(ds) -> float:
        return sum(d.seconds for d in ds)

    replica_kind = "reduce_scatter" if world_sharded else "all_reduce"
    syncs = 1 if defer else grad_accum  # micro-steps that reduce over the replicas
    comm = {
        "all_gather": grad_accum * (2 * total(c.ag) + c.outer_ag.seconds)
        + total([*c.rep_ag, c.outer_rep_ag, c.summed_ag]),
        "reduce_scatter": grad_accum * (total(c.rs) + c.outer_rs.seconds),
        "all_to_all": grad_accum * c.a2a.seconds * (2 * len(c.fwd) + c.n_ckpt),
        "all_reduce": syncs * c.repl_ar.seconds + 2 * small_ar.seconds,
    }
    comm[replica_kind] += syncs * total([*c.rep, c.outer_rep, c.summed])
    for kind, ds in [*c.vocab_fwd.items(), *c.vocab_bwd.items()]:
        comm[kind] += grad_accum * total(ds)
    compute = {k: grad_accum * v for k, v in c.compute.items()}
    compute["copies"] += sum(c.piece_send) + sum(c.unpack) + c.outer_refresh  # once a step ("world")
    mfu = 100.0 * per_token * tokens / step / world / peak if peak else 0.0
    st = StepTime(step, tokens / step, mfu, phases, exposed, comm, compute, link_busy_s=dict(clock.links.busy))
    return _on_shared_cores(st, prof)


def _on_shared_cores(st: StepTime, prof: Profile) -> StepTime:
    """``st`` for ranks sharing the profile's cores (``Profile.cores``): each rank runs a
    share of the time, so every figure takes ranks per core times longer."""
    share = max(1.0, prof.per_node / prof.cores) if prof.cores else 1.0
    if share == 1.0:
        return st
    longer = lambda d: {k: v * share for k, v in d.items()}  # noqa: E731
    return StepTime(
        st.step_s * share, st.tokens_per_s / share, st.mfu_pct / share, longer(st.phases), longer(st.exposed_comm),
        longer(st.comm_s), longer(st.compute_s), longer(st.link_busy_s),
    )  # fmt: skip


def backend_of(requested: str, prof: Profile) -> str:
    """The backend whose collectives ``prof`` times for a run asking for ``requested``
    (``ISPConfig.backend``): the profile's default for ``"auto"`` or one it did not
    measure. The planner and a virtual run's links (``--virtual-world --profile``)
    both read this one."""
    backend = prof.default_backend if requested == "auto" else requested
    return backend if backend in prof.collectives else prof.default_backend


def _elements_per_rank(model: nn.Module, config: ISPConfig, wp: int, memo: dict) -> tuple[int, int]:
    """Trainable elements rank 0 keeps: of its shards, and of the replicated parameters."""
    key = ("layouts", wp, config.shard_outer_params, config.vocab_parallel, config.param_dtype, config.reduce_dtype)
    layouts, replicated = memo[key]
    shards = sum(sp_.valid_rows * sp_.inner for _, lay, tr in layouts for sp_, t in zip(lay.params, tr) if t)
    return shards, sum(p.numel() for p in replicated if p.requires_grad)


def _vocab_parallel(coll, wp: int, tokens: int, hidden_bytes: float) -> tuple[dict, dict]:
    """The vocab-parallel head's collectives over the WP group (:mod:`isp_comm.vocab_parallel`),
    demands by kind, forward and backward; none at wp 1. ``tokens``: this rank's;
    ``hidden_bytes``: one token's hidden state. Sizes are the gathered buffers'."""
    if wp <= 1:
        return {}, {}
    every = wp * tokens  # the WP group's tokens
    forward = {
        # hidden states, labels (int64), each rank's logit maxima for every token
        "all_gather": [
            coll("all_gather", wp, every * hidden_bytes),
            coll("all_gather", wp, every * 8),
            coll("all_gather", wp, wp * every * 4),
        ],
        "all_reduce": [coll("all_reduce", wp, 2 * every * 4)],  # the softmax's sums and target logits
    }
    backward = {
        "all_gather": [coll("all_gather", wp, every * 4)],  # each rank's loss gradients
        "reduce_scatter": [coll("reduce_scatter", wp, every * hidden_bytes)],  # the hidden states' gradient
    }
    return forward, backward


def _token_bytes(model: nn.Module, param_dtype: torch.dtype | None) -> float:
    """Bytes of one token's hidden state in the compute dtype (a rank's Ulysses
    all-to-all and the vocab-parallel head move ``tokens x`` this)."""
    cfg = getattr(model, "cfg", None) or getattr(model, "config", None)
    hidden = getattr(cfg, "hidden", None) or getattr(cfg, "hidden_size", 0)
    itemsize = param_dtype.itemsize if param_dtype is not None else 4
    return float(hidden * itemsize)
