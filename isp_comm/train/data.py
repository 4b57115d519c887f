"""A deterministic synthetic corpus with learnable structure (no downloads).

Tokens follow a fixed random sparse Markov chain of order 1: from each token only a
few successors are likely, so a model can push the loss far below the unigram entropy.
"""

from __future__ import annotations

import math
import os

import numpy as np
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


def unigram_entropy(tokens: torch.Tensor | np.ndarray, vocab: int, limit: int = 1 << 20) -> float:
    """Of the first ``limit`` tokens (a memory-mapped corpus is not read whole for it)."""
    head = torch.as_tensor(np.asarray(tokens[:limit]).astype(np.int64))
    p = torch.bincount(head, minlength=vocab).float()
    p = p[p > 0] / p.sum()
    return float(-(p * p.log()).sum())


def batch_at(tokens: torch.Tensor | np.ndarray, step: int, batch: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Global batch ``step``: ``batch`` windows of ``seq + 1`` tokens, deterministic.
    Only these windows are read from a memory-mapped ``tokens``."""
    g = torch.Generator().manual_seed(10_000 + step)
    starts = torch.randint(0, len(tokens) - seq - 1, (batch,), generator=g)
    win = torch.from_numpy(np.stack(read_windows(tokens, starts.tolist(), seq + 1)).astype(np.int64))
    return win[:, :-1], win[:, 1:]


def read_windows(tokens: torch.Tensor | np.ndarray, starts: list[int], n: int) -> list[np.ndarray]:
    """``tokens[s : s + n]`` for each start. From a memory-mapped file they are read
    with ``pread``, not through the mapping: on kernels that map the page cache in large
    folios, one touched token maps up to 2 MiB into the rank's RSS, which then grows
    with the corpus (measured: +400 MiB per rank over 30 steps on a 2 GiB store)."""
    where = _file_position(tokens)
    if where is None:
        return [np.asarray(tokens[s : s + n]) for s in starts]
    path, base = where
    size = tokens.dtype.itemsize
    fd = os.open(path, os.O_RDONLY)
    try:
        return [np.frombuffer(os.pread(fd, n * size, base + s * size), dtype=tokens.dtype) for s in starts]
    finally:
        os.close(fd)


def _file_position(tokens: torch.Tensor | np.ndarray) -> tuple[str, int] | None:
    """The file and byte position of ``tokens[0]`` when it is a 1-D contiguous
    ``np.memmap`` (np.memmap maps from ``offset`` rounded down to the granularity)."""
    import mmap

    if not isinstance(tokens, np.memmap) or not tokens.filename or tokens.ndim != 1:
        return None
    buf = getattr(tokens, "_mmap", None)
    if buf is None or not tokens.flags.c_contiguous:
        return None
    start = tokens.offset - tokens.offset % mmap.ALLOCATIONGRANULARITY
    return tokens.filename, start + tokens.ctypes.data - np.frombuffer(buf, dtype=np.uint8).ctypes.data


def load_tokens(path: str) -> tuple[torch.Tensor | np.ndarray, int]:
    """Tokens and vocabulary size: the embedded corpus when ``path`` is empty, a token
    store's tokens, a pre-tokenized ``.npy`` (any integer dtype) or ``.bin`` (uint16),
    all memory-mapped, else a text file whose bytes are the tokens."""
    from isp_comm.train.store import check_data, is_store, open_store

    if not path:
        return markov_corpus(200_000, 256), 256
    check_data(path)
    if os.path.isdir(path) and is_store(path):
        store = open_store(path)
        return store.tokens, store.vocab
    if os.path.isdir(path) or path.endswith((".jsonl", ".json", ".parquet")):
        raise ValueError(f"--data {path}: documents to tokenize: give --tokenizer DIR (or --model with a tokenizer)")
    if path.endswith(".npy"):
        arr = np.load(path, mmap_mode="r").reshape(-1)
    elif path.endswith(".bin"):
        arr = np.memmap(path, dtype=np.uint16, mode="r")
    else:
        arr = np.memmap(path, dtype=np.uint8, mode="r") if os.path.getsize(path) else np.zeros(0, np.uint8)
    if arr.size == 0:
        raise ValueError(f"--data {path}: the file holds no tokens")
    vocab = 256 if arr.dtype == np.uint8 else _max_id(arr) + 1
    return arr, vocab


def _max_id(arr: np.ndarray, chunk: int = 1 << 24) -> int:
    """The largest id, read in chunks with ``pread`` (the mapping is not touched)."""
    return max(int(read_windows(arr, [i], min(chunk, arr.size - i))[0].max()) for i in range(0, arr.size, chunk))
