"""Vocab-parallel head and cross-entropy: training equal to single-process training
with the full head, the head's weight never gathered."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.nn.functional

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


def _ce_worker(rank: int, world: int, vocab: int, reduction: str, ignored_rank: int) -> list[float]:
    # the loss and the gradients of the head's input and weight against F.cross_entropy
    # on full logits, with ignored labels (every label of ``ignored_rank``)
    torch.manual_seed(0)
    head = torch.nn.Linear(8, vocab, bias=False)
    model = torch.nn.Sequential(torch.nn.ModuleList([torch.nn.Sequential(torch.nn.Linear(8, 8))]), head)
    full_w = head.weight.detach().clone().requires_grad_()
    comm = ISPCommunicator(model, ParallelGroups.create(wp_size=world), ISPConfig(vocab_parallel=True), head=head)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(3, 5, 8, generator=g, requires_grad=True)
    y = torch.randint(0, vocab, (3, 5), generator=g)
    y[0, :2] = -100
    if rank == ignored_rank:
        y[:] = -100
    weights = torch.rand(3, 5, generator=g) if reduction == "none" else torch.ones(())  # a gradient per token
    loss = comm.cross_entropy(head(x), y, reduction=reduction)
    (loss * weights).sum().backward()
    x_ref = x.detach().clone().requires_grad_()
    ref = torch.nn.functional.cross_entropy((x_ref @ full_w.t()).flatten(0, 1), y.flatten(), reduction=reduction)
    ref = ref.view(y.shape) if reduction == "none" else ref
    (ref * weights).sum().backward()
    # the head's gradient is summed over the WP ranks' tokens: compare with the sum of
    # the references' (a NaN anywhere reaches every rank through the gathers)
    w_grad = torch.distributed.nn.functional.all_reduce(full_w.grad.clone())
    rows = head.weight.shape[0]
    start = comm._vocab_head.vocab_start
    err = [
        (loss - ref).abs().max().item() if ref.isfinite().all() else float(loss.isnan() != ref.isnan()),
        (x.grad - x_ref.grad).abs().max().item(),
        (head.weight.grad[:rows] - w_grad[start : start + rows]).abs().max().item() if rows else 0.0,
    ]
    comm.close()
    return err


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "world, vocab, reduction, ignored_rank",
    [
        (2, 41, "mean", -1),  # uneven rows (21, 20)
        (2, 41, "sum", 1),  # rank 1 has no valid token: a sum of 0, no gradient; rank 0's intact
        (2, 41, "mean", 1),  # and a mean of NaN, as F.cross_entropy's, still no gradient
        (2, 41, "none", 1),  # each token's loss (0 where ignored) and a gradient of its own
        (4, 5, "none", -1),
        (4, 5, "mean", -1),  # 2, 2, 1, 0 rows: rank 3 holds none of the vocabulary
    ],
)
def test_vocab_parallel_cross_entropy_matches_full_logits(
    world: int, vocab: int, reduction: str, ignored_rank: int
) -> None:
    for err in run_ranks(_ce_worker, world, vocab, reduction, ignored_rank, timeout_s=100):
        assert all(e < 1e-6 for e in err), err  # fp32, only the softmax summation order differs (NaN fails)


def _refusal_worker(rank: int, world: int, case: str) -> str:
    import transformers  # noqa: F401  (the test extra installs it: never a silent skip)

    model = _model("hf", tied=case == "tied")
    if case == "own forward":  # a head whose forward is not the plain product (a scale of its own)
        scaled = type(
            "ScaledHead", (torch.nn.Linear,), {"forward": lambda self, x: 2 * super(type(self), self).forward(x)}
        )
        model.lm_head.__class__ = scaled
    try:
        ISPCommunicator(model, ParallelGroups.create(wp_size=2), ISPConfig(vocab_parallel=True))
        x = torch.randint(0, 37, (1, 8))
        model(input_ids=x, labels=x)  # transformers' own loss on the sharded logits
    except ValueError as exc:
        return str(exc)
    return "no error"


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "case, said",
    [
        ("tied", "tied to the embedding: untie them before wrapping (head.weight = nn.Parameter("),
        # before: ScaledHead's forward replaced silently, its scale lost
        ("own forward", "ScaledHead has one of its own: leave vocab_parallel off for this model (isp-train: "),
        # before: the loss read [wp, batch, seq, vocab/wp] logits as [batch, seq, vocab] (~3e-2 off, silently)
        ("labels", "call the model without labels and take the loss with comm.cross_entropy"),
    ],
)
def test_vocab_parallel_refuses_what_it_cannot_split(case: str, said: str) -> None:
    import transformers  # noqa: F401  (the test extra installs it: never a silent skip)

    for text in run_ranks(_refusal_worker, 2, case, timeout_s=50):
        assert said in text, text


def test_vocab_parallel_says_what_to_do_with_a_head_it_cannot_split() -> None:
    """The refusals that had no test, each saying what to do instead (it said only
    what was wrong: "pass head=", or nothing): no nn.Linear outside the blocks, a head
    with a bias, and logits or labels reshaped before the vocab-parallel loss."""
    from isp_comm.vocab_parallel import find_output_head, vocab_parallel_cross_entropy

    blocks = torch.nn.ModuleList([torch.nn.Linear(8, 8)])
    with pytest.raises(ValueError) as refused:
        find_output_head(torch.nn.Sequential(blocks, torch.nn.ReLU()), None, list(blocks))
    said = str(refused.value)
    assert "found no nn.Linear outside the blocks: pass the head's nn.Linear as ISPCommunicator(" in said, said
    assert said.endswith("or leave vocab_parallel off for this model (isp-train: without --vocab-parallel)"), said
    with pytest.raises(ValueError, match=r"found a ReLU: pass the head's nn.Linear as ISPCommunicator\(\.\.\., head="):
        find_output_head(torch.nn.Sequential(blocks), torch.nn.ReLU(), list(blocks))
    biased = torch.nn.Sequential(blocks, torch.nn.Linear(8, 37))
    with pytest.raises(ValueError, match="without bias, and this Linear has one: leave vocab_parallel off for this"):
        find_output_head(biased, None, list(blocks))
    # the loss takes the head's [wp, batch, seq, rows] and labels [batch, seq]; a flattened pair is refused
    # before any collective (comm: never reached)
    logits, labels = torch.zeros(2, 3, 5, 10), torch.zeros(3, 5, dtype=torch.long)
    with pytest.raises(ValueError) as refused:
        vocab_parallel_cross_entropy(logits.flatten(1, 2), labels, None, 0)  # type: ignore[arg-type]
    said = str(refused.value)
    assert said.startswith("vocab-sharded logits (2, 15, 10) do not match labels (3, 5)"), said
    assert "pass the head's output as it came (not flattened or sliced) and labels shaped like" in said, said


def _whole_worker(rank: int, world: int, vocab: int, backend: str) -> list[float | str]:
    # a head of ``vocab`` rows over ``world`` ranks (every split uneven, a rank with
    # none at 3 over 4): the whole logits against the full head's, from ranks whose
    # tokens differ; refused with grad; the vocab-sharded ones again outside
    torch.manual_seed(0)
    head = torch.nn.Linear(8, vocab, bias=False)
    full_w = head.weight.detach().clone()
    model = torch.nn.Sequential(torch.nn.ModuleList([torch.nn.Sequential(torch.nn.Linear(8, 8))]), head)
    config = ISPConfig(vocab_parallel=True, backend=backend)
    comm = ISPCommunicator(model, ParallelGroups.create(wp_size=world), config, head=head)
    x = torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(rank))
    with comm.whole_logits(), torch.no_grad():
        whole = head(x)
    out: list[float | str] = [str(tuple(whole.shape)), (whole - x @ full_w.t()).abs().max().item()]
    with comm.whole_logits(), pytest.raises(RuntimeError, match="for inference") as refused:
        head(x.requires_grad_())
    out += [str(refused.value)[:40], str(tuple(head(x).shape))]
    with comm.whole_logits(), torch.no_grad(), pytest.raises(ValueError, match="different shapes") as refused:
        head(torch.randn(1 + rank, 3, 8))  # one batch size per WP group
    out.append(str(refused.value))
    comm.close()
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world,vocab,backend", [(2, 37, "symm"), (2, 37, "torch"), (4, 3, "symm")])
def test_whole_logits_are_the_full_heads(world: int, vocab: int, backend: str) -> None:
    """``comm.whole_logits()``: this rank's tokens against the whole vocabulary, equal to
    the full head's logits up to summation order (the same dot products, 8 terms in
    fp32: 1e-6), which ``generate()`` runs in (tests/test_hf.py); ranks bringing
    different shapes are refused on every rank."""
    rows = -(-vocab // world)
    for out in run_ranks(_whole_worker, world, vocab, backend):
        assert out[0] == f"(2, 3, {vocab})" and out[1] < 1e-6, out
        assert out[2].startswith("whole logits (generate(), comm.whole_l"), out
        assert out[3] in {f"({world}, 2, 3, {n})" for n in (0, vocab % rows or rows, rows)}, out
        assert "WP rank 0: (1, 3, 8), WP rank 1: (2, 3, 8)" in out[4], out  # on every rank, before any gloo abort


def _labels_whole_worker(rank: int, world: int) -> float:
    import transformers  # noqa: F401  (the test extra installs it: never a silent skip)

    ref, model = _model("hf").eval(), _model("hf").eval()
    comm = ISPCommunicator(model, ParallelGroups.create(wp_size=world), ISPConfig(vocab_parallel=True))
    x = torch.randint(0, 37, (2, 8), generator=torch.Generator().manual_seed(rank))
    with torch.no_grad(), comm.whole_logits():
        got = model(input_ids=x, labels=x).loss
    err = (got - ref(input_ids=x, labels=x).loss).abs().item()
    comm.close()
    return err


@pytest.mark.timeout(60)
def test_labels_inside_whole_logits_give_the_plain_models_loss() -> None:
    """transformers' own loss (``labels=``), refused on the vocab-sharded logits, is the
    unwrapped model's on the whole ones (fp32; summation order only: 1e-5)."""
    assert all(e < 1e-5 for e in run_ranks(_labels_whole_worker, 2, timeout_s=50))
