"""The model a run trains, built on meta (the reference llama or a transformers
folder, with its LoRA adapters), and the ISP config its flags describe; the planner
(``--plan``) builds the same model from the same flags."""

from __future__ import annotations

import torch

from isp_comm import ISPConfig
from isp_comm.models.llama import LlamaConfig, build, llama_ffn_hidden
from isp_comm.train import hf_model, lora
from isp_comm.train.config import TrainConfig


def build_meta_model(cfg: TrainConfig, vocab: int, tok_dir: str) -> tuple[torch.nn.Module, LlamaConfig | None]:
    """The model to train, on meta (never the whole model: each module is made real
    alone while sharded), with its LoRA adapters; and the reference llama's config."""
    mcfg = None
    if cfg.model:  # on meta too (see isp_comm/train/hf_model.py)
        model = hf_model.build_model(cfg.model)
        what = f"--tokenizer {tok_dir}" if tok_dir else f"--data {cfg.data or '(the embedded corpus)'}"
        hf_model.check_vocab(what, vocab, model.config.vocab_size, cfg.model)
    else:
        mcfg = LlamaConfig(
            vocab_size=vocab,
            hidden=cfg.hidden,
            ffn_hidden=llama_ffn_hidden(cfg.hidden),
            n_layers=cfg.layers,
            n_heads=cfg.heads,
            n_kv_heads=cfg.kv_heads,
            max_seq_len=cfg.seq,
        )
        with torch.device("meta"):
            model = build(mcfg)
    if cfg.lora_rank:  # peft adapters on the meta model; the base is frozen and never reduce-scattered
        with torch.device("meta"):
            model = lora.apply_lora(model, cfg.lora_rank, cfg.targets(), cfg.lora_targets != TrainConfig.lora_targets)
    return model, mcfg


def use_bf16(cfg: TrainConfig, device: torch.device) -> bool:
    """--bf16 / --no-bf16, else bf16 on a GPU."""
    return cfg.bf16 if cfg.bf16 is not None else device.type == "cuda"


def isp_config(cfg: TrainConfig, bf16: bool) -> ISPConfig:
    return ISPConfig(
        overlap=cfg.overlap,
        memory_pool=cfg.memory_pool,
        activation_checkpointing=cfg.ckpt,
        shard_outer_params=cfg.shard_outer,
        state_sharding=cfg.state_sharding,
        vocab_parallel=cfg.vocab_parallel,
        backend=cfg.backend,
        param_dtype=torch.bfloat16 if bf16 else None,
        reduce_dtype=torch.float32 if bf16 else None,
        init_seed=cfg.seed,  # the same initial weights on every WP size
        timeout_s=cfg.comm_timeout,
        diagnosis_dir=cfg.out,  # hang.json, hang.txt; isp-comm doctor --live
    )
