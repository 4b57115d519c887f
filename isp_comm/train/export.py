"""``isp-export CHECKPOINT -o model.pt``: a plain full state dict from an isp-train
checkpoint, loadable into the unwrapped model with ``load_state_dict``.

No process group is needed. ``-o model.safetensors`` writes safetensors instead (needs
the ``safetensors`` package). ``--merge-lora`` folds a LoRA run's adapters into the
base weights (``W + alpha / r * B @ A``, alpha and r from the run's ``run.json``), so
the result loads into the model without peft.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from isp_comm.train.lora import merge_lora


def _lora_scaling(checkpoint_dir: str) -> float:
    """alpha / r of the run that wrote ``checkpoint_dir`` (its OUT/run.json)."""
    here = os.path.abspath(checkpoint_dir)
    for up in (here, os.path.dirname(here), os.path.dirname(os.path.dirname(here))):
        path = os.path.join(up, "run.json")
        if os.path.isfile(path):
            with open(path) as f:
                lora_rank = json.load(f)["config"].get("lora_rank", 0)
            if not lora_rank:
                raise ValueError(f"--merge-lora: {path} is not a LoRA run (lora_rank 0)")
            return 2.0  # alpha / r: isp-train's lora_alpha is 2 x rank
    raise ValueError(f"--merge-lora: no run.json above {checkpoint_dir}")


def export(checkpoint_dir: str, output: str, merge: bool = False) -> dict[str, torch.Tensor]:
    if os.path.isfile(os.path.join(checkpoint_dir, "latest")):  # a run's checkpoints/ folder
        with open(os.path.join(checkpoint_dir, "latest")) as f:
            checkpoint_dir = os.path.join(checkpoint_dir, f.read().strip())
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
    ap.add_argument("--merge-lora", action="store_true", help="fold LoRA adapters into the base weights")
    args = ap.parse_args(argv)
    try:
        sd = export(args.checkpoint, args.output, args.merge_lora)
    except (OSError, KeyError, ImportError, RuntimeError, ValueError) as exc:
        print(f"isp-export: error: {exc}", file=sys.stderr)
        return 2
    print(f"{args.output}: {len(sd)} tensors, {sum(v.numel() for v in sd.values()) / 1e6:.2f}M values")
    return 0


if __name__ == "__main__":
    sys.exit(main())
