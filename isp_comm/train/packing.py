"""Packed rows of a token store, with document boundaries, and a data order that resumes.

Rows follow Megatron's GPT dataset: the documents are laid end to end in store order
(each already ends in EOS) and cut into rows of ``seq + 1`` tokens that overlap by one,
so a document longer than ``seq`` is split and short ones share a row. A row carries
the boundaries of the documents inside it (``cu_seqlens``, 0 ... seq, over the input
positions), positions that restart at each boundary, and targets of ``-100`` where the
input is a document's last token (its EOS: what follows belongs to another document).
Only the document index is read to plan a row; its tokens are read when it is used.

The order is a seeded permutation of the rows, one per epoch, and the position in it
is one integer (rows consumed over all ranks), so a checkpoint holds it and a resume,
at any world size, continues with the next unseen rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from isp_comm.train.data import read_windows

IGNORE = -100
"""The target of a position whose next token is another document's (cross entropy's ignore_index)."""


@dataclass(frozen=True)
class PackedRow:
    """One row: ``seq`` inputs and targets, the documents' boundaries and positions."""

    inputs: torch.Tensor
    targets: torch.Tensor
    cu_seqlens: torch.Tensor
    positions: torch.Tensor


class PackedRows:
    """The rows of ``tokens`` (a flat, memory-mapped array) whose documents start at
    ``offsets`` (n_docs + 1 of them, the last the token count)."""

    def __init__(self, tokens: np.ndarray, offsets: np.ndarray, seq: int) -> None:
        if seq < 1:
            raise ValueError(f"--seq must be >= 1, got {seq}")
        if len(tokens) < seq + 1:
            raise ValueError(f"--seq {seq} is longer than the data ({len(tokens)} tokens)")
        self.tokens, self.offsets, self.seq = tokens, np.asarray(offsets, dtype=np.int64), seq

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.seq

    def row(self, i: int) -> PackedRow:
        if not 0 <= i < len(self):
            raise IndexError(f"row {i} of {len(self)}")
        a, seq = i * self.seq, self.seq
        (raw,) = read_windows(self.tokens, [a], seq + 1)  # pread: see data.read_windows
        win = torch.from_numpy(raw.astype(np.int64))
        lo, hi = np.searchsorted(self.offsets, [a, a + seq], side="right")
        starts = self.offsets[lo:hi] - a  # documents starting inside (a, a + seq]: strictly after a
        cuts = [0, *(int(s) for s in starts if 0 < s < seq), seq]
        targets = win[1:].clone()
        for c in cuts[1:-1]:
            targets[c - 1] = IGNORE  # the input at c - 1 ends a document
        if (starts == seq).any():
            targets[seq - 1] = IGNORE  # the next row starts a document
        lengths = torch.tensor(np.diff(cuts))
        positions = torch.arange(seq) - torch.repeat_interleave(torch.tensor(cuts[:-1]), lengths)
        return PackedRow(win[:-1], targets, torch.tensor(cuts, dtype=torch.int32), positions)

    def n_targets(self, rows: list[int]) -> int:
        """The targets that count (not ``IGNORE``) in ``rows``, from the document index
        alone: a row loses one per document starting in ``(a, a + seq]``."""
        a = np.asarray(rows, dtype=np.int64) * self.seq
        starts = np.searchsorted(self.offsets, a + self.seq, side="right") - np.searchsorted(self.offsets, a, "right")
        return int(len(rows) * self.seq - starts.sum())

    def packed(self, rows: list[int]) -> PackedRow:
        """``rows`` laid end to end as one sequence of ``len(rows) * seq`` tokens (the
        packed batch form of InternEvo and flash-attention's varlen kernels: batch 1,
        the boundaries of every document and of every row in one ``cu_seqlens``)."""
        parts = [self.row(i) for i in rows]
        cuts = [0]
        for k, r in enumerate(parts):
            cuts += (r.cu_seqlens[1:] + k * self.seq).tolist()
        cat = lambda name: torch.cat([getattr(r, name) for r in parts])  # noqa: E731
        return PackedRow(cat("inputs"), cat("targets"), torch.tensor(cuts, dtype=torch.int32), cat("positions"))


