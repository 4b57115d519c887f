"""``ISPConfig(find_unused_parameters=True)``: a parameter no rank used since the last
optimizer step keeps ``.grad`` ``None``, as in a plain model, so that AdamW's weight
decay and momentum leave it where single-process training leaves it."""

from __future__ import annotations

import types

import pytest
import torch

from isp_comm.testing import run_ranks

# Each step's plan, per rank: (blocks run, whether block 0 runs its MLP), one entry per
# micro-step. Before each step but the first, an iteration uses everything and its
# step is skipped (zero_grad() alone); each step's first micro-step runs in the order
# forward, zero_grad(), backward. Step 1: every rank stops after block 1 (block 2 unused by all) and rank 0
# alone skips block 0's MLP (used by rank 1: its gradient is rank 1's half). Step 2:
# every rank skips block 0's MLP in both micro-steps. Step 3: block 2 runs in the
# first micro-step only (used in the window). The pooler never runs.
PLANS = [
    [[(None, True)], [(None, True)]],
    [[(2, False)], [(2, True)]],
    [[(None, False), (None, False)], [(None, False), (None, False)]],
    [[(None, True), (2, True)], [(None, True), (2, True)]],
]


def _model(pooler: bool = True):
    from isp_comm.models.llama import LlamaConfig, build, rope_tables
    from tests.parity import TINY

    model = build(LlamaConfig(**TINY))
    if pooler:
        model.pooler = torch.nn.Linear(TINY["hidden"], 4)  # never used: a head this loop does not train
        with torch.no_grad():  # the same weights in every model on every rank
            g = torch.Generator().manual_seed(1)
            for p in model.pooler.parameters():
                p.copy_(torch.randn(p.shape, generator=g))
    plan = {"depth": None, "mlp": True}

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        cos, sin = rope_tables(self.cfg, torch.arange(input_ids.shape[1], device=input_ids.device))
        h = self.embed(input_ids)
        for layer in self.layers[: plan["depth"]]:
            h = layer(h, cos, sin, None)
        return self.lm_head(self.norm(h))

    def first_block(self, x, cos, sin, cu_seqlens=None):
        x = x + self.attn(self.attn_norm(x), cos, sin, cu_seqlens)
        return x + self.mlp(self.mlp_norm(x)) if plan["mlp"] else x

    model.forward = types.MethodType(forward, model)
    model.layers[0].forward = types.MethodType(first_block, model.layers[0])
    return model, plan


def _unused_worker(
    rank: int,
    world: int,
    wp: int,
    config_kw: dict,
    device: str | torch.device = "cpu",
    settings: tuple[bool, ...] = (True, False),
    plans: list = PLANS,
    pooler: bool = True,
    defer: bool = False,
) -> list[tuple[float, list[str]]]:
    """AdamW steps (weight decay 0.1) of the wrapped model, with and without
    ``find_unused_parameters`` (``settings``), against the plain one trained on every
    rank's half with that rank's plan (``plans``, as PLANS), on ``device`` (tests/gpu:
    ``cuda:0``). Returns, for each setting: the largest weight difference from the plain
    model, and the parameters whose ``.grad`` was ``None`` in one model and not in the
    other at a step. ``defer``: each step's micro-steps but the last defer their
    replica reductions (``set_requires_replica_sync(False)``)."""
    from isp_comm import ISPCommunicator, ISPConfig, ParallelGroups
    from tests.parity import loss_fn

    if torch.device(device).type == "cuda":
        torch.cuda.set_device(device)
    results = []
    for find in settings:
        (model, plan), (ref, ref_plan) = _model(pooler), _model(pooler)
        model.to(device), ref.to(device)
        groups = ParallelGroups.create(wp_size=wp)
        comm = ISPCommunicator(model, groups, ISPConfig(find_unused_parameters=find, **config_kw))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
        g = torch.Generator().manual_seed(0)
        mismatched: set[str] = set()
        for i, step in enumerate(plans):
            for micro in range(-1 if i else 0, len(step[0])):
                # micro-step -1: an iteration whose step is skipped (zero_grad() alone);
                # micro-step 0 in the order forward, zero_grad(), backward
                a, b = (torch.randint(0, 37, (2 * world, 8), generator=g).to(device) for _ in range(2))
                plan["depth"], plan["mlp"] = step[rank % 2][micro] if micro >= 0 else (None, True)
                comm.set_requires_replica_sync(not defer or micro in (-1, len(step[0]) - 1))
                loss = loss_fn(model(a.chunk(world)[rank]), b.chunk(world)[rank])
                if micro == 0:
                    opt.zero_grad(), ropt.zero_grad()
                loss.backward()
                for r in range(world):  # the plain model: each rank's half with its plan
                    ref_plan["depth"], ref_plan["mlp"] = step[r % 2][micro] if micro >= 0 else (None, True)
                    (loss_fn(ref(a.chunk(world)[r]), b.chunk(world)[r]) / world).backward()
            opt.step(), ropt.step()  # the step's pre-hook settles which gradients stay None
            mine, plain = dict(model.named_parameters()), dict(ref.named_parameters())
            mismatched |= {n for n, p in plain.items() if (p.grad is None) != (mine[n].grad is None)}
            opt.zero_grad(), ropt.zero_grad()
        full = comm.full_state_dict()
        comm.close()
        diff = max((full[k] - v).abs().max().item() for k, v in ref.state_dict().items() if k in full)
        results.append((diff, sorted(mismatched)))
    return results


