"""The token store: round trips at uint16 and uint32, preparation from JSON lines with a
tiny tokenizer (EOS per document, reuse), and the refusals of a bad --data."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

from isp_comm.train.store import check_data, open_store, prepare_store, store_path, write_store
from tests.test_train import isp_train


@pytest.mark.parametrize("vocab,dtype", [(300, "uint16"), (65_536, "uint16"), (128_256, "uint32"), (151_936, "uint32")])
def test_store_round_trips(tmp_path, vocab, dtype):
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, vocab, size=n) for n in (1, 7, 300, 2)]
    docs[2][0] = vocab - 1  # the largest id must survive the narrow dtype
    store = write_store(str(tmp_path / "s"), docs, vocab)
    assert store.meta["dtype"] == dtype and store.tokens.dtype == np.dtype(dtype)
    assert isinstance(store.tokens, np.memmap)
    assert store.n_docs == len(docs) and store.vocab == vocab
    again = open_store(str(tmp_path / "s"))
    for i, d in enumerate(docs):
        np.testing.assert_array_equal(again.doc(i).astype(np.int64), d)
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]


def test_a_killed_writes_temporary_folder_is_removed_by_the_next(tmp_path):
    """A preparation killed mid-write left ``STORE.HOST.PID.tmp`` (a partial corpus)
    that no later run removed; the next write of the same store removes it when its
    process is gone, and keeps a live process's (a job preparing it now)."""
    import socket

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    host, folder = socket.gethostname(), str(tmp_path / "s")
    dead, live = f"{folder}.{host}.{gone.pid}.tmp", f"{folder}.{host}.{os.getppid()}.tmp"
    for d in (dead, live):
        os.makedirs(d)
        (tmp_path / d / "tokens.bin").write_bytes(b"\0" * 64)
    write_store(folder, [np.arange(5)], 50)
    assert not os.path.exists(dead) and os.path.isdir(live)


def test_store_refuses_ids_outside_the_vocabulary(tmp_path):
    with pytest.raises(ValueError, match="outside"):
        write_store(str(tmp_path / "s"), [np.array([0, 70_000])], 65_536)
    assert not os.path.exists(tmp_path / "s")


def test_prepare_jsonl_appends_eos_and_reuses_the_store(tmp_path):
    from isp_comm.testing import tiny_tokenizer

    texts = ["the cat sat on the mat", "a dog ran", "", "the end of the corpus"]
    tok = tiny_tokenizer(str(tmp_path / "tok"), " ".join(texts) * 20)
    data = tmp_path / "corpus.jsonl"
    data.write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(texts)))
    store = prepare_store(str(data), str(tmp_path / "tok"), progress=False)
    assert store.n_docs == len(texts) and store.meta["tokenizer"].endswith("tok")
    for i, t in enumerate(texts):
        d = store.doc(i).tolist()
        assert d[-1] == tok.eos_token_id and tok.decode(d[:-1]) == t
    mtime = os.stat(os.path.join(store.path, "tokens.bin")).st_mtime_ns
    assert prepare_store(str(data), str(tmp_path / "tok"), progress=False).path == store.path
    assert os.stat(os.path.join(store.path, "tokens.bin")).st_mtime_ns == mtime  # reused, not rewritten
    cached = prepare_store(str(data), str(tmp_path / "tok"), cache_dir=str(tmp_path / "cache"), progress=False)
    assert os.path.dirname(cached.path) == str(tmp_path / "cache")
    data.write_text(data.read_text() + json.dumps({"text": "more"}) + "\n")
    assert store_path(str(data), str(tmp_path / "tok")) != store.path  # changed input, new store


