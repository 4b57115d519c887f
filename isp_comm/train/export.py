"""``isp-export CHECKPOINT -o model.pt``: a plain full state dict from an isp-train
checkpoint, loadable into the unwrapped model with ``load_state_dict``;
``isp-export CHECKPOINT --hf OUT_DIR``: a folder that transformers' ``from_pretrained``
loads, for runs of ``isp-train --model``.

No process group is needed. ``-o model.safetensors`` writes safetensors instead (needs
the ``safetensors`` package). ``--merge-lora`` folds a LoRA run's adapters into the
base weights (``W + alpha / r * B @ A``, alpha and r from the run's ``run.json``), so
the result loads into the model without peft.

For a LoRA run (``--lora-rank``) of ``isp-train --model``, ``--hf OUT_DIR`` writes
the adapters alone in peft's format (``PeftModel.from_pretrained`` loads them on top
of the original folder) and ``--hf OUT_DIR --merge-lora`` the merged model.

``--hf`` streams: the tensors go out in safetensors files of at most 5 GiB each
(with ``model.safetensors.index.json`` when there are several), one tensor at a time,
read from the checkpoint by DCP. The run's ``OUT/hf_model``
gives the config (``dtype`` set to the saved one) and the tokenizer's files.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException, FileSystemReader
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from isp_comm.errors import need_folder
from isp_comm.hf_checkpoint import (
    PEFT_PREFIX,
    SafetensorsFiles,
    published_layout,
    stored_specs,
    tied_aliases,
    write_config,
    write_stored,
)
from isp_comm.models.llama import export_config_path
from isp_comm.train import checkpoint
from isp_comm.train.config import lora_target_names
from isp_comm.train.hf_model import HF_DIR
from isp_comm.train.lora import ADAPTER, LORA_SCALING, merge_lora

CHECKPOINT_ARG = "a run folder, its checkpoints/ folder or one checkpoint"
"""What isp-export's argument may be."""


def _run_dir(checkpoint_dir: str, what: str) -> str:
    """The run's OUT folder (the one with run.json) above ``checkpoint_dir``."""
    need_folder(checkpoint_dir, CHECKPOINT_ARG)
    here = os.path.abspath(checkpoint_dir)
    for up in (here, os.path.dirname(here), os.path.dirname(os.path.dirname(here))):
        if os.path.isfile(os.path.join(up, "run.json")):
            return up
    raise ValueError(f"{what}: no run.json above {checkpoint_dir}")


def _lora_scaling(checkpoint_dir: str) -> float:
    """alpha / r of the run that wrote ``checkpoint_dir`` (its OUT/run.json)."""
    if not _run_config(checkpoint_dir).get("lora_rank", 0):
        raise ValueError(f"--merge-lora: {checkpoint_dir} is not from a LoRA run (lora_rank 0)")
    return LORA_SCALING


def _resolve(checkpoint_dir: str) -> str:
    """A run folder or its checkpoints/ folder means its newest complete checkpoint (as
    a resume takes it); anything that is not a checkpoint, or one whose files fail their
    checksums, is a ``ValueError`` saying what was expected."""
    need_folder(checkpoint_dir, CHECKPOINT_ARG)
    if os.path.isdir(os.path.join(checkpoint_dir, "checkpoints")):  # the run folder
        checkpoint_dir = os.path.join(checkpoint_dir, "checkpoints")
    if not os.path.isfile(os.path.join(checkpoint_dir, ".metadata")):  # a checkpoints folder: as a resume takes it
        checkpoint_dir = checkpoint.newest(checkpoint_dir) or checkpoint_dir
    if not os.path.isfile(os.path.join(checkpoint_dir, ".metadata")):
        raise ValueError(
            f"{checkpoint_dir} is not a checkpoint (no .metadata): give a run folder, its checkpoints/ "
            "folder or one checkpoint step_N/ in it"
        )
    bad = checkpoint.first_bad_file(checkpoint_dir)
    if bad:  # what a resume refuses, an export does too
        raise ValueError(f"checkpoint {checkpoint_dir}: {bad}{checkpoint.way_on(checkpoint_dir)}")
    return checkpoint_dir


def _read(reader: FileSystemReader, key: str, shape, dtype) -> torch.Tensor:
    """One tensor of a DCP checkpoint, read alone."""
    part = {key: torch.empty(shape, dtype=dtype)}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(part, storage_reader=reader, no_dist=True)
    return part[key]


def _run_config(checkpoint_dir: str) -> dict:
    return _run_config_file(checkpoint_dir).get("config", {})


