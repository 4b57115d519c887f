"""Packed rows keep documents apart (boundaries, restarting positions, no target across
documents, the same loss as the documents run one by one), and the data order visits
every row once per epoch and resumes bitwise, also at another world size."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
import torch

from isp_comm.train.packing import IGNORE, DataOrder, PackedRows, RowPermutation, rank_rows
from isp_comm.train.store import write_store


def _docs(seed: int = 0, n: int = 12, vocab: int = 50) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [np.append(rng.integers(1, vocab, size=int(rng.integers(1, 30))), 0) for _ in range(n)]  # 0: EOS


def test_rows_cover_the_stream_with_document_boundaries(tmp_path):
    docs = _docs()
    store = write_store(str(tmp_path / "s"), docs, 50)
    rows = PackedRows(store.tokens, store.offsets, seq=16)
    flat = np.concatenate(docs)
    assert len(rows) == (len(flat) - 1) // 16
    starts = set(np.cumsum([len(d) for d in docs]).tolist())
    for i in range(len(rows)):
        r = rows.row(i)
        a = i * 16
        assert r.inputs.tolist() == flat[a : a + 16].tolist()
        cuts = r.cu_seqlens.tolist()
        assert cuts == [0, *sorted(s - a for s in starts if 0 < s - a < 16), 16]
        for lo, hi in zip(cuts, cuts[1:]):
            assert r.positions[lo:hi].tolist() == list(range(hi - lo))
        for j in range(16):  # a target is the next token of the same document, else ignored
            assert r.targets[j].item() == (IGNORE if a + j + 1 in starts else flat[a + j + 1])


def test_packed_loss_and_grads_equal_documents_one_by_one(tmp_path):
    """Single-process reference llama; fp32, tolerance for summation order only."""
    from isp_comm.models.llama import LlamaConfig, build

    docs = _docs(1, n=6)
    store = write_store(str(tmp_path / "s"), docs, 50)
    rows = PackedRows(store.tokens, store.offsets, seq=32)
    r = rows.row(0)
    model = build(LlamaConfig(vocab_size=50, hidden=32, n_layers=2, n_heads=4, n_kv_heads=2), seed=0)
    logits = model(r.inputs[None], position_ids=r.positions, cu_seqlens=r.cu_seqlens)[0]
    loss = torch.nn.functional.cross_entropy(logits, r.targets, ignore_index=IGNORE, reduction="sum")
    loss.backward()
    packed = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    total = torch.zeros(())
    cuts = r.cu_seqlens.tolist()
    for lo, hi in zip(cuts, cuts[1:]):
        seg_logits = model(r.inputs[None, lo:hi])[0]
        total = total + torch.nn.functional.cross_entropy(
            seg_logits, r.targets[lo:hi], ignore_index=IGNORE, reduction="sum"
        )
    total.backward()
    assert torch.allclose(loss, total, rtol=1e-5), (loss, total)
    for n, p in model.named_parameters():
        assert torch.allclose(packed[n], p.grad, rtol=1e-4, atol=1e-6), n


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_every_row_once_per_epoch_over_all_ranks(dp):
    n_rows, batch = 37, 8
    orders = [DataOrder(n_rows, seed=3) for _ in range(dp)]  # each rank walks the same global order
    seen: list[int] = []
    for _ in range(-(-2 * n_rows // batch)):
        for rank, order in enumerate(orders):
            seen += rank_rows(order.take(batch), rank, dp)
    first, second = seen[:n_rows], seen[n_rows : 2 * n_rows]
    assert sorted(first) == list(range(n_rows)) and sorted(second) == list(range(n_rows))
    assert first != second  # a new permutation each epoch


@pytest.mark.parametrize("n", [1, 2, 3, 17, 64, 65, 1000])
def test_the_row_permutation_is_a_bijection_and_differs_by_seed(n):
    perms = [RowPermutation(n, seed, epoch)(np.arange(n)).tolist() for seed, epoch in ((0, 0), (0, 1), (1, 0))]
    assert all(sorted(p) == list(range(n)) for p in perms)
    if n >= 17:  # 17! orders: the same one twice would be a bug, not chance
        assert perms[0] != perms[1] and perms[0] != perms[2]


def test_the_order_of_a_large_corpus_is_not_held_in_memory():
    """A billion rows (a 2 GiB store of 1-token rows would have them): taking a batch
    allocates kilobytes, not the 8 GB a materialised permutation holds."""
    order = DataOrder(10**9, seed=0)
    tracemalloc.start()
    try:
        rows = [order.take(16) for _ in range(100)]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, peak
    flat = sum(rows, [])
    assert len(set(flat)) == len(flat) and all(0 <= r < 10**9 for r in flat)


def test_order_resumes_bitwise_at_another_world_size():
    straight = DataOrder(50, seed=7)
    expected = [straight.take(6) for _ in range(20)]
    first = DataOrder(50, seed=7)
    got = [first.take(6) for _ in range(9)]
    state = first.state_dict()
    resumed = DataOrder(50, seed=7)
    resumed.load_state_dict(dict(state))
    got += [resumed.take(6) for _ in range(11)]
    assert got == expected
    # a world of 3 data-parallel ranks reads its shares of the same global batches
    shares = [rank_rows(expected[9], r, 3) for r in range(3)]
    assert sum(shares, []) == expected[9]
    with pytest.raises(ValueError, match="seed"):
        DataOrder(50, seed=8).load_state_dict(state)
