"""The blockwise attention of logit softcapping and attention sinks on CUDA (skipped
without CUDA; CI has none and never runs it): the CPU's results, and no host read."""

from __future__ import annotations

import pytest
import torch

from isp_comm.sequence_parallel.local import blockwise_attention

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _run(q, k, v, sinks, softcap, block):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, sinks)]
    out = blockwise_attention(*leaves[:3], softcap=softcap, sinks=leaves[3], block=block)
    out.backward(torch.ones_like(out) / out.numel() ** 0.5)
    return [out.detach()] + [t.grad for t in leaves]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blockwise_attention_on_cuda_matches_the_cpu(dtype: torch.dtype) -> None:
    """Forward and every gradient (q, k, v, sinks) on CUDA against the same function on
    the CPU in fp32, GQA (8 heads over 2), blocks that do not divide the sequence;
    within CUDA's fp32 matmul rounding (TF32 off), or bf16's 2e-2 for bf16 inputs.
    Under ``torch.cuda.set_sync_debug_mode("error")`` a host read raises."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 8, 300, 32, generator=g)
    k, v = (torch.randn(2, 2, 300, 32, generator=g) for _ in range(2))
    sinks = torch.randn(8, generator=g)
    ref = _run(q, k, v, sinks, 30.0, 128)
    on = [t.cuda().to(dtype) for t in (q, k, v)] + [sinks.cuda()]
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = _run(*on, 30.0, 128)
    finally:
        torch.cuda.set_sync_debug_mode("default")
        torch.backends.cuda.matmul.allow_tf32 = tf32
    got, ref = ([t.float().cpu() for t in ts] for ts in (got, ref))
    rel = 1e-4 if dtype == torch.float32 else 2e-2  # CUDA's fp32 matmul order; bf16's 8-bit mantissa
    for name, a, b in zip(("out", "dq", "dk", "dv", "dsinks"), got, ref):
        atol = rel * float(b.abs().max())  # of the tensor's scale: the gradients are small numbers
        torch.testing.assert_close(a, b, rtol=rel, atol=atol, msg=lambda m, n=name: f"{n}: {m}")
