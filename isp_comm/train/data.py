"""A deterministic synthetic corpus with learnable structure (no downloads).

Tokens follow a fixed random sparse Markov chain of order 1: from each token only a
few successors are likely, so a model can push the loss far below the unigram entropy.
"""

from __future__ import annotations

import dataclasses
import math
import os
import queue
import threading
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


def window_step(tokens, step: int, cut: Slicing) -> Step:
    """Global batch ``step`` of random windows (``batch_at``), this rank's part."""
    x, y = batch_at(tokens, step, cut.batch * cut.grad_accum, cut.seq)
    per, part = cut.batch // cut.dp, cut.chunk(cut.seq)
    positions = torch.arange(cut.seq)[part]
    micros = []
    for m in range(cut.grad_accum):
        rows = slice(m * cut.batch + cut.dp_rank * per, m * cut.batch + (cut.dp_rank + 1) * per)
        micros.append(Micro(x[rows, part], y[rows, part], positions))
    return Step(step, micros)


def packed_step(rows, order, step: int, cut: Slicing) -> Step:
    """The next ``batch x grad_accum`` rows of ``order`` (a ``DataOrder`` over the
    ``PackedRows`` ``rows``), this rank's part, each micro-step's rows packed into one
    sequence with its document boundaries."""
    from isp_comm.train.packing import rank_rows

    ids = order.take(cut.batch * cut.grad_accum)
    micros = []
    for m in range(cut.grad_accum):
        r = rows.packed(rank_rows(ids[m * cut.batch : (m + 1) * cut.batch], cut.dp_rank, cut.dp))
        part = cut.chunk(len(r.inputs))
        micros.append(Micro(r.inputs[None, part], r.targets[None, part], r.positions[part], r.cu_seqlens))
    return Step(step, micros, rows.n_targets(ids), order.position)


class Prefetcher:
    """Makes the batches of steps ``first, first + 1, ...`` in a thread, ``depth``
    ahead of the training loop, so reading the store stays off the critical path
    (pinned on CUDA, so the copy to the device is asynchronous). ``close`` stops and
    joins the thread; a failure in it is raised by ``get``."""

    def __init__(self, make, first: int, last: int, pin: bool = False, depth: int = 2) -> None:
        self._make, self._pin = make, pin
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(first, last), name="isp-data", daemon=True)
        self._thread.start()

    def _run(self, first: int, last: int) -> None:
        for step in range(first, last + 1):
            try:
                item = self._make(step)
                if self._pin:
                    item = dataclasses.replace(item, micros=[m.pinned() for m in item.micros])
            except BaseException as exc:  # handed to the loop, which raises it
                item = exc
            while not self._stop.is_set():
                try:
                    self._queue.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if self._stop.is_set() or isinstance(item, BaseException):
                return

    def get(self, step: int) -> Step:
        while True:
            try:
                item = self._queue.get(timeout=1.0)
                break
            except queue.Empty:
                if not self._thread.is_alive():
                    raise RuntimeError("the data thread ended early") from None
        if isinstance(item, BaseException):
            raise item
        if item.step != step:
            raise RuntimeError(f"the data thread made step {item.step}, the loop wants step {step}")
        return item

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)


def document_offsets(path: str) -> np.ndarray | None:
    """The document index of a token store at ``path`` (memory-mapped), else None."""
    from isp_comm.train.store import is_store, open_store

    return open_store(path).offsets if path and os.path.isdir(path) and is_store(path) else None


class TrainData:
    """What a run trains and validates on: packed rows in a resumable order when the
    documents are known (``offsets``) and ``pack`` is on, else random windows; the
    held-out batches of ``eval_split`` (the last documents, or tokens) or of
    ``eval_source`` (tokens, offsets)."""

    def __init__(
        self,
        tokens,
        offsets,
        cut: Slicing,
        pack: bool = True,
        seed: int = 0,
        eval_split: float = 0.0,
        eval_source: tuple | None = None,
        eval_batches: int = 0,
    ) -> None:
        from isp_comm.train.evaluate import eval_set
        from isp_comm.train.packing import DataOrder, PackedRows, split_documents

        self.cut, self.packed = cut, pack and offsets is not None
        if eval_split and offsets is not None:
            (tokens, offsets), eval_source = split_documents(tokens, offsets, eval_split)
        elif eval_split:
            keep = len(tokens) - max(cut.seq + 2, int(len(tokens) * eval_split))
            tokens, eval_source = tokens[:keep], (tokens[keep:], None)
        self.tokens, self.rows, self.order, self.position = tokens, None, None, 0
        if len(tokens) < cut.seq + 2:
            raise ValueError(f"--seq {cut.seq} is longer than the training data ({len(tokens)} tokens)")
        if self.packed:
            self.rows = PackedRows(tokens, offsets, cut.seq)
            self.order = DataOrder(len(self.rows), seed=seed)
        self.eval = None
        if eval_source is not None and eval_batches:
            ev_tokens, ev_offsets = eval_source
            self.eval = eval_set(ev_tokens, ev_offsets, cut, eval_batches, pack and ev_offsets is not None)

    def describe(self) -> str:
        what = f"{len(self.rows)} packed rows" if self.rows is not None else "random windows"
        return what + (f", {len(self.eval.micros)} held-out batches" if self.eval is not None else "")

    def resume(self, saved: dict, step: int) -> None:
        """Continue after ``step``: from the checkpoint's data order when it has one,
        else as if every earlier step took ``batch x grad_accum`` rows."""
        if self.order is None:
            return
        if saved:
            self.order.load_state_dict(saved)
        else:
            self.order.position = step * self.cut.batch * self.cut.grad_accum
        self.position = self.order.position

    def state_dict(self) -> dict | None:
        """The data order at the last step taken (what a checkpoint holds); None for windows."""
        return None if self.order is None else {**self.order.state_dict(), "position": self.position}

    def taken(self, step: Step) -> None:
        self.position = step.position

    def make(self, step: int) -> Step:
        if self.order is None:
            return window_step(self.tokens, step, self.cut)
        return packed_step(self.rows, self.order, step, self.cut)

    def start(self, first: int, last: int, pin: bool = False) -> Prefetcher:
        return Prefetcher(self.make, first, last, pin=pin)
