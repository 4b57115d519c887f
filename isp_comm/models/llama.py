"""A small llama-class decoder: RMSNorm, rotary GQA attention, SwiGLU MLP.

Plain PyTorch with no isp_comm imports: it is what users bring, and what isp-comm wraps.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


def llama_ffn_hidden(hidden: int, multiple_of: int = 256) -> int:
    """Llama's SwiGLU inner width for a model width: 8/3 of it, rounded up to a
    multiple of ``multiple_of`` (2048 -> 5632, 4096 -> 11008, as Meta's llama). The
    rounding is not cosmetic: on a GPU a bf16 GEMM whose inner size is not a multiple
    of 8 falls back to slow kernels (in one run on an H100, a step of the 697M llama
    took 1.9 times as long at 5461 as at 5632)."""
    return -(-hidden * 8 // 3 // multiple_of) * multiple_of


@dataclass(kw_only=True)
class LlamaConfig:
    vocab_size: int = 256
    """Vocabulary size (256 for byte-level text)."""
    hidden: int = 64
    """Model width."""
    ffn_hidden: int = 172
    """SwiGLU inner width."""
    n_layers: int = 2
    """Number of transformer blocks."""
    n_heads: int = 4
    """Query heads."""
    n_kv_heads: int = 2
    """Key/value heads (grouped-query attention when < n_heads)."""
    bias: bool = False
    """Biases on every linear layer of the blocks."""
    rope_theta: float = 10000.0
    """Rotary embedding base."""
    max_seq_len: int = 2048
    """Longest sequence the rotary tables cover."""
    qkv_layout: str = "separate"
    """Projections and what the attention core receives: ``"separate"`` (q, k, v
    linears; ``attention_fn(q, k, v)``), ``"q_kv"`` (q and one kv linear;
    ``attention_fn(q, kv)`` with kv ``[b, 2, kv_heads, s, d]``) or ``"qkv"`` (one
    linear; ``attention_fn(qkv)`` with qkv ``[b, 3, heads, s, d]``, needs
    ``n_kv_heads == n_heads``)."""

    def __post_init__(self) -> None:
        if self.qkv_layout not in ("separate", "q_kv", "qkv"):
            raise ValueError(f"qkv_layout must be 'separate', 'q_kv' or 'qkv', got {self.qkv_layout!r}")
        if self.qkv_layout == "qkv" and self.n_kv_heads != self.n_heads:
            raise ValueError("qkv_layout='qkv' needs n_kv_heads == n_heads")
        if self.hidden % self.n_heads:
            raise ValueError(f"hidden={self.hidden} is not divisible by n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} is not divisible by n_kv_heads={self.n_kv_heads}")


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * self.weight.float()).to(x.dtype)


def rope_tables(cfg: LlamaConfig, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    head_dim = cfg.hidden // cfg.n_heads
    steps = torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device)
    inv = 1.0 / (cfg.rope_theta ** (steps / head_dim))
    ang = positions.float()[..., None] * inv
    return ang.cos(), ang.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (batch, heads, seq, head_dim); cos/sin: (seq, head_dim/2) or (batch, seq, ...).

    [Note: rotary as one complex product]
    Each pair (x[2i], x[2i+1]) is rotated by its position's angle, in fp32: as a
    complex number times cos + i sin, which is (x1 cos - x2 sin, x1 sin + x2 cos),
    the same products and sums as the pairwise form. One complex product (and its
    conjugate in backward) reads and writes the pairs once; the pairwise form, with
    its four products, a sum, a difference and a ``stack``, moved about 4 times the
    bytes. A block of Llama-3-8B's shape at 8,192 tokens moved 19.3 GiB forward and
    backward at 6ae422e, 15.3 GiB with this, grouped attention and plain views for
    the heads; transformers' Llama 14.7, its rotary and its norm's weight product in
    bf16 where these stay in fp32 (``python bench/model_bytes.py``). In fp32 the
    results are bitwise those of the pairwise form.

    Under ``torch.compile`` the pairwise form runs instead (:func:`_rope_pairs`):
    inductor generates no code for complex numbers (it warns, and calls ATen's
    kernels one by one), while it fuses the pairwise form's products, sums and
    ``stack`` into the kernels around them."""
    if torch.compiler.is_compiling():
        return _rope_pairs(x, cos, sin)
    rot = torch.complex(cos.float(), sin.float()).unsqueeze(-2)  # (..., seq, 1, head_dim/2): every head alike
    # on the (batch, seq, heads, head_dim) layout the projections write: their views, so
    # that neither the forward nor the backward copies the pairs into another layout
    pairs = torch.view_as_complex(x.transpose(1, 2).float().unflatten(-1, (-1, 2)))
    return torch.view_as_real(pairs * rot).flatten(-2).to(x.dtype).transpose(1, 2)


def _rope_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """:func:`apply_rope` as real products on the pairs, for compiled graphs."""
    c, s = cos.float().unsqueeze(-2), sin.float().unsqueeze(-2)
    pairs = x.transpose(1, 2).float().unflatten(-1, (-1, 2))
    x1, x2 = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2)
    return rotated.to(x.dtype).transpose(1, 2)


