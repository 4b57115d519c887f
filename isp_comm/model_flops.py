"""A model's training FLOPs per token, below the planner (its predicted step and MFU)
and the training command (its measured MFU), which both count them the same way.

The count is the usual one for a decoder (as torchtitan and the PaLM paper count
them): ``6 N`` for the matmuls of ``N`` non-embedding parameters in forward and
backward, plus ``12 L d s`` for attention scores and values over a sequence of ``s``
with ``L`` layers of width ``d`` (the causal mask not discounted). A frozen parameter
(LoRA's base) counts ``4``, not ``6``: its weight gradient is never computed, the
gradient of its input is (an upper bound: layers before the first trainable one
need neither).
"""

from __future__ import annotations

from torch import nn


def flops_per_token(model: nn.Module, seq: int) -> float:
    """Training FLOPs per token of a llama-class ``model`` (built on meta is fine)."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    matmuls = [p for p in model.parameters() if id(p) not in embeddings]
    trained = sum(p.numel() for p in matmuls if p.requires_grad)
    frozen = sum(p.numel() for p in matmuls if not p.requires_grad)
    cfg = getattr(model, "cfg", None) or getattr(model, "config", None)
    layers = getattr(cfg, "n_layers", None) or getattr(cfg, "num_hidden_layers", 0)
    width = getattr(cfg, "hidden", None) or getattr(cfg, "hidden_size", 0)
    return 6.0 * trained + 4.0 * frozen + 12.0 * layers * width * seq
