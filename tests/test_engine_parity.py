"""ISP training equals single-process training of the same global batch (fp32, gloo)."""

from __future__ import annotations

import itertools
import os

import pytest
import torch

from isp_comm.backends.symm_cpu import HOST_ENV
from isp_comm.testing import run_ranks
from tests.parity import ATOL, Case, check_parity, max_diff, parity_worker, train_isp, train_reference

CASES = [
    Case(optim=o, micro=m, ckpt=c, bias=b)
    for o, m, c, b in itertools.product(("sgd", "adamw"), (1, 3), (0.0, 0.5, 1.0), (False, True))
]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("world", [1, 2, *(pytest.param(w, marks=pytest.mark.slow) for w in (3, 4))])  # the slow tier
def test_parity_full_matrix(world: int) -> None:
    # Every combination of optimizer, micro-steps, checkpoint ratio and bias, wp = world.
    cases = CASES if world in (2, 4) else CASES[::3]
    check_parity(run_ranks(parity_worker, world, world, cases, {}, timeout_s=380))


@pytest.mark.slow  # 12 s; the CI tier's parity matrix at world 2 keeps overlap on
@pytest.mark.timeout(200)
def test_parity_replicas_and_no_overlap() -> None:
    # world 4 with wp 2: two replica groups also all-reduce the shards' gradients.
    cases = [Case(optim="adamw", micro=3, ckpt=0.5, bias=True), Case()]
    check_parity(run_ranks(parity_worker, 4, 2, cases, {}, timeout_s=180))
    check_parity(run_ranks(parity_worker, 2, 2, cases, {"overlap": False, "memory_pool": False}, timeout_s=180))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, *(pytest.param(w, marks=pytest.mark.slow) for w in (3, 4))])
def test_parity_torch_backend(world: int) -> None:
    # The matrix above runs the default backend ("auto": shared memory on CPU). Every
    # 5th case from the 3rd covers each optimizer, micro count, checkpoint ratio and bias.
    check_parity(run_ranks(parity_worker, world, world, CASES[2::5], {"backend": "torch"}, timeout_s=280))


@pytest.mark.timeout(200)
def test_parity_with_the_reduce_scatter_pairs_given_back_between_backwards() -> None:
    # release_reduce_buffers (on by default on CUDA): the pairs are made again in every
    # backward, three micro-steps included, and dropped when it ends; the same training.
    cases = [Case(optim="adamw", micro=3, ckpt=0.5, bias=True), Case()]
    check_parity(run_ranks(parity_worker, 2, 2, cases, {"backend": "torch", "release_reduce_buffers": True}))


def _two_host_worker(rank: int, world: int, cases: list[Case]) -> list[tuple]:
    # ranks 0,1 on "host0" and 2,3 on "host1": the WP groups {0,1} and {2,3} use shared
    # memory, the replica groups {0,2}, {1,3} and the world fall back to gloo.
    os.environ[HOST_ENV] = f"host{rank // 2}"
    return parity_worker(rank, world, 2, cases, {"backend": "symm"})


@pytest.mark.timeout(200)
def test_parity_symm_two_host_simulation() -> None:
    cases = [Case(optim="adamw", micro=3, ckpt=0.5, bias=True), Case()]
    check_parity(run_ranks(_two_host_worker, 4, cases, timeout_s=180))


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "world, backend",
    [(2, "symm"), pytest.param(3, "torch", marks=pytest.mark.slow), pytest.param(4, "symm", marks=pytest.mark.slow)],
)
def test_parity_with_outer_params_sharded(world: int, backend: str) -> None:
    # Embedding sharded along the hidden dim, final norm and head along dim 0 (vocab 37
    # pads at wp 2 and 4).
    kw = {"shard_outer_params": True, "backend": backend}
    # every 5th case covers each optimizer, micro count, checkpoint ratio (full too) and bias
    assert {c.ckpt for c in CASES[::5]} == {0.0, 0.5, 1.0} and {c.bias for c in CASES[::5]} == {False, True}
    check_parity(run_ranks(parity_worker, world, world, CASES[::5], kw, timeout_s=280))


def _outer_dims_worker(rank: int, world: int, cases: list[Case]) -> list[tuple]:
    def shapes(comm) -> None:  # hidden 18 over 4 ranks: 5, 5, 5, 3 columns; vocab 37: 10, 10, 10, 7 rows
        model = comm.model
        assert model.embed.weight.shape == (37, 5 if rank < 3 else 3), model.embed.weight.shape
        assert model.lm_head.weight.shape == (10 if rank < 3 else 7, 18), model.lm_head.weight.shape
        # the embedding is looked up hidden-split, never gathered: not in the gathered unit
        assert comm.embed_unit is not None and "embed.weight" not in {sp.fqn for sp in comm.root.params}

    out = []
    for case in cases:
        ref_sd, ref_losses = train_reference(case, world)
        sd, losses, _ = train_isp(case, rank, world, world, after_wrap=shapes, shard_outer_params=True)
        out.append((case, max_diff(sd, ref_sd), max(abs(a - b) for a, b in zip(losses, ref_losses))))
    return out


