"""Hugging Face safetensors checkpoints in and out of the shards: read through DCP's
``HuggingFaceStorageReader``, written in place by every rank.

[Note: nothing whole]
Both directions work on the sharded state dict of :mod:`isp_comm.state` (every
sharded parameter a DTensor whose local tensor is this rank's live shard).

* Loading: ``dcp.load`` with the Hugging Face reader asks each rank for its own
  rows, which the reader takes with safetensors slices (``get_slice``), straight
  into the shard. Replicated tensors are read whole. No rank reads a sharded tensor
  beyond its rows.
* Saving: the output files are laid out first (headers and sizes), then every rank
  of the first replica writes its own rows of each sharded tensor at their offsets
  in the final files (see [Note: writing in place]); with pieces, every rank writes its own. No tensor is ever assembled
  whole, on any rank. DCP's ``HuggingFaceStorageWriter`` does not fit this promise:
  it writes each rank's pieces, then consolidates them, one output file per rank,
  assembling each tensor whole in memory (an embedding of a large vocabulary is
  bigger than a block), and every byte is written twice.

Tied weights are one tensor and are read and written under their first name
(module registration order: ``model.embed_tokens.weight`` for transformers'
tied ``lm_head.weight``, as ``save_pretrained`` writes them); a checkpoint that also
carries the tied name is accepted.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import re
import struct
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from isp_comm.groups import first_error
from isp_comm.hf_layouts import Fused, Stored, converted_layouts, stored_layout, transformers_model

INDEX = "model.safetensors.index.json"


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


PEFT_PREFIX = "base_model.model."


def base_names(state_dict: Mapping[str, Any]) -> dict[str, str]:
    """Key -> the base model's key. For a model wrapped by peft (keys under
    ``base_model.model.``, adapted layers' weights under ``.base_layer.``) that is the
    transformers name, and the adapters' own tensors (``.lora_``) are left out: they
    are not in the base checkpoint. Any other model's keys map to themselves."""
    if not state_dict or not all(k.startswith(PEFT_PREFIX) for k in state_dict):
        return {k: k for k in state_dict}
    return {k: k[len(PEFT_PREFIX) :].replace(".base_layer.", ".") for k in state_dict if ".lora_" not in k}


def has_hf_weights(path: str) -> bool:
    """Whether the folder ``path`` holds transformers safetensors weights."""
    return os.path.isfile(os.path.join(path, "model.safetensors")) or os.path.isfile(os.path.join(path, INDEX))


OWN_FILE = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors")
"""The names transformers gives a model's safetensors files (:func:`file_name`)."""


def model_files(path: str) -> list[str]:
    """The safetensors files of the model in folder ``path``, as ``from_pretrained``
    reads them: those its index names, else ``model.safetensors``. Other
    ``*.safetensors`` beside them (an adapter, Mistral's ``consolidated``, a stale
    copy) are not the model's; a file the index names that is missing is a ``ValueError``."""
    index = os.path.join(path, INDEX)
    if not os.path.isfile(index):
        return ["model.safetensors"]
    with open(index) as f:
        names = sorted(set(json.load(f)["weight_map"].values()))
    absent = [n for n in names if not os.path.isfile(os.path.join(path, n))]
    if absent:
        raise ValueError(f"load_hf_checkpoint: {index} names {absent}, which are not in {path}")
    return names


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
    names = base_names(state_dict)  # a peft-wrapped model: its base model's names, adapters left out
    aliases = {names.get(k, k): v for k, v in tied_aliases(model).items()}
    wanted = {names[k]: v for k, v in state_dict.items() if k in names and names[k] not in aliases}
    with _model_only(path) as folder:
        _load(model, wanted, aliases, folder, path)


