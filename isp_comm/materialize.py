"""Materialising a meta-built model one module at a time, with seeds that depend on names.

[Note: initial weights independent of the layout]
Wrapping a model built under ``torch.device("meta")`` materialises each module with
parameters alone, takes this rank's rows and frees the rest, so no rank holds more
than one module's full weights. With a seed, each module is initialised under its
own generator state, seeded from the seed and the module's FQN: the initial weights
then depend on the seed and the names only, not on the WP size, on which parameters
are sharded (``shard_outer_params``, ``vocab_parallel``) nor on the order in which
modules are materialised. :func:`init_weights` gives the same weights to an
unwrapped model (the single-process reference).
"""

from __future__ import annotations

import zlib

import torch
from torch import nn


def module_seed(seed: int, fqn: str) -> int:
    """A 63-bit seed for the module called ``fqn`` (stable across runs and machines)."""
    return (seed * 0x9E3779B1 + zlib.crc32(fqn.encode())) % (2**63 - 1)


@torch.no_grad()
def reset_module(module: nn.Module, fqn: str, seed: int | None) -> None:
    """Initialise ``module``'s own parameters: ``reset_parameters()`` where it has one
    (under the generator of ``module_seed(seed, fqn)`` when a seed is given), zeros
    otherwise (real values then come from a checkpoint)."""
    if not hasattr(module, "reset_parameters"):
        for p in module.parameters(recurse=False):
            p.zero_()
        return
    if seed is None:
        module.reset_parameters()
        return
    cuda = sorted({p.device.index or 0 for p in module.parameters(recurse=False) if p.device.type == "cuda"})
    with torch.random.fork_rng(devices=cuda):
        torch.manual_seed(module_seed(seed, fqn))
        module.reset_parameters()


def materialize_module(module: nn.Module, fqn: str, device: torch.device, seed: int | None) -> None:
    """Move ``module``'s own meta parameters to ``device`` and initialise them."""
    module.to_empty(device=device, recurse=False)
    reset_module(module, fqn, seed)


def init_weights(model: nn.Module, seed: int) -> nn.Module:
    """Initialise an unwrapped model exactly as wrapping a meta-built copy of it does
    with ``ISPConfig(init_seed=seed)``: module by module, seeded by FQN."""
    for fqn, module in model.named_modules():
        if any(True for _ in module.parameters(recurse=False)):
            reset_module(module, fqn, seed)
    return model
