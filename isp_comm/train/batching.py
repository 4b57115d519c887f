"""The batches a run trains and validates on: random windows of the token stream, or
packed rows in a resumable order; the held-out batches; and the thread that makes the
next steps' batches ahead of the loop."""

from __future__ import annotations

import dataclasses
import queue
import threading
from dataclasses import dataclass

import numpy as np
import torch

from isp_comm.train.data import Micro, Slicing, Step, read_windows
from isp_comm.train.packing import DataOrder, PackedRows, rank_rows, split_documents


def batch_at(tokens: torch.Tensor | np.ndarray, step: int, batch: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Global batch ``step``: ``batch`` windows of ``seq + 1`` tokens, deterministic.
    Only these windows are read from a memory-mapped ``tokens``."""
    g = torch.Generator().manual_seed(10_000 + step)
    starts = torch.randint(0, len(tokens) - seq - 1, (batch,), generator=g)
    win = torch.from_numpy(np.stack(read_windows(tokens, starts.tolist(), seq + 1)).astype(np.int64))
    return win[:, :-1], win[:, 1:]


def _windows_text(w: list[int]) -> str:
    return f"--seq {w[0]} over {w[1]} tokens, checksum {w[2]}"


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


@dataclass
class EvalSet:
    """The held-out batches, made once: ``micros`` on this rank, fixed for the run."""

    micros: list[Micro]


def refuse_empty_documents(tokens, offsets, what: str) -> None:
    """Refuse documents that are each their EOS alone (or nothing): packed rows of them
    hold no target, and a run on them logged a loss of 0.0 at every step without a
    word (a JSON field null in every row, text the tokenizer maps to nothing). Cheap:
    the index is read only when there are no more tokens than documents."""
    n_docs = len(offsets) - 1
    if len(tokens) <= n_docs and int(np.diff(np.asarray(offsets)).max(initial=0)) < 2:
        raise ValueError(
            f"{what}: its {n_docs} document(s) are all empty (each its EOS alone), so there is nothing to "
            "predict: is the text under another field (isp-prepare-data --text-field NAME), or null in every row?"
        )


def eval_set(tokens, offsets, cut: Slicing, batches: int, packed: bool) -> EvalSet:
    """``batches`` global batches of the held-out data, in order: its first packed rows
    (wrapping around when it holds fewer), or windows at fixed seeds."""
    micros = []
    if len(tokens) < cut.seq + (1 if packed else 2):
        raise ValueError(
            f"the held-out data ({len(tokens)} tokens) is shorter than --seq {cut.seq}: a larger --eval-split, "
            "or a longer --eval-data"
        )
    if packed:
        refuse_empty_documents(tokens, offsets, "the held-out data")
        rows = PackedRows(tokens, offsets, cut.seq)
        for b in range(batches):
            ids = [(b * cut.batch + j) % len(rows) for j in range(cut.batch)]
            r = rows.packed(rank_rows(ids, cut.dp_rank, cut.dp))
            part = cut.chunk(len(r.inputs))
            micros.append(Micro(r.inputs[None, part], r.targets[None, part], r.positions[part], r.cu_seqlens))
        return EvalSet(micros)
    per, part = cut.batch // cut.dp, cut.chunk(cut.seq)
    for b in range(batches):
        x, y = batch_at(tokens, -1 - b, cut.batch, cut.seq)  # seeds apart from training's steps
        rows = slice(cut.dp_rank * per, (cut.dp_rank + 1) * per)
        micros.append(Micro(x[rows, part], y[rows, part], torch.arange(cut.seq)[part]))
    return EvalSet(micros)


class TrainData:
    """What a run trains and validates on: packed rows in a resumable order when the
    documents are known (``offsets``) and ``pack`` is on, else random windows; the
    held-out batches of ``eval_split`` (the last documents, or tokens) or of
    ``eval_source`` (tokens, offsets). ``data_name``: how a refusal of the data names it
    (``--data PATH``)."""

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
        data_name: str = "--data",
    ) -> None:
        self.cut, self.packed = cut, pack and offsets is not None
        if eval_split and offsets is not None:
            (tokens, offsets), eval_source = split_documents(tokens, offsets, eval_split)
        elif eval_split:
            keep = len(tokens) - max(cut.seq + 2, int(len(tokens) * eval_split))
            tokens, eval_source = tokens[:keep], (tokens[keep:], None)
        self.tokens, self.rows, self.order, self.position = tokens, None, None, 0
        self._identity: list[int] | None = None
        if len(tokens) < cut.seq + 2:
            raise ValueError(f"--seq {cut.seq} is longer than the training data ({len(tokens)} tokens)")
        if self.packed:
            refuse_empty_documents(tokens, offsets, data_name)
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
        else as if every earlier step took ``batch x grad_accum`` rows. A checkpoint of
        other data (another kind, or random windows of another length or corpus) is a
        ``ValueError``; one that says nothing of its data (an earlier version's) is not."""
        theirs = "random windows" if "windows" in saved else "a packed data order" if saved else None
        mine = "random windows" if self.order is None else "a packed data order"
        if theirs is not None and theirs != mine:
            raise ValueError(
                f"the checkpoint was trained on {theirs}, this run reads {mine}: same --data and --pack-boundaries "
                "to resume"
            )
        if self.order is None:
            if saved and saved["windows"] != self.windows():
                raise ValueError(
                    f"the checkpoint's random windows ({_windows_text(saved['windows'])}) are not this run's "
                    f"({_windows_text(self.windows())}): same --data, --seq and --eval-split to resume"
                )
            return
        if saved.get("seq", self.cut.seq) != self.cut.seq:
            raise ValueError(
                f"the checkpoint's packed rows are --seq {saved['seq']} long, this run's --seq {self.cut.seq}: the "
                "data order counts rows of the checkpoint's length, same --seq to resume"
            )
        if saved.get("tokens", self.identity()) != self.identity():
            theirs, mine = saved["tokens"], self.identity()
            raise ValueError(
                f"the checkpoint's packed rows came from {theirs[0]} tokens (checksum {theirs[1]}), this run's from "
                f"{mine[0]} (checksum {mine[1]}): same --data and --eval-split to resume"
            )
        if saved:
            self.order.load_state_dict(saved)
        else:
            self.order.position = step * self.cut.batch * self.cut.grad_accum
        self.position = self.order.position

    def identity(self) -> list[int]:
        """The training tokens' identity: their count and a checksum of 1,024 tokens
        spread over them (another corpus of the same length differs there). Read with
        ``pread`` (``read_windows``): indexed through the mapping, each token mapped its
        page-cache folio into the rank, and the first save's identity of a 1 GiB store
        raised every rank's peak RSS from 424 to 1,257 MiB."""
        if self._identity is None:
            at = np.linspace(0, len(self.tokens) - 1, num=1024).astype(np.int64).tolist()
            checksum = sum(int(w[0]) for w in read_windows(self.tokens, at, 1))
            self._identity = [len(self.tokens), checksum]
        return self._identity

    def windows(self) -> list[int]:
        """Random windows' identity: their length and the tokens' identity."""
        return [self.cut.seq, *self.identity()]

    def state_dict(self) -> dict:
        """What a checkpoint holds of the data: the data order at the last step taken,
        the tokens' identity and the rows' length, or the random windows' identity."""
        if self.order is None:
            return {"windows": self.windows()}
        return {**self.order.state_dict(), "position": self.position, "tokens": self.identity(), "seq": self.cut.seq}

    def taken(self, step: Step) -> None:
        self.position = step.position

    def make(self, step: int) -> Step:
        if self.order is None:
            return window_step(self.tokens, step, self.cut)
        return packed_step(self.rows, self.order, step, self.cut)

    def start(self, first: int, last: int, pin: bool = False) -> Prefetcher:
        return Prefetcher(self.make, first, last, pin=pin)
