"""``isp-export CHECKPOINT -o model.pt``: a plain full state dict from an isp-train
checkpoint, loadable into the unwrapped model with ``load_state_dict``;
``isp-export CHECKPOINT --hf OUT_DIR``: a folder that transformers' ``from_pretrained``
loads, for runs of ``isp-train --model``.

No process group is needed. ``-o model.safetensors`` writes safetensors instead (needs
the ``safetensors`` package). ``--merge-lora`` folds a LoRA run's adapters into the
base weights (``W + alpha / r * B @ A``, alpha and r from the run's ``run.json``), so
the result loads into the model without peft.

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
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from isp_comm.hf_checkpoint import SafetensorsFiles, tied_aliases, write_config
from isp_comm.train.hf_model import HF_DIR
from isp_comm.train.lora import merge_lora


def _run_dir(checkpoint_dir: str, what: str) -> str:
    """The run's OUT folder (the one with run.json) above ``checkpoint_dir``."""
    here = os.path.abspath(checkpoint_dir)
    for up in (here, os.path.dirname(here), os.path.dirname(os.path.dirname(here))):
        if os.path.isfile(os.path.join(up, "run.json")):
            return up
    raise ValueError(f"{what}: no run.json above {checkpoint_dir}")


def _lora_scaling(checkpoint_dir: str) -> float:
    """alpha / r of the run that wrote ``checkpoint_dir`` (its OUT/run.json)."""
    path = os.path.join(_run_dir(checkpoint_dir, "--merge-lora"), "run.json")
    with open(path) as f:
        lora_rank = json.load(f)["config"].get("lora_rank", 0)
    if not lora_rank:
        raise ValueError(f"--merge-lora: {path} is not a LoRA run (lora_rank 0)")
    return 2.0  # alpha / r: isp-train's lora_alpha is 2 x rank


def _resolve(checkpoint_dir: str) -> str:
    """A run's checkpoints/ folder means its latest checkpoint."""
    if os.path.isfile(os.path.join(checkpoint_dir, "latest")):
        with open(os.path.join(checkpoint_dir, "latest")) as f:
            return os.path.join(checkpoint_dir, f.read().strip())
    return checkpoint_dir


def export_hf(checkpoint_dir: str, out_dir: str, max_shard_bytes: int = 5 * 2**30) -> dict[str, str]:
    """Write the model of an ``isp-train --model`` checkpoint to ``out_dir`` as
    transformers does, one tensor at a time; returns the file of every tensor."""
    from transformers import AutoConfig, AutoModelForCausalLM

    src = os.path.join(_run_dir(checkpoint_dir, "--hf"), HF_DIR)
    if not os.path.isfile(os.path.join(src, "config.json")):
        raise ValueError(f"--hf: {checkpoint_dir} is not from a run of isp-train --model (no {src}/config.json)")
    checkpoint_dir = _resolve(checkpoint_dir)
    config = AutoConfig.from_pretrained(src, local_files_only=True)
    with torch.device("meta"):  # names, shapes and ties only
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    aliases = tied_aliases(model)
    reader = FileSystemReader(checkpoint_dir)
    stored = reader.read_metadata().state_dict_metadata
    wanted = {k: v for k, v in model.state_dict().items() if k not in aliases}
    missing = sorted(k for k in wanted if f"model.{k}" not in stored)
    if missing:
        raise ValueError(f"--hf: {checkpoint_dir} lacks {missing[:3]} of the model in {src}")
    specs = {k: (v.shape, stored[f"model.{k}"].properties.dtype) for k, v in wanted.items()}
    files = SafetensorsFiles(out_dir, specs, max_shard_bytes)
    files.create()
    try:
        for key, (shape, dtype) in specs.items():  # one tensor in memory at a time
            part = {f"model.{key}": torch.empty(shape, dtype=dtype)}
            with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
                warnings.simplefilter("ignore", UserWarning)
                dcp.load(part, storage_reader=reader, no_dist=True)
            files.write(key, part.pop(f"model.{key}"))
    finally:
        files.close()
    write_config(config, {dtype for _, dtype in specs.values()}, out_dir)
    for name in os.listdir(src):  # the tokenizer's files
        if name != "config.json":
            shutil.copyfile(os.path.join(src, name), os.path.join(out_dir, name))
    return {k: p.file for k, p in files.placed.items()}


def export(checkpoint_dir: str, output: str, merge: bool = False) -> dict[str, torch.Tensor]:
    checkpoint_dir = _resolve(checkpoint_dir)
    with tempfile.TemporaryDirectory() as tmp:
        flat = os.path.join(tmp, "all.pt")
        dcp_to_torch_save(checkpoint_dir, flat)
        model = torch.load(flat, weights_only=True)["model"]
    if merge:
        model = merge_lora(model, _lora_scaling(checkpoint_dir))
    if output.endswith(".safetensors"):
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in model.items()}, output)
    else:
        torch.save(model, output)
    return model


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="isp-export", description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint", help="a checkpoint directory, or a run's checkpoints/ directory (latest)")
    ap.add_argument("-o", "--output", default="model.pt", help="model.pt (torch.save) or model.safetensors")
    ap.add_argument("--hf", metavar="OUT_DIR", default="", help="a folder for transformers' from_pretrained instead")
    ap.add_argument("--merge-lora", action="store_true", help="fold LoRA adapters into the base weights")
    args = ap.parse_args(argv)
    try:
        if args.hf:
            if args.merge_lora:
                raise ValueError("--hf exports runs of isp-train --model, which has no LoRA: drop --merge-lora")
            placed = export_hf(args.checkpoint, args.hf)
            print(f"{args.hf}: {len(placed)} tensors in {len(set(placed.values()))} safetensors file(s)")
            return 0
        sd = export(args.checkpoint, args.output, args.merge_lora)
    except (OSError, KeyError, ImportError, RuntimeError, ValueError) as exc:
        print(f"isp-export: error: {exc}", file=sys.stderr)
        return 2
    print(f"{args.output}: {len(sd)} tensors, {sum(v.numel() for v in sd.values()) / 1e6:.2f}M values")
    return 0


if __name__ == "__main__":
    sys.exit(main())