@pytest.mark.timeout(200)
def test_embedding_split_along_hidden_with_padding() -> None:
    # The embedding is split along its hidden dim (padded columns at 18 over 4) and
    # looked up without gathering: every rank's columns for the WP group's tokens, one
    # all-to-all; its gradient comes back by the inverse all-to-all and index_add.
    cases = [Case(model="narrow"), Case(model="narrow", optim="adamw", micro=3, ckpt=0.5, bias=True)]
    check_parity(run_ranks(_outer_dims_worker, 4, cases, timeout_s=180))


class _ScaledEmbedding(torch.nn.Embedding):
    """An embedding with a forward of its own, as Gemma's scales by sqrt(hidden)."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids) * self.embedding_dim**0.5


def _scaled_embedding_worker(rank: int, world: int) -> tuple[float, bool]:
    """The tiny llama with a scaled embedding, its outer parameters sharded, against the
    plain model: the largest difference after two SGD steps, and whether the embedding
    was left to the gathered outer unit (which runs its own forward)."""
    from isp_comm import ISPCommunicator, ISPConfig, ParallelGroups
    from isp_comm.models.llama import LlamaConfig, build
    from tests.parity import TINY, loss_fn

    model, ref = build(LlamaConfig(**TINY)), build(LlamaConfig(**TINY))
    for m in (model, ref):
        m.embed.__class__ = _ScaledEmbedding
    comm = ISPCommunicator(model, ParallelGroups.create(wp_size=world), ISPConfig(shard_outer_params=True))
    opt, ropt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(0)
    for _ in range(2):
        a, b = (torch.randint(0, 37, (2 * world, 8), generator=g) for _ in range(2))
        loss_fn(model(a.chunk(world)[rank]), b.chunk(world)[rank]).backward()
        loss_fn(ref(a), b).backward()
        opt.step(), ropt.step()
        opt.zero_grad(), ropt.zero_grad()
    gathered = comm.embed_unit is None
    return _distance_and_close(comm, ref), gathered


@pytest.mark.timeout(120)
def test_an_embedding_with_a_forward_of_its_own_keeps_it() -> None:
    # fp32 SGD: 1e-5 covers the sums' order. Before, the hidden-split lookup replaced
    # the forward and dropped the scale (~2e-2 off, silently: Gemma's embedding)
    for diff, gathered in run_ranks(_scaled_embedding_worker, 2, timeout_s=100):
        assert gathered and diff < 1e-5, (diff, gathered)


def _module_granularity_worker(rank: int, world: int, backend: str) -> list[tuple]:
    out = []
    for case in [Case(), Case(optim="adamw", micro=3, ckpt=0.5, bias=True)]:
        ref_sd, ref_losses = train_reference(case, world)
        kw = {"comm_granularity": "module", "backend": backend}

        def no_landing(comm) -> None:
            assert set(comm.memory_plan().staging_numel.values()) == {0}

        sd, losses, stats = train_isp(case, rank, world, world, after_wrap=no_landing, **kw)
        # one collective per weight (and bias) of the 7 linears of each of the 3 blocks:
        # gathered once in forward and once in backward, reduced once, per micro-step
        per_pass = 3 * 7 * (2 if case.bias else 1)
        passes = case.steps * case.micro
        assert stats["all_gathers"] == 2 * per_pass * passes, stats
        assert stats["reduce_scatters"] == per_pass * passes, stats
        if backend == "symm":  # every collective went straight between the peers' pool buffers
            assert stats["direct_all_gathers"] == stats["all_gathers"], stats
            assert stats["direct_reduce_scatters"] == stats["reduce_scatters"], stats
        out.append((case, max_diff(sd, ref_sd), max(abs(a - b) for a, b in zip(losses, ref_losses))))
    return out


@pytest.mark.timeout(200)
@pytest.mark.parametrize(
    "world, backend",
    [(2, "symm"), pytest.param(3, "torch", marks=pytest.mark.slow), pytest.param(4, "symm", marks=pytest.mark.slow)],
)
def test_parity_module_granularity(world: int, backend: str) -> None:
    # one collective per parameter, landing in the slot directly (no landing buffer)
    check_parity(run_ranks(_module_granularity_worker, world, backend, timeout_s=180))


def _bucket_worker(rank: int, world: int, case: Case) -> tuple[float, float, list[str], int]:
    ref_sd, ref_losses = train_reference(case, world)
    seen: dict = {}
    sd, losses, _ = train_isp(
        case, rank, world, 2, after_wrap=lambda comm: seen.update(events=comm.record_events()), bucket_mb=1e-4
    )
    phases = [phase for _, _, phase in seen["events"]]
    start = phases.index("backward")
    end = phases.index("forward", start)  # the first micro-step's backward
    first = [kind for kind, _, _ in seen["events"][start:end]]
    # replicated: the norms, the embedding and the head (everything no block linear holds)
    n_replicated = sum(not n.startswith("layers.") or "norm" in n for n, _ in case.build().named_parameters())
    return max_diff(sd, ref_sd), max(abs(a - b) for a, b in zip(losses, ref_losses)), first, n_replicated


@pytest.mark.timeout(200)
def test_whole_gradients_are_reduced_in_buckets_during_backward() -> None:
    """World 4, wp 2: with buckets of one parameter (``bucket_mb`` tiny), the
    replicated parameters' gradients are all-reduced as autograd produces them,
    between the blocks' reduce-scatters (whose replica all-reduces are asynchronous
    too), and training still equals single-process training."""
    case = Case(optim="adamw", micro=2, ckpt=0.5, bias=True)
    for d, ld, kinds, n_replicated in run_ranks(_bucket_worker, 4, case, timeout_s=180):
        assert d <= ATOL["adamw"] and ld <= 2e-6, (d, ld)
        reduces = [i for i, k in enumerate(kinds) if k == "reduce_scatter"]
        buckets = [i for i, k in enumerate(kinds) if k == "all_reduce"]
        assert len(buckets) == n_replicated, kinds  # one bucket each
        assert buckets[0] < reduces[0] and buckets[-1] > reduces[-1], kinds  # the head's first, the embedding's last


def _inference_worker(rank: int, world: int, cfg: dict, evaluate: bool) -> list[float]:
    """Two AdamW steps on a tiny llama, with (``evaluate``) a forward under
    ``torch.inference_mode`` before the first and after each: its final logits."""
    from isp_comm import ISPCommunicator, ISPConfig, ParallelGroups
    from isp_comm.models.llama import LlamaConfig, build

    model = build(LlamaConfig(vocab_size=40, hidden=16, ffn_hidden=24, n_layers=2, n_heads=4, n_kv_heads=2))
    comm = ISPCommunicator(model, ParallelGroups.create(wp_size=2), ISPConfig(**cfg))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    x = torch.randint(0, 40, (2, 8), generator=torch.Generator().manual_seed(rank))
    for _ in range(2):
        if evaluate:
            with torch.inference_mode():
                model(x)
        comm.cross_entropy(model(x[:, :-1]), x[:, 1:]).backward()
        comm.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
    with torch.inference_mode():
        out = model(x).flatten().tolist()
    comm.close()
    return out


@pytest.mark.timeout(300)
def test_evaluations_under_inference_mode_change_nothing() -> None:
    # An evaluation before the first step (its forward makes the engine's first buffers)
    # and between steps: the training after it is bitwise the one without. Buffers kept
    # across steps are made outside inference mode, and the shared-memory backend's
    # worker thread writes an inference tensor under it, as the caller would.
    for cfg in (
        {"shard_outer_params": True},
        {"shard_outer_params": True, "backend": "torch", "state_sharding": "world"},
        {"shard_outer_params": True, "param_dtype": torch.bfloat16, "state_sharding": "world"},
    ):
        evaluated = run_ranks(_inference_worker, 4, cfg, True, timeout_s=120)
        plain = run_ranks(_inference_worker, 4, cfg, False, timeout_s=120)
        assert evaluated == plain, cfg


def _unplanned_worker(rank: int, world: int, shard_outer: bool) -> dict:
    """Three steps that did not go as planned, each then trained on as a plain loop
    would (see [Note: steps that did not go as planned]); the model after them is
    compared with the single-process model trained on the same batches."""
    from isp_comm import ISPCommunicator, ISPConfig, ParallelGroups
    from isp_comm.models.llama import LlamaConfig, build
    from tests.parity import TINY, backward_that_raises, loss_fn

    g = torch.Generator().manual_seed(0)
    data = [(torch.randint(0, 37, (2 * world, 8), generator=g), torch.randint(0, 37, (2 * world, 8), generator=g))]
    data *= 4
    model, ref = build(LlamaConfig(**TINY)), build(LlamaConfig(**TINY))
    comm = ISPCommunicator(model, ParallelGroups.create(wp_size=world), ISPConfig(shard_outer_params=shard_outer))
    opt, ropt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    mine = lambda t: t.chunk(world)[rank]  # noqa: E731

    def step(i: int) -> None:
        x, y = data[i]
        loss_fn(model(mine(x)), mine(y)).backward()
        loss_fn(ref(x), y).backward()

    x, y = data[0]
    # 0. a second backward over one forward (retain_graph): refused, by name, the engine left as it was
    loss = loss_fn(model(mine(x)), mine(y))
    loss.backward(retain_graph=True)
    try:
        loss.backward()
        second = ""
    except RuntimeError as e:
        second = str(e)
    del loss
    opt.zero_grad()

    # 1. an exception escapes a backward once the blocks' own have run (a check on the
    # embeddings' gradient that raises): gradients zeroed, training goes on
    backward_that_raises(model, mine(x), mine(y))
    phase_after_abort = comm.engine.phase.name
    opt.zero_grad()
    step(0)
    # 2. a forward with grad and no backward after the backward (an accuracy forward), then the step
    model(mine(x)).argmax(-1)
    opt.step(), ropt.step()
    opt.zero_grad(), ropt.zero_grad()
    # 3. an evaluation that raises before the first block (a token id past the vocabulary), then the step
    step(1)
    bad = mine(x).clone()
    bad[0, 0] = 1000
    with torch.no_grad():
        try:
            model(bad)
        except IndexError:
            pass
    opt.step(), ropt.step()
    opt.zero_grad(), ropt.zero_grad()
    # 4. the same, interrupted in a block (KeyboardInterrupt: torch runs its always-call
    # forward hooks for an Exception only, so the next forward undoes what it left)
    step(2)
    handle = model.layers[1].register_forward_hook(lambda *_: (_ for _ in ()).throw(KeyboardInterrupt))
    with torch.no_grad():
        try:
            model(mine(x))
        except KeyboardInterrupt:
            pass
    handle.remove()
    opt.step(), ropt.step()
    with torch.no_grad():
        out = {"logits": (model(mine(x)) - ref(mine(x))).abs().max().item(), "second": second}
    out["phase_after_abort"] = phase_after_abort
    full = comm.full_state_dict()
    out["weights"] = max((full[k] - v).abs().max().item() for k, v in ref.state_dict().items())
    comm.close()
    return out


@pytest.mark.timeout(200)
@pytest.mark.parametrize("shard_outer", [False, True])
def test_steps_that_did_not_go_as_planned_train_on_like_a_plain_loop(shard_outer: bool) -> None:
    # fp32 SGD at world 2, the blocks' sums in the same order: 1e-5 covers the logits' rounding.
    # Before: after the aborted backward no replicated gradient was averaged again (the
    # ranks drifted apart), the accuracy forward's stash made the step skip the head and
    # norms, and the failed forward left the outer region gathered with the old weights.
    for r in run_ranks(_unplanned_worker, 2, shard_outer, timeout_s=150):
        assert r["logits"] < 1e-5 and r["weights"] < 1e-5, r
        assert "a second backward over one forward (retain_graph=True)" in r["second"], r
        assert "(loss1 + loss2).backward()" in r["second"], r  # what a multi-loss loop does instead
        assert r["phase_after_abort"] == "BACKWARD", r  # the case needs the backward begun


def _wrapped_and_plain(
    wp: int, config_kw: dict, forward=None, frozen: str = "", prepare=None, device: str | torch.device = "cpu"
) -> tuple:
    """The tiny llama wrapped and a plain copy (its forward replaced by ``forward``
    in both when given; ``frozen`` in both: every block's ``"attention"``, or the
    whole ``"first block"``; ``prepare(model)`` called on both before wrapping), both
    on ``device``, each with SGD at lr 0.1."""
    import types

    from isp_comm import ISPCommunicator, ISPConfig, ParallelGroups
    from isp_comm.models.llama import LlamaConfig, build
    from tests.parity import TINY

    model, ref = build(LlamaConfig(**TINY)), build(LlamaConfig(**TINY))
    if forward is not None:
        model.forward, ref.forward = types.MethodType(forward, model), types.MethodType(forward, ref)
    for m in (model, ref):
        for layer in m.layers if frozen == "attention" else ():
            layer.attn.requires_grad_(False)
        if frozen == "first block":
            m.layers[0].requires_grad_(False)
        if prepare is not None:
            prepare(m)
        m.to(device)
    comm = ISPCommunicator(model, ParallelGroups.create(wp_size=wp), ISPConfig(**config_kw))
    opt, ropt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    return model, ref, comm, opt, ropt


def _distance_and_close(comm, ref) -> float:
    """The largest difference between the wrapped model's full weights and the plain one's."""
    full = comm.full_state_dict()
    comm.close()
    return max((full[k] - v).abs().max().item() for k, v in ref.state_dict().items() if k in full)


def _two_forwards_worker(rank: int, world: int, wp: int, config_kw: dict, frozen: str) -> float:
    """Two forwards with grad, then one backward of their summed losses (DPO's chosen
    and rejected), with an evaluation forward without grad between them and the
    backward; two micro-steps of accumulation, two steps of SGD. Returns the largest
    difference from the single-process model trained on the same global batches."""
    from tests.parity import loss_fn

    g = torch.Generator().manual_seed(0)
    model, ref, comm, opt, ropt = _wrapped_and_plain(wp, config_kw, frozen=frozen)
    mine = lambda t: t.chunk(world)[rank]  # noqa: E731

    def pair(m, a, b, part) -> torch.Tensor:
        return (loss_fn(m(part(a)), part(b)) + 0.5 * loss_fn(m(part(b)), part(a))) / 2

    for _ in range(2):
        for _ in range(2):
            a, b = (torch.randint(0, 37, (2 * world, 8), generator=g) for _ in range(2))
            loss = pair(model, a, b, mine)
            with torch.no_grad():
                model(mine(b))
            loss.backward()
            pair(ref, a, b, lambda t: t).backward()
        opt.step(), ropt.step()
        opt.zero_grad(), ropt.zero_grad()
    return _distance_and_close(comm, ref)


@pytest.mark.timeout(200)
def test_two_forwards_then_one_backward_train_as_a_plain_model() -> None:
    # fp32 SGD, the global batch split over ranks: 1e-5 covers the sums' order.
    # Before: the second use of a block in one backward stopped with an assertion
    # ("gradients were produced twice in one backward").
    # A whole frozen block has no post-backward and its views no node: before, block
    # 0's first backward never ended (the next forward's last block then found its
    # slot held: the slot error; with a slot each, "already swapped in").
    cases = (
        (2, 2, {}, ""),
        (2, 2, {"shard_outer_params": True}, "attention"),  # the blocks' first weights frozen: no node
        (2, 2, {"activation_checkpointing": 1.0, "comm_granularity": "module"}, ""),
        (2, 2, {}, "first block"),
        (2, 2, {"n_slots": 3, "activation_checkpointing": 1.0}, "first block"),
        (4, 2, {"state_sharding": "world", "overlap": False}, ""),
        (4, 2, {"state_sharding": "world", "backend": "torch"}, "attention"),
    )
    for world, wp, kw, frozen in cases:
        diffs = run_ranks(_two_forwards_worker, world, wp, kw, frozen, timeout_s=120)
        assert max(diffs) < 1e-5, (world, wp, kw, frozen, diffs)


def _unfrozen_after_a_forward_worker(rank: int, world: int, wp: int, config_kw: dict, live: bool) -> str | float:
    """Block 1 frozen for a forward with grad, whose outputs are dropped (an accuracy
    forward) or kept (``live``); then unfrozen, its weights and its norms, and one
    forward, backward and SGD step. Returns the refusal, or the largest difference from
    the single-process model doing the same."""
    from tests.parity import loss_fn

    model, ref, comm, opt, ropt = _wrapped_and_plain(wp, config_kw)
    g = torch.Generator().manual_seed(0)
    a, b = (torch.randint(0, 37, (2 * world, 8), generator=g) for _ in range(2))
    mine = lambda t: t.chunk(world)[rank]  # noqa: E731
    model.layers[1].requires_grad_(False)
    kept = model(mine(a)) if live else model(mine(a)).sum().item()
    for m in (model, ref):
        m.layers[1].requires_grad_(True)
    try:
        loss_fn(model(mine(a)), mine(b)).backward()
    except RuntimeError as e:
        del kept
        comm.close()
        return str(e)
    loss_fn(ref(a), b).backward()
    opt.step(), ropt.step()
    return _distance_and_close(comm, ref)


@pytest.mark.timeout(200)
def test_requires_grad_changed_after_a_forward_with_grad() -> None:
    # After a forward whose graph is gone, the next arms the reductions anew: before,
    # block 1's norms, unfrozen in between, got no bucket and were never averaged (the
    # ranks drifted apart by ~1e-3). fp32 SGD: 1e-5 covers the sums' order.
    for world, wp, kw in ((2, 2, {}), (2, 1, {}), (4, 2, {"state_sharding": "world"})):
        diffs = run_ranks(_unfrozen_after_a_forward_worker, world, wp, kw, False, timeout_s=120)
        assert max(diffs) < 1e-5, (world, wp, kw, diffs)
    # with the first forward's graph alive, one backward could run through both, each
    # reduced as the later says: refused (before, block 1's first gradients were lost)
    for said in run_ranks(_unfrozen_after_a_forward_worker, 2, 2, {}, True, timeout_s=120):
        assert "requires_grad changed between two forwards with grad whose graphs are both alive" in said, said


def _held_slot_worker(rank: int, world: int, frozen: bool) -> tuple[str, str]:
    """Block 0's slot taken by another owner while a forward's views of it are alive:
    its next gather waits for that slot (the gather raises the slot error here, where
    nothing will free it) instead of landing elsewhere, where the first forward's
    backward would read another block's bytes. Once that graph is dropped, any free
    slot does. ``frozen``: the whole block 0 (its views out of no node)."""
    import gc

    from isp_comm import ISPCommunicator, ISPConfig, ParallelGroups
    from isp_comm.models.llama import LlamaConfig, build
    from tests.parity import TINY

    model = build(LlamaConfig(**TINY))
    model.layers[0].requires_grad_(not frozen)
    comm = ISPCommunicator(model, ParallelGroups.create(wp_size=world), ISPConfig())
    engine = comm.engine
    unit, st = engine.units[0], engine.states[0]
    x = torch.randint(0, 37, (1, 8))
    loss = model(x).sum()  # block 0's views of its slot saved for this loss's backward
    dt, slot = unit.gather_dtype, st.slot
    engine.pool.acquire(dt, slot, 99, unit.gathered_numel, slot)  # another owner holds the slot
    try:
        engine.ensure_gathered(unit)
        held = ""
    except RuntimeError as e:
        held = str(e)
    del loss
    gc.collect()
    engine.ensure_gathered(unit)
    dropped = f"slot {st.slot}, was {slot}"
    engine.release(unit)
    engine.pool.release(dt, slot, 99, unit.gathered_numel)
    comm.close()
    return held, dropped


@pytest.mark.parametrize("frozen", [False, True], ids=["trainable", "frozen"])
def test_a_gather_keeps_the_slot_a_live_forward_saved_views_of(frozen: bool) -> None:
    # Before, a frozen block's gather took any free slot: its first forward's backward
    # would have read another block's bytes.
    held, dropped = run_ranks(_held_slot_worker, 2, frozen, timeout_s=60)[0]
    assert "block 0 needs slot" in held, held
    assert dropped == "slot 1, was 0", dropped


def _checkpointed_run_worker(rank: int, world: int, blocks: int, reentrant: bool) -> str | float:
    """A forward that wraps its first ``blocks`` blocks in one ``torch.utils.checkpoint``
    region (a user's own recomputation of a run of layers); two steps of SGD. Returns
    the refusal, or the largest difference from the single-process model."""
    from torch.utils.checkpoint import checkpoint

    from isp_comm.models.llama import rope_tables
    from tests.parity import loss_fn

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        cos, sin = rope_tables(self.cfg, torch.arange(input_ids.shape[1]))

        def run(h: torch.Tensor, layers) -> torch.Tensor:
            for layer in layers:
                h = layer(h, cos, sin, None)
            return h

        h = checkpoint(run, self.embed(input_ids), self.layers[:blocks], use_reentrant=reentrant)
        return self.lm_head(self.norm(run(h, self.layers[blocks:])))

    g = torch.Generator().manual_seed(0)
    model, ref, comm, opt, ropt = _wrapped_and_plain(world, {}, forward)  # three blocks, two slots
    mine = lambda t: t.chunk(world)[rank]  # noqa: E731
    for _ in range(2):
        a, b = (torch.randint(0, 37, (2 * world, 8), generator=g) for _ in range(2))
        try:
            loss_fn(model(mine(a)), mine(b)).backward()
        except RuntimeError as e:
            comm.close()
            return str(e)
        loss_fn(ref(a), b).backward()
        opt.step(), ropt.step()
        opt.zero_grad(), ropt.zero_grad()
    return _distance_and_close(comm, ref)


@pytest.mark.timeout(200)
def test_a_checkpoint_around_a_run_of_blocks() -> None:
    # fp32 SGD: 1e-5 covers the sums' order. A region of as many blocks as slots trains
    for reentrant in (False, True):
        diffs = run_ranks(_checkpointed_run_worker, 2, 2, reentrant, timeout_s=120)
        assert max(diffs) < 1e-5, (reentrant, diffs)
    # one more is refused, saying why (before: "blocks must run in the order of the
    # block list", which they did)
    for reentrant in (False, True):
        for said in run_ranks(_checkpointed_run_worker, 2, 3, reentrant, timeout_s=120):
            assert "a torch.utils.checkpoint region may hold at most n_slots blocks" in said, said


def _early_exit_worker(rank: int, world: int, config_kw: dict, returns: bool = True) -> float:
    """A model whose forward stops after its first two blocks on every other step (an
    early exit, a layer-dropping schedule), with grad; SGD against the single-process
    model doing the same. ``returns``: the forward returns its logits, else keeps them
    in an attribute and returns ``None``."""
    from isp_comm.models.llama import rope_tables
    from tests.parity import loss_fn

    def forward(self, input_ids: torch.Tensor, depth: int | None = None) -> torch.Tensor:
        cos, sin = rope_tables(self.cfg, torch.arange(input_ids.shape[1]))
        h = self.embed(input_ids)
        for layer in self.layers[:depth]:
            h = layer(h, cos, sin, None)
        self.logits = self.lm_head(self.norm(h))
        return self.logits if returns else None

    g = torch.Generator().manual_seed(0)
    model, ref, comm, opt, ropt = _wrapped_and_plain(world, config_kw, forward)  # three blocks
    for step in range(4):
        depth = 2 if step % 2 == 0 else None
        a, b = (torch.randint(0, 37, (2 * world, 8), generator=g) for _ in range(2))
        model(a.chunk(world)[rank], depth)
        loss_fn(model.logits, b.chunk(world)[rank]).backward()
        ref(a, depth)
        loss_fn(ref.logits, b).backward()
        opt.step(), ropt.step()
        opt.zero_grad(), ropt.zero_grad()
    return _distance_and_close(comm, ref)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("config_kw", [{}, {"state_sharding": "world", "shard_outer_params": True}])
def test_a_forward_that_exits_early_trains_as_a_plain_model(config_kw: dict) -> None:
    # fp32 SGD at world 2: 1e-5 covers the sums' order. Before: the third block,
    # prefetched while the second computed and never run, kept the slot the first
    # block's backward needed ("block 0 needs slot 0 but the slots are held by blocks
    # [2, None]").
    assert max(run_ranks(_early_exit_worker, 2, config_kw, timeout_s=90)) < 1e-5


@pytest.mark.timeout(120)
def test_a_forward_that_exits_early_and_returns_none_trains_as_a_plain_model() -> None:
    # fp32 SGD at world 2: 1e-5 covers the sums' order. A forward that keeps its
    # logits in an attribute and returns None was taken for one that raised, whose
    # prefetched block waits for the next forward: the first block's backward then
    # found its slot held by the third ("the slots are held by blocks [2, None]").
    assert max(run_ranks(_early_exit_worker, 2, {}, False, timeout_s=90)) < 1e-5


def _identity_block_worker(
    rank: int, world: int, wp: int, config_kw: dict, skipping: tuple[int, ...], device: str | torch.device = "cpu"
) -> float:
    """The last of the three blocks is the identity on every other step (its forward
    returns its input and uses none of its weights: a LayerDrop that still calls the
    block) on the ranks in ``skipping``; SGD against the plain model of the global
    batch, the block the identity for those ranks' rows, on ``device`` (tests/gpu:
    ``cuda:0``)."""
    from tests.parity import loss_fn

    if torch.device(device).type == "cuda":
        torch.cuda.set_device(device)

    skip = [False]

    def prepare(m: torch.nn.Module) -> None:
        compute = m.layers[2].forward
        m.layers[2].forward = lambda h, *args, **kwargs: h if skip[0] else compute(h, *args, **kwargs)

    g = torch.Generator().manual_seed(0)
    model, ref, comm, opt, ropt = _wrapped_and_plain(wp, config_kw, prepare=prepare, device=device)
    for step in range(4):
        a, b = (torch.randint(0, 37, (2 * world, 8), generator=g).to(device) for _ in range(2))
        skip[0] = step % 2 == 0 and rank in skipping
        loss_fn(model(a.chunk(world)[rank]), b.chunk(world)[rank]).backward()
        logits = []
        for r, rows in enumerate(a.chunk(world)):
            skip[0] = step % 2 == 0 and r in skipping
            logits.append(ref(rows))
        loss_fn(torch.cat(logits), b).backward()
        opt.step(), ropt.step()
        opt.zero_grad(), ropt.zero_grad()
    return _distance_and_close(comm, ref)


@pytest.mark.timeout(150)
@pytest.mark.parametrize(
    "world, wp, config_kw, skipping",
    [
        (2, 2, {}, (0, 1)),
        (2, 2, {"activation_checkpointing": 1.0}, (0, 1)),
        (2, 2, {"find_unused_parameters": True, "backend": "symm", "timeout_s": 30}, (0,)),
        (4, 2, {"find_unused_parameters": True, "state_sharding": "world"}, (1, 2)),
    ],
    ids=["every-rank", "checkpointed", "one-rank-one-queue", "world-sharding"],
)
def test_a_block_that_uses_none_of_its_weights_trains_as_a_plain_model(
    world: int, wp: int, config_kw: dict, skipping: tuple[int, ...]
) -> None:
    # fp32 SGD: 1e-5 covers the sums' order. Before, the block held its slot to the
    # backward's end, and the first block's backward found its slot taken ("block 0
    # needs slot 0 but the slots are held by blocks [2, None]"); on the ranks that
    # skipped it only, its reduce-scatter was never issued (find_unused_parameters:
    # its peers waited at the deadline).
    assert max(run_ranks(_identity_block_worker, world, wp, config_kw, skipping, timeout_s=120)) < 1e-5


def _zero_after_forward_worker(rank: int, world: int, wp: int, config_kw: dict) -> float:
    """Three steps of SGD in the order forward, ``zero_grad()``, backward, step (the
    earlier step's gradients still in ``.grad`` at the forward), against the plain model."""
    from tests.parity import loss_fn

    g = torch.Generator().manual_seed(0)
    model, ref, comm, opt, ropt = _wrapped_and_plain(wp, config_kw)
    for _ in range(3):
        a, b = (torch.randint(0, 37, (2 * world, 8), generator=g) for _ in range(2))
        loss, ref_loss = loss_fn(model(a.chunk(world)[rank]), b.chunk(world)[rank]), loss_fn(ref(a), b)
        opt.zero_grad(), ropt.zero_grad()
        loss.backward(), ref_loss.backward()
        opt.step(), ropt.step()
    return _distance_and_close(comm, ref)


def _frozen_before_backward_worker(rank: int, world: int, wp: int) -> float:
    """Two steps of two micro-steps, the final norm (a replicated parameter) frozen
    between the second micro-step's forward and its backward, in both models: autograd
    adds nothing to the first micro-step's gradient, and SGD steps on that (a
    parameter with a gradient), frozen or not."""
    from tests.parity import loss_fn

    g = torch.Generator().manual_seed(0)
    model, ref, comm, opt, ropt = _wrapped_and_plain(wp, {})
    for _ in range(2):
        for micro in range(2):
            a, b = (torch.randint(0, 37, (2 * world, 8), generator=g) for _ in range(2))
            loss, ref_loss = loss_fn(model(a.chunk(world)[rank]), b.chunk(world)[rank]), loss_fn(ref(a), b)
            if micro:
                model.norm.requires_grad_(False), ref.norm.requires_grad_(False)
            loss.backward(), ref_loss.backward()
        opt.step(), ropt.step()
        opt.zero_grad(), ropt.zero_grad()
        model.norm.requires_grad_(True), ref.norm.requires_grad_(True)
    return _distance_and_close(comm, ref)


@pytest.mark.timeout(60)
def test_a_parameter_frozen_between_forward_and_backward_keeps_its_earlier_gradient() -> None:
    # fp32 SGD: 1e-5 covers the sums' order. The replicated gradients of earlier
    # micro-steps are set aside while a backward's are averaged, then added back: one
    # frozen after the forward that armed them must get its earlier gradient back too
    assert max(run_ranks(_frozen_before_backward_worker, 2, 2, timeout_s=50)) < 1e-5


def _block_frozen_before_backward_worker(rank: int, world: int, wp: int, config_kw: dict) -> tuple[float, list]:
    """Block 1 frozen between the first step's forward and its backward, in both
    models, thawed for the second step: autograd gives its parameters no gradient (the
    shards' are computed by the engine, the norms' set to zeros by their buckets), so
    the first step leaves them alone. The difference after two steps of SGD, and the
    block's parameters that had a gradient after that backward."""
    from tests.parity import loss_fn

    g = torch.Generator().manual_seed(0)
    model, ref, comm, opt, ropt = _wrapped_and_plain(wp, config_kw)
    with_grad = []
    for step in range(2):
        a, b = (torch.randint(0, 37, (2 * world, 8), generator=g) for _ in range(2))
        loss, ref_loss = loss_fn(model(a.chunk(world)[rank]), b.chunk(world)[rank]), loss_fn(ref(a), b)
        if step == 0:
            model.layers[1].requires_grad_(False), ref.layers[1].requires_grad_(False)
        loss.backward(), ref_loss.backward()
        if step == 0:
            with_grad = [n for n, p in model.layers[1].named_parameters() if p.grad is not None]
            model.layers[1].requires_grad_(True), ref.layers[1].requires_grad_(True)
        opt.step(), ropt.step()
        opt.zero_grad(), ropt.zero_grad()
    return _distance_and_close(comm, ref), with_grad


@pytest.mark.timeout(100)
@pytest.mark.parametrize(
    "world, wp, config_kw", [(2, 2, {}), (4, 2, {"state_sharding": "world"})], ids=["wp2", "wp2x2-world"]
)
def test_a_block_frozen_between_forward_and_backward_gets_no_gradient(world: int, wp: int, config_kw: dict) -> None:
    # fp32 SGD: 1e-5 covers the sums' order. Before, the engine reduced the block's
    # gradients into its shards and the buckets wrote zeros into its norms, and SGD
    # stepped the shards (5e-3 off; an outside review)
    for diff, with_grad in run_ranks(_block_frozen_before_backward_worker, world, wp, config_kw, timeout_s=90):
        assert diff < 1e-5 and with_grad == [], (diff, with_grad)


def _written_before_backward_worker(rank: int, world: int, wp: int, config_kw: dict) -> list[str]:
    """The blocks' linear weights halved under ``no_grad`` between a forward and its
    backward, in both models: what each backward said; then a step that goes on."""
    from tests.parity import loss_fn

    g = torch.Generator().manual_seed(0)
    model, ref, comm, *_ = _wrapped_and_plain(wp, config_kw)
    a, b = (torch.randint(0, 37, (2 * world, 8), generator=g) for _ in range(2))
    said = []
    for m, x, y in ((ref, a, b), (model, a.chunk(world)[rank], b.chunk(world)[rank])):
        loss = loss_fn(m(x), y)
        with torch.no_grad():
            for lin in (lin for lin in m.layers.modules() if isinstance(lin, torch.nn.Linear)):
                lin.weight.mul_(0.5)
        try:
            loss.backward()
            said.append("ran")
        except RuntimeError as exc:
            said.append(str(exc))
    loss_fn(model(a.chunk(world)[rank]), b.chunk(world)[rank]).backward()  # the next step runs
    comm.close()
    return said


@pytest.mark.timeout(100)
@pytest.mark.parametrize("wp, config_kw", [(2, {}), (1, {"state_sharding": "world"})], ids=["wp2", "pieces"])
def test_weights_written_between_forward_and_backward_are_refused_as_autograd_does(wp: int, config_kw: dict) -> None:
    # before: the plain model's backward refused, the wrapped one gathered the halved
    # shards again and combined them with the forward's activations (an outside review)
    for plain, wrapped in run_ranks(_written_before_backward_worker, 2, wp, config_kw, timeout_s=90):
        assert "modified by an inplace operation" in plain, plain
        assert wrapped.startswith("isp-comm: block 2's weights were written in place"), wrapped  # the last first


def _forward_raised_worker(rank: int, world: int, config_kw: dict) -> list:
    """A forward that raises (from a hook on block 1), with and without grad: what
    ``model.parameters()`` are, and the full weights, right after it, against before."""
    from isp_comm import ISPCommunicator, ISPConfig, ParallelGroups
    from isp_comm.models.llama import LlamaConfig, build
    from tests.parity import TINY

    model = build(LlamaConfig(**TINY))
    comm = ISPCommunicator(model, ParallelGroups.create(wp_size=world), ISPConfig(**config_kw))
    params, before = list(model.parameters()), comm.full_state_dict()
    handle = model.layers[1].register_forward_hook(lambda *_: 1 / 0)
    said = []
    for grad in (False, True):
        with torch.set_grad_enabled(grad), pytest.raises(ZeroDivisionError):
            model(torch.randint(0, 37, (2, 8)))
        now = comm.full_state_dict()
        same = all(a is b for a, b in zip(params, model.parameters()))
        said.append((same, [k for k in before if not torch.equal(before[k], now[k])]))
    handle.remove()
    comm.close()
    return said


@pytest.mark.timeout(100)
@pytest.mark.parametrize(
    "config_kw", [{"param_dtype": torch.bfloat16}, {"shard_outer_params": True}], ids=["bf16", "shard-outer"]
)
def test_a_forward_that_raised_puts_the_outer_parameters_back_at_once(config_kw: dict) -> None:
    # before: until the next forward, model.parameters() held the embedding's, norm's
    # and head's bf16 casts or gathered copies, which state dicts saved and in-place
    # edits wrote (then lost); an outside review
    for said in run_ranks(_forward_raised_worker, 2, config_kw, timeout_s=90):
        assert said == [(True, [])] * 2, said


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world, wp, config_kw", [(2, 2, {}), (4, 2, {"state_sharding": "world"})])
def test_zero_grad_between_forward_and_backward(world: int, wp: int, config_kw: dict) -> None:
    # fp32 SGD: 1e-5 covers the sums' order. Before, the forward set the last step's
    # replicated gradients aside, zero_grad() could not see them, and the backward
    # added them back: the norms, embedding and head stepped on two steps' gradients.
    assert max(run_ranks(_zero_after_forward_worker, world, wp, config_kw, timeout_s=90)) < 1e-5
