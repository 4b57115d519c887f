"""isp-train's Hugging Face side: a transformers model from a local folder, and text
tokenized by a local tokenizer, cached next to the data.

``--model DIR`` builds the model of ``DIR/config.json`` on the meta device (fp32
master weights, SDPA attention where the model has it); isp-comm materialises it module by module while
sharding it and, when ``DIR`` holds safetensors weights, every rank then reads its
own rows of them (:meth:`ISPCommunicator.load_hf_checkpoint`). Nothing is
downloaded: every file is read from the folders given.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import numpy as np
import torch
from torch import nn

from isp_comm.hf_checkpoint import has_hf_weights
from isp_comm.sequence_parallel.hf import SUPPORTED_MODEL_TYPES

HF_DIR = "hf_model"
"""The folder of a run's output (``OUT/hf_model``) holding the trained model's
``config.json`` and the tokenizer's files, for ``isp-export --hf``."""

_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
)


def model_type(path: str) -> str:
    """The ``model_type`` of ``path/config.json``; a ``ValueError`` when there is no
    such folder (said so: "no config.json in that folder" sent a user looking inside
    a folder that did not exist), the folder has no such file, or the type is not one
    isp-train supports."""
    if not os.path.isdir(path):
        what = f"--model {path} is a file, not a folder" if os.path.exists(path) else f"--model {path}: no such folder"
        raise ValueError(
            f"{what}: give a local folder of a transformers model (its config.json and safetensors, as "
            "save_pretrained writes them)"
        )
    config = os.path.join(path, "config.json")
    if not os.path.isfile(config):
        raise ValueError(f"--model {path}: no config.json in that folder")
    try:
        with open(config) as f:
            found = json.load(f)
    except (OSError, ValueError) as exc:  # a broken file once said only json's "Expecting property name ..."
        raise ValueError(f"--model {path}: config.json cannot be read as JSON ({exc})") from None
    kind = found.get("model_type") if isinstance(found, dict) else None
    if kind not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"--model {path}: model type {kind!r} is not supported (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    return kind


UNREAD_WEIGHTS = ("pytorch_model.bin", "pytorch_model.bin.index.json", "tf_model.h5", "flax_model.msgpack")
"""Weight files ``from_pretrained`` reads and isp-train does not (safetensors only)."""


def check_model_folder(path: str) -> str:
    """:func:`model_type`, and a ``ValueError`` when the folder's weights are in a
    format isp-train does not read: training would start from a fresh initialisation
    where the user meant the folder's weights."""
    kind = model_type(path)
    unread = [n for n in UNREAD_WEIGHTS if os.path.isfile(os.path.join(path, n))]
    if unread and not has_hf_weights(path):
        raise ValueError(
            f"--model {path}: its weights are in {unread[0]}, which isp-train does not read (safetensors only): "
            "convert them with transformers (save_pretrained(..., safe_serialization=True)), or give a folder "
            "holding config.json alone to train from a fresh initialisation"
        )
    return kind


def build_model(path: str) -> nn.Module:
    """The transformers causal LM of ``path/config.json`` on the meta device, in fp32,
    with SDPA attention where its class has it and its own eager attention where not
    (Gemma 2's softcapping, GPT-OSS's sinks: asking those for SDPA is an error)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    model_type(path)
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
        sdpa = getattr(MODEL_FOR_CAUSAL_LM_MAPPING[type(config)], "_supports_sdpa", False)
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(
                config, attn_implementation="sdpa" if sdpa else "eager", dtype=torch.float32
            )
    except Exception as exc:  # transformers' checks of a config raise its own classes, not only ValueError
        said = " ".join(str(exc).split())
        raise ValueError(f"--model {path}: transformers refuses its config.json: {said}") from None


def eager_experts_for(model: nn.Module, bf16: bool) -> str | None:
    """Switch a transformers MoE to its eager experts (a loop over the experts, any
    widths) where torch's grouped matrix product, transformers' default, cannot take
    the fused experts' widths in the run's dtype: it needs rows of a multiple of 16
    bytes (widths of multiples of 8 in bf16, 4 in fp32) and otherwise raises at the
    first forward, on CPU and CUDA alike. Published MoEs are aligned; a small one made
    to experiment may not be. The warning to print when it switched, else None."""
    itemsize = 2 if bf16 else 4
    widths = sorted({d for p in model.parameters() if p.ndim == 3 for d in p.shape[1:] if d * itemsize % 16})
    switch = getattr(model, "set_experts_implementation", None)
    if not widths or switch is None or getattr(model.config, "_experts_implementation", None) == "eager":
        return None
    switch("eager")
    return (
        f"the experts' widths {', '.join(map(str, widths))} are not multiples of {16 // itemsize}: torch's "
        f"grouped matrix product cannot take them in {'bf16' if bf16 else 'fp32'}, so the experts run "
        "transformers' eager loop (slower on a GPU)"
    )


def has_tokenizer(path: str) -> bool:
    return any(os.path.isfile(os.path.join(path, f)) for f in _TOKENIZER_FILES)


def _fingerprint(tokenizer_dir: str, data: str) -> str:
    """Of the tokenizer's files and the data file's size and modification time."""
    h = hashlib.sha256()
    for name in _TOKENIZER_FILES:
        p = os.path.join(tokenizer_dir, name)
        if os.path.isfile(p):
            with open(p, "rb") as f:
                h.update(name.encode() + f.read())
    st = os.stat(data)
    h.update(f"{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def cache_path(tokenizer_dir: str, data: str) -> str:
    """Where an earlier version kept the tokens of ``data`` under this tokenizer."""
    return f"{data}.tokens-{_fingerprint(tokenizer_dir, data)}.npy"


def load_tokenizer(path: str):  # -> transformers.PreTrainedTokenizerBase
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ValueError(f"--tokenizer {path}: cannot load a tokenizer from it ({exc})") from exc


def older_cache(tokenizer_dir: str, data: str) -> str:
    """The tokenizer cache an earlier version wrote for the text file ``data`` (its
    tokens, no EOS, next to it), or "" when there is none: a run begun on it reads it
    again, so that it resumes on the same tokens. Nothing writes one any more: a text
    file becomes a token store, as ``isp-prepare-data`` makes it."""
    cache = cache_path(tokenizer_dir, data)
    return cache if os.path.isfile(cache) else ""


def read_older_cache(tokenizer_dir: str, cache: str) -> tuple[torch.Tensor, int]:
    """The tokens of an :func:`older_cache` and the tokenizer's vocabulary size."""
    return torch.from_numpy(np.load(cache).astype(np.int64)), len(load_tokenizer(tokenizer_dir))


def check_vocab(what: str, vocab: int, model_vocab: int, model_dir: str) -> None:
    if vocab > model_vocab:
        raise ValueError(
            f"{what} has a vocabulary of {vocab} tokens, more than the model's {model_vocab} "
            f"(vocab_size in {model_dir}/config.json)"
        )


def save_run_files(model: nn.Module, tokenizer_dir: str, out: str) -> None:
    """``OUT/hf_model``: the trained model's config.json and the tokenizer's files."""
    dest = os.path.join(out, HF_DIR)
    os.makedirs(dest, exist_ok=True)
    model.config.save_pretrained(dest)
    if tokenizer_dir:
        for name in _TOKENIZER_FILES:
            src = os.path.join(tokenizer_dir, name)
            if os.path.isfile(src):
                shutil.copyfile(src, os.path.join(dest, name))
