"""``isp-export CHECKPOINT -o model.pt``: a plain full state dict from an isp-train
checkpoint, loadable into the unwrapped model with ``load_state_dict``.

No process group is needed. ``-o model.safetensors`` writes safetensors instead (needs
the ``safetensors`` package).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save


def export(checkpoint_dir: str, output: str) -> dict[str, torch.Tensor]:
    if os.path.isfile(os.path.join(checkpoint_dir, "latest")):  # a run's checkpoints/ folder
        with open(os.path.join(checkpoint_dir, "latest")) as f:
            checkpoint_dir = os.path.join(checkpoint_dir, f.read().strip())
    with tempfile.TemporaryDirectory() as tmp:
        flat = os.path.join(tmp, "all.pt")
        dcp_to_torch_save(checkpoint_dir, flat)
        model = torch.load(flat, weights_only=True)["model"]
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
    args = ap.parse_args(argv)
    try:
        sd = export(args.checkpoint, args.output)
    except (OSError, KeyError, ImportError, RuntimeError) as exc:
        print(f"isp-export: error: {exc}", file=sys.stderr)
        return 2
    print(f"{args.output}: {len(sd)} tensors, {sum(v.numel() for v in sd.values()) / 1e6:.2f}M values")
    return 0


if __name__ == "__main__":
    sys.exit(main())
