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


def load_tokens(path: str) -> tuple[torch.Tensor, int]:
    """Tokens and vocabulary size: the embedded corpus when ``path`` is empty, else a
    text file (bytes are tokens) or a pre-tokenized ``.npy`` / ``.bin`` (uint16)."""
    import numpy as np

    if not path:
        return markov_corpus(200_000, 256), 256
    if path.endswith(".npy"):
        arr = np.load(path).reshape(-1)
    elif path.endswith(".bin"):
        arr = np.fromfile(path, dtype=np.uint16)
    else:
        with open(path, "rb") as f:
            arr = np.frombuffer(f.read(), dtype=np.uint8)
    if arr.size == 0:
        raise ValueError(f"--data {path}: the file holds no tokens")
    tokens = torch.from_numpy(arr.astype(np.int64))
    vocab = 256 if arr.dtype == np.uint8 else int(tokens.max()) + 1
    return tokens, vocab
