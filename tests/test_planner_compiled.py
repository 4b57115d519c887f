"""The planner's step for compiled blocks ([Note: fused regions] in
``isp_comm/planner/fusion.py``): fused traffic worked out by hand, the compiled step
never above the eager one, the outside left eager, and the eager step unmoved."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from isp_comm import ISPConfig
from isp_comm.models.llama import LlamaConfig, RMSNorm, build
from isp_comm.planner import profile as profiles
from isp_comm.planner.fusion import StorageLog, addressed_bytes
from isp_comm.planner.ops import trace_ops
from isp_comm.planner.step import step_time
from isp_comm.planner.targets import parse_target

D, F_, T = 64, 96, 2 * 32  # hidden, SwiGLU width, tokens (batch 2 of 32)


class _Block(nn.Module):
    """RMSNorm, then SwiGLU, then the residual: ``x + down(silu(gate(n)) * up(n))``."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = RMSNorm(D)
        self.gate, self.up, self.down = nn.Linear(D, F_, False), nn.Linear(D, F_, False), nn.Linear(F_, D, False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = self.norm(x)
        return x + self.down(F.silu(self.gate(n)) * self.up(n))


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.blocks, self.head = nn.Embedding(128, D), nn.ModuleList([_Block()]), nn.Linear(D, 128, False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def _meta(cls, *args):
    with torch.device("meta"):
        return cls(*args)


def test_an_rmsnorm_swiglu_block_moves_what_an_ideal_fusion_moves() -> None:
    """fp32, T tokens, width D, SwiGLU width F. Compiled, the forward is three kernels
    between the products: the norm reads x and its weight and writes its output (the
    gate and up projections read it) and the reciprocal RMS per token (inductor's
    partition saves it for backward); SiLU and the product of gate and up are one
    kernel though the up projection runs between them in program order (nothing flows
    from SiLU into it): it reads gate and up and writes their product; the residual
    reads x and the down projection and writes the block's output. Eager, every
    operator reads its inputs and writes its output (the norm alone is six)."""
    model = _meta(_Model)
    so = trace_ops(model, list(model.blocks), 2, 32, None, compiled=True)
    fwd = so.block_fwd[0]
    norm = 4 * T * D + 4 * D + 4 * T * D + 4 * T
    swiglu = 4 * T * F_ * 3
    residual = 4 * T * D * 3
    assert fwd.moved == [norm, swiglu, residual]
    # products, kernels, the graph, and the trace's backward hook's view of the input (eager's too)
    assert len(fwd.gemm) == 3 and fwd.dispatches == 3 + 3 + 1 + 1
    eager = trace_ops(model, list(model.blocks), 2, 32, None).block_fwd[0]
    td, t4 = 4 * T * D, 4 * T  # pow, mean, + eps, rsqrt, x * r, * weight, silu, * up, + x
    by_op = [2 * td, td + t4, 2 * t4, 2 * t4, 2 * td + t4, 2 * td + 4 * D, 8 * T * F_, 12 * T * F_, 3 * td]
    assert eager.moved == by_op and eager.gemm == fwd.gemm  # 288,512 bytes against 156,160
    assert sum(so.block_bwd[0].moved) < sum(trace_ops(model, list(model.blocks), 2, 32, None).block_bwd[0].moved)


def test_a_region_reads_once_and_writes_what_leaves_it() -> None:
    """The log's rules alone: a chain read from one input writes only its end; a
    value read by a product is written; a fill costs nothing; a broadcast weight is
    read at its own size; a sum of a product and a value that product read is a kernel
    of its own (as the residual across an MLP); an input written in place is written."""
    log = StorageLog()
    x, w = torch.empty(8, 16, device="meta"), torch.empty(16, device="meta")
    log.begin("piece")
    a = x * w  # reads x (512 B) and w (64 B, broadcast), feeds b and the product
    log.record([x, w.expand(8, 16)], a, cut=False)
    b = a.exp()
    log.record([a], b, cut=False)
    zeros = torch.zeros(8, 16, device="meta")
    log.record([], zeros, cut=False)
    c = b + zeros  # the chain's end: returned
    log.record([b, zeros], c, cut=False)
    p = a @ torch.empty(16, 16, device="meta")
    log.record([a], p, cut=True)
    d = p + a  # waits for the product, which waits for a: another kernel, a read again
    log.record([p, a], d, cut=False)
    log.end((c, d))
    log.record([a], a.sum(), cut=False)  # the backward reads a: it was written
    log.begin("in place")
    log.record([x, 2.0], x.mul_(2.0), cut=False)  # the graph's input, written in place: written back
    log.end(())
    (owner, regions), (_, in_place) = log.regions()
    assert owner == "piece" and addressed_bytes(w.expand(8, 16)) == 64
    assert regions == [512 + 64 + 512 + 512, 512 * 3] and in_place == [512 + 512]


def _llama(layers: int = 2) -> nn.Module:
    cfg = LlamaConfig(vocab_size=256, hidden=128, ffn_hidden=352, n_layers=layers, n_heads=4, n_kv_heads=2)
    return _meta(build, cfg)


def test_the_outside_stays_eager() -> None:
    """isp-train compiles the blocks alone: the embedding, final norm, head and loss
    are the same operators compiled or not."""
    model = _llama()
    blocks, memo = list(model.layers), {}
    eager = trace_ops(model, blocks, 2, 64, torch.bfloat16, copies=memo)
    compiled = trace_ops(model, blocks, 2, 64, torch.bfloat16, copies=memo, compiled=True)
    assert compiled.outer_fwd == eager.outer_fwd and compiled.outer_bwd == eager.outer_bwd
    assert compiled.flops == eager.flops  # the same products and attention, fused or not
    assert compiled.block_fwd[1] is compiled.block_fwd[0]  # the twin does what its first did


@pytest.mark.parametrize("target", ["cpu", "h100x8", "h200x8"])
@pytest.mark.parametrize("ckpt", [0.0, 1.0])
def test_the_compiled_step_is_never_above_the_eager_one(target: str, ckpt: float) -> None:
    model, memo = _llama(), {}
    prof = profiles.from_target(parse_target(target))
    world = prof.per_node
    cfg = ISPConfig(activation_checkpointing=ckpt, param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for wp, sp in ((world, 1), (1, 2 if world > 1 else 1)):
        shape = {"world": world, "wp": wp, "sp": sp, "batch": 2 * world // sp, "seq": 128, "memo": memo}
        eager = step_time(model, cfg, prof, **shape)
        compiled = step_time(model, cfg, prof, **shape, compiled=True)
        assert compiled.step_s < eager.step_s, (target, ckpt, wp, sp)
        assert compiled.compute_s["elementwise"] < eager.compute_s["elementwise"]
        assert compiled.compute_s["gemm"] == eager.compute_s["gemm"]
        assert dataclasses.replace(compiled, step_s=0.0) != dataclasses.replace(eager, step_s=0.0)


EAGER = {
    ("cpu", 1, 1, 1, 0.0): (
        0.0822496558033005,
        {
            "gemm": 0.01657102411235157,
            "attention": 0.0038795999823279434,
            "elementwise": 0.04702559584515399,
            "copies": 0.0034477543608504597,
            "dispatch": 0.0027700000000000003,
            "engine": 0.0004,
        },
    ),
    ("cpu", 1, 1, 1, 1.0): (
        0.10285507970602968,
        {
            "gemm": 0.021649976228678952,
            "attention": 0.005032768550839787,
            "elementwise": 0.060218899063043965,
            "copies": 0.0034477543608504597,
            "dispatch": 0.0037500000000000003,
            "engine": 0.0006000000000000001,
        },
    ),
    ("h100x8", 8, 8, 1, 0.5): (
        0.009991640455622505,
        {
            "gemm": 6.672260868058563e-05,
            "attention": 7.368257832935892e-06,
            "elementwise": 0.00010004150644421449,
            "copies": 7.720900101976998e-06,
            "dispatch": 0.004833867627042264,
            "engine": 0.0007999999999999999,
        },
    ),
    ("h100x8", 8, 2, 2, 1.0): (
        0.011076497476757123,
        {
            "gemm": 3.778979606688036e-05,
            "attention": 4.235230109109951e-06,
            "elementwise": 0.00010269824227479395,
            "copies": 9.394099999899974e-06,
            "dispatch": 0.0055592767315492155,
            "engine": 0.0009599999999999999,
        },
    ),
    ("h200x8", 8, 4, 1, 0.0): (
        0.00908819252423137,
        {
            "gemm": 5.786562522741055e-05,
            "attention": 6.2660554476518815e-06,
            "elementwise": 6.123124459004425e-05,
            "copies": 5.914921397385932e-06,
            "dispatch": 0.004186637074734894,
            "engine": 0.0006399999999999999,
        },
    ),
}
"""Eager steps of the tiny llama (target, world, wp, sp, checkpointing) predicted
before the compiled model existed (commit 6909a49), to the bit."""


@pytest.mark.parametrize("key", sorted(EAGER))
def test_eager_predictions_did_not_move(key: tuple) -> None:
    target, world, wp, sp, ckpt = key
    prof = profiles.from_target(parse_target(target))
    cfg = ISPConfig(activation_checkpointing=ckpt, param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    st = step_time(_llama(), cfg, prof, world=world, wp=wp, sp=sp, batch=2 * world // sp, seq=128)
    assert (st.step_s, st.compute_s) == EAGER[key]


def test_the_eager_llama3_8b_step_on_h100_did_not_move() -> None:
    """The measured H100 case (bench/virtual.py's llama3-8b at world 8, wp 8, one
    block of 32 checkpointed): 0.99369 s eager before the compiled model, to the bit."""
    cfg = LlamaConfig(
        vocab_size=128256, hidden=4096, ffn_hidden=14336, n_layers=32, n_heads=32, n_kv_heads=8, max_seq_len=8192
    )
    icfg = ISPConfig(
        activation_checkpointing=1 / 32, shard_outer_params=True, param_dtype=torch.bfloat16, reduce_dtype=torch.float32
    )
    prof = profiles.from_target(parse_target("h100x8"))
    st = step_time(_meta(build, cfg), icfg, prof, world=8, wp=8, sp=1, batch=8, seq=8192)
    assert st.step_s == 0.9936894399433073


def _planned(*flags: str) -> tuple[str, float]:
    """``isp-train --plan`` on h100x8 with ``flags``: its step line and ``step_s``."""
    from tests.test_planner import _plan

    res = _plan("--target", "h100x8", "--layers", "2", "--hidden", "256", "--heads", "4", "--batch", "8", *flags)
    assert res.returncode == 0, res.stderr[-2000:]
    lines = res.stdout.strip().splitlines()
    return next(line for line in lines if line.startswith("predicted step")), json.loads(lines[-1])["step_s"]


@pytest.mark.timeout(200)
def test_plan_with_compile_prints_the_compiled_step() -> None:
    eager_line, eager = _planned()
    compiled_line, compiled = _planned("--compile")
    assert eager_line.startswith("predicted step: ") and compiled_line.startswith("predicted step (compiled blocks): ")
    assert compiled < eager


def test_bench_virtual_predicts_the_compiled_step() -> None:
    """bench/virtual.py's planner rows: "planner compiled" is the compiled step, not the eager one."""
    from bench import virtual

    cfg = virtual.QUICK["tiny-n4"]
    run = virtual.Run(cfg, virtual.fixed_layout(cfg))
    eager, compiled = virtual.predict(run), virtual.predict(run, compiled=True)
    assert compiled["step_s"] < eager["step_s"] and compiled["target"] == eager["target"]