def _load(model: nn.Module, wanted: dict[str, Any], aliases: dict[str, str], folder: str, path: str) -> None:
    """Check ``wanted``'s keys and shapes against the safetensors files in ``folder``
    (the model's files of ``path``), then read each rank's part of every tensor. Files
    in the layout transformers publishes the model in (:mod:`isp_comm.hf_layouts`) are
    read as such: renamed tensors under their stored names, each rank's experts from
    their own tensors."""
    _readable(folder, path)
    reader = HuggingFaceStorageReader(folder)
    metadata = reader.read_metadata().state_dict_metadata
    stored = {k: tuple(md.size) for k, md in metadata.items() if isinstance(md, TensorStorageMetadata)}
    own = {k: tuple(v.shape) for k, v in wanted.items()}
    layout: dict[str, Stored] = {}
    problems = _differences(own, stored, set(aliases))
    why_quantized = quantized(model) if problems else ""
    if why_quantized:  # no layout reads them: say why, not only which keys
        raise ValueError(f"load_hf_checkpoint({path}): " + "; ".join(problems) + why_quantized)
    converted = converted_layouts(model) if problems else []
    if converted:  # the layout transformers publishes the model in, maybe
        alias_shapes = {k: tuple(wanted[v].shape) for k, v in aliases.items() if v in wanted}
        why = (
            ". This model's checkpoints are stored in another layout than its parameters, which transformers' "
            f"from_pretrained converts while loading ({'; '.join(converted)})"
        )
        try:
            layout = stored_layout(model, {**own, **alias_shapes})
        except ValueError as exc:
            raise ValueError(f"load_hf_checkpoint({path}): " + "; ".join(problems) + f"{why}, and {exc}") from None
        specs = stored_specs(layout, {k: (v.shape, v.dtype) for k, v in wanted.items()})
        published = _differences(
            {k: tuple(s) for k, (s, _) in specs.items()}, stored, {_name(layout.get(k, k)) for k in aliases}
        )
        if published:
            raise ValueError(
                f"load_hf_checkpoint({path}): "
                + "; ".join(problems)
                + f"{why}; in that layout: "
                + "; ".join(published)
            )
    elif problems:
        raise ValueError(f"load_hf_checkpoint({path}): " + "; ".join(problems))
    fused = {k: (layout[k], v) for k, v in wanted.items() if isinstance(layout.get(k), Fused)}
    dcp.load({_name(layout.get(k, k)): v for k, v in wanted.items() if k not in fused}, storage_reader=reader)
    _agreed(lambda: _read_experts(fused, folder), f"load_hf_checkpoint({path})")


def quantized(model: nn.Module) -> str:
    """Why a checkpoint of ``model`` holds other tensors than its parameters when its
    transformers config has a ``quantization_config`` (every published GPT-OSS is
    MXFP4: ``gate_up_proj_blocks`` and ``_scales`` for ``gate_up_proj``; DeepSeek-V3 is
    FP8), else ``""``. ``from_pretrained`` dequantizes such files while loading; a
    meta-built model is built unquantized, and its files are read as they are, so the
    missing and unexpected keys alone did not say what to do."""
    config = getattr(transformers_model(model), "config", None)
    qc = getattr(config, "quantization_config", None)
    if qc is None:
        return ""
    method = qc.get("quant_method") if isinstance(qc, dict) else getattr(qc, "quant_method", None)
    return (
        f". The folder's config.json has a quantization_config (quant_method {method}): its files hold quantized "
        "tensors, which are read as they are, not dequantized. Save a dequantized copy first (transformers' "
        "from_pretrained with the quantization's config and dequantize=True, then save_pretrained) and give that"
    )


def _readable(folder: str, path: str) -> None:
    """A ``ValueError`` naming the first safetensors file of ``folder`` whose header
    cannot be read (a truncated download, another format under the name): safetensors'
    own error names no file, and is no ``ValueError``, so a run stopped on it with a
    traceback on every rank."""
    from safetensors import SafetensorError, safe_open

    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            try:
                with safe_open(os.path.join(folder, name), framework="pt"):
                    pass
            except (OSError, SafetensorError) as exc:
                why = f"{name} cannot be read (cut short, or not safetensors): {exc}"
                raise ValueError(f"load_hf_checkpoint({path}): {why}") from None


def _differences(expected: Mapping[str, tuple], stored: Mapping[str, tuple], allowed: set[str]) -> list[str]:
    """What keeps files holding ``stored`` (name: shape) from being read as
    ``expected``: missing keys, unexpected keys (other than ``allowed``: tied names),
    shape mismatches; empty when they match."""
    missing = sorted(expected.keys() - stored.keys())
    unexpected = sorted(stored.keys() - expected.keys() - allowed)
    mismatched = [
        f"{k}: checkpoint {s}, model {expected[k]}" for k, s in stored.items() if k in expected and s != expected[k]
    ]
    parts = [f"missing keys {missing}" if missing else "", f"unexpected keys {unexpected}" if unexpected else ""]
    parts.append(f"shape mismatches {mismatched}" if mismatched else "")
    return [p for p in parts if p]


