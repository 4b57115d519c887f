"""A model's training FLOPs per token, below the planner (its predicted step and MFU)
and the training command (its measured MFU), which both count them the same way.

The count is the usual one for a decoder (as torchtitan and the PaLM paper count
them): ``6 N`` for the matmuls of ``N`` non-embedding parameters in forward and
backward, plus ``12 L d s`` for attention scores and values over a sequence of ``s``
with ``L`` layers of width ``d`` (the causal mask not discounted). A frozen parameter
(LoRA's base) counts ``4``, not ``6``: its weight gradient is never computed, the
gradient of its input is (an upper bound: layers before the first trainable one
need neither). An MoE's experts, fused into one 3-D parameter per projection
(transformers 5: ``[experts, out, in]``), count at ``top_k / experts`` of their
size: each token goes through ``top_k`` of them (torchtitan counts MoE models'
active parameters so). Counted whole, Mixtral 8x7B (46.7B parameters, 12.9B of
them a token's) would report 3.6 times its MFU.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn


def flops_per_token(model: nn.Module, seq: int) -> float:
    """Training FLOPs per token of a llama-class ``model`` (built on meta is fine)."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    matmuls = [p for p in model.parameters() if id(p) not in embeddings]
    cfg = getattr(model, "cfg", None) or getattr(model, "config", None)
    active = _active_share(cfg)
    trained = sum(p.numel() * active(p) for p in matmuls if p.requires_grad)
    frozen = sum(p.numel() * active(p) for p in matmuls if not p.requires_grad)
    layers = getattr(cfg, "n_layers", None) or getattr(cfg, "num_hidden_layers", 0)
    width = getattr(cfg, "hidden", None) or getattr(cfg, "hidden_size", 0)
    return 6.0 * trained + 4.0 * frozen + 12.0 * layers * width * seq


def _active_share(cfg: object) -> Callable[[nn.Parameter], float]:
    """The share of a parameter each token goes through: ``top_k / experts`` for an
    MoE's fused experts (a 3-D parameter whose dim 0 is the config's expert count),
    1 for every other."""
    experts = next((getattr(cfg, a) for a in EXPERT_COUNTS if isinstance(getattr(cfg, a, None), int)), 0)
    top_k = getattr(cfg, "num_experts_per_tok", None)
    if not experts or not isinstance(top_k, int):
        return lambda p: 1.0
    return lambda p: top_k / experts if p.dim() == 3 and p.shape[0] == experts else 1.0


EXPERT_COUNTS = ("num_local_experts", "num_experts", "n_routed_experts")
"""transformers configs' names for an MoE's expert count (Mixtral; Qwen-MoE, OLMoE; DeepSeek)."""
