"""Post-accumulate-grad hooks on a wrapped model: the optimizer stepped in the backward
([Note: post-accumulate-grad hooks] in ``isp_comm/hooks/grad_hooks.py``), against the
same idiom on the plain model over the global batch."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from isp_comm import ISPCommunicator, ISPConfig, ParallelGroups
from isp_comm.testing import run_ranks
from tests.parity import ATOL, Case, batches, loss_fn, max_diff

CASE = Case(optim="adamw", bias=True, micro=2, steps=3)


def _step_in_backward(model: torch.nn.Module, acting: list[bool] | None = None) -> dict[int, int]:
    """torch's recipe: an AdamW per parameter, stepped and zeroed from the parameter's
    post-accumulate-grad hook (only while ``acting[0]``, when given); returns the
    steps per parameter (by position)."""
    params = list(model.parameters())
    opts = {p: torch.optim.AdamW([p], lr=1e-2, weight_decay=0.1, eps=1e-6) for p in params}
    calls = dict.fromkeys(range(len(params)), 0)
    index = {id(p): i for i, p in enumerate(params)}

    def step(p: torch.nn.Parameter) -> None:
        if acting is not None and not acting[0]:
            return
        calls[index[id(p)]] += 1
        opts[p].step()
        opts[p].zero_grad()

    for p in params:
        p.register_post_accumulate_grad_hook(step)
    return calls


def _reference(world: int, defer: bool) -> tuple[dict[str, torch.Tensor], dict[int, int]]:
    """The plain model; ``defer``: its hooks step at the last micro-step only, on the
    sum of the step's gradients (FSDP2's hooks without gradient sync alike)."""
    model = CASE.build()
    acting = [True]
    calls = _step_in_backward(model, acting)
    for step in batches(CASE, world):
        for i, (x, y) in enumerate(step):
            acting[0] = not defer or i == len(step) - 1
            (loss_fn(model(x), y) / CASE.micro).backward()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, calls


def _worker(rank: int, world: int, layouts: list) -> dict[str, tuple[float, dict]]:
    """Per layout: the largest difference from the plain model, and the parameters
    the hooks stepped another number of times (a deferred backward's must not run)."""
    out = {}
    for name, wp, config_kw in layouts:
        defer = config_kw.pop("defer", False)
        model = CASE.build()
        comm = ISPCommunicator(model, ParallelGroups.create(wp_size=wp), ISPConfig(**config_kw))
        calls = _step_in_backward(model)
        for step in batches(CASE, world):
            for i, (x, y) in enumerate(step):
                comm.set_requires_replica_sync(not defer or i == len(step) - 1)
                (comm.cross_entropy(model(x.chunk(world)[rank]), y.chunk(world)[rank]) / CASE.micro).backward()
        got = comm.full_state_dict()
        comm.close()
        want, want_calls = _reference(world, defer)
        out[name] = (max_diff(got, want), {k: (n, want_calls[k]) for k, n in calls.items() if n != want_calls[k]})
    return out


LAYOUTS = {
    2: [
        ("wp2", 2, {}),
        ("pieces", 1, {"state_sharding": "world"}),
        (
            "wp2-outer-vocab-ckpt",
            2,
            {"shard_outer_params": True, "vocab_parallel": True, "activation_checkpointing": 0.5},
        ),
    ],
    4: [
        ("wp2x2-world-outer", 2, {"state_sharding": "world", "shard_outer_params": True}),
        ("wp2x2-deferred", 2, {"defer": True}),
        ("wp2x2-world-deferred", 2, {"state_sharding": "world", "defer": True}),
    ],
}


@pytest.mark.timeout(200)
@pytest.mark.parametrize("world", [2, 4])
def test_an_optimizer_stepped_in_the_backward_trains_as_on_the_plain_model(world: int) -> None:
    # AdamW's tolerance (reduction order over ranks against one process); each hook
    # called once per backward (per step, deferred), as autograd calls it on the plain
    # model. Before, a
    # sharded parameter's hooks never ran (its gradient is the engine's, not autograd's:
    # it was never stepped), and a replicated one's stepped on this rank's gradient
    # before the average (the replicas drifted apart), without a word
    for out in run_ranks(_worker, world, LAYOUTS[world], timeout_s=180):
        for name, (diff, other_calls) in out.items():
            assert diff < ATOL["adamw"] and not other_calls, (name, diff, other_calls)


def _unused_worker(rank: int, world: int) -> tuple[float, dict]:
    """With ``find_unused_parameters``: the last block and a pooler unused by every
    rank. Their hooks must not run (a plain model runs none: no gradient was
    accumulated), so AdamW's weight decay leaves them where the plain model does.
    Returns the largest difference from the plain model and the parameters stepped
    another number of times."""
    from tests.test_unused_parameters import _model

    g = torch.Generator().manual_seed(0)
    data = [torch.randint(0, 37, (2 * world, 8), generator=g) for _ in range(3)]
    plain, plan = _model()
    plan["depth"] = 2
    plain_calls = _step_in_backward(plain)
    for x in data:
        loss_fn(plain(x), x).backward()
    model, plan = _model()
    plan["depth"] = 2
    comm = ISPCommunicator(model, ParallelGroups.create(wp_size=world), ISPConfig(find_unused_parameters=True))
    calls = _step_in_backward(model)
    for x in data:
        xs = x.chunk(world)[rank]
        comm.cross_entropy(model(xs), xs).backward()
    got = comm.full_state_dict()
    comm.close()
    other = {k: (n, plain_calls[k]) for k, n in calls.items() if n != plain_calls[k]}
    return max_diff(got, dict(plain.state_dict())), other


@pytest.mark.timeout(100)
def test_with_find_unused_parameters_an_unused_parameters_hook_does_not_run() -> None:
    # AdamW's tolerance, as above. Before, the unused block's shards and the pooler got
    # zeros reduced for them and their hooks stepped on those (weight decay moved them)
    for diff, other_calls in run_ranks(_unused_worker, 2, timeout_s=90):
        assert diff < ATOL["adamw"] and not other_calls, (diff, other_calls)


def _removed_worker(rank: int, world: int, wp: int, config_kw: dict) -> tuple[dict, dict]:
    """Hooks a user removes: a one-shot hook that removes itself, and hooks removed
    between the forward and the backward of the first step; their calls on the
    wrapped model and on the plain one (an outside review's case)."""

    def run(model: torch.nn.Module, loss: Callable) -> dict[str, int]:
        calls, handles = {"one-shot": 0, "removed": 0}, {}

        def once(p: torch.nn.Parameter) -> None:
            calls["one-shot"] += 1
            handles[id(p)].remove()

        def counted(_p: torch.nn.Parameter) -> None:
            calls["removed"] += 1

        for p in model.parameters():
            handles[id(p)] = p.register_post_accumulate_grad_hook(once)
        removed = [p.register_post_accumulate_grad_hook(counted) for p in model.parameters()]
        for i, (x, y) in enumerate(batches(CASE, world)[0] * 3):
            out = loss(model, x, y)
            for h in removed if i == 0 else ():
                h.remove()
            out.backward()
            model.zero_grad()
        return calls

    model = CASE.build()
    comm = ISPCommunicator(model, ParallelGroups.create(wp_size=wp), ISPConfig(**config_kw))
    got = run(model, lambda m, x, y: comm.cross_entropy(m(x.chunk(world)[rank]), y.chunk(world)[rank]))
    comm.close()
    return got, run(CASE.build(), lambda m, x, y: loss_fn(m(x), y))


@pytest.mark.timeout(100)
@pytest.mark.parametrize("wp, config_kw", [(2, {}), (1, {"state_sharding": "world"})], ids=["wp2", "pieces"])
def test_a_hook_removed_stays_removed(wp: int, config_kw: dict) -> None:
    # before: a hook removed while the communicator held it aside came back when the
    # backward ended (one-shot hooks ran every step, removed ones on every parameter)
    for got, plain in run_ranks(_removed_worker, 2, wp, config_kw, timeout_s=90):
        assert got == plain, (got, plain)


def _refused_worker(rank: int, world: int, wp: int, config_kw: dict) -> list[str]:
    """What is refused, in order: a hook put on a parameter before wrapping; a
    ``register_hook`` on a shard after wrapping, at the next training forward; then
    (the handle removed) that a training step goes on, and a ``register_hook`` on a
    whole parameter is called, as on DDP."""
    told = []
    model = CASE.build()
    model.layers[0].attn.q_proj.weight.register_post_accumulate_grad_hook(lambda p: None)
    model.layers[1].mlp.up_proj.bias.register_hook(lambda g: g)
    with pytest.raises(ValueError, match="registered before wrapping") as before:
        ISPCommunicator(model, ParallelGroups.create(wp_size=wp), ISPConfig(**config_kw))
    told.append(str(before.value))
    model = CASE.build()
    comm = ISPCommunicator(model, ParallelGroups.create(wp_size=wp), ISPConfig(**config_kw))
    x, y = (t.chunk(world)[rank] for t in batches(CASE, world)[0][0])
    handle = model.layers[1].attn.o_proj.weight.register_hook(lambda g: g)
    with pytest.raises(RuntimeError, match="register_post_accumulate_grad_hook") as after:
        model(x)
    told.append(str(after.value))
    handle.remove()
    seen = []
    model.layers[1].mlp_norm.weight.register_hook(lambda g: seen.append(g.shape))
    comm.cross_entropy(model(x), y).backward()
    comm.close()
    return [*told, str(seen)]


@pytest.mark.timeout(100)
@pytest.mark.parametrize("wp, config_kw", [(2, {}), (1, {"state_sharding": "world"})], ids=["wp2", "pieces"])
def test_gradient_hooks_that_would_never_run_are_refused(wp: int, config_kw: dict) -> None:
    # before: both were dropped without a word (the hooks of a sharded parameter never
    # ran, nor an optimizer stepped from them)
    for before, after, seen in run_ranks(_refused_worker, 2, wp, config_kw, timeout_s=90):
        assert "layers.0.attn.q_proj.weight, layers.1.mlp.up_proj.bias" in before, before
        assert "register_hook on layers.1.attn.o_proj.weight " in after, after
        assert seen == str([torch.Size([36])]), seen


def _two_forwards_worker(rank: int, world: int, wp: int, config_kw: dict) -> tuple[float, dict]:
    """An optimizer stepped in the backward of two forwards with grad (each rank's
    first and second sequences, DPO's chosen and rejected alike), on the wrapped model
    and on the plain one over the global batch: the largest difference, and the
    parameters whose hooks ran another number of times."""

    def run(model: torch.nn.Module, loss: Callable, mine: Callable) -> dict[int, int]:
        calls = _step_in_backward(model)
        for step in batches(CASE, world):
            for x, y in step:
                x, y = (mine(t).view(-1, 2, t.shape[-1]) for t in (x, y))
                ((loss(model(x[:, 0]), y[:, 0]) + loss(model(x[:, 1]), y[:, 1])) / (2 * CASE.micro)).backward()
        return calls

    plain = CASE.build()
    want_calls = run(plain, loss_fn, lambda t: t)
    model = CASE.build()
    comm = ISPCommunicator(model, ParallelGroups.create(wp_size=wp), ISPConfig(**config_kw))
    calls = run(model, comm.cross_entropy, lambda t: t.chunk(world)[rank])
    got = comm.full_state_dict()
    comm.close()
    return max_diff(got, dict(plain.state_dict())), {
        k: (n, want_calls[k]) for k, n in calls.items() if n != want_calls[k]
    }


@pytest.mark.timeout(100)
@pytest.mark.parametrize("wp, config_kw", [(2, {}), (1, {"state_sharding": "world"})], ids=["wp2", "pieces"])
def test_an_optimizer_stepped_in_the_backward_of_two_forwards_steps_once(wp: int, config_kw: dict) -> None:
    # AdamW's tolerance, as above. Before, a block's gradients reduced for the first
    # forward ran the shards' hooks, which stepped them before the second forward's
    # backward of the block (refused since the weights' version check; an outside review)
    for diff, other_calls in run_ranks(_two_forwards_worker, 2, wp, config_kw, timeout_s=90):
        assert diff < ATOL["adamw"] and not other_calls, (diff, other_calls)
