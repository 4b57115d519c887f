"""Per-block ``torch.compile`` (the torchtitan recipe) under the engine.

A user compiles each block with ``block.compile(...)``, before or after wrapping.
``Module.compile`` compiles the block's whole ``__call__``, which after wrapping is
the engine's forward: gathers, slot swaps and autograd markers would be traced, and
the engine's in-place landing would be hidden from autograd's version checks inside
compiled code. So the engine takes the compile over:

[Note: compiled blocks]
A block compiled before wrapping (its ``_compiled_call_impl`` set) is taken over at
wrap time, and ``block.compile(...)`` after wrapping is routed to the take-over (an
instance attribute shadows ``Module.compile`` until ``close()``): the module's
compiled call is cleared and the block's *original* forward is compiled instead, with
the same compile context (backend, mode, fullgraph, dynamic). The compiled region is
exactly the block's own compute, and its parameters are the gathered views the engine
swapped in, seen by dynamo as graph inputs; the engine's forward runs eagerly. The
engine's forward is also kept out of dynamo's tracing, so a compile around the whole
model graph-breaks at each block instead of tracing the engine.

[Note: dynamo loaded on first call]
``torch.compiler.disable`` imports dynamo where it decorates: a second or more of the
start of every process that imports isp-comm, isp-train's launcher among them, which
spent it before any rank could start. (A rank loads dynamo anyway: torch's meta
kernels and the optimizer's step import it.) What isp-comm and the reference llama
keep out of graphs is marked with ``torch._disable_dynamo`` instead, torch's own form
for its modules: the same ``disable``, applied at the first call. Dynamo skips the
wrapper (it lives in ``torch._compile``, on dynamo's skip list), so a traced caller
runs it eagerly, the function inside with dynamo off, as ``disable`` does.
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

    def guard(self, forward: Callable[..., Any]) -> Callable[..., Any]:
        """``forward`` (the engine's) kept out of dynamo's tracing, and ``block.compile``
        routed to :meth:`take_over` (see the note)."""
        block = self.block

        def compile(*args: Any, **kwargs: Any) -> None:
            nn.Module.compile(block, *args, **kwargs)
            self.take_over()

        block.__dict__["compile"] = compile
        return torch._disable_dynamo(forward, recursive=True)  # [Note: dynamo loaded on first call]