def test_isp_prepare_data_takes_the_data_positionally_or_as_data(tmp_path, capsys):
    """The README's ``isp-prepare-data FILE --tokenizer DIR``, and ``--data FILE`` as
    isp-train spells it: the same store; neither, or both, is a usage error."""
    from isp_comm.testing import tiny_tokenizer
    from isp_comm.train.store import main

    tiny_tokenizer(str(tmp_path / "tok"), "the cat sat on the mat " * 20)
    data = tmp_path / "corpus.txt"
    data.write_text("the cat sat\non the mat\n")
    folders = []
    for args in ([str(data)], ["--data", str(data)]):
        main([*args, "--tokenizer", str(tmp_path / "tok")])
        folders.append(capsys.readouterr().out.splitlines()[-1])
    assert folders[0] == folders[1] and open_store(folders[0]).n_docs >= 1
    for args in ([], [str(data), "--data", str(data)]):
        with pytest.raises(SystemExit):
            main([*args, "--tokenizer", str(tmp_path / "tok")])
        assert "DATA" in capsys.readouterr().err


def test_prepare_folder_of_text_files_and_missing_field(tmp_path):
    from isp_comm.testing import tiny_tokenizer

    tiny_tokenizer(str(tmp_path / "tok"), "alpha beta gamma delta " * 30)
    (tmp_path / "d" / "sub").mkdir(parents=True)
    (tmp_path / "d" / "a.txt").write_text("alpha beta")
    (tmp_path / "d" / "sub" / "b.txt").write_text("gamma delta")
    (tmp_path / "d" / "notes.md").write_text("ignored")
    store = prepare_store(str(tmp_path / "d"), str(tmp_path / "tok"), progress=False)
    assert store.n_docs == 2
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"content": "x"}) + "\n")
    # the row's own fields, and the flag that reads another: isp-train has no
    # --text-field, which the message once pointed to
    with pytest.raises(ValueError, match=r"no field 'text' \(it has 'content'\): .*isp-prepare-data .*--text-field"):
        prepare_store(str(bad), str(tmp_path / "tok"), progress=False)


def test_data_with_no_documents_is_refused_naming_it(tmp_path):
    """An empty ``.jsonl`` (or a folder of them) is one line naming the ``--data``: it
    once stopped isp-train with "no tokens to store", which named neither the file nor
    what was wrong with it."""
    from isp_comm.testing import tiny_tokenizer

    tiny_tokenizer(str(tmp_path / "tok"), "alpha beta gamma delta " * 30)
    (tmp_path / "empty.jsonl").write_bytes(b"\n\n")
    with pytest.raises(ValueError, match=r"--data .*empty\.jsonl: it holds no documents"):
        prepare_store(str(tmp_path / "empty.jsonl"), str(tmp_path / "tok"), progress=False)
    assert not [p for p in os.listdir(tmp_path) if ".store-" in p]  # nothing half-written left


def test_json_rows_null_and_bad_ones_name_their_line(tmp_path):
    """A null text is an empty document (as Parquet's null); a number or a list was
    trained as its repr ("None", "5"); a bad row, bytes that are not UTF-8 and a JSON
    list after blank lines each get one line naming the file's line."""
    from isp_comm.train.store import iter_texts

    def texts(name: str, data: bytes) -> list[str]:
        (tmp_path / name).write_bytes(data)
        return list(iter_texts([str(tmp_path / name)]))

    ok = b'\xef\xbb\xbf{"text": "a"}\n\n{"text": null}\n{"text": "b\xc3\xa9"}\n'  # a byte-order mark, a blank line
    assert texts("ok.jsonl", ok) == ["a", "", "b\u00e9"]
    assert texts("list.json", b'\n\n[{"text": "a"}, {"text": null}]') == ["a", ""]
    cases = {
        b'{"text": "a"}\n{"text": 5}\n': "line 2: 'text' holds int 5, not text",
        b'{"text": ["x"]}\n': "line 1: 'text' holds list ['x'], not text",
        b'{"text": "a"}\n{"text": "trunc\n': "not JSON at line 2, column 16 (Invalid control character",
        b'{"text": "a"}\n{"text": "caf\xe9"}\n': "line 2 is not UTF-8 text (byte b'\\xe9')",
    }
    for data, message in cases.items():
        with pytest.raises(ValueError, match=re.escape(message)):
            texts("bad.jsonl", data)


