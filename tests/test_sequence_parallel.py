"""Sequence parallel: all-to-all against gloo, and ISP (SP x WP) training equal to
single-process training on whole sequences, for models/llama.py and transformers."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from isp_comm import ISPCommunicator, ISPConfig, ParallelGroups
from isp_comm.backends import SymmCpuBackend, TorchBackend
from isp_comm.sequence_parallel import all_to_all
from isp_comm.testing import run_ranks
from models.llama import LlamaConfig, build
from tests.parity import loss_fn, max_diff

SP_CFG = dict(vocab_size=37, hidden=48, ffn_hidden=50, n_layers=2, n_heads=8, n_kv_heads=2)
SEQ, PER_GROUP, STEPS = 8, 2, 2


def _a2a_worker(rank: int, world: int, backend_name: str) -> None:
    backend = SymmCpuBackend(60) if backend_name == "symm" else TorchBackend()
    group = dist.group.WORLD
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(3, 2 * world, 5, 7, generator=g, requires_grad=True)  # scatter dim 1, gather dim 2
    (y,) = all_to_all((x,), 1, 2, group, backend)
    # reference: torch.distributed.all_to_all on gloo, chunk lists
    ins = [c.contiguous() for c in x.detach().chunk(world, dim=1)]
    outs = [torch.empty_like(ins[0]) for _ in range(world)]
    dist.all_to_all(outs, ins, group=group)
    assert torch.equal(y, torch.cat(outs, dim=2))
    # backward is the inverse exchange: d(sum(y * w))/dx, compared with a manual inverse
    w = torch.randn(y.shape, generator=g)
    (y * w).sum().backward()
    back_in = [c.contiguous() for c in w.chunk(world, dim=2)]
    back_out = [torch.empty_like(back_in[0]) for _ in range(world)]
    dist.all_to_all(back_out, back_in, group=group)
    assert torch.equal(x.grad, torch.cat(back_out, dim=1))
    backend.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", ["torch", "symm"])
def test_all_to_all_round_trip_and_backward(backend: str) -> None:
    run_ranks(_a2a_worker, 3, backend, timeout_s=50)


def _model(kind: str, tied: bool = False):
    if kind == "llama":
        return build(LlamaConfig(**SP_CFG))
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=37,
        hidden_size=48,
        intermediate_size=50,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def _logits(kind: str, model, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    if kind == "llama":
        return model(x, position_ids=pos)
    return model(input_ids=x, position_ids=pos[None]).logits


def _data(dp: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    n = dp * PER_GROUP
    return [
        (torch.randint(0, 37, (n, SEQ), generator=g), torch.randint(0, 37, (n, SEQ), generator=g)) for _ in range(STEPS)
    ]


def _sp_worker(rank: int, world: int, sp: int, wp: int, kind: str, outer: bool = False, tied: bool = False) -> float:
    dp, sp_rank, dp_rank = world // sp, rank % sp, rank // sp
    ref = _model(kind, tied)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.1)
    model = _model(kind, tied)
    groups = ParallelGroups.create(wp_size=wp, sp_size=sp)
    comm = ISPCommunicator(model, groups, ISPConfig(shard_outer_params=outer))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    lo, hi = sp_rank * SEQ // sp, (sp_rank + 1) * SEQ // sp
    for x, y in _data(dp):
        xs, ys = x.chunk(dp)[dp_rank][:, lo:hi], y.chunk(dp)[dp_rank][:, lo:hi]
        loss_fn(_logits(kind, model, xs, torch.arange(lo, hi)), ys).backward()
        opt.step(), opt.zero_grad()
        loss_fn(_logits(kind, ref, x, torch.arange(SEQ)), y).backward()
        ropt.step(), ropt.zero_grad()
    err = max_diff(comm.full_state_dict(), ref.state_dict())
    comm.close()
    return err


@pytest.mark.timeout(200)
@pytest.mark.parametrize("sp, wp", [(1, 4), (2, 2), (4, 4), (2, 4), (4, 1)])
@pytest.mark.parametrize("kind", ["llama", "hf"])
def test_sp_wp_parity(kind: str, sp: int, wp: int) -> None:
    if kind == "hf":
        pytest.importorskip("transformers")
    # 8 heads over 2 KV heads: at sp = 4 the KV heads are repeated (GQA, SP > KV heads).
    for err in run_ranks(_sp_worker, 4, sp, wp, kind, timeout_s=180):
        assert err < 2e-6  # fp32 SGD parity, as in test_engine_parity


@pytest.mark.timeout(200)
@pytest.mark.parametrize("kind, tied", [("llama", False), ("hf", False), ("hf", True)])
def test_sp_wp_parity_with_embedding_and_head_sharded(kind: str, tied: bool) -> None:
    if kind == "hf":
        pytest.importorskip("transformers")
    # tied: the head's weight is the embedding's; it is sharded once and used by both.
    for err in run_ranks(_sp_worker, 4, 2, 2, kind, True, tied, timeout_s=180):
        assert err < 2e-6  # fp32 SGD parity, as in test_engine_parity


def _bad_heads_worker(rank: int, world: int, kind: str) -> str:
    model = build(LlamaConfig(**{**SP_CFG, "n_heads": 6, "n_kv_heads": 2, "hidden": 36}))
    if kind == "hf-arch":
        import transformers

        cfg = transformers.OPTConfig(
            num_hidden_layers=1,
            hidden_size=16,
            num_attention_heads=4,
            ffn_dim=32,
            vocab_size=11,
            word_embed_proj_dim=16,
            max_position_embeddings=32,
        )
        model = transformers.OPTForCausalLM(cfg)
    try:
        ISPCommunicator(model, ParallelGroups.create(wp_size=1, sp_size=4), ISPConfig())
    except ValueError as exc:
        return str(exc)
    return "no error"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind, msg", [("llama", "6 attention heads cannot be split"), ("hf-arch", "not 'opt'")])
def test_sp_refuses_what_it_cannot_split(kind: str, msg: str) -> None:
    if kind == "hf-arch":
        pytest.importorskip("transformers")
    for text in run_ranks(_bad_heads_worker, 4, kind, timeout_s=50):
        assert msg in text, text
