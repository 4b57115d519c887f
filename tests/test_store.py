"""The token store: round trips at uint16 and uint32, preparation from JSON lines with a
tiny tokenizer (EOS per document, reuse), and the refusals of a bad --data."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from isp_comm.train.store import check_data, open_store, prepare_store, store_path, write_store


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
    with pytest.raises(ValueError, match="no field 'text'"):
        prepare_store(str(bad), str(tmp_path / "tok"), progress=False)


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