def test_a_json_file_of_one_object_is_refused_as_such(tmp_path):
    """A ``.json`` that is one object over several lines (a ``{"data": [...]}``
    wrapper) was refused as "not JSON at line 1", of a valid JSON file: it is named
    for what it is. JSON lines, a JSON list and a broken row are read as before."""
    from isp_comm.train.store import iter_texts

    docs = [{"text": "a"}, {"text": "b"}]
    (tmp_path / "wrapped.json").write_text(json.dumps({"data": docs, "version": 1}, indent=2))
    with pytest.raises(ValueError, match=re.escape("wrapped.json: one JSON object (keys 'data', 'version'), not doc")):
        list(iter_texts([str(tmp_path / "wrapped.json")]))
    (tmp_path / "lines.json").write_text("".join(json.dumps(d) + "\n" for d in docs))
    (tmp_path / "list.json").write_text(json.dumps(docs, indent=2))
    assert list(iter_texts([str(tmp_path / "lines.json"), str(tmp_path / "list.json")])) == ["a", "b"] * 2
    (tmp_path / "long.json").write_text(json.dumps({"text": "x " * 5000}))  # one row, longer than any peek
    assert list(iter_texts([str(tmp_path / "long.json")])) == ["x " * 5000]
    (tmp_path / "broken.json").write_text('{"text": "a"}\n{"text": \n')
    with pytest.raises(ValueError, match=re.escape("broken.json: not JSON at line 2")):
        list(iter_texts([str(tmp_path / "broken.json")]))


def test_a_text_file_that_is_not_utf8_is_refused_with_its_line(tmp_path):
    """A ``.txt`` document is refused as a JSON row is: a Latin-1 file was once read with
    its bytes replaced by U+FFFD, and trained on replacement characters without a word.
    A byte-order mark is allowed (not a token)."""
    from isp_comm.train.store import iter_texts

    (tmp_path / "ok.txt").write_bytes(b"\xef\xbb\xbfcaf\xc3\xa9\nna\xc3\xafve\n")
    assert list(iter_texts([str(tmp_path / "ok.txt")])) == ["caf\u00e9\nna\u00efve\n"]
    (tmp_path / "latin1.txt").write_bytes("caf\u00e9\nna\u00efve\n".encode("latin-1"))
    with pytest.raises(ValueError, match=re.escape("latin1.txt: line 1 is not UTF-8 text (byte b'\\xe9')")):
        list(iter_texts([str(tmp_path / "latin1.txt")]))
    (tmp_path / "late.txt").write_bytes(b"alpha\nbeta\ngam\xffma\n")
    with pytest.raises(ValueError, match=re.escape("late.txt: line 3 is not UTF-8 text (byte b'\\xff')")):
        list(iter_texts([str(tmp_path / "late.txt")]))


def test_check_data_refusals(tmp_path):
    np.save(tmp_path / "f.npy", np.zeros(8, dtype=np.float32))
    np.save(tmp_path / "neg.npy", np.array([1, -2, 3], dtype=np.int32))
    np.save(tmp_path / "ok.npy", np.array([1, 2, 3], dtype=np.int32))
    (tmp_path / "x.csv").write_text("1,2")
    for name, match in [("f.npy", "integers"), ("neg.npy", "negative"), ("nope.txt", "no such"), ("x.csv", "kind")]:
        with pytest.raises(ValueError, match=match) as err:
            check_data(str(tmp_path / name))
        assert str(err.value).startswith("--data ") and "\n" not in str(err.value)
    check_data(str(tmp_path / "ok.npy"))


SMALL = ["--layers", "2", "--hidden", "32", "--heads", "4", "--kv-heads", "2", "--batch", "2", "--seq", "16"]


