"""A token store on disk: one flat token file, a document index, a small sidecar.

The layout follows Megatron's indexed datasets (a ``.bin`` of tokens beside an
``.idx`` of document offsets), as three files in one folder::

    STORE/tokens.bin   the tokens of every document, EOS-terminated, back to back
                       (uint16 when the vocabulary fits, uint32 otherwise)
    STORE/index.npy    int64 document offsets into tokens.bin, n_docs + 1 of them
    STORE/meta.json    format, dtype, token and document counts, vocabulary size,
                       the tokenizer folder and a fingerprint of its files and inputs

Everything is read through ``np.memmap``: opening a store costs the index, not the
tokens, so a rank's memory does not grow with the corpus. A store is written into a
temporary folder renamed into place, so a killed preparation leaves no half store and
a second preparation of the same inputs reuses the first (the fingerprint names it).

Tokenization runs through the tokenizer's batched call, which a fast (Rust) tokenizer
spreads over the machine's cores itself; ``datasets``' ``map(num_proc=...)`` would add
a dependency and a copy of the corpus in Arrow files for the same parallelism.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import socket
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np

from isp_comm.backends.shm import owners_gone
from isp_comm.train.data import read_windows

FORMAT = "isp-token-store-1"
TEXT_SUFFIXES = (".txt", ".jsonl", ".json", ".parquet")
_BATCH_DOCS = 256


@dataclass(frozen=True)
class TokenStore:
    """An opened store: ``tokens`` and ``offsets`` are memory-mapped, read on use."""

    path: str
    tokens: np.ndarray
    offsets: np.ndarray
    vocab: int
    meta: dict

    @property
    def n_docs(self) -> int:
        return len(self.offsets) - 1

    def doc(self, i: int) -> np.ndarray:
        """Document ``i``'s tokens (its EOS included), a view of the mapped file."""
        return self.tokens[self.offsets[i] : self.offsets[i + 1]]


def is_store(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "meta.json")) and os.path.isfile(os.path.join(path, "tokens.bin"))


def is_pretokenized(path: str) -> bool:
    """A ``.npy``, a ``.bin`` or a prepared store: tokens already, no tokenizer wanted."""
    return path.endswith((".npy", ".bin")) or is_store(path)


def token_dtype(vocab: int) -> np.dtype:
    """uint16 when every id fits (vocab <= 65,536), else uint32."""
    if vocab <= 0 or vocab > 2**32:
        raise ValueError(f"a vocabulary of {vocab} tokens cannot be stored")
    return np.dtype(np.uint16) if vocab <= 2**16 else np.dtype(np.uint32)


