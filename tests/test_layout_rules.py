"""House rules a reader relies on, checked over the library's source: no function over
80 lines, no constructor over 40 (a function's length counts its signature, docstring
and body, as ``ast`` spans them); and imports that read in one direction: no cycle
between the package's modules, and no module importing from a layer above its own.

Every import counts, wherever it is written: at the top, inside a function, under
``if TYPE_CHECKING:``, relative or absolute, and ``import_module`` (bare or as
``importlib.import_module``, relative with a literal package too) or ``__import__`` of a
literal name. ``from a.b import c`` is an edge to the module ``a.b.c`` when there is
one, else to ``a.b`` (its ``__init__``); importing a module also runs its parents'
``__init__`` files, which the graph leaves out (a package's ``__init__`` that re-exports
its modules would otherwise be in a cycle with each of them)."""

from __future__ import annotations

import ast
from pathlib import Path

MAX_FUNCTION_LINES = 80
MAX_CONSTRUCTOR_LINES = 40
ROOT = Path(__file__).resolve().parents[1] / "isp_comm"  # this checkout's source, not an installed copy
LAYERS = (
    "isp_comm",  # the library core: every module not in a layer below
    "isp_comm.memory_forecast",
    "isp_comm.memory_breakdown",
    "isp_comm.__init__",  # the public names: they re-export the core and the forecast
    "isp_comm.planner",
    "isp_comm.train",
)
"""The layers, from the bottom. A module is in the layer of the longest name that is
its own or a prefix of it (``isp_comm.planner.step`` is in ``isp_comm.planner``); a
module may import from its own layer and the ones before it."""
TOP = frozenset({"bench", "tests"})
"""The repository's scripts and tests, above every layer: the package never imports them."""


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


def module_names(root: Path) -> dict[str, Path]:
    """Every module of the package at ``root``, by dotted name; a package is named by
    its ``__init__`` (``isp_comm.train.__init__``), so that a layer's name does not
    take in the package's facade above it."""
    return {".".join(p.relative_to(root.parent).with_suffix("").parts): p for p in sorted(root.rglob("*.py"))}


def _target(name: str, modules: dict[str, Path]) -> str | None:
    """The module an import of ``name`` runs: the longest module (or package) of the
    package that ``name`` is or lies in; None for another distribution's."""
    parts = name.split(".")
    if parts[0] in TOP:
        return parts[0]
    for end in range(len(parts), 0, -1):
        for candidate in (".".join(parts[:end]), ".".join([*parts[:end], "__init__"])):
            if candidate in modules:
                return candidate
    return None


def _imported_names(node: ast.AST, package: str) -> list[str]:
    """The dotted names an import statement (or ``importlib.import_module("...")``)
    in a module of ``package`` brings in: ``from a import b`` gives ``a.b``."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:  # relative: from the module's package, up level - 1 packages
            parent = package.split(".")[: len(package.split(".")) - node.level + 1]
            base = ".".join([*parent, *([node.module] if node.module else [])])
        return [f"{base}.{alias.name}" if base else alias.name for alias in node.names]
    if isinstance(node, ast.Call) and _callee(node.func) in ("import_module", "__import__"):
        literals = [a.value if isinstance(a, ast.Constant) and isinstance(a.value, str) else None for a in node.args]
        if literals and literals[0] is not None:
            name = literals[0]
            if name.startswith(".") and len(literals) > 1 and literals[1]:  # import_module(".x", "a.b")
                dots = len(name) - len(name.lstrip("."))
                anchor = literals[1].split(".")[: len(literals[1].split(".")) - dots + 1]
                name = ".".join([*anchor, name.lstrip(".")])
            return [name]
    return []


def _callee(func: ast.expr) -> str | None:
    """The called name: ``f`` for ``f(...)`` and ``m.f(...)``."""
    if isinstance(func, ast.Attribute):
        return func.attr
    return func.id if isinstance(func, ast.Name) else None


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the package's modules (and ``bench``/``tests``) it imports."""
    modules = module_names(root)
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name.removesuffix(".__init__") if name.endswith("__init__") else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            for imported in _imported_names(node, package):
                # ``from a import b``: ``a.b`` when b is a module, else ``a`` itself
                target = _target(imported, modules)
                if target is not None and target != name:
                    targets.add(target)
        graph[name] = targets
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def layer_of(module: str, layers: tuple[str, ...]) -> int:
    """The position in ``layers`` (bottom first) of the longest name that is ``module``
    or a package holding it; ``bench`` and ``tests`` (``TOP``) at the top."""
    if module in TOP:
        return len(layers)
    matches = [i for i, name in enumerate(layers) if module == name or module.startswith(name + ".")]
    return max(matches, key=lambda i: len(layers[i]))