@pytest.mark.timeout(240)
def test_isp_train_prepares_jsonl_once_then_takes_the_store(tmp_path):
    from isp_comm.testing import tiny_tokenizer

    texts = [f"document {i}: the quick brown fox jumps over the lazy dog number {i}." for i in range(60)]
    tiny_tokenizer(str(tmp_path / "tok"), " ".join(texts))
    data = tmp_path / "corpus.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    cache = tmp_path / "cache"
    args = [*SMALL, "--steps", "2", "--no-trace", "--data", str(data), "--tokenizer", str(tmp_path / "tok")]
    res = isp_train(2, *args, "--data-cache", str(cache), "--out", str(tmp_path / "a"))
    assert res.returncode == 0, res.stderr[-3000:]
    (store,) = os.listdir(cache)
    assert "vocabulary 300" in res.stdout, res.stdout
    args = [*SMALL, "--steps", "2", "--no-trace", "--data", str(cache / store), "--out", str(tmp_path / "b")]
    res = isp_train(2, *args)
    assert res.returncode == 0, res.stderr[-3000:]
    with open(tmp_path / "a" / "metrics.jsonl") as fa, open(tmp_path / "b" / "metrics.jsonl") as fb:
        assert [json.loads(r)["loss"] for r in fa] == [json.loads(r)["loss"] for r in fb]  # the same tokens


@pytest.mark.timeout(240)
def test_isp_train_on_a_text_file_takes_the_store_isp_prepare_data_made(tmp_path, capsys):
    # before, isp-train --data FILE.txt --tokenizer DIR (no --data-cache) tokenized the
    # file again into a cache of its own (no EOS, random windows) beside the store
    from isp_comm.testing import tiny_tokenizer
    from isp_comm.train.store import main

    tiny_tokenizer(str(tmp_path / "tok"), "the quick brown fox jumps over the lazy dog " * 20)
    data = tmp_path / "corpus.txt"
    data.write_text("the quick brown fox jumps over the lazy dog\n" * 40)
    main([str(data), "--tokenizer", str(tmp_path / "tok")])
    folder = capsys.readouterr().out.splitlines()[-1]
    before = sorted(os.listdir(tmp_path))
    args = [*SMALL, "--steps", "2", "--no-trace", "--data", str(data), "--tokenizer", str(tmp_path / "tok")]
    res = isp_train(2, *args, "--out", str(tmp_path / "run"))
    assert res.returncode == 0, res.stderr[-3000:]
    assert sorted(set(os.listdir(tmp_path)) - {"run"}) == before, "isp-train made a file of its own beside the data"
    assert f"{open_store(folder).meta['n_tokens']} tokens (" in res.stdout and "packed rows" in res.stdout, res.stdout


def test_pretokenized_files_are_memory_mapped(tmp_path):
    from isp_comm.train.sources import load_tokens

    np.save(tmp_path / "t.npy", np.array([3, 1, 4, 1, 5], dtype=np.int8))
    np.array([70, 2, 65_535], dtype=np.uint16).tofile(tmp_path / "t.bin")
    tokens, vocab = load_tokens(str(tmp_path / "t.npy"))
    assert isinstance(tokens, np.memmap) and vocab == 6 and tokens.tolist() == [3, 1, 4, 1, 5]
    tokens, vocab = load_tokens(str(tmp_path / "t.bin"))
    assert isinstance(tokens, np.memmap) and vocab == 65_536


def _ids(vocab: int, n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, n)


@pytest.mark.parametrize("vocab", [2, 256, 50_257, 151_936])
def test_a_bin_of_uint32_tokens_is_refused_naming_the_file(tmp_path, vocab: int) -> None:
    """A .bin is read as uint16 (nanoGPT's format): uint32 tokens were read as pairs of
    uint16 and trained on as garbage, without a word. A sample of the file shows it
    (every second uint16 a high half, 0 or a few); the one line names the file and
    says to save it as .npy. Vocabularies from 2 ids to Qwen2's 151,936 (high halves
    up to 2), and a file longer than the sample (read at its start, middle and end)."""
    path = tmp_path / "tokens.bin"
    _ids(vocab, 20_000).astype(np.uint32).tofile(path)
    with pytest.raises(ValueError) as refused:
        check_data(str(path))
    said = str(refused.value)
    assert said.startswith(f"--data {path}: its content looks like uint32 tokens") and "\n" not in said, said
    assert "save the tokens as .npy" in said, said