def write_store(
    folder: str, docs: Iterable[np.ndarray], vocab: int, meta: dict | None = None, source: str = ""
) -> TokenStore:
    """Write the documents ``docs`` (integer arrays, each already EOS-terminated when
    wanted) as a store at ``folder``, atomically, and open it. ``source``: the ``--data``
    they came from, named when it holds no document (else the refusal names nothing)."""
    dtype = token_dtype(vocab)
    remove_dead_writes(folder)
    tmp = f"{folder.rstrip(os.sep)}.{socket.gethostname()}.{os.getpid()}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    offsets = [0]
    try:
        with open(os.path.join(tmp, "tokens.bin"), "wb") as f:
            for d in docs:
                d = np.asarray(d)
                if d.size and (int(d.min()) < 0 or int(d.max()) >= vocab):
                    raise ValueError(f"a token id outside [0, {vocab}) in document {len(offsets) - 1}")
                f.write(d.astype(dtype, copy=False).tobytes())
                offsets.append(offsets[-1] + d.size)
        if offsets[-1] == 0:
            raise ValueError(
                f"--data {source}: it holds no documents (an empty file, or only empty files): nothing to train on"
                if source
                else "no tokens to store"
            )
        np.save(os.path.join(tmp, "index.npy"), np.asarray(offsets, dtype=np.int64))
        full = dict(meta or {}) | {
            "format": FORMAT,
            "dtype": dtype.name,
            "n_tokens": offsets[-1],
            "n_docs": len(offsets) - 1,
            "vocab": vocab,
        }
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump(full, f, indent=1)
        shutil.rmtree(folder, ignore_errors=True)
        os.replace(tmp, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return open_store(folder)


def remove_dead_writes(folder: str) -> None:
    """Remove the temporary folders that killed writes of the store ``folder`` left on
    this host (``FOLDER.HOST.PID.tmp`` whose process is gone): each held a partial
    corpus (21 MB of a 40 MB JSON-lines file killed at 9 s), which no later run
    removed. Another host's, or a live process's (a job preparing the same store), are
    left alone."""
    parent, base = os.path.split(os.path.abspath(folder))
    for name in owners_gone(parent, f"{base}.{socket.gethostname()}.", "."):
        if name.endswith(".tmp"):
            shutil.rmtree(os.path.join(parent, name), ignore_errors=True)


def open_store(folder: str) -> TokenStore:
    """Open a store written by :func:`write_store`, memory-mapped (nothing read yet)."""
    with open(os.path.join(folder, "meta.json")) as f:
        meta = json.load(f)
    if meta.get("format") != FORMAT:
        raise ValueError(f"--data {folder}: not a token store of format {FORMAT} (found {meta.get('format')!r})")
    tokens = np.memmap(os.path.join(folder, "tokens.bin"), dtype=np.dtype(meta["dtype"]), mode="r")
    offsets = np.load(os.path.join(folder, "index.npy"), mmap_mode="r")
    if tokens.size != meta["n_tokens"] or len(offsets) != meta["n_docs"] + 1 or int(offsets[-1]) != tokens.size:
        raise ValueError(f"--data {folder}: the store's files disagree with its meta.json (a partial copy?)")
    return TokenStore(folder, tokens, offsets, int(meta["vocab"]), meta)


def input_files(path: str) -> list[str]:
    """The text files of ``path``: itself, or the readable files of a folder (sorted)."""
    if os.path.isfile(path):
        return [path]
    files = []
    for root, dirs, names in os.walk(path):
        dirs.sort()
        files += [os.path.join(root, n) for n in sorted(names) if n.endswith(TEXT_SUFFIXES)]
    if not files:
        raise ValueError(f"--data {path}: the folder holds no {'/'.join(TEXT_SUFFIXES)} file")
    return files


def iter_texts(files: list[str], text_field: str = "text") -> Iterator[str]:
    """Each document's text: a whole ``.txt`` file, a JSON-lines row's or JSON list
    item's ``text_field``, a Parquet row's ``text_field`` column (pyarrow, lazily).
    Bytes that are not UTF-8 are refused with the file's line, in a ``.txt`` as in a
    JSON file (a ``.txt`` once had them replaced by U+FFFD without a word: a Latin-1
    file trained on replacement characters)."""
    for path in files:
        if path.endswith(".txt"):  # refused as a JSON row is: a replaced byte would train as U+FFFD
            with open(path, "rb") as f:
                yield _utf8(path, f.read(), 1)
        elif path.endswith((".jsonl", ".json")):
            yield from _json_texts(path, text_field)
        elif path.endswith(".parquet"):
            import pyarrow.parquet as pq

            pf = pq.ParquetFile(path)
            if text_field not in pf.schema_arrow.names:
                raise ValueError(f"--data {path}: no column {text_field!r} (have {pf.schema_arrow.names})")
            _refuse_non_text_column(path, text_field, pf.schema_arrow.field(text_field).type)
            for batch in pf.iter_batches(columns=[text_field]):
                yield from (t or "" for t in batch.column(0).to_pylist())
        else:
            raise ValueError(f"--data {path}: cannot read this kind of file (want {'/'.join(TEXT_SUFFIXES)})")


def _refuse_non_text_column(path: str, field: str, kind) -> None:
    """Refuse a Parquet column ``field`` whose Arrow type ``kind`` is not text (numbers,
    bytes, lists), as a JSON row holding one is refused: the tokenizer raised on the
    first batch, a traceback on rank 0 and a lost peer on the others."""
    import pyarrow as pa

    value = kind.value_type if pa.types.is_dictionary(kind) else kind
    text = (pa.types.is_string, pa.types.is_large_string, getattr(pa.types, "is_string_view", lambda _: False))
    if not any(is_text(value) for is_text in text):
        raise ValueError(
            f"--data {path}: column {field!r} holds {kind}, not text: convert it to strings (utf8), or for text "
            "under another column, isp-prepare-data FILE --tokenizer DIR --text-field NAME"
        )


def _json_texts(path: str, field: str) -> Iterator[str]:
    """``field`` of each JSON-lines row, or of each item of a JSON list. A null is an
    empty document (as a Parquet null is); any other non-text value, a row that is not
    JSON and bytes that are not UTF-8 are refused with one line naming the file's line
    (a byte-order mark is allowed)."""
    with open(path, "rb") as f:
        if f.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n").startswith(b"["):  # a JSON list
            f.seek(0)
            rows: Iterator[tuple[str, object]] = (
                (f"item {n}", row) for n, row in enumerate(_loads(path, _utf8(path, f.read(), 1)), 1)
            )
        else:
            f.seek(0)
            _refuse_one_object(path, f, field)
            rows = (
                (f"line {n}", _loads(path, _utf8(path, raw, n), n))
                for n, raw in enumerate(f, 1)
                if raw.strip(b"\xef\xbb\xbf \t\r\n")
            )
        for where, row in rows:
            if not isinstance(row, dict) or field not in row:
                has = f" (it has {', '.join(map(repr, list(row)[:6]))})" if isinstance(row, dict) else ""
                raise ValueError(
                    f"--data {path}: {where} has no field {field!r}{has}: for text under another field, "
                    "isp-prepare-data FILE --tokenizer DIR --text-field NAME makes a store to pass as --data"
                )
            text = row[field]
            if text is not None and not isinstance(text, str):
                raise ValueError(
                    f"--data {path}: {where}: {field!r} holds {type(text).__name__} {text!r:.40}, not text"
                )
            yield text or ""


def _refuse_one_object(path: str, f, field: str) -> None:
    """Refuse a ``.json`` file that is one JSON object over several lines (a
    ``{"data": [...]}`` wrapper, one pretty-printed document): read as JSON lines, its
    first line ``{`` was "not JSON at line 1", of a file that is JSON. Only a ``.json``
    whose first line is not a JSON row is parsed whole; ``f`` is left at its start."""
    first = next((line for line in f if line.strip(b"\xef\xbb\xbf \t\r\n")), b"").lstrip(b"\xef\xbb\xbf")
    f.seek(0)
    if not path.endswith(".json") or not first.lstrip().startswith(b"{"):
        return
    try:
        json.loads(first)
        return  # JSON lines
    except ValueError:
        pass
    try:
        whole = json.loads(f.read().decode("utf-8-sig"))
    except ValueError:  # not one object either: the rows' own refusal names the line
        whole = None
    f.seek(0)
    if isinstance(whole, dict):
        keys = ", ".join(map(repr, list(whole)[:6]))
        raise ValueError(
            f"--data {path}: one JSON object (keys {keys}), not documents: a .json holds a list of "
            f"{{{field!r}: ...}} objects, or one such object per line (JSON lines)"
        )


def _utf8(path: str, raw: bytes, line: int) -> str:
    try:
        return raw.decode("utf-8-sig" if line == 1 else "utf-8")
    except UnicodeDecodeError as exc:
        lines = raw[: exc.start].count(b"\n")  # within a whole file's bytes
        raise ValueError(
            f"--data {path}: line {line + lines} is not UTF-8 text (byte {raw[exc.start : exc.start + 1]!r})"
        ) from None


def _loads(path: str, text: str, line: int = 0) -> object:
    """One JSON row (``line`` of the file), or a whole JSON file (``line`` 0)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        at = f"line {line}, column {exc.colno}" if line else f"line {exc.lineno}, column {exc.colno}"
        raise ValueError(f"--data {path}: not JSON at {at} ({exc.msg})") from None


def fingerprint(files: list[str], tokenizer_dir: str, text_field: str) -> str:
    """Of the tokenizer's files, each input's name, size and modification time, the field."""
    from isp_comm.train.hf_model import _TOKENIZER_FILES

    h = hashlib.sha256(f"{FORMAT}:{text_field}".encode())
    for name in _TOKENIZER_FILES:
        p = os.path.join(tokenizer_dir, name)
        if os.path.isfile(p):
            with open(p, "rb") as f:
                h.update(name.encode() + f.read())
    for p in files:
        st = os.stat(p)
        h.update(f"{os.path.abspath(p)}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def store_path(data: str, tokenizer_dir: str, cache_dir: str = "", text_field: str = "text") -> str:
    """Where the store of ``data`` goes: next to the data, or under ``cache_dir``."""
    key = fingerprint(input_files(data), tokenizer_dir, text_field)
    base = os.path.basename(os.path.normpath(data))
    parent = cache_dir or os.path.dirname(os.path.abspath(os.path.normpath(data)))
    return os.path.join(parent, f"{base}.store-{key}")


def prepare_store(
    data: str, tokenizer_dir: str, cache_dir: str = "", text_field: str = "text", progress: bool = True
) -> TokenStore:
    """The store of ``data`` tokenized by ``tokenizer_dir``, EOS after each document:
    reused when a store of the same inputs exists, else written (with a progress bar)."""
    from tqdm import tqdm

    from isp_comm.train.hf_model import load_tokenizer

    folder = store_path(data, tokenizer_dir, cache_dir, text_field)
    if is_store(folder):
        return open_store(folder)
    tok = load_tokenizer(tokenizer_dir)
    if tok.eos_token_id is None:
        raise ValueError(f"--tokenizer {tokenizer_dir}: it has no EOS token to end documents with")
    files = input_files(data)
    total = sum(os.path.getsize(p) for p in files)
    bar = tqdm(total=total, unit="B", unit_scale=True, desc="tokenizing", disable=not progress)

    def docs() -> Iterator[np.ndarray]:
        batch: list[str] = []
        for text in iter_texts(files, text_field):
            batch.append(text)
            if len(batch) == _BATCH_DOCS:
                yield from _encode(tok, batch, bar)
                batch = []
        yield from _encode(tok, batch, bar)

    if cache_dir:
        os.makedirs(cache_dir, exist_ok=True)
    meta = {"tokenizer": os.path.abspath(tokenizer_dir), "sources": files, "text_field": text_field}
    try:
        return write_store(folder, docs(), len(tok), meta, source=data)
    finally:
        bar.close()


def _encode(tok, texts: list[str], bar) -> Iterator[np.ndarray]:
    if not texts:
        return
    eos = tok.eos_token_id
    for text, ids in zip(texts, tok(texts, add_special_tokens=False)["input_ids"]):
        bar.update(len(text.encode("utf-8", errors="replace")))
        yield np.asarray([*ids, eos], dtype=np.int64)


def check_data(path: str) -> None:
    """Refuse a ``--data`` isp-train cannot train on, with one line naming the flag:
    a path that does not exist, a kind it cannot read, a float ``.npy``, negative ids,
    a ``.bin`` of uint32 tokens. Cheap: a ``.npy`` is memory-mapped and scanned in
    chunks, a ``.bin`` sampled."""
    if not os.path.exists(path):
        raise ValueError(f"--data {path}: no such file or folder")
    if os.path.isdir(path):
        if not is_store(path):
            input_files(path)
        return
    if path.endswith(".npy"):
        try:
            arr = np.load(path, mmap_mode="r")
        except ValueError as exc:
            raise ValueError(f"--data {path}: not a readable .npy ({exc})") from exc
        if not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"--data {path}: token ids must be integers, the array holds {arr.dtype}")
        flat = arr.reshape(-1)
        if flat.size == 0:
            raise ValueError(f"--data {path}: the file holds no tokens")
        if np.issubdtype(arr.dtype, np.signedinteger):
            for i in range(0, flat.size, 1 << 24):
                if int(read_windows(flat, [i], min(1 << 24, flat.size - i))[0].min()) < 0:
                    raise ValueError(f"--data {path}: negative token ids")
    elif path.endswith(".bin"):
        if os.path.getsize(path) < 2 or os.path.getsize(path) % 2:
            raise ValueError(
                f"--data {path}: a .bin of uint16 tokens needs an even, non-zero size (tokens of another dtype: "
                "save them as .npy, which keeps it)"
            )
        _refuse_uint32_bin(path)
    elif not path.endswith(TEXT_SUFFIXES):
        text = ", ".join(TEXT_SUFFIXES)
        raise ValueError(f"--data {path}: cannot read this kind of file (want .npy, .bin, a store, or text: {text})")


BIN_SAMPLE = 4096
"""uint32 words read at each of a .bin's start, middle and end by :func:`_refuse_uint32_bin`."""


def _refuse_uint32_bin(path: str) -> None:
    """Refuse a ``.bin`` whose content is evidently uint32 tokens: read as uint16, as
    nanoGPT's format is, each id becomes two (its low half, then its high half) and the
    run trains on garbage without a word. Evident: in a sample of up to 3 x
    :data:`BIN_SAMPLE` words, every second uint16 is at most 3 (the high half of an id
    below 262,144, every known vocabulary) and most of the others are larger. Real
    uint16 tokens never show it: a small vocabulary's ids are small in both places,
    a large one's in neither. Cheap: 48 KiB read, whatever the file's size."""
    size = os.path.getsize(path)
    if size % 4 or size < 256:  # not whole uint32 words, or under 64 of them: no evidence
        return
    words, take = size // 4, min(size // 4, BIN_SAMPLE)
    parts = []
    with open(path, "rb") as f:
        for start in sorted({0, (words - take) // 2, words - take}):
            f.seek(4 * start)
            parts.append(np.frombuffer(f.read(4 * take), dtype=np.uint16))
    pairs = np.concatenate(parts).reshape(-1, 2)
    low, high = pairs[:, 0], pairs[:, 1]  # a native uint32's halves, as np.memmap reads the file
    top = int(high.max())
    if top <= 3 and 2 * int(np.count_nonzero(low > top)) >= len(low):
        raise ValueError(
            f"--data {path}: its content looks like uint32 tokens, but a .bin is read as uint16 (every second "
            f"uint16 of {2 * len(pairs)} sampled is at most {top}, as a uint32 id's high half): save the tokens as "
            ".npy (np.save keeps their dtype), or as uint16 if every id is below 65,536"
        )


def parser() -> argparse.ArgumentParser:
    """isp-prepare-data's arguments. The data is positional, or ``--data`` as isp-train
    spells it: one of the two, required (``data`` or ``data_flag`` holds it)."""
    p = argparse.ArgumentParser(prog="isp-prepare-data", description=main.__doc__)
    what = ".txt, .jsonl/.json, .parquet, or a folder of them"
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("data", nargs="?", metavar="DATA", default="", help=what)
    source.add_argument("--data", dest="data_flag", metavar="DATA", default="", help=f"the same: {what}")
    p.add_argument("--tokenizer", required=True, help="a local tokenizer folder (AutoTokenizer)")
    p.add_argument("--data-cache", default="", help="folder for the store (default: next to the data)")
    p.add_argument("--text-field", default="text", help="the JSON / Parquet field holding a document's text")
    return p


def main(argv: list[str] | None = None) -> None:
    """``isp-prepare-data DATA --tokenizer DIR [--data-cache DIR] [--text-field F]``:
    prepare (or find) the store of DATA and print its folder as the last line."""
    args = parser().parse_args(argv)
    args.data = args.data or args.data_flag
    try:
        check_data(args.data)
        store = prepare_store(args.data, args.tokenizer, args.data_cache, args.text_field)
    except ValueError as exc:
        print(f"isp-prepare-data: error: {exc}", file=sys.stderr)
        sys.exit(2)
    m = store.meta
    print(f"{m['n_docs']} documents, {m['n_tokens']} tokens ({m['dtype']}), vocabulary {m['vocab']}")
    print(store.path)


if __name__ == "__main__":
    main()