def _name(where: Stored) -> str:
    """The stored name of a tensor stored whole (a fused parameter has none)."""
    return where if isinstance(where, str) else ""


def _read_experts(fused: Mapping[str, tuple[Fused, Any]], folder: str) -> None:
    """Fill each rank's rows of every fused parameter from the tensors of its own
    experts (see [Note: one rank's experts])."""
    if not fused:
        return
    from safetensors import safe_open

    with contextlib.ExitStack() as stack:
        files = [
            stack.enter_context(safe_open(os.path.join(folder, n), framework="pt"))
            for n in sorted(os.listdir(folder))
            if n.endswith(".safetensors")
        ]
        where = {k: f for f in files for k in f.keys()}  # noqa: SIM118 - safe_open has no __iter__
        for key, (layout, value) in fused.items():
            local, first = _expert_rows(key, value)
            for cell, offset in layout.experts(first, local.shape[0]):
                rows = local[cell.expert - first].narrow(layout.dim, offset, layout.shape[layout.dim])
                rows.copy_(where[cell.key].get_tensor(cell.key))


def _expert_rows(key: str, value: Any) -> tuple[torch.Tensor, int]:
    """This rank's rows of fused parameter ``key`` and the index of the first: its
    local tensor's, whole experts (wrapping shards such a parameter along dim 0)."""
    if not isinstance(value, DTensor):
        return value, 0
    shape, offset = compute_local_shape_and_global_offset(value.shape, value.device_mesh, value.placements)
    if tuple(shape[1:]) != tuple(value.shape[1:]):
        raise ValueError(f"{key}: sharded along {value.placements}, not along its experts (dim 0)")
    return value.to_local(), offset[0]


@contextlib.contextmanager
def _model_only(path: str) -> Iterator[str]:
    """``path`` itself when its only ``*.safetensors`` are the model's files, else a
    temporary folder of links to those files alone: DCP's Hugging Face reader takes
    every ``*.safetensors`` of its folder, and a stray one would add or override keys."""
    files = model_files(path)
    if sorted(n for n in os.listdir(path) if n.endswith(".safetensors")) == files:
        yield path
        return
    with tempfile.TemporaryDirectory(prefix="isp-hf-") as tmp:
        for name in files:
            os.symlink(os.path.abspath(os.path.join(path, name)), os.path.join(tmp, name))
        yield tmp


# safetensors' names of the dtypes a checkpoint may hold
_SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def file_name(index: int, n_files: int) -> str:
    """transformers' name for file ``index`` (1-based) of ``n_files``."""
    return "model.safetensors" if n_files == 1 else f"model-{index:05d}-of-{n_files:05d}.safetensors"


@dataclass(frozen=True)
class Placed:
    """Where a tensor's bytes go: its file and the absolute offset of its first byte."""

    file: str
    start: int
    shape: torch.Size
    dtype: torch.dtype