@pytest.mark.timeout(200)
@pytest.mark.parametrize(
    "world, wp, config_kw",
    [(2, 2, {}), (4, 2, {"state_sharding": "world", "shard_outer_params": True})],
    ids=["wp2", "wp2x2-world"],
)
def test_unused_parameters_keep_no_gradient_and_stay_put(world: int, wp: int, config_kw: dict) -> None:
    for (found, found_none), (zeroed, zeroed_none) in run_ranks(_unused_worker, world, wp, config_kw, timeout_s=150):
        # fp32 AdamW over four steps: 1e-5 covers the sums' order (the parity tests' bound)
        assert found < 1e-5 and found_none == [], (found, found_none)
        # without it, the unused parameters get zeros, which weight decay and momentum move
        assert zeroed > 1e-3 and "pooler.weight" in zeroed_none, (zeroed, zeroed_none)


@pytest.mark.timeout(120)
def test_whole_parameters_used_by_some_ranks_on_one_queue() -> None:
    # a bucket a parameter each (bucket_mb tiny) on the shared-memory backend, whose one
    # queue runs every group's collectives, and no pooler (its bucket, first in the
    # buckets' order and never ready, would hold every later one back to the end): in
    # step 1 rank 0 skips block 0's MLP, so the bucket of its mlp_norm, ready in the
    # middle of rank 1's backward, never is on rank 0. With the option every bucket
    # waits for the backward's end, in one order on both (before, the backend refused
    # the two orders as collectives out of step)
    plans = [[[(None, True)], [(None, True)]], [[(None, False)], [(None, True)]], [[(None, True)], [(None, True)]]]
    config_kw = {"backend": "symm", "bucket_mb": 1e-6, "timeout_s": 30}
    results = run_ranks(_unused_worker, 2, 2, config_kw, "cpu", (True,), plans, False, timeout_s=90)
    for ((found, found_none),) in results:
        assert found < 1e-5 and found_none == [], (found, found_none)  # the bound of the test above
    # without the option the refusal names it
    with pytest.raises(AssertionError, match=r"out of step(.|\n)*find_unused_parameters=True"):
        run_ranks(_unused_worker, 2, 2, config_kw, "cpu", (False,), plans, False, timeout_s=90)


@pytest.mark.timeout(120)
def test_a_step_whose_forward_runs_no_block() -> None:
    # step 1 runs no block on any rank (a loss on the embedding and head alone), so its
    # backward reaches no block's hook: the whole gradients' arrival starts it. Before,
    # the engine never saw that backward, nothing was averaged, and each rank stepped
    # the head on its own gradient (0.03 apart after three steps), with or without the
    # option
    plans = [[[(None, True)], [(None, True)]], [[(0, True)], [(0, True)]], [[(None, True)], [(None, True)]]]
    for ((found, found_none),) in run_ranks(_unused_worker, 2, 2, {}, "cpu", (True,), plans, timeout_s=90):
        assert found < 1e-5 and found_none == [], (found, found_none)  # the bound of the first test


