"""The reference llama's rotary embedding and grouped attention (isp_comm/models/llama.py):
the same numbers as the pairwise rotary and repeated KV heads they replace, in fewer
bytes (see [Note: rotary as one complex product])."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from isp_comm.models.llama import LlamaConfig, apply_rope, build, causal_attention, rope_tables


def _pairwise_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The rotary as written before: each pair (x[2i], x[2i+1]) rotated in fp32, stacked."""
    x1, x2 = x.float()[..., 0::2], x.float()[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2).to(x.dtype)


def test_rotary_is_the_pairwise_rotation_bitwise() -> None:
    cfg = LlamaConfig(hidden=64, n_heads=4, n_kv_heads=2)
    cos, sin = rope_tables(cfg, torch.arange(16))
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        y = torch.randn(2, 16, 4 * 16, generator=g).to(dtype)  # a projection's output
        x = y.view(2, 16, 4, 16).transpose(1, 2)  # its heads, as the model takes them
        assert torch.equal(apply_rope(x, cos, sin), _pairwise_rope(x, cos, sin)), dtype
        assert torch.equal(apply_rope(x.contiguous(), cos, sin), _pairwise_rope(x, cos, sin)), dtype
        xg, xr = (x.detach().clone().requires_grad_() for _ in range(2))
        grad = torch.randn(x.shape, generator=g).to(dtype)
        apply_rope(xg, cos, sin).backward(grad)
        _pairwise_rope(xr, cos, sin).backward(grad)
        assert torch.equal(xg.grad, xr.grad), dtype


def test_grouped_attention_equals_repeated_kv_heads() -> None:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 8, 32, 16, generator=g, requires_grad=True)
    k, v = (torch.randn(2, 2, 32, 16, generator=g, requires_grad=True) for _ in range(2))
    out = causal_attention(q, k, v)
    ref = F.scaled_dot_product_attention(q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1), is_causal=True)
    assert torch.equal(out, ref)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    ref_grads = torch.autograd.grad(ref.sum(), (q, k, v))
    for a, b in zip(grads, ref_grads):  # fp32: the group's sum in another order at most
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_a_block_of_llama3_8b_moves_about_what_transformers_llama_does() -> None:
    """Element-wise bytes of one block, forward and backward, by the planner's meta
    trace: 19.3 GiB at 6ae422e, 15.3 now, transformers' Llama 14.7 (its rotary and
    norm product in bf16). 5% over transformers' at most."""
    import transformers  # the test extra installs it: never a silent skip

    from isp_comm.discovery import find_blocks
    from isp_comm.planner.ops import trace_ops

    def block(model) -> float:
        t = trace_ops(model, list(find_blocks(model)), 1, 8192, torch.bfloat16)
        return (sum(t.block_fwd[0].moved) + sum(t.block_bwd[0].moved)) / 2**30

    shape = dict(hidden=4096, ffn_hidden=14336, n_layers=2, n_heads=32, n_kv_heads=8, max_seq_len=8192)
    hf = transformers.LlamaConfig(
        vocab_size=1024, hidden_size=4096, intermediate_size=14336, num_hidden_layers=2, num_attention_heads=32,
        num_key_value_heads=8, max_position_embeddings=8192, attn_implementation="sdpa",
    )  # fmt: skip
    with torch.device("meta"):
        ours, theirs = block(build(LlamaConfig(vocab_size=1024, **shape))), block(transformers.LlamaForCausalLM(hf))
    assert ours <= 1.05 * theirs, (ours, theirs)
