"""An MoE router's load-balancing loss over whole sequences, when each rank holds a chunk.

transformers' MoE models (Mixtral, Qwen2/3-MoE, OLMoE, GPT-OSS), called with
``output_router_logits=True``, return Switch Transformer's auxiliary loss
(``aux_loss``): the number of experts times the sum over experts of the share of
top-k assignments each got and its mean router probability, both over the tokens of
the call. It is a product of two means, not a mean over tokens, so under sequence
parallelism the loss of a rank's chunk is not its share of the sequence's, and no
averaging of the ranks' losses or gradients makes it so.

[Note: the router loss over the SP group]
Both factors are sums over tokens divided by the token count. Each rank sums its
chunk's assignments and probabilities per expert, and one all-reduce over the SP group
(two numbers per expert and the count, not differentiated) gives the sequence's. The
assignments carry no gradient, so the sequence's loss is linear in each chunk's
probability sums given the group's counts: rank ``r``'s term
``E * sum_e f_e * p_e(r) / n``, with ``f_e`` and ``n`` the group's, differentiates to
exactly its chunk's part of the sequence's gradient. Gradients are averaged over the
ranks, as the chunks' cross entropies are (each a mean over its own tokens), so that
part is scaled by the SP size, and every rank's value is the sequence's loss itself.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def experts_of(model: torch.nn.Module) -> tuple[int, int]:
    """The number of experts and of experts per token, as transformers' MoE causal-LM
    classes pass them to their load-balancing loss."""
    n, k = getattr(model, "num_experts", None), getattr(model, "num_experts_per_tok", None)
    if not isinstance(n, int) or not isinstance(k, int):
        raise ValueError(
            f"router_aux_loss: {type(model).__name__} has no num_experts and num_experts_per_tok: "
            "it is not one of transformers' MoE causal-LM models with a router loss "
            "(Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, GPT-OSS)"
        )
    return n, k


def load_balancing_loss(
    router_logits: Sequence[torch.Tensor],
    experts: int,
    top_k: int,
    sum_over_group: Callable[[torch.Tensor], torch.Tensor],
    group_size: int,
) -> torch.Tensor:
    """Switch Transformer's load-balancing loss of every layer's ``router_logits``
    (``[tokens, experts]`` each, this rank's tokens) over the sequences the group's
    chunks make up; ``sum_over_group`` sums a tensor in place over the SP group. See
    [Note: the router loss over the SP group]."""
    if not router_logits:
        raise ValueError(
            "router_aux_loss: no router logits; call the model with output_router_logits=True "
            "and pass the output's router_logits"
        )
    device = router_logits[0].device
    counts = torch.zeros(experts, dtype=torch.float32, device=device)
    probs = torch.zeros(experts, dtype=torch.float32, device=device)
    rows = 0
    for logits in router_logits:
        p = torch.softmax(logits.float(), dim=-1)
        chosen = torch.topk(p.detach(), top_k, dim=-1).indices.reshape(-1)
        counts = counts.scatter_add(0, chosen, torch.ones(chosen.shape, dtype=torch.float32, device=device))
        probs = probs + p.sum(dim=0)
        rows += p.shape[0]
    sums = torch.cat([counts, probs.detach(), torch.full((1,), float(rows), device=device)])
    sum_over_group(sums)  # the sequences' counts, probability sums and token count
    share, total = sums[:experts] / sums[-1], sums[experts : 2 * experts] / sums[-1]
    value = experts * (share * total).sum()
    local = experts * group_size * (share * probs).sum() / sums[-1]
    return value + (local - local.detach())
