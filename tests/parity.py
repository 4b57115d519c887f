"""Shared pieces of the parity tests: tiny uneven models, data, and the two trainers.

The reference is single-process training on the concatenation of every rank's
micro-batches; the ISP run feeds each rank its own slice and averages like DDP.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from isp_comm import ISPCommunicator, ISPConfig, ParallelGroups
from models.llama import LlamaConfig, build

# Uneven on purpose: ffn 50 and head-dim 6 pad at wp 3 and 4; one KV head (k/v out 6)
# leaves rank 3 of wp=4 with zero rows.
TINY = dict(vocab_size=37, hidden=36, ffn_hidden=50, n_layers=3, n_heads=6, n_kv_heads=1)


@dataclass(frozen=True)
class Case:
    optim: str = "sgd"
    micro: int = 1
    ckpt: float = 0.0
    bias: bool = False
    steps: int = 3
    seq: int = 7
    batch_per_rank: int = 2

    def model_config(self) -> LlamaConfig:
        return LlamaConfig(**TINY, bias=self.bias)


def make_optim(name: str, params) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1)
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, eps=1e-6)


def batches(case: Case, world: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """[step][micro] -> global (x, y) of world * batch_per_rank sequences."""
    g = torch.Generator().manual_seed(1234)
    n = world * case.batch_per_rank
    V = TINY["vocab_size"]
    return [
        [
            (torch.randint(0, V, (n, case.seq), generator=g), torch.randint(0, V, (n, case.seq), generator=g))
            for _ in range(case.micro)
        ]
        for _ in range(case.steps)
    ]


def loss_fn(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def train_reference(case: Case, world: int) -> tuple[dict[str, torch.Tensor], list[float]]:
    model = build(case.model_config())
    opt = make_optim(case.optim, model.parameters())
    losses = []
    for step in batches(case, world):
        total = 0.0
        for x, y in step:
            loss = loss_fn(model(x), y) / case.micro
            loss.backward()
            total += loss.item()
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, losses


def train_isp(
    case: Case, rank: int, world: int, wp: int, **config_kw
) -> tuple[dict[str, torch.Tensor], list[float], dict]:
    model = build(case.model_config())
    groups = ParallelGroups.create(wp_size=wp, sp_size=1)
    comm = ISPCommunicator(model, groups, ISPConfig(activation_checkpointing=case.ckpt, **config_kw))
    opt = make_optim(case.optim, model.parameters())
    hook = comm.scheduler_hook()
    losses = []
    for step in batches(case, world):
        total = torch.zeros(())
        for x, y in step:
            xs, ys = x.chunk(world)[rank], y.chunk(world)[rank]
            hook.before_forward()
            loss = loss_fn(model(xs), ys) / case.micro
            hook.before_backward()
            loss.backward()
            hook.after_backward()
            total += loss.detach()
        opt.step()
        opt.zero_grad()
        torch.distributed.all_reduce(total)
        losses.append(total.item() / world)
    sd = comm.full_state_dict()
    stats = comm.stats()
    comm.close()
    return sd, losses, stats


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    for k in a:
        assert a[k].shape == b[k].shape, (k, a[k].shape, b[k].shape)
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def copy_case(case: Case, **kw) -> Case:
    return copy.replace(case, **kw) if hasattr(copy, "replace") else Case(**{**case.__dict__, **kw})
