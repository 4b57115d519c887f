"""LoRA through peft on transformers models: wrapped after ``get_peft_model``, the
adapters train like single-process LoRA training, and the frozen base weights are
never reduce-scattered."""

from __future__ import annotations

import peft
import pytest
import torch
import transformers

from isp_comm import ISPCommunicator, ISPConfig, ParallelGroups
from isp_comm.testing import run_ranks
from tests.parity import loss_fn, max_diff

V, SEQ, STEPS = 37, 8, 3


def _base_model(arch: str):
    kw = dict(
        vocab_size=V,
        hidden_size=48,
        intermediate_size=50,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    cfg = transformers.LlamaConfig(**kw) if arch == "llama" else transformers.Qwen2Config(**kw)
    cfg._attn_implementation = "sdpa"
    cfg.use_cache = False  # training: a KV cache would grow again when a checkpointed block recomputes
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg) if arch == "llama" else transformers.Qwen2ForCausalLM(cfg)


def _lora_model(arch: str):
    model = _base_model(arch)
    lora = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "down_proj"])
    model = peft.get_peft_model(model, lora)
    for name, p in model.named_parameters():  # lora_B starts at zero: make the adapters matter at once
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)
    return model


# (name, architecture, wp, sp, activation checkpointing)
CASES = [
    ("llama-wp4", "llama", 4, 1, 0.0),
    ("llama-wp2-ckpt", "llama", 2, 1, 1.0),
    ("qwen2-wp4", "qwen2", 4, 1, 0.0),
    ("qwen2-wp2-sp2", "qwen2", 2, 2, 0.5),
]


def _worker(rank: int, world: int) -> dict:
    out = {}
    for name, arch, wp, sp, ckpt in CASES:
        ref, model = _lora_model(arch), _lora_model(arch)
        comm = ISPCommunicator(
            model, ParallelGroups.create(wp_size=wp, sp_size=sp), ISPConfig(activation_checkpointing=ckpt)
        )
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, eps=1e-6)
        ropt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2, eps=1e-6)
        dp, sp_rank, dp_rank = world // sp, rank % sp, rank // sp
        lo, hi = sp_rank * SEQ // sp, (sp_rank + 1) * SEQ // sp
        g = torch.Generator().manual_seed(3)
        loss_diff = 0.0
        for _ in range(STEPS):
            x = torch.randint(0, V, (2 * dp, SEQ), generator=g)
            y = torch.randint(0, V, (2 * dp, SEQ), generator=g)
            ref_loss = loss_fn(ref(input_ids=x).logits, y)
            ref_loss.backward()
            ropt.step(), ropt.zero_grad()
            xs, ys = x.chunk(dp)[dp_rank][:, lo:hi], y.chunk(dp)[dp_rank][:, lo:hi]
            logits = model(input_ids=xs, position_ids=torch.arange(lo, hi)[None]).logits
            loss = comm.cross_entropy(logits, ys)
            loss.backward()
            opt.step(), opt.zero_grad()
            mean = loss.detach().clone()
            torch.distributed.all_reduce(mean)  # equal chunks: the mean of the ranks' means
            loss_diff = max(loss_diff, abs(mean.item() / world - ref_loss.item()))
        sd = comm.full_state_dict()
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        out[name] = {"diff": max_diff(sd, ref.state_dict()), "loss": loss_diff, "stats": comm.stats()}
        out[name]["trainable"] = trainable
        comm.close()
    return out


@pytest.mark.slow  # 14 s; the CI tier trains LoRA through examples/lora.py
@pytest.mark.timeout(300)
def test_peft_lora_trains_like_single_process() -> None:
    every = run_ranks(_worker, 4, timeout_s=280)
    res = every[0]
    for name, *_ in CASES:
        for rank, r in enumerate(every):  # every rank: the second replica and SP peers too
            # AdamW (eps 1e-6) over 3 steps in fp32: the AdamW parity tests' tolerance
            assert r[name]["diff"] < 2e-5, (name, rank, r[name]["diff"])
            assert r[name]["loss"] < 2e-6, (name, rank, r[name]["loss"])  # losses before each step: fp32 order only
    # the frozen base weights are never reduce-scattered: each block reduces its
    # adapters' gradients only (a few KB), not the block's weights
    s = res["llama-wp4"]["stats"]
    assert s["reduce_scatters"] == 2 * STEPS, s
    assert s["bytes_reduced"] < 0.1 * s["bytes_gathered"], s


