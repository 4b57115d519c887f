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

[Note: buffers and transformers models]
Buffers are materialised with their module. A transformers model is initialised by
its own ``_init_weights(module)``, as ``from_config`` does: normal linears and
embeddings, norms at one, and rotary ``inv_freq`` computed from the config. That
buffer is not persistent, so no checkpoint brings it back: it must be computed
here. A floating buffer that no initialiser filled is an error naming it, never
garbage from uninitialised memory.
"""

from __future__ import annotations

import sys
import zlib
from collections.abc import Callable

import torch
from torch import nn

Initializer = Callable[[nn.Module], None]


def module_seed(seed: int, fqn: str) -> int:
    """A 63-bit seed for the module called ``fqn`` (stable across runs and machines)."""
    return (seed * 0x9E3779B1 + zlib.crc32(fqn.encode())) % (2**63 - 1)


def model_initializer(model: nn.Module) -> Initializer | None:
    """What initialises ``model``'s modules beyond their ``reset_parameters()``: the
    ``_init_weights`` of the transformers model in it (the first ``PreTrainedModel``
    among its modules, so a peft wrapper finds its base model), and peft's rule for
    LoRA adapters (see :func:`_adapter_inits`); ``None`` when neither applies.
    transformers and peft are never imported here: a model of their classes exists
    only once they were."""
    base = None
    tf = sys.modules.get("transformers")
    if tf is not None:
        base = next((m._init_weights for m in model.modules() if isinstance(m, tf.PreTrainedModel)), None)
    adapters = _adapter_inits(model)
    if not adapters:
        return base

    def init(module: nn.Module) -> None:
        rule = adapters.get(id(module))
        if rule is not None:
            rule(module)
        elif base is not None:
            base(module)

    return init


def _adapter_inits(model: nn.Module) -> dict[int, Initializer]:
    """peft's LoRA initialisation (``init_lora_weights=True``) for the adapters' own
    modules, by identity: a linear's A as ``nn.Linear``'s default (its
    ``reset_parameters()`` already drew it), B zero; an embedding's A zero, B normal.
    So a meta-built LoRA model starts as its base model, as ``get_peft_model`` on a
    real one does; a transformers ``_init_weights`` would draw B from a normal."""
    if "peft" not in sys.modules:
        return {}
    from peft.tuners.lora import LoraLayer

    def keep(_module: nn.Module) -> None:
        pass

    def zeros(module: nn.Module) -> None:
        for p in module.parameters(recurse=False):
            nn.init.zeros_(p)

    def normal(module: nn.Module) -> None:
        for p in module.parameters(recurse=False):
            nn.init.normal_(p)

    rules: dict[int, Initializer] = {}
    for m in model.modules():
        if isinstance(m, LoraLayer):
            rules.update({id(a): keep for a in m.lora_A.values()})
            rules.update({id(b): zeros for b in m.lora_B.values()})
            rules.update({id(m.lora_embedding_A): zeros, id(m.lora_embedding_B): normal})
    return rules


def _own_tensors(module: nn.Module) -> list[torch.Tensor]:
    return [*module.parameters(recurse=False), *module.buffers(recurse=False)]


@torch.no_grad()
def reset_module(module: nn.Module, fqn: str, seed: int | None, init: Initializer | None = None) -> None:
    """Initialise ``module``'s own parameters and buffers: ``reset_parameters()``
    where it has one, then ``init(module)`` (a transformers model's
    ``_init_weights``) when given; parameters neither touches are zeros (real values
    then come from a checkpoint). With a seed, both run under the generator of
    ``module_seed(seed, fqn)``."""
    if not hasattr(module, "reset_parameters") and init is None:
        for p in module.parameters(recurse=False):
            p.zero_()
    own = _own_tensors(module)
    device = own[0].device if own else torch.device("cpu")
    # [Note: seeded initialisation on the host] With a seed, a module's values are
    # drawn on the CPU from the CPU generator alone, then copied to its device: the
    # weights are then the same on CPU and GPU (a CUDA generator draws other numbers),
    # and no GPU's RNG is seeded or advanced (torch.manual_seed would seed them all).
    on_host = seed is not None and device.type != "cpu"
    if on_host:
        module._apply(lambda t: t.to("cpu"), recurse=False)
    with torch.random.fork_rng(devices=[], enabled=seed is not None):
        if seed is not None:
            torch.random.default_generator.manual_seed(module_seed(seed, fqn))
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
        if init is not None:
            init(module)
    if on_host:
        module._apply(lambda t: t.to(device), recurse=False)


def materialize_module(
    module: nn.Module, fqn: str, device: torch.device, seed: int | None, init: Initializer | None = None
) -> None:
    """Move ``module``'s own meta parameters and buffers to ``device`` and initialise
    them; a floating buffer left unset is a ``ValueError`` naming it."""
    module.to_empty(device=device, recurse=False)
    unset = [(n, b) for n, b in module.named_buffers(recurse=False) if b.is_floating_point()]
    with torch.no_grad():
        for _, b in unset:
            b.fill_(float("nan"))
    reset_module(module, fqn, seed, init)
    for name, b in unset:
        if b.numel() and torch.isnan(b).all():
            where = f"{fqn}.{name}" if fqn else name
            raise ValueError(
                f"buffer {where} of the meta-built model has no known value: give {type(module).__name__} a "
                "reset_parameters() that computes it, or build the model on a real device"
            )


def materialize_rest(model: nn.Module, materialize: Callable[[nn.Module, str], None]) -> None:
    """Materialise every module still holding meta parameters or buffers, keeping
    tied parameters tied: ``to_empty`` gives a module new parameter objects, so a
    later owner of the same meta parameter is pointed at the first owner's new one
    and is not initialised again (as :func:`init_weights` skips it)."""
    done: dict[int, nn.Parameter] = {}
    for fqn, mod in model.named_modules():
        metas = {n: p for n, p in mod._parameters.items() if p is not None and p.device.type == "meta"}
        tied = {n: done[id(p)] for n, p in metas.items() if id(p) in done}
        if len(tied) < len(metas) or any(b.device.type == "meta" for b in mod.buffers(recurse=False)):
            materialize(mod, fqn)
            done.update({id(p): mod._parameters[n] for n, p in metas.items() if id(p) not in done})
        mod._parameters.update(tied)


def init_weights(model: nn.Module, seed: int) -> nn.Module:
    """Initialise an unwrapped model exactly as wrapping a meta-built copy of it does
    with ``ISPConfig(init_seed=seed)``: module by module, seeded by FQN; a module
    whose parameters are all tied to earlier ones is left to their first owner."""
    init = model_initializer(model)
    seen: set[int] = set()
    for fqn, module in model.named_modules():
        params = list(module.parameters(recurse=False))
        fresh = any(id(p) not in seen for p in params) or any(True for _ in module.buffers(recurse=False))
        if fresh:
            reset_module(module, fqn, seed, init)
        seen.update(id(p) for p in params)
    return model
