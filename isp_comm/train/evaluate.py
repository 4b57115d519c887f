"""The model's loss on a batch, for training and for validation.

Packed rows go to the model as one sequence with their document boundaries: the
reference llama takes ``cu_seqlens``; a transformers model takes its varlen keywords
(``cu_seq_lens_q``/``_k``, ``max_length_q``/``_k``: flash-attention's and isp_comm's
sequence-parallel attention read them) and restarting ``position_ids`` (from which
its sdpa and eager masks keep attention inside documents).

A packed step's loss is the mean over the targets that count in the whole step (all
micro-steps, all ranks), whatever share of them a rank holds: each rank's token sum
is scaled by ``world / n_targets`` and the gradients are averaged over the world, so
the step equals its documents run one by one. Windows keep each rank's own mean.

Validation (``evaluate``) runs under ``torch.no_grad`` through the same wrapped
model: its blocks are gathered as in a forward, and nothing is reduce-scattered.
"""

from __future__ import annotations

import math

import torch

from isp_comm.train.batching import EvalSet
from isp_comm.train.data import Micro, Step
from isp_comm.train.packing import IGNORE


def logits_of(model: torch.nn.Module, micro: Micro, is_hf: bool, routed: list | None = None) -> torch.Tensor:
    """The model's logits for ``micro`` (already on the model's device); a transformers
    MoE's router logits, when its config asks for its router's auxiliary loss, appended
    to ``routed``."""
    cu = micro.cu_seqlens
    if cu is not None:  # its length changes with each packing: compiled blocks take it as dynamic, never recompile
        torch._dynamo.maybe_mark_dynamic(cu, 0)
    if is_hf:
        extra = {}
        if cu is not None:
            cu = cu.to(micro.inputs.device, non_blocking=True)
            longest = int(micro.cu_seqlens.diff().max())
            extra = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=longest, max_length_k=longest)
        out = model(input_ids=micro.inputs, position_ids=micro.positions[None], use_cache=False, **extra)
        if routed is not None and getattr(out, "router_logits", None) is not None:
            routed.append(out.router_logits)
        return out.logits
    if cu is None:
        return model(micro.inputs, position_ids=micro.positions)
    return model(micro.inputs, position_ids=micro.positions, cu_seqlens=cu)


def token_sum(comm, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The summed cross entropy of this rank's targets that count (fp32)."""
    return comm.cross_entropy(logits, targets, ignore_index=IGNORE, reduction="sum")


def micro_loss(comm, logits: torch.Tensor, micro: Micro, step: Step, world: int) -> torch.Tensor:
    """The loss to differentiate for one micro-step: its share of the step's mean."""
    if step.n_targets is not None:  # packed (a step of one-token documents only has none)
        return token_sum(comm, logits, micro.targets) * (world / max(step.n_targets, 1))
    return comm.cross_entropy(logits, micro.targets, ignore_index=IGNORE) / len(step.micros)


def router_loss(comm, model: torch.nn.Module, routed: list, micros: int) -> torch.Tensor | float:
    """A micro-step's share of an MoE's router auxiliary loss (``routed``: the router
    logits :func:`logits_of` appended), weighted by the config's
    ``router_aux_loss_coef``, as transformers adds it to the loss given ``labels``
    (``output_router_logits=True``: the load-balancing loss a fine-tune of an MoE
    keeps); isp-train takes the cross entropy from the logits itself. Each rank's is
    over its own sequences, whole under sequence parallelism
    (``comm.router_aux_loss``), as under data parallelism; 0 without one."""
    if not routed:
        return 0.0
    coef = getattr(getattr(model, "config", None), "router_aux_loss_coef", 0.0) or 0.0
    return coef * sum(comm.router_aux_loss(r) for r in routed) / micros


def evaluate(model: torch.nn.Module, comm, data: EvalSet, device: torch.device, is_hf: bool) -> dict[str, float]:
    """``eval_loss`` (the mean over every held-out target that counts, all ranks) and
    ``eval_perplexity``; one all-reduce, and under ``no_grad`` no reduce-scatter."""
    was_training = model.training
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=device)
    try:
        with torch.no_grad():
            for micro in data.micros:
                m = micro.to(device)
                total[0] += token_sum(comm, logits_of(model, m, is_hf), m.targets).double()
                total[1] += (m.targets != IGNORE).sum()
    finally:
        model.train(was_training)
    comm.all_reduce(total, what="the validation total")
    loss = float(total[0] / total[1].clamp(min=1))
    return {"eval_loss": loss, "eval_perplexity": math.exp(min(loss, 700.0))}


def eval_note(row: dict) -> str:
    """The progress line's validation part ("" at a step without one)."""
    if "eval_loss" not in row:
        return ""
    return f"  eval loss {row['eval_loss']:.4f} ppl {row['eval_perplexity']:.2f}"
