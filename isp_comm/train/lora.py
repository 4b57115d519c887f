"""LoRA for isp-train: peft adapters on the reference model, and merging them on export.

``--lora-rank R`` wraps the model with ``peft.get_peft_model`` (rank ``R``,
``lora_alpha = 2 R``, no dropout) on the projections named by ``--lora-targets``
before isp-comm wraps it, so the adapters are sharded with their blocks and the base
weights, frozen, are never reduce-scattered (see the README's "Frozen parameters and
LoRA"). The model is built on meta and materialised by isp-comm, which initialises
the adapters as peft does (A as ``nn.Linear``, B zero; isp_comm/materialize.py), so
training starts from the base model exactly.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from isp_comm.hf_checkpoint import tied_aliases

ADAPTER = "default"  # peft's adapter name
LORA_SCALING = 2.0  # lora_alpha / r: isp-train's lora_alpha is 2 x rank


def apply_lora(model: nn.Module, rank: int, targets: list[str], given: bool = True) -> nn.Module:
    """``model`` with LoRA adapters on the linears whose names end in ``targets``;
    everything else frozen. Needs the ``peft`` package. ``given``: ``targets`` came
    from ``--lora-targets``, not its default (see :func:`unknown_targets`)."""
    try:
        import peft
    except ImportError as exc:
        raise ValueError("--lora-rank needs the peft package (pip install peft)") from exc
    linears = {n: n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    unknown = sorted(set(targets) - set(linears.values()))
    if unknown:
        raise ValueError(unknown_targets(model, linears, targets, unknown, rank, given))
    tied = tied_aliases(model)
    tied_weights = set(tied) | set(tied.values())
    on_tied = sorted({leaf for n, leaf in linears.items() if leaf in targets and f"{n}.weight" in tied_weights})
    if on_tied:
        raise ValueError(
            f"--lora-targets {','.join(on_tied)}: its weight is tied to another ({sorted(tied.items())}), "
            "and an adapter on one name of a tied weight cannot be merged into it: leave it out"
        )
    cfg = peft.LoraConfig(r=rank, lora_alpha=int(LORA_SCALING * rank), lora_dropout=0.0, target_modules=targets)
    return peft.get_peft_model(model, cfg)


def unknown_targets(
    model: nn.Module, linears: dict[str, str], targets: list[str], unknown: list[str], rank: int, given: bool
) -> str:
    """The one line for targets the model has no linear of, with what to pass: its
    attention's projections (the linears under a module named ``*attn*``/``*attention*``),
    as the default's are a llama's. Of the default, it names the default, which the user
    never typed: a Phi-3 folder (one fused ``qkv_proj``) met ``q_proj,k_proj,v_proj: no
    such linear``, as if it had. The default is not swapped for them silently: run.json
    records the targets, and ``isp-export --hf`` writes them in the adapter's config."""
    names = sorted(set(linears.values()))
    attention = list(dict.fromkeys(leaf for n, leaf in linears.items() if re.search(r"attn|attention", n, re.I)))
    kind = getattr(getattr(model, "config", None), "model_type", "")
    model_is = f"this {kind} model" if kind else "the model"
    advice = f": pass --lora-targets {','.join(attention)} (its attention's projections)" if attention else ""
    if given:
        return f"--lora-targets {','.join(unknown)}: no such linear in {model_is} (its linears: {names}){advice}"
    return (
        f"--lora-rank {rank}: the default --lora-targets {','.join(targets)} (a llama's attention projections) "
        f"names {','.join(unknown)}, which {model_is} lacks (its linears: {names}){advice or ': pass --lora-targets'}"
    )


def merge_lora(sd: dict[str, torch.Tensor], scaling: float) -> dict[str, torch.Tensor]:
    """A peft-LoRA state dict -> the base model's: ``W + scaling * B @ A`` under the
    original names (``base_model.model.`` and ``.base_layer`` dropped)."""
    out: dict[str, torch.Tensor] = {}
    for key, value in sd.items():
        if ".lora_A." in key or ".lora_B." in key:
            continue
        plain = re.sub(r"^base_model\.model\.", "", key).replace(".base_layer.", ".")
        stem = key.rsplit(".base_layer.", 1)[0] if ".base_layer.weight" in key else None
        if stem is not None and f"{stem}.lora_A.{ADAPTER}.weight" in sd:
            a, b = sd[f"{stem}.lora_A.{ADAPTER}.weight"], sd[f"{stem}.lora_B.{ADAPTER}.weight"]
            value = value + scaling * (b.float() @ a.float()).to(value.dtype)
        out[plain] = value
    return out


def init_from(comm, path: str) -> None:
    """Load the weights of a plain state dict file (``model.pt`` / ``.safetensors``, as
    isp-export writes) into the wrapped model; under peft, into the base weights (the
    adapters keep their initialisation). Each rank keeps its own rows."""
    from isp_comm.hf_checkpoint import base_names

    try:
        if path.endswith(".safetensors"):
            from safetensors.torch import load_file

            full = load_file(path)
        else:
            full = torch.load(path, weights_only=True, map_location="cpu")
    except Exception as e:  # noqa: BLE001 - torch.load's advice (weights_only=False) is not the user's to take
        why = str(e).partition("\n")[0][:200]  # the first line (an empty file's EOFError has none)
        raise ValueError(
            f"--init-from {path}: not a readable state dict ({type(e).__name__}: {why}); "
            "it takes a file of model.state_dict() (torch.save) or a .safetensors file, as isp-export writes"
        ) from None
    if not isinstance(full, dict) or not all(isinstance(v, torch.Tensor) for v in full.values()):
        raise ValueError(
            f"--init-from {path}: holds a {type(full).__name__}, not a state dict of tensors; save "
            "model.state_dict() (not the model itself), or export a run with isp-export"
        )
    current = comm.state_dict()
    names = base_names(current)
    missing = sorted(plain for plain in names.values() if plain not in full)
    if missing:
        raise ValueError(f"--init-from {path}: lacks {missing[:3]}{' ...' if len(missing) > 3 else ''}")
    wrong = [(plain, ours) for ours, plain in names.items() if full[plain].shape != current[ours].shape]
    if wrong:
        plain, ours = wrong[0]
        raise ValueError(
            f"--init-from {path}: {plain} has shape {tuple(full[plain].shape)}, the model's "
            f"{tuple(current[ours].shape)} ({len(wrong)} of {len(names)} tensors differ): the file holds another "
            "model; give the model flags it was trained with (--layers, --hidden, --heads, --kv-heads, or --model)"
        )
    comm.load_state_dict({**current, **{ours: full[plain] for ours, plain in names.items()}})