def _fresh_states_worker(rank: int, world: int, backward: bool) -> tuple[int, int]:
    """An evaluation forward with grad (no backward), or a backward whose step is
    skipped (``zero_grad()`` alone; the pooler unused), then a fresh optimizer's state
    dict: (parameters with a state, parameters)."""
    from isp_comm import ISPCommunicator, ISPConfig, ParallelGroups
    from tests.parity import loss_fn

    model, _ = _model()
    comm = ISPCommunicator(model, ParallelGroups.create(wp_size=world), ISPConfig(find_unused_parameters=True))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randint(0, 37, (1, 8))
    out = model(x)  # without a backward, its graph dropped
    if backward:
        loss_fn(out, x).backward()
        opt.zero_grad()
    states = comm.optimizer_state_dict(opt)["state"]
    comm.close()
    return sum("exp_avg" in s for s in states.values()), len(list(model.parameters()))


@pytest.mark.timeout(100)
@pytest.mark.parametrize("backward", [False, True], ids=["forward-only", "skipped-step"])
def test_a_fresh_optimizers_states_after_a_forward_without_backward(backward: bool) -> None:
    # the state dict's step at lr 0 on zero gradients is not a training step: before,
    # find_unused_parameters took back the zeros it made, every one after a forward
    # alone, the pooler's after a backward whose step was skipped, and AdamW made no
    # state for them
    for with_state, params in run_ranks(_fresh_states_worker, 2, backward, timeout_s=60):
        assert with_state == params, (with_state, params)


def _resume_worker(rank: int, world: int, root: str, wp: int, config_kw: dict, api: str) -> dict[str, float]:
    """Four AdamW steps whose first two leave block 2 and the pooler unused (no state
    yet), checkpointed with DCP after step 2: the run that saved and went on, and a fresh
    optimizer that loaded the checkpoint, each against the run that never saved. The
    state dicts are the communicator's, or (``api="torch"``) torch's ``get_state_dict``
    and ``set_state_dict``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from isp_comm import ISPCommunicator, ISPConfig, ParallelGroups
    from tests.parity import loss_fn

    full = {}
    for how in ("plain", "saved", "resumed"):
        model, plan = _model()
        config = ISPConfig(find_unused_parameters=True, **config_kw)
        comm = ISPCommunicator(model, ParallelGroups.create(wp_size=wp), config)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        g = torch.Generator().manual_seed(0)
        for step in range(4):
            data = [torch.randint(0, 37, (2 * world, 8), generator=g) for _ in range(2)]
            if how == "resumed" and step < 2:
                continue
            if how == "resumed" and step == 2 and api == "torch":
                msd, osd = get_state_dict(model, opt)
                dcp.load({"model": msd, "optim": osd}, checkpoint_id=root)
                set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
            elif how == "resumed" and step == 2:
                state = {"model": comm.state_dict(), "optim": comm.optimizer_state_dict(opt)}
                dcp.load(state, checkpoint_id=root)
                comm.load_state_dict(state["model"])
                comm.load_optimizer_state_dict(opt, state["optim"])
            plan["depth"] = 2 if step < 2 else None
            loss_fn(model(data[0].chunk(world)[rank]), data[1].chunk(world)[rank]).backward()
            opt.step(), opt.zero_grad()
            if how == "saved" and step == 1:
                msd, osd = get_state_dict(model, opt) if api == "torch" else (None, comm.optimizer_state_dict(opt))
                dcp.save({"model": msd or comm.state_dict(), "optim": osd}, checkpoint_id=root)
        full[how] = comm.full_state_dict()
        comm.close()
    return {how: max((full[how][k] - v).abs().max().item() for k, v in full["plain"].items()) for how in full}


@pytest.mark.timeout(200)
@pytest.mark.parametrize(
    "world, wp, config_kw, api",
    [
        (2, 2, {}, "comm"),
        (4, 2, {"state_sharding": "world", "shard_outer_params": True}, "comm"),
        (2, 2, {}, "torch"),
    ],
    ids=["wp2", "wp2x2-world", "wp2-torch-api"],
)
def test_a_checkpoint_of_parameters_not_yet_stepped_resumes(
    tmp_path, world: int, wp: int, config_kw: dict, api: str
) -> None:
    # bitwise: the same operations in one process. Before, the stepped optimizer's state
    # dict left out block 2's and the pooler's states, which a fresh optimizer's asks
    # for, and dcp.load failed ("Missing key in checkpoint state_dict: optim.state...")
    for out in run_ranks(_resume_worker, world, str(tmp_path), wp, config_kw, api, timeout_s=180):
        assert out == {"plain": 0.0, "saved": 0.0, "resumed": 0.0}, out