def split_documents(tokens: np.ndarray, offsets: np.ndarray, fraction: float) -> tuple[tuple, tuple]:
    """``(tokens, offsets)`` of the first documents and of the last ``fraction`` of
    them (at least one each), both views of the mapped store: the held-out split of
    ``--eval-split``."""
    n_docs = len(offsets) - 1
    held = min(max(1, round(fraction * n_docs)), n_docs - 1)
    if held < 1:
        raise ValueError(f"--eval-split {fraction}: the data has {n_docs} document(s), too few to hold some out")
    cut = int(offsets[n_docs - held])
    return (tokens[:cut], offsets[: n_docs - held + 1]), (tokens[cut:], np.asarray(offsets[n_docs - held :]) - cut)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a bijective scramble of uint64 values (wrapping arithmetic)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


class RowPermutation:
    """A seeded permutation of ``range(n)`` computed index by index, in O(1) memory.

    [Note: an order that does not grow with the corpus] ``np.random.permutation(n)``
    holds 8 bytes a row on every rank: 128 MiB for a 2 GiB store cut into 64-token
    rows, which broke "a rank's memory does not grow with the corpus". Instead a
    balanced Feistel network over ``2 * half`` bits (the smallest even width covering
    ``n``) is a bijection of ``[0, 4^half)``; an index that lands at ``n`` or above is
    mapped again until it falls inside (cycle walking), which keeps it a bijection of
    ``range(n)``. Every row is therefore seen exactly once per epoch.
    """

    ROUNDS = 6

    def __init__(self, n: int, seed: int, epoch: int) -> None:
        self.n, self.epoch, self.half = n, epoch, max(1, (max(n - 1, 1).bit_length() + 1) // 2)
        self.mask = np.uint64((1 << self.half) - 1)
        rng = np.random.default_rng([seed, epoch])
        self.keys = rng.integers(0, 2**63, size=self.ROUNDS, dtype=np.uint64)

    def _round_trip(self, x: np.ndarray) -> np.ndarray:
        h = np.uint64(self.half)
        left, right = x >> h, x & self.mask
        for key in self.keys:
            left, right = right, left ^ (_mix(right ^ key) & self.mask)
        return (left << h) | right

    def __call__(self, idx: np.ndarray) -> np.ndarray:
        """The permuted positions of ``idx`` (integers in ``range(n)``)."""
        out = self._round_trip(np.asarray(idx, dtype=np.uint64))
        outside = out >= self.n
        while outside.any():  # at most 4x the domain, so a few passes in expectation
            out[outside] = self._round_trip(out[outside])
            outside = out >= self.n
        return out.astype(np.int64)


class DataOrder:
    """A seeded permutation of ``n_rows`` rows per epoch; ``position`` counts the rows
    handed out so far over all ranks (the checkpointed state). The permutation is
    computed for the rows asked for, never held whole (see ``RowPermutation``)."""

    def __init__(self, n_rows: int, seed: int = 0, position: int = 0) -> None:
        if n_rows < 1:
            raise ValueError("no rows to train on")
        self.n_rows, self.seed, self.position = n_rows, seed, position
        self._perm = RowPermutation(n_rows, seed, 0)

    def _permutation(self, epoch: int) -> RowPermutation:
        if epoch != self._perm.epoch:
            self._perm = RowPermutation(self.n_rows, self.seed, epoch)
        return self._perm

    @property
    def epoch(self) -> int:
        return self.position // self.n_rows

    def take(self, n: int) -> list[int]:
        """The next ``n`` rows of the global order (crossing into the next epoch when one ends)."""
        out = []
        while len(out) < n:
            e, k = divmod(self.position, self.n_rows)
            chunk = self._permutation(e)(np.arange(k, min(k + n - len(out), self.n_rows)))
            out += chunk.tolist()
            self.position += len(chunk)
        return out

    def state_dict(self) -> dict:
        return {"seed": self.seed, "position": self.position, "n_rows": self.n_rows}

    def load_state_dict(self, state: dict) -> None:
        if state["n_rows"] != self.n_rows or state["seed"] != self.seed:
            raise ValueError(
                f"the checkpoint's data order ({state['n_rows']} rows, seed {state['seed']}) is not this run's "
                f"({self.n_rows} rows, seed {self.seed}): same --data, --seq, --eval-split and --seed to resume"
            )
        self.position = int(state["position"])


def rank_rows(global_rows: list[int], dp_rank: int, dp: int) -> list[int]:
    """This data-parallel rank's contiguous share of a global batch's rows."""
    per = len(global_rows) // dp
    return global_rows[dp_rank * per : (dp_rank + 1) * per]
