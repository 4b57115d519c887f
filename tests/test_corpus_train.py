"""isp-train on a token store: packed rows (the same step as the documents run one by
one, under sequence parallel too), a data order that checkpoints resume, validation
at an interval without reduce-scatter, and batches read ahead in a thread."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from isp_comm.testing import run_ranks
from isp_comm.train.batching import Prefetcher, TrainData
from isp_comm.train.data import Slicing, Step
from isp_comm.train.packing import IGNORE, PackedRows
from isp_comm.train.store import open_store, write_store

TINY = ["--layers", "2", "--hidden", "32", "--heads", "4", "--kv-heads", "2", "--seq", "32", "--batch", "2"]
VOCAB = 50


def _store(folder: str, n_docs: int = 120, seed: int = 0) -> str:
    rng = np.random.default_rng(seed)
    docs = [np.append(rng.integers(1, VOCAB, size=int(rng.integers(1, 40))), 0) for _ in range(n_docs)]  # 0: EOS
    write_store(folder, docs, VOCAB)
    return folder


def _train(*args: str, n: int = 1) -> subprocess.CompletedProcess:
    from tests.test_train import isp_train

    return isp_train(n, *TINY, "--no-trace", *args, timeout=150)


def _rows(out: str) -> dict[int, dict]:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return {r["step"]: r for r in map(json.loads, f)}


def test_packed_targets_and_sequence(tmp_path) -> None:
    """``n_targets`` (from the index alone) counts the targets rows really keep, and a
    packed batch's boundaries hold every row's documents, shifted by its place."""
    store = write_store(str(tmp_path / "s"), [np.append(np.arange(1, n), 0) for n in (3, 40, 1, 7, 30, 5)], VOCAB)
    rows = PackedRows(store.tokens, store.offsets, seq=8)
    for ids in ([0], [1, 2, 3], list(range(len(rows)))):
        assert rows.n_targets(ids) == sum(int((rows.row(i).targets != IGNORE).sum()) for i in ids)
    r = rows.packed([2, 0])
    assert torch.equal(r.inputs, torch.cat([rows.row(2).inputs, rows.row(0).inputs]))
    assert r.cu_seqlens.tolist() == rows.row(2).cu_seqlens.tolist() + (rows.row(0).cu_seqlens[1:] + 8).tolist()


def test_documents_that_are_all_empty_are_refused(tmp_path) -> None:
    """A store whose documents are each their EOS alone (a JSON field null in every
    row) has no target in any packed row: a run on it logged loss 0.0 at every step
    without a word. It is refused, as training data and as held-out data; one empty
    document among others is not."""
    empty = write_store(str(tmp_path / "empty"), [np.array([0]) for _ in range(300)], VOCAB)
    with pytest.raises(ValueError, match=r"--data: its 300 document\(s\) are all empty .*--text-field"):
        TrainData(empty.tokens, empty.offsets, Slicing(2, 1, 8))
    mixed = write_store(str(tmp_path / "mixed"), [np.append(np.arange(1, 40), 0)] * 3 + [np.array([0])] * 60, VOCAB)
    with pytest.raises(ValueError, match=r"the held-out data: its 32 document\(s\) are all empty"):
        TrainData(mixed.tokens, mixed.offsets, Slicing(2, 1, 8), eval_split=0.5, eval_batches=1)
    assert len(TrainData(mixed.tokens, mixed.offsets, Slicing(2, 1, 8)).rows) == (len(mixed.tokens) - 1) // 8


def test_eval_split_holds_out_the_last_documents(tmp_path) -> None:
    store = write_store(str(tmp_path / "s"), [np.full(10, i + 1) for i in range(20)], VOCAB)
    data = TrainData(store.tokens, store.offsets, Slicing(2, 1, 4), eval_split=0.1, eval_batches=2)
    assert len(data.tokens) == 180 and len(data.rows) == (180 - 1) // 4  # 18 documents train
    held = torch.cat([m.inputs.flatten() for m in data.eval.micros]).unique().tolist()
    assert set(held) <= {19, 20}  # only the last two documents' tokens
    with pytest.raises(
        ValueError, match=r"the held-out data \(10 tokens\) is shorter than --seq 12: a larger --eval-split"
    ):
        TrainData(store.tokens, store.offsets, Slicing(2, 1, 12), eval_split=0.05, eval_batches=2)  # one document


def test_prefetcher_runs_ahead_raises_and_joins() -> None:
    made: list[int] = []

    def make(step: int) -> Step:
        made.append(step)
        if step == 4:
            raise ValueError("bad row")
        return Step(step, [])

    feed = Prefetcher(make, 1, 10, depth=2)
    assert feed.get(1).step == 1 and feed.get(2).step == 2
    with pytest.raises(ValueError, match="bad row"):
        feed.get(3), feed.get(4)
    feed.close()
    assert not feed._thread.is_alive() and made == [1, 2, 3, 4]
    feed = Prefetcher(lambda s: Step(s, []), 1, 1000, depth=2)  # the loop leaves early: still joined
    feed.get(1)
    feed.close()
    assert not feed._thread.is_alive() and not [t for t in threading.enumerate() if t.name == "isp-data"]


def parity_worker(rank: int, world: int, path: str) -> dict:
    """One packed step of ISP at SP 2 (through isp-train's batch, forward and loss
    code) against the same documents run one by one on an unwrapped copy; then a
    validation pass, counting the collectives it issues."""
    from isp_comm import ISPCommunicator, ISPConfig, ParallelGroups
    from isp_comm.models.llama import LlamaConfig, build
    from isp_comm.train.batching import eval_set, packed_step
    from isp_comm.train.evaluate import evaluate, logits_of, micro_loss
    from isp_comm.train.packing import DataOrder

    store = open_store(path)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden=32, ffn_hidden=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32)
    ref, model = build(cfg), build(cfg)
    comm = ISPCommunicator(model, ParallelGroups.create(wp_size=world, sp_size=world), ISPConfig())
    cut = Slicing(batch=2, grad_accum=2, seq=32, sp=world, sp_rank=rank)
    rows = PackedRows(store.tokens, store.offsets, 32)
    step = packed_step(rows, DataOrder(len(rows), seed=1), 1, cut)
    total = torch.zeros(())
    for micro in step.micros:
        loss = micro_loss(comm, logits_of(model, micro, False), micro, step, world)
        loss.backward()
        total += loss.detach()
    dist.all_reduce(total)
    torch.optim.SGD(model.parameters(), lr=1.0).step()  # new weights = old - gradient
    ids = DataOrder(len(rows), seed=1).take(4)
    ref_sum = torch.zeros(())
    for micro_ids in (ids[:2], ids[2:]):
        r = rows.packed(micro_ids)
        cuts = r.cu_seqlens.tolist()
        for a, b in zip(cuts, cuts[1:]):  # every document (piece) alone, positions from 0
            logits = ref(r.inputs[None, a:b])[0]
            ref_sum = ref_sum + F.cross_entropy(logits, r.targets[a:b], ignore_index=IGNORE, reduction="sum")
    ref_loss = ref_sum / step.n_targets
    ref_loss.backward()
    grads = {k: p.grad.clone() for k, p in ref.named_parameters()}
    before = {k: p.detach().clone() for k, p in build(cfg).named_parameters()}
    after = comm.full_state_dict()
    grad_err = max((before[k] - after[k] - grads[k]).abs().max().item() for k in grads)
    c0 = comm.stats()
    held = evaluate(model, comm, eval_set(store.tokens, store.offsets, cut, 2, True), torch.device("cpu"), False)
    c1 = comm.stats()
    comm.close()
    return {
        "loss": (total / world).item(),
        "ref_loss": ref_loss.item(),
        "grad_err": grad_err,
        "grad_max": max(g.abs().max().item() for g in grads.values()),
        "eval": held,
        "reduce_scatters": c1["reduce_scatters"] - c0["reduce_scatters"],
        "all_gathers": c1["all_gathers"] - c0["all_gathers"],
    }


@pytest.mark.timeout(120)
def test_packed_step_equals_documents_one_by_one_under_sp(tmp_path) -> None:
    """World 2, SP 2, two micro-steps of two packed rows: the step's loss and every
    gradient equal those of its documents run alone, in fp32. Tolerances: the loss
    to 1e-6 relative and the gradients to 1e-6 absolute (the largest is ~0.06;
    measured: equal losses, gradients 1.2e-7 apart, read as old minus new weights
    after an SGD step of lr 1, so the weights' own rounding, ~6e-8, is in it): only
    the summation order differs (per-chunk sums reduced over ranks, attention after an
    all-to-all), a few fp32 ulps. A document attending across a boundary, or each
    rank's own token mean, would be off by 1e-3 or more. Validation then gathers blocks and reduce-scatters nothing."""
    path = _store(str(tmp_path / "s"))
    for r in run_ranks(parity_worker, 2, path, timeout_s=100):
        assert abs(r["loss"] - r["ref_loss"]) <= 1e-6 * r["ref_loss"], r
        assert r["grad_err"] < 1e-6 and r["grad_max"] > 1e-2, r
        assert r["reduce_scatters"] == 0 and r["all_gathers"] > 0, r
        assert 0 < r["eval"]["eval_loss"] < 10 and r["eval"]["eval_perplexity"] > 1, r


def test_packed_run_resumes_bitwise_and_logs_eval(tmp_path) -> None:
    """Packed by default on a store; a run interrupted at step 3 and resumed to 6 logs
    the losses of an uninterrupted one bitwise (the data order is in the checkpoint:
    without it the resumed steps would take other rows); validation rows at every
    --eval-every step, in metrics.jsonl and the progress line."""
    store = _store(str(tmp_path / "s"))
    common = ["--data", store, "--eval-every", "2", "--eval-split", "0.1", "--log-every", "100"]
    straight, cut = str(tmp_path / "straight"), str(tmp_path / "cut")
    res = _train(*common, "--steps", "6", "--out", straight)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "packed rows" in res.stdout and res.stdout.count("eval loss") == 3, res.stdout
    rows = _rows(straight)
    assert [s for s, r in rows.items() if "eval_loss" in r] == [2, 4, 6]
    assert all(r["eval_perplexity"] == pytest.approx(np.exp(r["eval_loss"])) for r in rows.values() if "eval_loss" in r)
    assert _train(*common, "--steps", "3", "--out", cut).returncode == 0
    res = _train(*common, "--steps", "6", "--out", cut, "--resume")
    assert res.returncode == 0, res.stderr[-3000:]
    assert {s: r["loss"] for s, r in _rows(cut).items()} == {s: r["loss"] for s, r in rows.items()}
    assert {s: r["eval_loss"] for s, r in _rows(cut).items() if "eval_loss" in r} == {
        s: r["eval_loss"] for s, r in rows.items() if "eval_loss" in r
    }
    # resuming on other data is one line: random windows of the same store, another store,
    # one of the same documents' lengths (so of as many rows) but other tokens (before:
    # resumed on them, saying only that --data had changed), and another held-out share
    other = _store(str(tmp_path / "o"), seed=1)
    mine = open_store(store)
    ends = np.asarray(mine.offsets).tolist()
    docs = [np.asarray(mine.tokens[a:b]).astype(np.int64) for a, b in zip(ends[:-1], ends[1:])]
    same_rows = write_store(str(tmp_path / "same_rows"), [np.append(VOCAB - d[:-1], 0) for d in docs], VOCAB).path
    for args, words in (
        (["--data", store, "--no-pack-boundaries"], "trained on a packed data order, this run reads random windows"),
        (["--data", other], "packed rows came from 2092 tokens (checksum 24683), this run's from 2245"),
        (["--data", same_rows], "same --data and --eval-split to resume"),
        (["--eval-split", "0.2"], "same --data and --eval-split to resume"),  # before: named --data alone
    ):
        res = _train(*args, "--steps", "8", "--out", cut, "--resume")
        lines = [line for line in res.stderr.splitlines() if line.strip()]
        assert res.returncode == 2 and len(lines) == 1 and words in lines[0], res.stderr[-2000:]


def test_packed_resume_with_another_seq_of_as_many_rows_is_refused(tmp_path) -> None:
    """A small corpus can be cut into as many rows at two --seq (2,936 tokens: 45 rows
    at 64 and at 65), and a checkpoint's data order alone (rows, seed, tokens) then
    took a resume with the other length, its position counting rows of another length
    (data.md promises a refusal). The checkpoint holds the rows' length: one line."""
    store = write_store(str(tmp_path / "s"), [np.append(np.arange(1, 40), 0) for _ in range(15)], VOCAB)
    assert (len(store.tokens) - 1) // 32 == (len(store.tokens) - 1) // 33  # 18 rows either way
    saved = TrainData(store.tokens, store.offsets, Slicing(2, 1, 32)).state_dict()
    with pytest.raises(ValueError, match=r"packed rows are --seq 32 long, this run's --seq 33: .* same --seq"):
        TrainData(store.tokens, store.offsets, Slicing(2, 1, 33)).resume(saved, 1)
    out = str(tmp_path / "run")
    assert _train("--data", store.path, "--steps", "2", "--out", out).returncode == 0
    res = _train("--seq", "33", "--steps", "4", "--out", out, "--resume")
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert res.returncode == 2 and len(lines) == 1 and "same --seq to resume" in lines[0], res.stderr[-2000:]
    assert _train("--steps", "3", "--out", out, "--resume").returncode == 0


def test_random_windows_resume_only_on_their_data(tmp_path) -> None:
    """A random-window run's checkpoint holds its windows' identity: a resume with
    another --seq or other tokens is one line; the same flags resume."""
    out = str(tmp_path / "w")
    assert _train("--steps", "2", "--out", out).returncode == 0
    other = str(tmp_path / "t.npy")
    tokens = np.random.default_rng(0).integers(0, 256, 200_000).astype(np.int16)  # the built-in corpus's vocabulary
    tokens[0] = 255
    np.save(other, tokens)
    for args in (["--seq", "16"], ["--data", other]):
        res = _train(*args, "--steps", "4", "--out", out, "--resume")
        lines = [line for line in res.stderr.splitlines() if line.strip()]
        assert res.returncode == 2 and len(lines) == 1, res.stderr[-2000:]
        assert "random windows" in lines[0] and "same --data, --seq and --eval-split" in lines[0], lines
    assert _train("--steps", "3", "--out", out, "--resume").returncode == 0


@pytest.mark.slow  # four world-1/2 launches (~50 s)
@pytest.mark.timeout(400)
def test_packed_order_resumes_at_another_world_size(tmp_path) -> None:
    """World 2 with SP 2 checkpoints at step 3; resumed on 1 rank (at --sp 1: a resume
    takes the run's --sp 2 otherwise) and on 2, both take the next unseen rows: their
    losses match the uninterrupted world-2 run's (world 2 bitwise; world 1 to 1e-5, the
    summation order differs), where other rows would differ by ~1e-2.
    --no-pack-boundaries keeps the random windows (no data order)."""
    store = _store(str(tmp_path / "s"))
    common = ["--data", store, "--sp", "2", "--save-every", "3"]
    straight, cut = str(tmp_path / "straight"), str(tmp_path / "cut")
    assert _train(*common, "--steps", "6", "--out", straight, n=2).returncode == 0
    assert _train(*common, "--steps", "3", "--out", cut, n=2).returncode == 0
    one = str(tmp_path / "one")
    shutil.copytree(cut, one)
    res = _train(*common[:2], "--sp", "1", "--steps", "6", "--out", one, "--resume")
    assert res.returncode == 0, res.stderr[-3000:]
    res = _train(*common, "--steps", "6", "--out", cut, "--resume", n=2)
    assert res.returncode == 0, res.stderr[-3000:]
    ref = {s: r["loss"] for s, r in _rows(straight).items()}
    assert {s: r["loss"] for s, r in _rows(cut).items()} == ref
    assert {s: r["loss"] for s, r in _rows(one).items()} == pytest.approx(ref, rel=1e-5, abs=0)
    res = _train("--data", store, "--no-pack-boundaries", "--steps", "2", "--out", str(tmp_path / "w"))
    assert res.returncode == 0 and "random windows" in res.stdout, res.stderr[-3000:]


@pytest.mark.parametrize(
    "args, text",
    [
        (["--eval-every", "2"], "--eval-every needs --eval-split"),
        (["--eval-split", "0.1"], "need --eval-every"),
        (["--eval-split", "1.5", "--eval-every", "2"], "--eval-split must be in [0, 1)"),
        (["--eval-data", "/nonexistent", "--eval-every", "2"], "--eval-data /nonexistent"),
    ],
)
def test_bad_eval_flags_are_one_line(args, text, capsys) -> None:
    from isp_comm.train.config import parse_config

    with pytest.raises(SystemExit) as exc:
        parse_config(args)
    assert exc.value.code == 2 and text in capsys.readouterr().err


def test_transformers_model_takes_packed_rows_through_its_varlen_keywords(tmp_path) -> None:
    """A transformers llama (sdpa) given a packed batch by ``logits_of`` (restarting
    position_ids, cu_seq_lens_q/k, max_length_q/k) computes each document's logits as
    if it ran alone (fp32, to 1e-5: the masked softmax sums in another order)."""
    transformers = pytest.importorskip("transformers")
    from isp_comm.testing import tiny_hf_config
    from isp_comm.train.data import Micro
    from isp_comm.train.evaluate import logits_of

    store = open_store(_store(str(tmp_path / "s"), n_docs=30))
    r = PackedRows(store.tokens, store.offsets, 32).packed([0, 1])
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(tiny_hf_config("llama", vocab_size=VOCAB))
    model.config._attn_implementation = "sdpa"
    with torch.no_grad():
        packed = logits_of(model, Micro(r.inputs[None], r.targets[None], r.positions, r.cu_seqlens), True)[0]
        cuts = r.cu_seqlens.tolist()
        alone = torch.cat([model(input_ids=r.inputs[None, a:b]).logits[0] for a, b in zip(cuts, cuts[1:])])
        crossing = model(input_ids=r.inputs[None]).logits[0]
    assert len(cuts) > 4 and torch.allclose(packed, alone, atol=1e-5), (packed - alone).abs().max()
    assert not torch.allclose(crossing, alone, atol=1e-3)  # without the boundaries it would differ


@pytest.mark.slow  # a world-2 launch of a transformers model (9-22 s); CI: the in-process varlen test above
@pytest.mark.timeout(300)
def test_transformers_model_trains_packed_under_sp(tmp_path) -> None:
    """isp-train --model on a store of JSON-lines documents at world 2, SP 2: packed
    rows with their boundaries through the SP attention, and a validation loss."""
    import transformers

    from isp_comm.testing import tiny_hf_config, tiny_tokenizer

    texts = [f"note {i}: the tide came in over {i % 7} stones." for i in range(60)]
    tok = tiny_tokenizer(str(tmp_path / "m"), " ".join(texts))
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(tiny_hf_config("llama", vocab_size=len(tok))).save_pretrained(
        tmp_path / "m"
    )
    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    out = str(tmp_path / "run")
    args = ["--model", str(tmp_path / "m"), "--data", str(tmp_path / "c.jsonl"), "--sp", "2", "--steps", "4"]
    res = _train(*args, "--eval-every", "2", "--eval-split", "0.1", "--out", out, n=2)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "packed rows" in res.stdout
    assert [s for s, r in _rows(out).items() if "eval_loss" in r] == [2, 4]


def test_a_text_files_bytes_are_refused_for_a_model_without_a_tokenizer(tmp_path) -> None:
    """``--model DIR`` without a tokenizer and ``--data FILE.txt`` trained the model on
    the file's bytes as its own token ids (0-255 of its vocabulary), without a word;
    it is one line, for --eval-data too. With --tokenizer, or a .npy of the bytes, the
    same flags are taken."""
    transformers = pytest.importorskip("transformers")
    from isp_comm.testing import tiny_hf_config, tiny_tokenizer
    from isp_comm.train.config import TrainConfig

    folder = str(tmp_path / "m")
    transformers.AutoModelForCausalLM.from_config(tiny_hf_config("llama", vocab_size=VOCAB)).save_pretrained(folder)
    (tmp_path / "t.txt").write_text("alpha beta " * 50)
    text, npy = str(tmp_path / "t.txt"), str(tmp_path / "t.npy")
    np.save(npy, np.frombuffer((tmp_path / "t.txt").read_bytes(), dtype=np.uint8))
    with pytest.raises(ValueError, match=r"^--data .*t\.txt: --model .* has no tokenizer, .* save them as a \.npy$"):
        TrainConfig(model=folder, data=text)
    with pytest.raises(ValueError, match=r"^--eval-data .*t\.txt: --model .* has no tokenizer"):
        TrainConfig(model=folder, data=npy, eval_data=text, eval_every=1)
    tiny_tokenizer(str(tmp_path / "tok"), "alpha beta " * 20)
    assert TrainConfig(model=folder, data=text, tokenizer=str(tmp_path / "tok")).data == text
    assert TrainConfig(model=folder, data=npy).data == npy
    assert TrainConfig(data=text).data == text  # the reference llama: bytes are its tokens (vocabulary 256)


def test_a_refusal_of_a_flag_the_resume_took_names_where_it_came_from(tmp_path, capsys) -> None:
    """``--resume --data STORE`` of a run begun on text with ``--tokenizer`` took that
    flag from the run and stopped with "--tokenizer needs --data, a text file to
    tokenize", naming a flag the user had not typed; the line now says it is the run's
    and from which file, and an empty value drops it."""
    from isp_comm.train.config import parse_config

    store, tok, out = _store(str(tmp_path / "s")), tmp_path / "tok", tmp_path / "run"
    tok.mkdir()
    out.mkdir()
    (tmp_path / "c.jsonl").write_text('{"text": "a"}\n')
    (out / "config.json").write_text(json.dumps({"data": str(tmp_path / "c.jsonl"), "tokenizer": str(tok)}))
    with pytest.raises(SystemExit):
        parse_config(["--resume", "--out", str(out), "--data", store])
    said = capsys.readouterr().err.strip().splitlines()[-1]
    assert said.endswith(
        f"--tokenizer needs --data, a text file to tokenize (--tokenizer {tok}: the resumed run's, from "
        f"{out / 'config.json'}; give --tokenizer anew, or an empty value to drop it)"
    ), said
    assert parse_config(["--resume", "--out", str(out), "--data", store, "--tokenizer", ""]).data == store
