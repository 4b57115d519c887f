"""The tokens a ``--data`` path names (the embedded corpus, a token store, ``.npy``,
``.bin`` or a text file's bytes), and the job's loading of them: text tokenized once
by rank 0 into a token store that the other ranks then open."""

from __future__ import annotations

import os

import numpy as np
import torch
import torch.distributed as dist

from isp_comm.groups import first_error
from isp_comm.train import hf_model
from isp_comm.train.config import TrainConfig
from isp_comm.train.data import markov_corpus, read_windows
from isp_comm.train.store import check_data, is_pretokenized, is_store, open_store, prepare_store


def load_tokens(path: str) -> tuple[torch.Tensor | np.ndarray, int]:
    """Tokens and vocabulary size: the embedded corpus when ``path`` is empty, a token
    store's tokens, a pre-tokenized ``.npy`` (any integer dtype) or ``.bin`` (uint16),
    all memory-mapped, else a text file whose bytes are the tokens."""
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


def document_offsets(path: str) -> np.ndarray | None:
    """The document index of a token store at ``path`` (memory-mapped), else None."""
    return open_store(path).offsets if path and os.path.isdir(path) and is_store(path) else None


def _on_rank0_first(fn, *args):
    """``fn(*args)`` on rank 0 (which may write a cache the others then read), then on
    the others; an error on rank 0 is raised on every rank, never a hang."""
    error = out = None
    if dist.get_rank() == 0:
        try:
            out = fn(*args)
        except ValueError as exc:
            error = str(exc)
    first = first_error(error)
    if first:
        raise ValueError(first)
    return out if dist.get_rank() == 0 else fn(*args)


def load_data(cfg: TrainConfig) -> tuple[torch.Tensor, int, str, object]:
    """The tokens, their vocabulary size, the tokenizer folder used ("" for none), and
    the document offsets when the data is a token store (else None)."""
    tok_dir = cfg.tokenizer
    if not tok_dir and cfg.model and cfg.data and not is_pretokenized(cfg.data):
        tok_dir = cfg.model if hf_model.has_tokenizer(cfg.model) else ""
    offsets = None
    text_file = tok_dir and cfg.data.endswith(".txt") and not cfg.data_cache  # --data-cache: always the store
    older = hf_model.older_cache(tok_dir, cfg.data) if text_file else ""
    if older:
        tokens, vocab = hf_model.read_older_cache(tok_dir, older)
    elif tok_dir:  # prepared once by rank 0 (a progress bar there), then opened by the others
        store = _on_rank0_first(prepare_text, cfg.data, tok_dir, cfg.data_cache, dist.get_rank() == 0)
        tokens, vocab, offsets = store.tokens, store.vocab, store.offsets
    else:
        tokens, vocab = load_tokens(cfg.data)
        offsets = document_offsets(cfg.data)
    return tokens, vocab, tok_dir, offsets


def prepare_text(data: str, tok_dir: str, cache: str, progress: bool):
    return prepare_store(data, tok_dir, cache, progress=progress)
