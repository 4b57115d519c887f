"""Frozen parameters: partly frozen blocks train exactly like single-process training,
frozen shards get no gradient and are never reduce-scattered, and requires_grad may
change between steps."""

from __future__ import annotations

import pytest
import torch

from isp_comm import ISPCommunicator, ISPConfig, ParallelGroups
from isp_comm.models.llama import LlamaConfig, build
from isp_comm.testing import run_ranks
from tests.parity import TINY, loss_fn, max_diff

SEQ, STEPS = 8, 3


def _freeze(model: torch.nn.Module, what: str) -> None:
    for i, layer in enumerate(model.layers):
        if what == "attention":
            layer.attn.requires_grad_(False)
        elif what == "mlp":
            layer.mlp.requires_grad_(False)
        elif what == "one-linear":  # a different one in each block
            [layer.attn.q_proj, layer.mlp.up_proj, layer.attn.o_proj][i % 3].requires_grad_(False)
        elif what == "block-1" and i == 1:
            layer.requires_grad_(False)
    if what == "norms-only":
        for name, p in model.named_parameters():
            p.requires_grad_(name.endswith("norm.weight"))
    if what == "embedding":
        model.embed.requires_grad_(False)


# (name, what is frozen, wp, sp, activation checkpointing, options)
CASES = [
    ("attention", "attention", 4, 1, 0.0, {}),
    ("mlp-replicas-ckpt", "mlp", 2, 1, 0.5, {}),
    ("one-linear-per-block", "one-linear", 4, 1, 0.0, {}),
    ("norms-only", "norms-only", 4, 1, 0.0, {}),
    ("embedding-outer", "embedding", 4, 1, 0.0, {"shard_outer_params": True}),
    ("attention-sp2", "attention", 2, 2, 0.0, {}),
    ("block-1", "block-1", 4, 1, 0.0, {}),
    ("unfreeze-after-step-1", "attention", 4, 1, 1.0, {"unfreeze_at": 1}),
    # the state over the world (wp 2 x 2 replicas): a frozen unit's pieces are never
    # re-gathered over the replicas, and one unfrozen later is again after its steps
    ("block-1-world", "block-1", 2, 1, 0.0, {"state_sharding": "world"}),
    ("none-world", "none", 2, 1, 0.0, {"state_sharding": "world"}),
    ("block-1-world-unfrozen", "block-1", 2, 1, 0.0, {"state_sharding": "world", "unfreeze_at": 1}),
]


def _worker(rank: int, world: int) -> dict:
    out = {}
    for name, what, wp, sp, ckpt, opts in CASES:
        opts = dict(opts)
        unfreeze_at = opts.pop("unfreeze_at", None)
        ref, model = build(LlamaConfig(**TINY, bias=True)), build(LlamaConfig(**TINY, bias=True))
        _freeze(ref, what), _freeze(model, what)
        ropt = torch.optim.SGD(ref.parameters(), lr=0.1)
        groups = ParallelGroups.create(wp_size=wp, sp_size=sp)
        comm = ISPCommunicator(model, groups, ISPConfig(activation_checkpointing=ckpt, **opts))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)  # frozen ones included: they must stay put
        dp, sp_rank, dp_rank = world // sp, rank % sp, rank // sp
        lo, hi = sp_rank * SEQ // sp, (sp_rank + 1) * SEQ // sp
        g = torch.Generator().manual_seed(7)
        stray_grads, loss_diff = [], 0.0
        for step in range(STEPS):
            if step == unfreeze_at:
                for m in (ref, model):
                    m.requires_grad_(True)
            x = torch.randint(0, TINY["vocab_size"], (2 * dp, SEQ), generator=g)
            y = torch.randint(0, TINY["vocab_size"], (2 * dp, SEQ), generator=g)
            rloss = loss_fn(ref(x), y)
            rloss.backward()
            ropt.step(), ropt.zero_grad()
            xs, ys = x.chunk(dp)[dp_rank][:, lo:hi], y.chunk(dp)[dp_rank][:, lo:hi]
            loss = comm.cross_entropy(model(xs, position_ids=torch.arange(lo, hi)), ys)
            loss.backward()
            stray_grads += [n for n, p in model.named_parameters() if not p.requires_grad and p.grad is not None]
            opt.step(), opt.zero_grad()
            total = loss.detach().clone()
            torch.distributed.all_reduce(total)
            loss_diff = max(loss_diff, abs(total.item() / world - rloss.item()))
        out[name] = {
            "diff": max_diff(comm.full_state_dict(), ref.state_dict()),
            "loss_diff": loss_diff,
            "stray_grads": stray_grads,
            "stats": comm.stats(),
        }
        comm.close()
    return out


@pytest.mark.timeout(300)
def test_partly_frozen_models_train_like_single_process() -> None:
    per_rank = run_ranks(_worker, 4, timeout_s=280)
    res = per_rank[0]
    for name, *_ in CASES:
        for rank, x in enumerate(per_rank):  # every rank (replicas too) against the reference
            r = x[name]
            # fp32 SGD over 3 steps: the parity tests' tolerance
            assert r["diff"] < 2e-6 and r["loss_diff"] < 2e-6, (name, rank, r["diff"], r["loss_diff"])
        assert all(not x[name]["stray_grads"] for x in per_rank), (name, "a frozen shard got a .grad")
    # collectives: a fully frozen block is never reduce-scattered (3 blocks, 3 steps)
    assert res["block-1"]["stats"]["reduce_scatters"] == 2 * STEPS, res["block-1"]["stats"]
    assert res["norms-only"]["stats"]["reduce_scatters"] == 0, res["norms-only"]["stats"]
    # a partly frozen block reduces less: attention frozen moves the MLP's gradients only
    attn, full = res["attention"]["stats"], res["unfreeze-after-step-1"]["stats"]
    assert attn["reduce_scatters"] == 3 * STEPS
    assert attn["bytes_reduced"] < full["bytes_reduced"] * 0.8, (attn["bytes_reduced"], full["bytes_reduced"])
    # replica all-gathers at the forwards after steps 1 and 2: block 1, frozen, skips both;
    # unfrozen at step 2 (its first step after unfreezing is step 2), it skips one
    frozen, none = res["block-1-world"]["stats"], res["none-world"]["stats"]
    unfrozen = res["block-1-world-unfrozen"]["stats"]
    assert none["all_gathers"] - frozen["all_gathers"] == STEPS - 1, (none, frozen)
    assert none["all_gathers"] - unfrozen["all_gathers"] == 1, (none, unfrozen)