def causal_attention(
    q: torch.Tensor,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | Sequence[int] | None = None,
) -> torch.Tensor:
    """Causal attention on [batch, heads, seq, head_dim]; k/v may have fewer (GQA) heads.
    ``(q, kv)`` and ``(qkv,)`` take the packed forms of ``LlamaConfig.qkv_layout``;
    ``cu_seqlens`` (document boundaries, 0 ... seq, a tensor or host ints) keeps
    attention inside documents."""
    if k is None:
        q, k, v = q.unbind(1)
    elif v is None:
        k, v = k.unbind(1)
    # grouped KV heads go to the kernel as they are: it reads each for its group of query
    # heads (CPU and CUDA flash kernels), where repeating them wrote a copy as large as
    # the queries; in bf16 their gradients are summed over the group in fp32, then rounded
    gqa = q.shape[1] != k.shape[1]
    if cu_seqlens is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    return _documents(q, k, v, cu_seqlens, gqa)


# host-read boundaries: traced, a compiled block would specialise on each packing; torch's
# lazy torch.compiler.disable, which imports dynamo at the first call, not at this import
@torch._disable_dynamo
def _documents(q, k, v, cu_seqlens: torch.Tensor | Sequence[int], gqa: bool) -> torch.Tensor:
    """Causal attention of each document alone (a slice per document, boundaries read
    on the host), outside any compiled graph: traced, the graph would depend on the
    number and places of the documents, one recompile per new packing."""
    cuts = cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else list(cu_seqlens)
    docs = [(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b]) for a, b in zip(cuts, cuts[1:])]
    return torch.cat([F.scaled_dot_product_attention(*d, is_causal=True, enable_gqa=gqa) for d in docs], dim=2)


