"""Per-block ``torch.compile`` (the torchtitan recipe) under the engine.

A user compiles each block with ``block.compile(...)``, before or after wrapping.
``Module.compile`` compiles the block's whole ``__call__``, which after wrapping is
the engine's forward: gathers, slot swaps and autograd markers would be traced, and
the engine's in-place landing would be hidden from autograd's version checks inside
compiled code. So the engine takes the compile over:

[Note: compiled blocks]
The engine's block forward is ``torch._dynamo.disable``d (an outer compile
graph-breaks at it and runs it eagerly), and the first time it runs for a block whose
``_compiled_call_impl`` is set, it clears it and compiles the block's *original*
forward instead, with the same compile context (backend, mode, fullgraph, dynamic):
the compiled region is exactly the block's own compute, and its parameters are the
gathered views the engine swapped in, seen by dynamo as graph inputs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn


def _compile_context(compiled_call: Callable[..., Any]) -> Callable[[Callable[..., Any]], Callable[..., Any]] | None:
    """The dynamo context (its backend and options) behind ``Module.compile``'s wrapper,
    when it can be found: calling it compiles another function the same way."""
    code = getattr(compiled_call, "__code__", None)
    if code is None or compiled_call.__closure__ is None:
        return None
    cells = dict(zip(code.co_freevars, compiled_call.__closure__))
    ctx = cells.get("self")
    if ctx is None or not callable(ctx.cell_contents):
        return None
    return ctx.cell_contents


class BlockCompute:
    """The callable a wrapped block computes with: its original forward, or that
    forward compiled once the block asks for compilation (see the note above)."""

    __slots__ = ("block", "fn", "compiled")

    def __init__(self, block: nn.Module, orig: Callable[..., Any]) -> None:
        self.block, self.fn, self.compiled = block, orig, False
        self.take_over()

    def take_over(self) -> None:
        """If ``block.compile()`` was called, compile the original forward instead."""
        compiled_call = self.block._compiled_call_impl
        if compiled_call is None:
            return
        self.block._compiled_call_impl = None
        ctx = _compile_context(compiled_call)
        orig = self.fn if not self.compiled else self.fn._torchdynamo_orig_callable
        self.fn = ctx(orig) if ctx is not None else torch.compile(orig)
        self.compiled = True

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)