@pytest.mark.parametrize("vocab", [1, 2, 4, 5, 256, 50_257, 65_536])
@pytest.mark.parametrize("n", [128, 129, 20_000])  # 128: 64 uint32 words, the least that is sampled
def test_a_bin_of_uint16_tokens_is_taken_whatever_its_vocabulary(tmp_path, vocab: int, n: int) -> None:
    """No false alarm on real uint16 data: random tokens of a small vocabulary (ids small
    in every place, as a uint32 file's high halves are) or a large one, a count that
    fills whole uint32 words or not, and a file of zeros."""
    path = tmp_path / "tokens.bin"
    _ids(vocab, n).astype(np.uint16).tofile(path)
    check_data(str(path))
    np.zeros(n, dtype=np.uint16).tofile(path)
    check_data(str(path))


@pytest.mark.timeout(120)
def test_bad_data_is_refused_before_ranks_start(tmp_path):
    np.save(tmp_path / "f.npy", np.zeros(8, dtype=np.float64))
    np.save(tmp_path / "neg.npy", np.array([1, -1], dtype=np.int64))
    (tmp_path / "x.csv").write_text("1,2")
    _ids(50_257, 4096).astype(np.uint32).tofile(tmp_path / "u32.bin")
    for name, text in [
        ("f.npy", "integers"),
        ("neg.npy", "negative"),
        ("gone.npy", "no such"),
        ("x.csv", "kind"),
        ("u32.bin", "looks like uint32 tokens"),
    ]:
        res = isp_train(1, "--data", str(tmp_path / name), "--nproc-per-node", "2", "--out", str(tmp_path / "o"))
        lines = res.stderr.strip().splitlines()
        assert res.returncode == 2 and len(lines) == 1 and "--data" in lines[0] and text in lines[0], res.stderr


