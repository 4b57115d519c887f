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