class SafetensorsFiles:
    """The output files of a checkpoint, laid out before any byte is written.

    [Note: writing in place] A safetensors file is an 8-byte header length, a JSON
    header naming every tensor's dtype, shape and byte range, then the bytes. With
    every shape and dtype known up front, the header is written first and the file
    sized; then any process may write any tensor's bytes, or any rows of them, at
    their offsets, in any order. So each rank writes its own rows straight into the
    final files and no tensor is ever assembled whole."""

    def __init__(self, path: str, specs: Mapping[str, tuple[torch.Size, torch.dtype]], max_shard_bytes: int) -> None:
        self.path = path
        nbytes = {k: math.prod(shape) * dtype.itemsize for k, (shape, dtype) in specs.items()}
        groups: list[list[str]] = [[]]
        used = 0
        for key, size in nbytes.items():  # state-dict order, as save_pretrained fills its files
            if groups[-1] and used + size > max_shard_bytes:
                groups.append([])
                used = 0
            groups[-1].append(key)
            used += size
        self.headers: dict[str, bytes] = {}
        self.sizes: dict[str, int] = {}
        self.placed: dict[str, Placed] = {}
        self._open: dict[str, Any] = {}  # file name -> open handle, while writing
        for i, keys in enumerate(groups, start=1):
            name = file_name(i, len(groups))
            header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
            offset = 0
            for k in keys:
                shape, dtype = specs[k]
                header[k] = {
                    "dtype": _SAFETENSORS_DTYPES[dtype],
                    "shape": list(shape),
                    "data_offsets": [offset, offset + nbytes[k]],
                }
                offset += nbytes[k]
            raw = json.dumps(header, separators=(",", ":")).encode()
            raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
            self.headers[name] = struct.pack("<Q", len(raw)) + raw
            self.sizes[name] = len(self.headers[name]) + offset
            for k in keys:
                start = len(self.headers[name]) + header[k]["data_offsets"][0]
                self.placed[k] = Placed(name, start, specs[k][0], specs[k][1])

    def create(self) -> None:
        """Write every header and size every file (once, by one process), and the
        index when there are several files; the model files and index of an earlier save
        go (only those, as ``save_pretrained``: an adapter's files beside them stay)."""
        os.makedirs(self.path, exist_ok=True)
        for name in os.listdir(self.path):
            if OWN_FILE.fullmatch(name) or name == INDEX:  # an earlier save's, never another's
                os.remove(os.path.join(self.path, name))
        for name, header in self.headers.items():
            with open(os.path.join(self.path, name), "wb") as f:
                f.write(header)
                f.truncate(self.sizes[name])
        if len(self.headers) > 1:
            total = sum(math.prod(p.shape) * p.dtype.itemsize for p in self.placed.values())
            index = {"metadata": {"total_size": total}, "weight_map": {k: p.file for k, p in self.placed.items()}}
            with open(os.path.join(self.path, INDEX), "w") as f:
                json.dump(index, f, indent=2)

    def write(self, key: str, value: torch.Tensor, dim: int = 0, first: int = 0) -> None:
        """Write ``value``: tensor ``key`` whole, or the slice of it starting at index
        ``first`` along ``dim`` (0, or 1 for a 2-D tensor). Files stay open until
        :meth:`close`, which makes them durable."""
        p = self.placed[key]
        data = value.detach().contiguous().cpu()
        if data.numel() == 0:
            return
        raw = data.view(torch.uint8).numpy() if data.dim() else data.reshape(1).view(torch.uint8).numpy()
        f = self._open.get(p.file)
        if f is None:
            f = self._open[p.file] = open(os.path.join(self.path, p.file), "r+b")  # noqa: SIM115 - closed in close()
        if dim == 0:
            inner = math.prod(p.shape[1:]) * p.dtype.itemsize
            f.seek(p.start + first * inner)
            f.write(raw.data)
        else:  # columns [first, first + n) of every row
            f.flush()
            rows, row_bytes = p.shape[0], p.shape[1] * p.dtype.itemsize
            mm = np.memmap(f, dtype=np.uint8, mode="r+", offset=p.start, shape=(rows, row_bytes))
            lo = first * p.dtype.itemsize
            mm[:, lo : lo + raw.shape[1]] = raw
            mm.flush()
            del mm

    def close(self) -> None:
        """Flush and sync every file this process wrote into (once each)."""
        for f in self._open.values():
            f.flush()
            os.fsync(f.fileno())
            f.close()
        self._open.clear()


def save_hf_checkpoint(
    model: nn.Module, state_dict: dict[str, Any], path: str, max_shard_bytes: int = 5 * 2**30
) -> None:
    """Write ``state_dict`` (the wrapped model's sharded state dict) to the folder
    ``path`` as transformers does: ``model.safetensors``, or several files and
    ``model.safetensors.index.json``; plus ``config.json`` (its ``dtype`` set to the
    saved one) when ``model`` has a transformers config. Collective over the world:
    every rank holding rows no other rank holds (the first replica; with pieces,
    every rank) writes its own rows of each sharded tensor into
    the final files (see [Note: writing in place]), replicated tensors are shared
    out among the ranks.

    A model wrapped by peft is a ``ValueError``: its keys are peft's, under which
    ``from_pretrained`` finds none of the base model's weights."""
    if base_names(state_dict).keys() != state_dict.keys():
        raise ValueError(
            f"save_hf_checkpoint({path}): the model is wrapped by peft, and its keys (base_model.model..., "
            "lora_A/lora_B) are not a transformers checkpoint's. Save it with dcp.save(comm.state_dict(), ...); "
            "isp-train's runs export it with isp-export --hf (the adapters) or --hf --merge-lora (merged)"
        )
    aliases = tied_aliases(model)
    tensors = {k: v for k, v in state_dict.items() if k not in aliases}
    layout = published_layout(model, {k: v.shape for k, v in tensors.items()})
    files = SafetensorsFiles(
        path, stored_specs(layout, {k: (v.shape, v.dtype) for k, v in tensors.items()}), max_shard_bytes
    )
    rank, world = dist.get_rank(), dist.get_world_size()
    _agreed(lambda: files.create() if rank == 0 else None, f"save_hf_checkpoint({path})")

    def write_mine() -> None:
        try:
            for i, (key, value) in enumerate(tensors.items()):
                if isinstance(value, DTensor):
                    rows = _own_rows(value)
                    if rows is not None:
                        write_stored(files, layout.get(key, key), value.to_local(), *rows)
                elif i % world == rank:
                    write_stored(files, layout.get(key, key), value)
        finally:
            files.close()

    _agreed(write_mine, f"save_hf_checkpoint({path})")
    if rank == 0:
        config = getattr(model, "config", None)
        if config is not None and hasattr(config, "save_pretrained"):
            write_config(config, {t.dtype for t in tensors.values()}, path)
    dist.barrier()


