"""What a compiled block saves for backward: the forecast's meta trace against
``torch.compile`` (inductor) on CPU, storage for storage ([Note: what a compiled block
saves] in isp_comm/memory_forecast/activations.py).

Exact comparisons: both sides count the same storages (each once, parameters never),
and the trace runs the partition inductor runs, so no tolerance is needed.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from isp_comm.memory_forecast import forecast
from isp_comm.memory_forecast.activations import trace
from isp_comm.models.llama import LlamaConfig, build

BATCH, SEQ = 2, 128
CFG = LlamaConfig(vocab_size=512, hidden=256, ffn_hidden=704, n_layers=2, n_heads=8, n_kv_heads=2)


class _Watched(nn.Module):
    """A block whose calls set ``flag[0]`` (outside any compiled region, so it holds
    while the compiled block's own forward runs)."""

    def __init__(self, inner: nn.Module, flag: list[bool]) -> None:
        super().__init__()
        self.inner, self.flag = inner, flag

    def forward(self, *args, **kwargs):
        self.flag[0] = True
        try:
            return self.inner(*args, **kwargs)
        finally:
            self.flag[0] = False


def _saved_by_first_block(model: nn.Module, layers: nn.ModuleList, run, compiled: bool) -> int:
    """Bytes autograd keeps while ``layers[0]`` runs (compiled by inductor or eager),
    in one real forward of ``model``: each storage once, parameters never."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}
    flag = [False]

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = t.untyped_storage().data_ptr()
        if flag[0] and key not in params:
            seen.setdefault(key, t.untyped_storage().nbytes())
        return t

    torch._dynamo.reset()
    layers[0] = _Watched(torch.compile(layers[0]) if compiled else layers[0], flag)
    ids = torch.randint(0, CFG.vocab_size, (BATCH, SEQ))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run(model, ids)
    return sum(seen.values())


def _reference(device: str):
    with torch.device(device):
        model = build(CFG)
    return model, model.layers, lambda m, ids: m(ids)


def _transformers(device: str):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=CFG.vocab_size, hidden_size=CFG.hidden, intermediate_size=CFG.ffn_hidden,
        num_hidden_layers=CFG.n_layers, num_attention_heads=CFG.n_heads, num_key_value_heads=CFG.n_kv_heads,
    )  # fmt: skip
    with torch.device(device):
        model = transformers.LlamaForCausalLM(config)
    return model, model.model.layers, lambda m, ids: m(input_ids=ids, use_cache=False).logits


@pytest.mark.parametrize(
    "family,dtype",
    [("reference", torch.float32), ("reference", torch.bfloat16), ("transformers", torch.float32)],
)
def test_the_trace_counts_what_a_compiled_block_saves(family, dtype):
    make = _reference if family == "reference" else _transformers
    meta, meta_layers, meta_run = make("meta")
    blocks = list(meta_layers)
    param_dtype = None if dtype == torch.float32 else dtype
    eager = trace(meta, blocks, BATCH, SEQ, param_dtype, meta_run).saved[0]
    compiled = trace(meta, blocks, BATCH, SEQ, param_dtype, meta_run, compiled=True).saved[0]

    model, layers, run = make("cpu")
    model.to(dtype)
    assert compiled == _saved_by_first_block(model, layers, run, compiled=True)
    model, layers, run = make("cpu")
    model.to(dtype)
    assert eager == _saved_by_first_block(model, layers, run, compiled=False)
    assert compiled < eager  # inductor recomputes what eager autograd keeps


def test_the_forecast_sees_blocks_given_compile():
    """``forecast(compiled=None)`` counts a meta model whose blocks were given
    ``block.compile()`` (as isp-train --compile does before wrapping) as compiled."""
    meta, layers, _ = _reference("meta")
    eager = forecast(meta, None, 1, 1, 1, BATCH, SEQ).activations_by_block
    assert eager == forecast(meta, None, 1, 1, 1, BATCH, SEQ, compiled=False).activations_by_block
    for block in layers:
        block.compile()
    seen = forecast(meta, None, 1, 1, 1, BATCH, SEQ).activations_by_block
    assert seen == forecast(meta, None, 1, 1, 1, BATCH, SEQ, compiled=True).activations_by_block
    assert sum(seen) < sum(eager)


class _Branchy(nn.Module):
    """A block that takes another path when compiled: a product saving its input
    (eager), or two matmuls saving their input and the 4x wider middle (compiled)."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(hidden))
        self.a = nn.Parameter(torch.randn(hidden, 4 * hidden) / hidden)
        self.b = nn.Parameter(torch.randn(4 * hidden, hidden) / hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return (x @ self.a) @ self.b
        return x * self.w


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(CFG.vocab_size, 32)
        self.layers = nn.ModuleList([_Branchy(32), _Branchy(32)])
        self.head = nn.Linear(32, CFG.vocab_size)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def test_the_trace_takes_the_path_a_compiled_block_takes():
    """A block may branch on ``torch.compiler.is_compiling()`` (the reference llama's
    rotary does); the trace of a compiled block takes the compiled path, as dynamo
    does: input and middle kept (5 hidden states), not the eager path's input alone."""
    with torch.device("meta"):
        meta = _Tiny()
    compiled = trace(meta, list(meta.layers), BATCH, SEQ, None, lambda m, ids: m(ids), compiled=True).saved[0]
    hidden_state = BATCH * SEQ * 32 * 4
    assert compiled == 5 * hidden_state
    model = _Tiny()
    assert compiled == _saved_by_first_block(model, model.layers, lambda m, ids: m(ids), compiled=True)


def test_a_forward_set_on_a_block_survives_the_trace():
    """A forward set on a block's instance (as accelerate's hooks do) is the block's
    own: the traced copy, kept for the next trace (``copies``), still has it after the
    trace replaced it for a twin (block 1) and for a compiled block (block 0)."""
    import functools

    meta, layers, run = _reference("meta")
    for block in layers:
        block.forward = functools.partial(type(block).forward, block)
    copies: dict = {}
    trace(meta, list(layers), BATCH, SEQ, None, run, copies, compiled=True)
    _, copied = copies[("meta copy", None)]
    assert all("forward" in b.__dict__ for b in copied)
    assert [b.forward.args[0] for b in copied] == copied  # each its own copy's