def export_hf(
    checkpoint_dir: str, out_dir: str, max_shard_bytes: int = 5 * 2**30, merge: bool = False
) -> dict[str, str]:
    """Write the model of an ``isp-train --model`` checkpoint to ``out_dir`` as
    transformers does, one tensor at a time; returns the file of every tensor. For a
    LoRA run: with ``merge`` the base weights with the adapters folded in (what
    ``from_pretrained`` loads), else the adapters alone in peft's format."""
    from transformers import AutoConfig, AutoModelForCausalLM

    src = os.path.join(_run_dir(checkpoint_dir, "--hf"), HF_DIR)
    if not os.path.isfile(os.path.join(src, "config.json")):
        raise ValueError(f"--hf: {checkpoint_dir} is not from a run of isp-train --model (no {src}/config.json)")
    run = _run_config(checkpoint_dir)
    lora_rank = run.get("lora_rank", 0)
    if merge and not lora_rank:
        raise ValueError(f"--merge-lora: {checkpoint_dir} is not from a LoRA run (lora_rank 0)")
    checkpoint_dir = _resolve(checkpoint_dir)
    reader = FileSystemReader(checkpoint_dir)
    stored = reader.read_metadata().state_dict_metadata
    if lora_rank and not merge:
        working_dir = _run_config_file(checkpoint_dir).get("working_dir", os.getcwd())  # older runs: here
        return _export_adapter(reader, stored, run, os.path.abspath(working_dir), out_dir, src)
    config = AutoConfig.from_pretrained(src, local_files_only=True)
    with torch.device("meta"):  # names, shapes and ties only
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    aliases = tied_aliases(model)
    wanted = {k: v for k, v in model.state_dict().items() if k not in aliases}
    where = {k: _stored_name(k, stored) for k in wanted}  # the run's key of each transformers key
    missing = sorted(k for k, s in where.items() if s is None)
    if missing:
        raise ValueError(f"--hf: {checkpoint_dir} lacks {missing[:3]} of the model in {src}")
    specs = {k: (v.shape, stored[where[k]].properties.dtype) for k, v in wanted.items()}
    layout = published_layout(model, {k: v.shape for k, v in wanted.items()})  # as save_pretrained writes it
    files = SafetensorsFiles(out_dir, stored_specs(layout, specs), max_shard_bytes)
    files.create()
    try:
        for key, (shape, dtype) in specs.items():  # one tensor in memory at a time
            value = _read(reader, where[key], shape, dtype)
            adapted = where[key].endswith(".base_layer.weight")
            stem = where[key].rsplit(".base_layer.", 1)[0] if adapted else None
            if stem is not None and f"{stem}.lora_A.{ADAPTER}.weight" in stored:  # fold W + alpha / r * B @ A
                a_key, b_key = f"{stem}.lora_A.{ADAPTER}.weight", f"{stem}.lora_B.{ADAPTER}.weight"
                a = _read(reader, a_key, stored[a_key].size, stored[a_key].properties.dtype)
                b = _read(reader, b_key, stored[b_key].size, stored[b_key].properties.dtype)
                value = value + LORA_SCALING * (b.float() @ a.float()).to(value.dtype)
            write_stored(files, layout.get(key, key), value)
    finally:
        files.close()
    write_config(config, {dtype for _, dtype in specs.values()}, out_dir)
    for name in os.listdir(src):  # the tokenizer's files
        if name != "config.json":
            shutil.copyfile(os.path.join(src, name), os.path.join(out_dir, name))
    return {k: p.file for k, p in files.placed.items()}


def _stored_name(key: str, stored) -> str | None:
    """The checkpoint's name of transformers key ``key``: ``model.KEY``, or under peft
    ``model.base_model.model.KEY`` with ``.base_layer`` before an adapted weight's name."""
    stem, _, leaf = key.rpartition(".")
    for name in (f"model.{key}", f"model.{PEFT_PREFIX}{key}", f"model.{PEFT_PREFIX}{stem}.base_layer.{leaf}"):
        if name in stored:
            return name
    return None


