"""Hugging Face safetensors checkpoints in and out of the shards, through DCP's
``HuggingFaceStorageReader`` and ``HuggingFaceStorageWriter``.

[Note: nothing whole]
Both directions work on the sharded state dict of :mod:`isp_comm.state` (every
sharded parameter a DTensor whose local tensor is this rank's live shard).

* Loading: ``dcp.load`` with the Hugging Face reader asks each rank for its own
  rows, which the reader takes with safetensors slices (``get_slice``), straight
  into the shard. Replicated tensors are read whole. No rank reads a sharded tensor
  beyond its rows.
* Saving: ``dcp.save`` with the Hugging Face writer has every rank write its own
  shards (one replica writes replicated data) into ``OUT/.sharded``; then the ranks
  share the consolidation of those pieces into the output files, each rank writing
  whole files and holding one tensor at a time, and the pieces are removed. No rank
  ever gathers a block.

Tied weights are one tensor and are read and written under their first name
(module registration order: ``model.embed_tokens.weight`` for transformers'
tied ``lm_head.weight``, as ``save_pretrained`` writes them); a checkpoint that also
carries the tied name is accepted.
"""

from __future__ import annotations

import copy
import os
import shutil
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter
from torch.distributed.checkpoint._consolidate_hf_safetensors import consolidate_safetensors_files_on_every_rank
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.tensor import DTensor

INDEX = "model.safetensors.index.json"
_PIECES = ".sharded"


def tied_aliases(model: nn.Module) -> dict[str, str]:
    """``{later name: first name}`` for every parameter reachable under several names."""
    first: dict[int, str] = {}
    aliases = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            aliases[name] = first[id(p)]
        else:
            first[id(p)] = name
    return aliases


def has_hf_weights(path: str) -> bool:
    """Whether the folder ``path`` holds transformers safetensors weights."""
    return os.path.isfile(os.path.join(path, "model.safetensors")) or os.path.isfile(os.path.join(path, INDEX))


def load_hf_checkpoint(model: nn.Module, state_dict: dict[str, Any], path: str) -> None:
    """Fill ``state_dict`` (the wrapped model's sharded state dict, sharing its
    memory) from the safetensors checkpoint folder ``path``.

    Keys and shapes are checked against the files' headers first: a missing key, an
    unexpected key or a shape mismatch is a ``ValueError`` naming them (every rank
    reads the same headers, so every rank raises)."""
    if not os.path.isdir(path):
        raise ValueError(f"load_hf_checkpoint: {path} is not a folder")
    if not has_hf_weights(path):
        raise ValueError(f"load_hf_checkpoint: {path} holds neither model.safetensors nor {INDEX}")
    aliases = tied_aliases(model)
    wanted = {k: v for k, v in state_dict.items() if k not in aliases}
    reader = HuggingFaceStorageReader(path)
    stored = reader.read_metadata().state_dict_metadata
    missing = sorted(wanted.keys() - stored.keys())
    unexpected = sorted(stored.keys() - wanted.keys() - aliases.keys())
    mismatched = [
        f"{k}: checkpoint {tuple(md.size)}, model {tuple(wanted[k].shape)}"
        for k, md in stored.items()
        if k in wanted and isinstance(md, TensorStorageMetadata) and tuple(md.size) != tuple(wanted[k].shape)
    ]
    if missing or unexpected or mismatched:
        parts = [f"missing keys {missing}" if missing else "", f"unexpected keys {unexpected}" if unexpected else ""]
        parts.append(f"shape mismatches {mismatched}" if mismatched else "")
        raise ValueError(f"load_hf_checkpoint({path}): " + "; ".join(p for p in parts if p))
    dcp.load(wanted, storage_reader=reader)


def file_indices(state_dict: Mapping[str, Any], max_shard_bytes: int) -> dict[str, int]:
    """Tensor name -> output file (1-based), filling files in state-dict order up to
    ``max_shard_bytes`` each (a larger tensor gets a file of its own), as
    ``save_pretrained`` does."""
    out: dict[str, int] = {}
    index, used = 1, 0
    for key, t in state_dict.items():
        size = t.numel() * t.element_size()
        if used and used + size > max_shard_bytes:
            index, used = index + 1, 0
        out[key] = index
        used += size
    return out


def _contiguous(t: torch.Tensor) -> torch.Tensor:
    """safetensors writes contiguous tensors only: an embedding split along its hidden
    dim has a transposed shard, copied here (this rank's shard, nothing more)."""
    if not isinstance(t, DTensor):
        return t.contiguous()
    local = t.to_local()
    if local.is_contiguous():
        return t
    return DTensor.from_local(
        local.contiguous(), t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride()
    )


def file_name(index: int, n_files: int) -> str:
    """transformers' name for file ``index`` (1-based) of ``n_files``."""
    return "model.safetensors" if n_files == 1 else f"model-{index:05d}-of-{n_files:05d}.safetensors"


def save_hf_checkpoint(
    model: nn.Module, state_dict: dict[str, Any], path: str, max_shard_bytes: int = 5 * 2**30
) -> None:
    """Write ``state_dict`` (the wrapped model's sharded state dict) to the folder
    ``path`` as transformers does: ``model.safetensors``, or several files and
    ``model.safetensors.index.json``; plus ``config.json`` (its ``dtype`` set to the
    saved one) when ``model`` has a transformers config. Collective over the world."""
    aliases = tied_aliases(model)
    tensors = {k: _contiguous(v) for k, v in state_dict.items() if k not in aliases}
    indices = file_indices(tensors, max_shard_bytes)
    pieces = os.path.join(path, _PIECES)
    rank = dist.get_rank()
    if rank == 0:
        os.makedirs(path, exist_ok=True)
        shutil.rmtree(pieces, ignore_errors=True)
        for name in os.listdir(path):  # no stale file of an earlier save may remain
            if name.endswith(".safetensors") or name == INDEX:
                os.remove(os.path.join(path, name))
    dist.barrier()
    writer = HuggingFaceStorageWriter(pieces, fqn_to_index_mapping=indices, save_distributed=True)
    dcp.save(tensors, storage_writer=writer)
    consolidate_safetensors_files_on_every_rank(pieces, path, indices)  # ends with a barrier
    if rank == 0:
        shutil.rmtree(pieces)
        if max(indices.values()) == 1:  # one file: transformers' plain name, no index
            os.replace(os.path.join(path, "model-00001-of-00001.safetensors"), os.path.join(path, file_name(1, 1)))
            os.remove(os.path.join(path, INDEX))
        config = getattr(model, "config", None)
        if config is not None and hasattr(config, "save_pretrained"):
            write_config(config, {t.dtype for t in tensors.values()}, path)
    dist.barrier()


def write_config(config: Any, dtypes: set[torch.dtype], path: str) -> None:
    """``config.json`` of a transformers config, its ``dtype`` the saved weights' (so
    that ``from_pretrained`` loads them as they are, bitwise)."""
    config = copy.deepcopy(config)
    floating = {d for d in dtypes if d.is_floating_point}
    if len(floating) == 1:
        config.dtype = floating.pop()
    config.save_pretrained(path)
