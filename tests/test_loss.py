"""The chunked cross-entropy: F.cross_entropy's values and gradients, one fp32 chunk
of logits alive at a time."""

from __future__ import annotations

import weakref

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from isp_comm.loss import cross_entropy


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_values_and_gradients_are_f_cross_entropys(dtype: torch.dtype, reduction: str) -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 29, 41, generator=g).to(dtype).requires_grad_()
    labels = torch.randint(0, 41, (3, 29), generator=g)
    labels[0, :7] = -100  # ignored tokens count for nothing
    weights = torch.rand(3, 29, generator=g)  # "none": a gradient of its own for each token
    ours = cross_entropy(logits, labels, reduction=reduction, chunk_bytes=4 * 41 * 10)  # 10 rows a chunk
    (mine,) = torch.autograd.grad(ours if reduction != "none" else (ours * weights).sum(), logits)
    ref = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction=reduction)
    if reduction == "none":
        ref = ref.view(labels.shape)
    (theirs,) = torch.autograd.grad(ref if reduction != "none" else (ref * weights).sum(), logits)
    assert mine.dtype == dtype and ours.shape == ref.shape
    # fp32 arithmetic per token as F.cross_entropy's; the chunks' sums in another order
    # (measured 0 and up to 9e-8 on the gradient of the sum)
    assert (ours - ref).abs().max().item() <= 1e-6 * ref.abs().max().item()
    assert (mine.float() - theirs.float()).abs().max().item() <= 2e-7


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_no_valid_token_gives_no_gradient(reduction: str) -> None:
    """Every label ignored: F.cross_entropy's mean is NaN (0 / 0) and its sum 0, and the
    gradient is 0 in both; a NaN gradient would reach every rank's through the
    reductions."""
    logits = torch.randn(2, 5, 11).requires_grad_()
    labels = torch.full((2, 5), -100)
    ours = cross_entropy(logits, labels, reduction=reduction)
    (mine,) = torch.autograd.grad(ours.sum(), logits)
    ref = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction=reduction)
    (theirs,) = torch.autograd.grad(ref.sum(), logits)
    assert ours.isnan().any().item() == ref.isnan().any().item() == (reduction == "mean")
    assert reduction != "none" or (ours.shape == labels.shape and not ours.any())
    assert torch.equal(mine, theirs) and not mine.any()


class _LiveBytes(TorchDispatchMode):
    """The most bytes of tensors made under the mode alive at once."""

    def __init__(self, *before: torch.Tensor) -> None:
        super().__init__()
        self.live, self.peak = 0, 0
        self.storages = {t.untyped_storage().data_ptr() for t in before}  # made before: not counted

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else (out,):
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if storage.nbytes() and key not in self.storages:  # a new storage (not a view, not in place)
                self.storages.add(key)
                self.live += storage.nbytes()
                self.peak = max(self.peak, self.live)
                weakref.finalize(storage, self._free, key, storage.nbytes())
        return out

    def _free(self, key: int, n: int) -> None:
        self.storages.discard(key)
        self.live -= n


def test_the_backward_holds_one_fp32_chunk_beside_the_gradient() -> None:
    # 512 tokens of a vocabulary of 1000 in bf16 (1 MB of logits): F.cross_entropy on
    # their fp32 copy holds three fp32 logits-sized tensors through its backward
    # (measured 6.1 MB beyond the logits); the chunked loss, at 64 tokens a chunk, the
    # bf16 gradient (1 MB) and a chunk's fp32 copy, difference and softmax (768 KB):
    # measured 1.8 MB
    logits = torch.randn(512, 1000).bfloat16().requires_grad_()
    labels = torch.randint(0, 1000, (512,))
    peaks = {}
    for name, loss_of in (
        ("chunked", lambda: cross_entropy(logits, labels, chunk_bytes=64 * 1000 * 4)),
        ("F", lambda: F.cross_entropy(logits.float(), labels)),
    ):
        with _LiveBytes(logits, labels) as mode:
            loss_of().backward()
        peaks[name] = mode.peak
        logits.grad = None
    fp32 = 512 * 1000 * 4
    assert peaks["F"] >= 2.5 * fp32, peaks
    assert peaks["chunked"] <= 0.5 * fp32 + 4 * 64 * 1000 * 4, peaks
