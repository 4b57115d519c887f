"""transformers' ``generate`` on a wrapped model, made to work as on a model FSDP shards.

At wp > 1 every forward gathers over the WP group, so a rank whose sequences are done
must keep running forwards until its peers' are; under ``vocab_parallel`` the
generation loop must see whole logits; under sequence parallelism each rank generates
from prompts of its own. The communicator says which of these apply and hands the
context managers that switch them; this module wraps the model's ``generate`` in them.
Also the two small attribute helpers the communicator uses for its other patches.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn

from isp_comm.vocab_parallel import WPComm


def patch(obj: Any, name: str, value: Any) -> Callable[[], None]:
    """Set ``obj``'s own attribute ``name`` to ``value``; returns what puts it back as
    it was (its own earlier value, or none: the class's shows again)."""
    had, before = name in obj.__dict__, obj.__dict__.get(name)
    setattr(obj, name, value)
    return functools.partial(setattr, obj, name, before) if had else functools.partial(delattr, obj, name)


@contextlib.contextmanager
def flag_set(obj: Any, flag: str) -> Iterator[None]:
    """``obj.flag`` is ``True`` inside, as it was after (nothing when ``obj`` is ``None``)."""
    before = getattr(obj, flag, None)
    if obj is not None:
        setattr(obj, flag, True)
    try:
        yield
    finally:
        if obj is not None:
            setattr(obj, flag, before)


def wrap_generate(
    model: nn.Module,
    wp_comm: WPComm,
    *,
    synced: bool,
    contexts: Callable[[], list[AbstractContextManager[Any]]],
) -> Callable[[], None] | None:
    """The model's ``generate`` (transformers'), run inside ``contexts()`` (whole
    sequences under SP, whole logits under ``vocab_parallel``, the embedding's shape
    check), and with ``synced`` (wp > 1 in a job of several ranks) ``synced_gpus``
    defaulting to ``True``, as transformers sets it for an FSDP-managed model (without
    it, a peer waited in a block's gather until the deadline), the ranks agreeing on
    going on over the WP group (:func:`synced_over_wp`). Returns what puts the
    instance back as it was, for the communicator's ``close``; ``None`` when the model
    has no ``generate``."""
    generate = getattr(model, "generate", None)
    if not callable(generate):
        return None
    params = list(inspect.signature(generate).parameters)
    at = params.index("synced_gpus") if "synced_gpus" in params else len(params)  # given by position?

    @functools.wraps(generate)
    def generate_wrapped(*args: Any, **kwargs: Any) -> Any:
        if synced and len(args) > at and args[at] is None:
            args = (*args[:at], True, *args[at + 1 :])
        elif synced and len(args) <= at and kwargs.get("synced_gpus") is None:
            kwargs["synced_gpus"] = True
        with contextlib.ExitStack() as stack:
            for cm in (*contexts(), synced_over_wp(model, wp_comm)):
                stack.enter_context(cm)
            return generate(*args, **kwargs)

    return patch(model, "generate", generate_wrapped)


@contextlib.contextmanager
def synced_over_wp(model: nn.Module, wp_comm: WPComm) -> Iterator[None]:
    """Inside, transformers' ``synced_gpus`` asks the WP group, through the
    communicator's backend and under its deadline, whether any rank still has
    sequences to finish, where transformers all-reduces over the whole job with
    torch's own (a default group's collective, outside the deadline and the hang
    diagnosis: a peer that failed kept a rank waiting until the process group's
    timeout, and a job whose other replicas did not generate waited for good).
    The forwards' collectives are the WP group's, so its ranks are the ones that
    must go on together."""
    owners = [m for m in model.modules() if hasattr(type(m), "_has_unfinished_sequences")]

    def has_unfinished(this_peer_finished: bool, synced_gpus: bool, device: torch.device) -> bool:
        if not synced_gpus:
            return not this_peer_finished
        going = torch.tensor([0.0 if this_peer_finished else 1.0], device=device)
        return wp_comm.all_reduce(going, "all-reduce of generate()'s unfinished sequences").item() > 0

    before = [m.__dict__.get("_has_unfinished_sequences") for m in owners]
    for m in owners:
        m._has_unfinished_sequences = has_unfinished
    try:
        yield
    finally:
        for m, fn in zip(owners, before):
            if fn is None:
                del m._has_unfinished_sequences
            else:
                m._has_unfinished_sequences = fn
