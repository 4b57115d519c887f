"""Vocab-parallel head and cross-entropy: training equal to single-process training
with the full head, the head's weight never gathered."""

from __future__ import annotations

import pytest
import torch

from isp_comm import ISPCommunicator, ISPConfig, ParallelGroups
from isp_comm.testing import run_ranks
from tests.test_sequence_parallel import _model, check_sp_cases


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["llama", pytest.param("hf", marks=pytest.mark.slow)])
def test_vocab_parallel_parity(kind: str) -> None:
    if kind == "hf":
        import transformers  # noqa: F401  (the test extra installs it: never a silent skip)
    # vocab 37 over wp 4: 10, 10, 10, 7 rows; with outer the embedding and norm are
    # sharded too, the head stays vocab-parallel.
    shapes = [(1, 4, False), (2, 2, True), (2, 4, True)] if kind == "llama" else [(1, 4, True), (2, 2, False)]
    check_sp_cases([(sp, wp, kind, outer, False, {"vocab_parallel": True}) for sp, wp, outer in shapes])


def _ce_worker(rank: int, world: int) -> float:
    # the loss and the logits' gradient against F.cross_entropy on full logits, with
    # ignored labels; a head wider than the model to make the vocab uneven (41 over 2)
    torch.manual_seed(0)
    head = torch.nn.Linear(8, 41, bias=False)
    model = torch.nn.Sequential(torch.nn.ModuleList([torch.nn.Sequential(torch.nn.Linear(8, 8))]), head)
    full_w = head.weight.detach().clone()
    comm = ISPCommunicator(model, ParallelGroups.create(wp_size=world), ISPConfig(vocab_parallel=True), head=head)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(3, 5, 8, generator=g, requires_grad=True)
    y = torch.randint(0, 41, (3, 5), generator=g)
    y[0, :2] = -100
    loss = comm.cross_entropy(head(x), y)
    loss.backward()
    x_ref = x.detach().clone().requires_grad_()
    ref = torch.nn.functional.cross_entropy((x_ref @ full_w.t()).flatten(0, 1), y.flatten())
    ref.backward()
    err = max((loss - ref).abs().item(), (x.grad - x_ref.grad).abs().max().item())
    comm.close()
    return err


@pytest.mark.timeout(60)
def test_vocab_parallel_cross_entropy_matches_full_logits() -> None:
    for err in run_ranks(_ce_worker, 2, timeout_s=50):
        assert err < 1e-6  # fp32, only the softmax summation order differs


def _refusal_worker(rank: int, world: int) -> str:
    import transformers  # noqa: F401  (the test extra installs it: never a silent skip)

    try:
        ISPCommunicator(_model("hf", tied=True), ParallelGroups.create(wp_size=2), ISPConfig(vocab_parallel=True))
    except ValueError as exc:
        return str(exc)
    return "no error"


@pytest.mark.timeout(60)
def test_vocab_parallel_refuses_a_tied_head() -> None:
    import transformers  # noqa: F401  (the test extra installs it: never a silent skip)

    for text in run_ranks(_refusal_worker, 2, timeout_s=50):
        assert "tied to the embedding" in text, text
