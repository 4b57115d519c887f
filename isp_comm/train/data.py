"""A deterministic synthetic corpus with learnable structure (no downloads).

Tokens follow a fixed random sparse Markov chain of order 1: from each token only a
few successors are likely, so a model can push the loss far below the unigram entropy.
"""

from __future__ import annotations

import math

import torch


def markov_corpus(n_tokens: int, vocab: int, branching: int = 4, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    succ = torch.randint(0, vocab, (vocab, branching), generator=g)
    probs = torch.softmax(torch.randn(vocab, branching, generator=g) * 1.5, dim=-1)
    out = torch.empty(n_tokens, dtype=torch.long)
    tok = 0
    choice = torch.multinomial(probs.repeat(math.ceil(n_tokens / vocab), 1)[:n_tokens], 1, generator=g).squeeze(1)
    for i in range(n_tokens):
        out[i] = tok
        tok = int(succ[tok, choice[i]])
    return out


def unigram_entropy(tokens: torch.Tensor, vocab: int) -> float:
    p = torch.bincount(tokens, minlength=vocab).float()
    p = p[p > 0] / p.sum()
    return float(-(p * p.log()).sum())


def batch_at(tokens: torch.Tensor, step: int, batch: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Global batch ``step``: ``batch`` windows of ``seq + 1`` tokens, deterministic."""
    g = torch.Generator().manual_seed(10_000 + step)
    starts = torch.randint(0, tokens.numel() - seq - 1, (batch,), generator=g)
    win = torch.stack([tokens[s : s + seq + 1] for s in starts.tolist()])
    return win[:, :-1], win[:, 1:]
