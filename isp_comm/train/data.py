"""What every data module shares, at the bottom of the training data's chain: the
batch types (``Micro``, ``Step``, ``Slicing``), ``read_windows`` (tokens read from a
memory-mapped file without mapping them into the rank), and the embedded corpus.

The chain, from the bottom (each module imports only the ones before it)::

    data       these types, read_windows, the embedded corpus
    store      a token store on disk          packing   packed rows, the data order
    sources    the tokens a --data path names
    batching   the steps' batches, the held-out batches, the data thread (TrainData)
    evaluate   the loss of a batch, for training and validation

The embedded corpus is a deterministic synthetic one with learnable structure (no
downloads): tokens follow a fixed random sparse Markov chain of order 1, from each
token only a few successors are likely, so a model can push the loss far below the
unigram entropy.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import numpy as np
import torch


def markov_corpus(n_tokens: int, vocab: int, branching: int = 4, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    succ = torch.randint(0, vocab, (vocab, branching), generator=g)
    probs = torch.softmax(torch.randn(vocab, branching, generator=g) * 1.5, dim=-1)
    choice = torch.multinomial(probs.repeat(math.ceil(n_tokens / vocab), 1)[:n_tokens], 1, generator=g).squeeze(1)
    # the walk in plain Python lists: indexing tensors element by element took 1 s of
    # every launch's start for the default 200,000 tokens (the walk is sequential)
    table, steps = succ.tolist(), choice.tolist()
    out, tok = [], 0
    for c in steps:
        out.append(tok)
        tok = table[tok][c]
    return torch.tensor(out, dtype=torch.long)


def unigram_entropy(tokens: torch.Tensor | np.ndarray, vocab: int, limit: int = 1 << 20) -> float:
    """Of the first ``limit`` tokens (a memory-mapped corpus is not read whole for it)."""
    head = torch.as_tensor(np.asarray(tokens[:limit]).astype(np.int64))
    p = torch.bincount(head, minlength=vocab).float()
    p = p[p > 0] / p.sum()
    return float(-(p * p.log()).sum())


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


@dataclass(frozen=True)
class Micro:
    """One micro-step's input on this rank: its rows (packed: one sequence of all its
    rows) cut to its sequence-parallel chunk, the chunk's positions and, packed, the
    document boundaries of the whole sequence (host ints: no device read per layer)."""

    inputs: torch.Tensor
    targets: torch.Tensor
    positions: torch.Tensor
    cu_seqlens: torch.Tensor | None = None

    def to(self, device: torch.device) -> Micro:
        move = lambda t: t.to(device, non_blocking=True)  # noqa: E731
        return Micro(move(self.inputs), move(self.targets), move(self.positions), self.cu_seqlens)

    def pinned(self) -> Micro:
        return Micro(self.inputs.pin_memory(), self.targets.pin_memory(), self.positions, self.cu_seqlens)


@dataclass(frozen=True)
class Step:
    """An optimizer step's micro-steps on this rank. ``n_targets``: the targets that
    count over the whole step and every rank (packed rows; None for windows, whose
    loss stays each rank's mean); ``position``: the data order's position after the step."""

    step: int
    micros: list[Micro]
    n_targets: int | None = None
    position: int = 0


@dataclass(frozen=True)
class Slicing:
    """Which part of a global batch this rank reads: rows ``dp_rank`` of ``dp``,
    sequence chunk ``sp_rank`` of ``sp``."""

    batch: int
    grad_accum: int
    seq: int
    dp: int = 1
    dp_rank: int = 0
    sp: int = 1
    sp_rank: int = 0

    def chunk(self, length: int) -> slice:
        return slice(self.sp_rank * length // self.sp, (self.sp_rank + 1) * length // self.sp)