class Attention(nn.Module):
    """GQA attention. ``attention_fn`` is the swappable core (a library may replace it,
    e.g. by a sequence-parallel one); ``n_heads`` / ``n_kv_heads`` describe it."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads = cfg.n_heads, cfg.n_kv_heads
        self.attention_fn = causal_attention
        self.head_dim = hd = cfg.hidden // cfg.n_heads
        self.layout = cfg.qkv_layout
        q_out, kv_out = cfg.n_heads * hd, cfg.n_kv_heads * hd
        if self.layout == "qkv":
            self.qkv_proj = nn.Linear(cfg.hidden, 3 * q_out, bias=cfg.bias)
        else:
            self.q_proj = nn.Linear(cfg.hidden, q_out, bias=cfg.bias)
            if self.layout == "q_kv":
                self.kv_proj = nn.Linear(cfg.hidden, 2 * kv_out, bias=cfg.bias)
            else:
                self.k_proj = nn.Linear(cfg.hidden, kv_out, bias=cfg.bias)
                self.v_proj = nn.Linear(cfg.hidden, kv_out, bias=cfg.bias)
        self.o_proj = nn.Linear(q_out, cfg.hidden, bias=cfg.bias)

    def _heads(self, y: torch.Tensor, parts: int, heads: int) -> torch.Tensor:
        """[b, s, parts * heads * d] -> [b, parts, heads, s, d]."""
        b, s, _ = y.shape
        return y.view(b, s, parts, heads, self.head_dim).permute(0, 2, 3, 1, 4)

    def _head(self, y: torch.Tensor, heads: int) -> torch.Tensor:
        """[b, s, heads * d] -> [b, heads, s, d], a view (no part to select: its
        backward would write a zeroed copy of the gradient)."""
        b, s, _ = y.shape
        return y.view(b, s, heads, self.head_dim).transpose(1, 2)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cu_seqlens: torch.Tensor | None = None
    ) -> torch.Tensor:
        b, s, _ = x.shape
        kw = {} if cu_seqlens is None else {"cu_seqlens": cu_seqlens}
        if self.layout == "qkv":
            q, k, v = self._heads(self.qkv_proj(x), 3, self.n_heads).unbind(1)
            qkv = torch.stack((apply_rope(q, cos, sin), apply_rope(k, cos, sin), v), dim=1)
            o = self.attention_fn(qkv, **kw)
        elif self.layout == "q_kv":
            q = apply_rope(self._head(self.q_proj(x), self.n_heads), cos, sin)
            k, v = self._heads(self.kv_proj(x), 2, self.n_kv_heads).unbind(1)
            o = self.attention_fn(q, torch.stack((apply_rope(k, cos, sin), v), dim=1), **kw)
        else:
            q = self._head(self.q_proj(x), self.n_heads)
            k = self._head(self.k_proj(x), self.n_kv_heads)
            v = self._head(self.v_proj(x), self.n_kv_heads)
            o = self.attention_fn(apply_rope(q, cos, sin), apply_rope(k, cos, sin), v, **kw)
        return self.o_proj(o.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden, cfg.ffn_hidden, bias=cfg.bias)
        self.up_proj = nn.Linear(cfg.hidden, cfg.ffn_hidden, bias=cfg.bias)
        self.down_proj = nn.Linear(cfg.ffn_hidden, cfg.hidden, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.hidden)
        self.mlp = MLP(cfg)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cu_seqlens: torch.Tensor | None = None
    ) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin, cu_seqlens)
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.layers = nn.ModuleList(DecoderBlock(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.hidden)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab_size, bias=False)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits. ``cu_seqlens``: boundaries of the documents packed into each row
        (over the whole sequence, 0 ... seq); ``position_ids`` then restart per document."""
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)
        cos, sin = rope_tables(self.cfg, position_ids)
        h = self.embed(input_ids)
        for layer in self.layers:
            h = layer(h, cos, sin, cu_seqlens)
        return self.lm_head(self.norm(h))


def build(cfg: LlamaConfig, seed: int = 0) -> Llama:
    """The model with deterministic weights (same seed, same weights on every rank),
    built on the CPU from the CPU generator alone: ``torch.manual_seed`` would also
    reseed every GPU's generator, undoing a per-rank CUDA seed (dropout) set before."""
    gen_state = torch.random.get_rng_state()
    torch.random.default_generator.manual_seed(seed)
    try:
        return Llama(cfg)
    finally:
        torch.random.set_rng_state(gen_state)


def export_config_path(path: str) -> str:
    """Where ``isp-export -o PATH`` writes the model's config: ``PATH`` without its
    file's suffix, plus ``.config.json`` (a dot in a folder's name is no suffix)."""
    return os.path.splitext(path)[0] + ".config.json"


def from_export(path: str) -> Llama:
    """The unwrapped model of an ``isp-export -o PATH`` file (``.pt`` or
    ``.safetensors``), rebuilt from the config written beside it
    (``PATH`` without its suffix, plus ``.config.json``), with its weights loaded."""
    import json

    with open(export_config_path(path)) as f:
        cfg = LlamaConfig(**json.load(f))
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        sd = load_file(path)
    else:
        sd = torch.load(path, weights_only=True)
    if any(".lora_" in k for k in sd):
        raise ValueError(f"{path} holds LoRA adapters: export it with --merge-lora to rebuild the plain model")
    with torch.device("meta"):
        model = Llama(cfg)
    model.load_state_dict(sd, assign=True)
    return model