@pytest.mark.slow  # three world-2 launches (~36 s); CI sibling: test_isp_train_prepares_jsonl_once_then_takes_the_store
@pytest.mark.timeout(400)
def test_docs_worked_example(tmp_path):
    """docs/data.md's worked example, its bash lines run as written in a folder holding
    a tiny corpus.jsonl and tokenizer tok/."""
    from isp_comm.testing import tiny_tokenizer

    doc = os.path.join(os.path.dirname(__file__), "..", "docs", "data.md")
    with open(doc) as f:
        block = f.read().split("## Worked example", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    texts = [f"story {i}: a small cat sat on a warm mat and looked at bird {i}." for i in range(80)]
    tiny_tokenizer(str(tmp_path / "tok"), " ".join(texts))
    (tmp_path / "corpus.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for line in block.strip().splitlines():
        cmd = line.replace("python ", f"{sys.executable} ", 1)
        res = subprocess.run(cmd, shell=True, cwd=tmp_path, capture_output=True, text=True, timeout=200, env=env)
        assert res.returncode == 0, (line, res.stderr[-3000:])
    (store,) = os.listdir(tmp_path / "stores")
    with open(tmp_path / "run" / "metrics.jsonl") as f:
        rows = [json.loads(r) for r in f]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert [r["step"] for r in rows if "eval_loss" in r] == [2, 4, 6]  # validation before and after the resume


def test_parquet_and_memory_stays_flat_while_reading(tmp_path):
    """A Parquet corpus is prepared like JSON lines; reading batches of a mapped store of
    ~48 MiB adds no anonymous memory (the loose bound, 8 MiB, covers allocator noise)."""
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    from isp_comm.testing import tiny_tokenizer
    from isp_comm.train.batching import batch_at

    texts = ["one two three", "four five", "six"]
    tok = tiny_tokenizer(str(tmp_path / "tok"), " ".join(texts) * 10)
    pq.write_table(pa.table({"text": texts, "n": [1, 2, 3]}), tmp_path / "c.parquet")
    store = prepare_store(str(tmp_path / "c.parquet"), str(tmp_path / "tok"), progress=False)
    assert [tok.decode(store.doc(i).tolist()[:-1]) for i in range(3)] == texts

    rng = np.random.default_rng(0)
    chunks = (rng.integers(0, 70_000, size=1 << 20) for _ in range(12))  # 12 Mi uint32 tokens
    big = write_store(str(tmp_path / "big"), chunks, 70_000)

    def anon_kib() -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("RssAnon:"))

    batch_at(big.tokens, 0, 8, 512)
    before = anon_kib()
    for step in range(200):
        batch_at(big.tokens, step, 8, 512)
    assert anon_kib() - before < 8 * 1024


def test_a_parquet_column_that_is_not_text_is_refused(tmp_path):
    """A Parquet text column of numbers or bytes is refused with one line naming the
    file, the column and its type, as a JSON row of a number is: the tokenizer once
    raised on it, a traceback on rank 0 and a lost peer on the others. Strings,
    dictionary-encoded too, are read."""
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    from isp_comm.testing import tiny_tokenizer

    tiny_tokenizer(str(tmp_path / "tok"), "one two three " * 10)
    cases = {"ints": pa.array([1, 2]), "bytes": pa.array([b"one", b"two"]), "lists": pa.array([["one"], ["two"]])}
    for name, column in cases.items():
        pq.write_table(pa.table({"text": column}), tmp_path / f"{name}.parquet")
        with pytest.raises(ValueError, match=rf"{name}\.parquet: column 'text' holds [^,]+, not text: convert it"):
            prepare_store(str(tmp_path / f"{name}.parquet"), str(tmp_path / "tok"), progress=False)
    pq.write_table(pa.table({"text": pa.array(["one", "two"]).dictionary_encode()}), tmp_path / "dict.parquet")
    assert prepare_store(str(tmp_path / "dict.parquet"), str(tmp_path / "tok"), progress=False).n_docs == 2


def test_the_data_identity_maps_nothing_of_the_store(tmp_path):
    """The checksum a checkpoint keeps of the data (1,024 tokens spread over it) read
    them through the mapping, which mapped each one's page-cache folio into the rank:
    a 1 GiB store's first save raised the peak RSS by 833 MiB (a 64 MiB one here, by
    about its size). Read with pread, the mapping stays untouched; the checksum is the
    one earlier checkpoints hold."""
    from isp_comm.train.batching import TrainData
    from isp_comm.train.data import Slicing

    rng = np.random.default_rng(0)
    write_store(str(tmp_path / "s"), (rng.integers(0, 60_000, size=1 << 22) for _ in range(8)), 60_000)  # 64 MiB
    store = open_store(str(tmp_path / "s"))

    def file_kib() -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("RssFile:"))

    data = TrainData(store.tokens, store.offsets, Slicing(8, 1, 64))
    before = file_kib()
    count, checksum = data.identity()
    assert file_kib() - before < 8 * 1024
    at = np.linspace(0, count - 1, num=1024).astype(np.int64)
    assert checksum == int(np.asarray(store.tokens[at], dtype=np.int64).sum())  # as earlier versions computed it


def test_windows_of_mapped_files_read_the_right_tokens(tmp_path):
    from isp_comm.train.batching import batch_at
    from isp_comm.train.data import read_windows
    from isp_comm.train.sources import load_tokens

    arr = np.arange(5000, dtype=np.int32) % 977
    np.save(tmp_path / "t.npy", arr)  # a header before the data: the offset counts
    tokens, _ = load_tokens(str(tmp_path / "t.npy"))
    assert [w.tolist() for w in read_windows(tokens, [0, 17, 4990], 10)] == [
        arr[s : s + 10].tolist() for s in (0, 17, 4990)
    ]
    x, y = batch_at(tokens, 3, 4, 16)
    x2, y2 = batch_at(torch.from_numpy(arr.astype(np.int64)), 3, 4, 16)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    store = write_store(str(tmp_path / "s"), [arr[:100], arr[100:]], 977)
    assert read_windows(store.tokens, [95], 10)[0].tolist() == arr[95:105].tolist()