def _meta_built(rank: int, world: int, src: str) -> dict:
    """The big-model recipe with LoRA: build on meta, ``get_peft_model``, wrap, load the
    base weights; against the base model, and an unwrapped copy of the same recipe."""
    from isp_comm.materialize import init_weights

    lora = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "embed_tokens"])
    base = transformers.AutoModelForCausalLM.from_pretrained(src)
    with torch.device("meta"):
        model = peft.get_peft_model(transformers.AutoModelForCausalLM.from_config(base.config), lora)
    comm = ISPCommunicator(model, ParallelGroups.create(wp_size=world), ISPConfig(init_seed=5))
    comm.load_hf_checkpoint(src)
    full = comm.full_state_dict()
    reference = init_weights(peft.get_peft_model(transformers.AutoModelForCausalLM.from_config(base.config), lora), 5)
    x = torch.randint(0, V, (2, SEQ), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits_err = (model(input_ids=x).logits - base(input_ids=x).logits).abs().max().item()
    with pytest.raises(ValueError) as refused:
        comm.save_hf_checkpoint(src + "-out")
    comm.close()
    adapters = {k: v for k, v in full.items() if ".lora_" in k}
    ref_sd = reference.state_dict()
    return {
        "zero": sorted(k for k, v in adapters.items() if not v.any()),
        "drawn": sorted(k for k, v in adapters.items() if v.any()),
        "as_unwrapped": all(torch.equal(v, ref_sd[k]) for k, v in adapters.items()),
        "logits_err": logits_err,
        "refused": str(refused.value),
    }


@pytest.mark.timeout(120)
def test_a_meta_built_lora_model_starts_as_its_base_model(tmp_path) -> None:
    """peft zeroes B (a linear's; an embedding's A) so that training starts from the
    base model; a meta-built model wrapped by isp-comm must start there too, with the
    adapters an unwrapped model of the same recipe gets (``init_weights``), and a
    peft model is not saved as a transformers checkpoint under peft's keys."""
    base = _base_model("llama")
    base.save_pretrained(tmp_path / "base")
    for r in run_ranks(_meta_built, 2, str(tmp_path / "base"), timeout_s=100):
        assert r["logits_err"] == 0.0  # the adapters add exactly nothing
        assert all(".lora_B." in k or "lora_embedding_A" in k for k in r["zero"]), r["zero"]
        assert all(".lora_A." in k or "lora_embedding_B" in k for k in r["drawn"]), r["drawn"]
        assert len(r["zero"]) == len(r["drawn"]) == 2 * 2 + 1  # q and v in two blocks, the embedding
        assert r["as_unwrapped"]
        assert "wrapped by peft" in r["refused"]


def test_an_adapter_on_a_tied_head_is_refused() -> None:
    """An adapter on ``lm_head`` when it is the embedding's weight: training would adapt
    the head only, and no merge can fold that into the one tied tensor (isp-export
    --merge-lora dropped it). isp-train refuses it with one line naming the target."""
    from isp_comm.testing import tiny_hf_config
    from isp_comm.train.lora import apply_lora

    def tied():
        with torch.device("meta"):
            return transformers.AutoModelForCausalLM.from_config(tiny_hf_config(model_type="qwen2", tied=True))

    with pytest.raises(ValueError, match=r"--lora-targets lm_head: its weight is tied"):
        apply_lora(tied(), 4, ["q_proj", "lm_head"])
    adapted = apply_lora(tied(), 4, ["q_proj"])  # the rest of a tied model adapts as usual
    assert any(".lora_A." in n for n, _ in adapted.named_parameters())


def test_the_default_targets_on_a_fused_qkv_model_name_what_to_pass(tmp_path) -> None:
    """isp-train --model of a Phi-3 folder (one fused qkv_proj) with --lora-rank 4 and
    the default --lora-targets (a llama's q_proj,k_proj,v_proj,o_proj): one line that
    says the default is the cause, names the model's linears and what to pass; it said
    "--lora-targets k_proj,q_proj,v_proj: no such linear", of a flag never typed. What
    it suggests adapts the model (that it trains: by hand, 2 ranks at --sp 2, loss
    down). A target given and missing says what to pass too."""
    from isp_comm.testing import tiny_hf_config
    from isp_comm.train.config import parse_config
    from isp_comm.train.lora import apply_lora
    from isp_comm.train.model import build_meta_model

    folder = str(tmp_path / "phi3")
    transformers.AutoModelForCausalLM.from_config(tiny_hf_config("phi3", pad_token_id=0)).save_pretrained(folder)
    linears = "its linears: ['down_proj', 'gate_up_proj', 'lm_head', 'o_proj', 'qkv_proj']"
    advice = ": pass --lora-targets o_proj,qkv_proj (its attention's projections)"
    with pytest.raises(ValueError) as default:
        build_meta_model(parse_config(["--model", folder, "--lora-rank", "4"]), 300, folder)
    assert str(default.value) == (
        "--lora-rank 4: the default --lora-targets q_proj,k_proj,v_proj,o_proj (a llama's attention projections) "
        f"names k_proj,q_proj,v_proj, which this phi3 model lacks ({linears}){advice}"
    )
    with pytest.raises(ValueError) as given:
        build_meta_model(
            parse_config(["--model", folder, "--lora-rank", "4", "--lora-targets", "q_proj,o_proj"]), 300, folder
        )
    assert str(given.value) == f"--lora-targets q_proj: no such linear in this phi3 model ({linears}){advice}"
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(tiny_hf_config("phi3", pad_token_id=0))
    adapted = apply_lora(model, 4, ["o_proj", "qkv_proj"])
    assert {n.split(".lora_A.")[0].rsplit(".", 1)[-1] for n, _ in adapted.named_parameters() if ".lora_A." in n} == {
        "o_proj",
        "qkv_proj",
    }


def test_mfu_counts_a_frozen_base_at_four_flops_a_parameter() -> None:
    """MFU's FLOPs: 6 a trained parameter (forward, input and weight gradients), 4 a
    frozen one (no weight gradient); a LoRA run counted 6 for its frozen base, which
    put its MFU half as high again as the work done."""
    from isp_comm.model_flops import flops_per_token
    from isp_comm.models.llama import LlamaConfig, build
    from isp_comm.train.lora import apply_lora

    cfg = LlamaConfig(vocab_size=37, hidden=16, ffn_hidden=32, n_layers=2, n_heads=4, n_kv_heads=2)
    model = build(cfg)
    linears = sum(p.numel() for n, p in model.named_parameters() if "embed" not in n)
    attention = 12 * 2 * 16 * 8  # 12 L d s at seq 8
    assert flops_per_token(model, 8) == 6 * linears + attention
    lora = apply_lora(build(cfg), 2, ["q_proj", "v_proj"])
    adapters = sum(p.numel() for n, p in lora.named_parameters() if "lora_" in n)
    assert adapters > 0
    assert flops_per_token(lora, 8) == 6 * adapters + 4 * linears + attention


def _save_pretrained_worker(rank: int, world: int, root: str) -> dict[str, object]:
    """``save_pretrained`` of a wrapped transformers model and of a wrapped peft one:
    without ``state_dict=`` (refused, naming the way), and with the full state dict
    gathered on every rank and saved on rank 0 (what it wrote, loaded back, against the
    wrapped model's values); after ``close`` it is the class's own again."""
    from tests.test_validation import said_by

    out: dict[str, object] = {}
    for name, make in (("transformers", lambda: _base_model("llama")), ("peft", lambda: _lora_model("llama"))):
        model = make()
        comm = ISPCommunicator(model, ParallelGroups.create(wp_size=world))
        out[f"{name}-plain"] = said_by(ValueError, model.save_pretrained, f"{root}/{name}-plain")
        inner = model.model if name == "transformers" else model.get_base_model()  # an outside review's case
        out[f"{name}-inner"] = said_by(ValueError, inner.save_pretrained, f"{root}/{name}-inner")
        full = comm.full_state_dict(cpu=True, rank0_only=True)
        if rank == 0:
            mine = {k: v for k, v in full.items() if "lora_" in k or name != "peft"}  # the save empties full
            model.save_pretrained(f"{root}/{name}", state_dict=full)
            if name == "peft":
                back = peft.PeftModel.from_pretrained(_base_model("llama"), f"{root}/{name}")
            else:
                back = transformers.LlamaForCausalLM.from_pretrained(f"{root}/{name}")
            sd = back.state_dict()
            out[f"{name}-saved"] = max_diff({k: sd[k] for k in mine}, mine) if len(mine) > 10 else "too few"
        torch.distributed.barrier()
        comm.close()
        out[f"{name}-closed"] = "save_pretrained" not in model.__dict__ and "save_pretrained" not in inner.__dict__
    return out


@pytest.mark.timeout(150)
def test_save_pretrained_is_refused_without_the_full_state_dict_and_saves_with_it(tmp_path) -> None:
    # before: transformers' save_pretrained stopped in safetensors ("invalid python
    # storage") on one rank and wrote its shards on another; peft's alike
    out = run_ranks(_save_pretrained_worker, 2, str(tmp_path), timeout_s=140)
    for rank, said in enumerate(out):
        for name in ("transformers", "peft"):
            assert "comm.save_hf_checkpoint(path)" in said[f"{name}-plain"], said
            assert "comm.save_hf_checkpoint(path)" in said[f"{name}-inner"], said
            assert said[f"{name}-closed"] is True, said
            # bitwise: the same values written and read
            assert rank or said[f"{name}-saved"] == 0.0, (name, said[f"{name}-saved"])