def _export_adapter(
    reader: FileSystemReader, stored, run: dict, working_dir: str, out_dir: str, src: str
) -> dict[str, str]:
    """A LoRA run's adapters alone, as peft saves them (``adapter_model.safetensors``
    without the adapter's name in the keys, ``adapter_config.json``), for
    ``PeftModel.from_pretrained(base, out_dir)`` on top of the original folder."""
    import peft
    from safetensors.torch import save_file

    tensors = {}
    for name, md in stored.items():
        adapter = f".lora_A.{ADAPTER}." in name or f".lora_B.{ADAPTER}." in name
        if adapter and name.startswith("model."):  # the model's, not the optimizer's state of it
            key = name[len("model.") :].replace(f".{ADAPTER}.", ".")
            tensors[key] = _read(reader, name, md.size, md.properties.dtype).contiguous()
    if not tensors:
        raise ValueError("--hf: the checkpoint holds no LoRA adapters")
    os.makedirs(out_dir, exist_ok=True)
    save_file(tensors, os.path.join(out_dir, "adapter_model.safetensors"), metadata={"format": "pt"})
    rank = run["lora_rank"]
    targets = lora_target_names(run["lora_targets"])
    peft.LoraConfig(
        r=rank,
        lora_alpha=int(LORA_SCALING * rank),
        lora_dropout=0.0,
        target_modules=targets,
        base_model_name_or_path=os.path.join(working_dir, run["model"]),  # as is when absolute
        task_type="CAUSAL_LM",
    ).save_pretrained(out_dir)
    for name in os.listdir(src):  # the tokenizer's files
        if name != "config.json":
            shutil.copyfile(os.path.join(src, name), os.path.join(out_dir, name))
    return dict.fromkeys(tensors, "adapter_model.safetensors")


def export(checkpoint_dir: str, output: str, merge: bool = False) -> dict[str, torch.Tensor]:
    """The full state dict of a checkpoint, written to ``output`` with the reference
    model's config beside it (``OUTPUT_STEM.config.json``, for
    ``isp_comm.models.llama.from_export``)."""
    model_config = _run_config_file(checkpoint_dir).get("model_config")
    checkpoint_dir = _resolve(checkpoint_dir)
    with tempfile.TemporaryDirectory() as tmp:
        flat = os.path.join(tmp, "all.pt")
        dcp_to_torch_save(checkpoint_dir, flat)
        model = torch.load(flat, weights_only=True)["model"]
    if merge:
        model = merge_lora(model, _lora_scaling(checkpoint_dir))
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    if output.endswith(".safetensors"):
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in model.items()}, output)
    else:
        torch.save(model, output)
    if model_config:
        with open(export_config_path(output), "w") as f:
            json.dump(model_config, f, indent=1)
    return model


def _run_config_file(checkpoint_dir: str) -> dict:
    """The run.json of the run above ``checkpoint_dir``, or ``{}``."""
    try:
        with open(os.path.join(_run_dir(checkpoint_dir, "isp-export"), "run.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def parser() -> argparse.ArgumentParser:
    """isp-export's arguments."""
    ap = argparse.ArgumentParser(prog="isp-export", description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint", help="a run folder, its checkpoints/ folder (the latest) or one checkpoint")
    ap.add_argument(
        "-o", "--output", default="", help="model.pt (torch.save) or model.safetensors (default: the run's model.pt)"
    )
    ap.add_argument("--hf", metavar="OUT_DIR", default="", help="a folder for transformers' from_pretrained instead")
    ap.add_argument(
        "--merge-lora",
        action="store_true",
        help="fold LoRA adapters into the base weights (with --hf: the merged model instead of the adapters alone)",
    )
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        if args.hf:
            placed = export_hf(args.checkpoint, args.hf, merge=args.merge_lora)
            print(f"{args.hf}: {len(placed)} tensors in {len(set(placed.values()))} safetensors file(s)")
            return 0
        need_folder(args.checkpoint, CHECKPOINT_ARG)
        if not args.output:  # into the run folder
            try:
                args.output = os.path.join(_run_dir(args.checkpoint, "isp-export"), "model.pt")
            except ValueError:
                where = f"{args.checkpoint} is in no run folder (no run.json above it)"
                raise ValueError(f"{where}: give -o OUTPUT") from None
        sd = export(args.checkpoint, args.output, args.merge_lora)
    except (OSError, KeyError, ImportError, RuntimeError, ValueError, CheckpointException) as exc:
        unread = isinstance(exc, CheckpointException)  # DCP's, a BaseException: its cause in one line
        why = f"{args.checkpoint} cannot be read: {checkpoint.root_cause(exc)}" if unread else exc
        print(f"isp-export: error: {why}", file=sys.stderr)
        return 2
    print(f"{args.output}: {len(sd)} tensors, {sum(v.numel() for v in sd.values()) / 1e6:.2f}M values")
    return 0


if __name__ == "__main__":
    sys.exit(main())
