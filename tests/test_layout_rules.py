"""House rules a reader relies on, checked over the library's source: no function over
80 lines, no constructor over 40 (a function's length counts its signature, docstring
and body, as ``ast`` spans them)."""

from __future__ import annotations

import ast
from pathlib import Path

MAX_FUNCTION_LINES = 80
MAX_CONSTRUCTOR_LINES = 40
ROOT = Path(__file__).resolve().parents[1] / "isp_comm"  # this checkout's source, not an installed copy


def too_long(source: str) -> list[tuple[str, int, int]]:
    """(name, first line, length) of every function in ``source`` over its limit."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1
            limit = MAX_CONSTRUCTOR_LINES if node.name == "__init__" else MAX_FUNCTION_LINES
            if length > limit:
                found.append((node.name, node.lineno, length))
    return found


def test_the_check_sees_a_long_function() -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(80))
    assert too_long(f"def f():\n{body}\n") == [("f", 1, 81)]
    init = "\n".join(f"        self.x{i} = {i}" for i in range(40))
    assert too_long(f"class C:\n    def __init__(self):\n{init}\n") == [("__init__", 2, 41)]


def test_functions_fit_in_80_lines_and_constructors_in_40() -> None:
    offenders = []
    for path in sorted(ROOT.rglob("*.py")):
        for name, line, length in too_long(path.read_text()):
            offenders.append(f"{path.relative_to(ROOT.parent)}:{line} {name}: {length} lines")
    assert not offenders, "functions over the limit:\n" + "\n".join(offenders)
