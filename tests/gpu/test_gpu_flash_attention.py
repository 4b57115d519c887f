"""flash-attn as the local attention (skipped without CUDA and flash-attn; CI has
neither and never runs it)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from isp_comm.sequence_parallel.local import flash_attn_usable, local_attention

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or importlib.util.find_spec("flash_attn") is None,
    reason="needs CUDA and flash-attn",
)


@pytest.mark.parametrize("varlen", [False, True])
def test_flash_attention_matches_sdpa(varlen: bool) -> None:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 8, 64, 32, generator=g).cuda().bfloat16()
    k, v = (torch.randn(2, 2, 64, 32, generator=g).cuda().bfloat16() for _ in range(2))  # GQA
    cu = torch.tensor([0, 5, 40, 64]) if varlen else None
    assert flash_attn_usable(q)
    out = local_attention(q, k, v, cu)
    ref = local_attention(q.float().cpu(), k.float().cpu(), v.float().cpu(), cu)  # sdpa path on CPU
    torch.testing.assert_close(out.float().cpu(), ref, rtol=2e-2, atol=2e-2)  # bf16 inputs and kernel
