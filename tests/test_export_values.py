"""Every export path, checked by value in the CI tier: ``isp-export -o``, ``--hf`` and
``--merge-lora`` of a tiny isp-train run (world 1), each compared with what
``ISPCommunicator.full_state_dict()`` gives after loading the same checkpoint.
The slow tier checks the same paths at larger worlds and against transformers and
peft; this one is cheap enough to run on every change."""

from __future__ import annotations

import os

import pytest
import torch

from isp_comm.testing import run_ranks
from isp_comm.train.lora import LORA_SCALING, merge_lora

SCALE = ["--seq", "32", "--batch", "2", "--steps", "2", "--save-every", "2", "--no-trace", "--lr", "1e-2"]
TEXT = "pack my box with five dozen liquor jugs. " * 50


def _full_state_dict(rank: int, world: int, model_dir: str, checkpoints: str, lora_rank: int) -> dict:
    """The wrapped model's full_state_dict() after loading the latest of ``checkpoints``
    into the model isp-train builds."""
    from isp_comm import ISPCommunicator, ISPConfig, ParallelGroups
    from isp_comm.train import checkpoint as ckpt
    from isp_comm.train.config import TrainConfig
    from isp_comm.train.hf_model import build_model
    from isp_comm.train.lora import apply_lora

    model = build_model(model_dir)
    if lora_rank:
        with torch.device("meta"):
            model = apply_lora(model, lora_rank, TrainConfig.lora_targets.split(","))
    comm = ISPCommunicator(model, ParallelGroups.create(wp_size=1), ISPConfig())
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    ckpt.load(ckpt.latest(os.path.dirname(checkpoints)), comm, opt)
    sd = comm.full_state_dict()
    comm.close()
    return sd


def _run(tmp_path, name: str, *flags: str) -> tuple[str, str]:
    """A 2-step isp-train run on a tiny transformers folder; (model folder, checkpoints)."""
    from tests.test_train import _hf_folder, isp_train

    data, model_dir, out = tmp_path / "corpus.txt", tmp_path / "model", tmp_path / name
    if not model_dir.exists():
        data.write_text(TEXT)
        _hf_folder(model_dir, TEXT)
    res = isp_train(1, "--model", str(model_dir), "--data", str(data), "--out", str(out), *SCALE, *flags, timeout=180)
    assert res.returncode == 0, res.stderr[-3000:]
    return str(model_dir), str(out / "checkpoints")


def _export(checkpoints: str, *args: str) -> None:
    from tests.test_train import export_cli

    res = export_cli(checkpoints, *args)
    assert res.returncode == 0, res.stderr[-3000:]


def _safetensors(folder: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(folder, name)))
    return out


def _differences(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> str:
    """What differs, bitwise ("" when nothing): an export copies the checkpoint's tensors
    (a merge computes its fold the same way on both sides)."""
    if got.keys() != want.keys():
        return f"keys differ: {sorted(set(got) ^ set(want))[:6]}"
    bad = [k for k in want if not torch.equal(got[k], want[k])]
    return f"{len(bad)} of {len(want)} tensors differ, e.g. {bad[:3]}" if bad else ""


@pytest.mark.slow  # 38 s; the CI tier's isp-train tests export too (tests/test_train.py)
@pytest.mark.timeout(420)
def test_every_export_path_matches_full_state_dict(tmp_path) -> None:
    model_dir, plain = _run(tmp_path, "plain")
    (full,) = run_ranks(_full_state_dict, 1, model_dir, plain, 0, timeout_s=120)

    found = {}  # every path is checked before failing, so that a fault names each it reaches
    _export(plain, "-o", str(tmp_path / "model.pt"))  # the run's own keys
    found["-o"] = _differences(torch.load(tmp_path / "model.pt", weights_only=True), full)

    _export(plain, "--hf", str(tmp_path / "hf"))  # transformers' keys: the model's own
    hf = _safetensors(str(tmp_path / "hf"))
    found["--hf"] = _differences(hf, {k: v for k, v in full.items() if k in hf})
    assert len(hf) >= len(full) - 1  # a tied head is written once

    model_dir, lora = _run(tmp_path, "lora", "--lora-rank", "4")
    (full,) = run_ranks(_full_state_dict, 1, model_dir, lora, 4, timeout_s=120)
    _export(lora, "--hf", str(tmp_path / "merged"), "--merge-lora")
    merged = _safetensors(str(tmp_path / "merged"))
    want = merge_lora(full, LORA_SCALING)  # W + alpha / r * B @ A, fp32, as the export folds it
    found["--hf --merge-lora"] = _differences(merged, {k: v for k, v in want.items() if k in merged})
    assert len(merged) >= len(want) - 1
    _export(lora, "-o", str(tmp_path / "merged.pt"), "--merge-lora")
    found["-o --merge-lora"] = _differences(
        torch.load(tmp_path / "merged.pt", weights_only=True), merge_lora(full, LORA_SCALING)
    )
    failed = {path: what for path, what in found.items() if what}
    assert not failed, failed
