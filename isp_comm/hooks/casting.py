"""Walking nested forward inputs/outputs (tensors in tuples, lists and dicts)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """Apply ``fn`` to every tensor in ``obj``, rebuilding tuples, lists and dicts."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # NamedTuple
        return type(obj)(*(map_tensors(o, fn) for o in obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(map_tensors(o, fn) for o in obj)
    if isinstance(obj, dict):
        out = copy.copy(obj)  # keeps dict subclasses such as transformers' ModelOutput
        for k, v in obj.items():
            out[k] = map_tensors(v, fn)
        return out
    return obj


def cast_floats(obj: Any, dtype: torch.dtype) -> Any:
    """Floating-point tensors in ``obj`` cast to ``dtype`` (differentiably)."""
    return map_tensors(obj, lambda t: t.to(dtype) if t.is_floating_point() else t)


def cast_params_in(params: list, dtype: torch.dtype | None) -> list:
    """Stand ``dtype`` copies in for the floating parameters named by ``params``
    (``ReplicatedParam``s: module and attribute) while a forward computes; returns
    what :func:`cast_params_out` puts back. A parameter owned by several modules
    (tied) is cast once. The cast is differentiable, so the gradient reaches the
    master parameter in its own dtype."""
    swapped: list = []
    if dtype is None:
        return swapped
    casts: dict[int, torch.Tensor] = {}
    for rp in params:
        master = rp.module._parameters[rp.name]
        if master is None or master.dtype == dtype or not master.is_floating_point():
            continue
        cast = casts.get(id(master))
        if cast is None:
            cast = casts[id(master)] = master.to(dtype)
        swapped.append((rp, master))
        rp.module._parameters[rp.name] = cast
    return swapped


def cast_params_out(swapped: list) -> None:
    """Put the master parameters back (see :func:`cast_params_in`)."""
    for rp, master in swapped:
        rp.module._parameters[rp.name] = master