def upward(graph: dict[str, set[str]], layers: tuple[str, ...]) -> list[str]:
    """Every import from a module to one in a layer above its own, as ``a -> b``."""
    return [
        f"{src} -> {dst}"
        for src, targets in sorted(graph.items())
        for dst in sorted(targets)
        if layer_of(dst, layers) > layer_of(src, layers)
    ]


def test_the_package_imports_downward_without_cycles() -> None:
    graph = import_graph(ROOT)
    assert len(graph) > 50 and sum(map(len, graph.values())) > 100  # the graph is there
    assert cycles(graph) == [], "import cycles (each a set of modules that import each other)"
    assert upward(graph, LAYERS) == [], "imports from a layer above the importer's"


def _write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root / "pkg"


CLEAN = {
    "pkg/__init__.py": "from pkg.core import f\n",
    "pkg/core.py": "def f():\n    return 1\n",
    "pkg/util.py": "from .core import f\n",
    "pkg/top/__init__.py": "",
    "pkg/top/app.py": "from pkg import util\nfrom ..core import f\n",
}
SYNTHETIC_LAYERS = ("pkg", "pkg.top")


def test_the_import_check_sees_a_planted_cycle_and_an_upward_import(tmp_path) -> None:
    """The check on a small package: clean as written, then each planted import found
    (inside a function, under TYPE_CHECKING, relative), and nothing else."""
    clean = _write(tmp_path / "clean", CLEAN)
    graph = import_graph(clean)
    assert graph["pkg.top.app"] == {"pkg.util", "pkg.core"}
    assert cycles(graph) == [] and upward(graph, SYNTHETIC_LAYERS) == []

    planted = dict(CLEAN)
    planted["pkg/core.py"] = (
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.util import g\n"
        "def f():\n    from .top import app\n    return 1\n"
    )
    graph = import_graph(_write(tmp_path / "planted", planted))
    assert cycles(graph) == [["pkg.core", "pkg.top.app", "pkg.util"]]
    assert upward(graph, SYNTHETIC_LAYERS) == ["pkg.core -> pkg.top.app"]

    for i, dynamic in enumerate(
        (
            "import importlib\nimportlib.import_module('pkg.top.app')\n",
            "from importlib import import_module\nimport_module('pkg.top.app')\n",
            "from importlib import import_module\nimport_module('.top.app', 'pkg')\n",
            "__import__('pkg.top.app')\n",
        )
    ):
        graph = import_graph(_write(tmp_path / f"upward{i}", dict(CLEAN, **{"pkg/util.py": dynamic})))
        assert upward(graph, SYNTHETIC_LAYERS) == ["pkg.util -> pkg.top.app"], dynamic
        assert cycles(graph) == [["pkg.top.app", "pkg.util"]], dynamic


def test_the_distribution_installs_one_top_level_package() -> None:
    """``pip install isp-comm`` put a top-level ``models`` package (the reference llama)
    beside ``isp_comm``: a user's own ``models`` package, which most training projects
    have, then shadowed it or was shadowed, and ``isp-train`` failed to import its
    model. Everything installed lives under ``isp_comm``."""
    import tomllib

    from setuptools import find_packages

    pyproject = tomllib.loads((ROOT.parent / "pyproject.toml").read_text())
    include = pyproject["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = find_packages(where=str(ROOT.parent), include=include)
    assert packages and {name.split(".")[0] for name in packages} == {"isp_comm"}, packages
    assert "isp_comm.models" in packages