def published_layout(model: nn.Module, shapes: Mapping[str, torch.Size]) -> dict[str, Stored]:
    """Where ``save_pretrained`` puts each parameter of ``shapes``
    (:func:`~isp_comm.hf_layouts.stored_layout`); ``{}``, the parameters' own names,
    for a model whose conversion isp-comm does not cut shard by shard (the files are
    then in the model's own layout, which transformers 5 and ``load_hf_checkpoint`` read)."""
    try:
        return stored_layout(model, shapes)
    except ValueError:
        return {}


def stored_specs(
    layout: Mapping[str, Stored], specs: Mapping[str, tuple[torch.Size, torch.dtype]]
) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """The shape and dtype of every tensor in the files of parameters ``specs``
    (name: shape and dtype), stored as ``layout`` says."""
    out: dict[str, tuple[torch.Size, torch.dtype]] = {}
    for key, (shape, dtype) in specs.items():
        where = layout.get(key, key)
        if isinstance(where, Fused):
            out.update({c.key: (where.shape, dtype) for c in where.cells})
        else:
            out[where] = (shape, dtype)
    return out


def write_stored(files: SafetensorsFiles, where: Stored, value: torch.Tensor, dim: int = 0, first: int = 0) -> None:
    """Write ``value``, the rows from ``first`` along ``dim`` of a parameter stored at
    ``where``: one tensor, or the tensors of the experts those rows are."""
    if isinstance(where, str):
        files.write(where, value, dim, first)
        return
    if dim != 0:
        raise ValueError(f"{where.cells[0].key}...: sharded along dim {dim}, not along its experts (dim 0)")
    for cell, offset in where.experts(first, value.shape[0]):
        files.write(cell.key, value[cell.expert - first].narrow(where.dim, offset, where.shape[where.dim]))


def _own_rows(value: DTensor) -> tuple[int, int] | None:
    """(split dim, first row) of the rows ``value``'s local tensor holds in the full
    tensor, or ``None`` when another rank writes them: a copy on a mesh dim the
    tensor is replicated over is written by coordinate 0 of that dim only."""
    coordinate = value.device_mesh.get_coordinate()
    if any(p.is_replicate() and c != 0 for p, c in zip(value.placements, coordinate)):
        return None
    (dim,) = {p.dim for p in value.placements if p.is_shard()}
    _, offset = compute_local_shape_and_global_offset(value.shape, value.device_mesh, value.placements)
    return dim, offset[dim]


def _agreed(fn: Any, what: str) -> None:
    """``fn()`` on every rank; if it fails anywhere, every rank raises one
    ``ValueError`` naming the first failure (no rank is left waiting)."""
    error = None
    try:
        fn()
    except OSError as exc:
        error = f"{what}: rank {dist.get_rank()}: {exc}"
    first = first_error(error)
    if first:
        raise ValueError(first)


def write_config(config: Any, dtypes: set[torch.dtype], path: str) -> None:
    """``config.json`` of a transformers config, its ``dtype`` the saved weights' (so
    that ``from_pretrained`` loads them as they are, bitwise)."""
    config = copy.deepcopy(config)
    floating = {d for d in dtypes if d.is_floating_point}
    if len(floating) == 1:
        config.dtype = floating.pop()
    config.save_pretrained(path)
