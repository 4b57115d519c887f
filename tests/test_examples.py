"""The examples the README and docs/ show are files in examples/, and each runs as written.

Every ```python block of README.md and docs/*.md is the whole text of the file in
examples/ that the paragraph above the block links to (its last link), so the page
and the file cannot drift apart. Each example runs here as its first line says: under torchrun at world 2
on CPU (``--standalone``, which takes a free port), or as a plain script, in a fresh
folder, one thread per rank, with a deadline.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\((?:\.\./)?(examples/[\w.]+\.py)\)")
COMMAND = re.compile(r"(torchrun --standalone --nproc-per-node 2|python) (examples/[\w.]+\.py)")


def paragraph_above(lines: list[str], i: int) -> str:
    """The paragraph that ends just above line ``i`` (blank lines between skipped)."""
    j = i - 1
    while j >= 0 and not lines[j].strip():
        j -= 1
    start = j
    while start > 0 and lines[start - 1].strip():
        start -= 1
    return " ".join(lines[start : j + 1])


def python_blocks(page: Path) -> list[tuple[int, str | None, str]]:
    """(line, linked example or None, code) of every ```python block of ``page``."""
    lines = page.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        if lines[i].strip() == "```python":
            links = LINK.findall(paragraph_above(lines, i))
            end = lines.index("```", i + 1)
            blocks.append((i + 1, links[-1] if links else None, "\n".join(lines[i + 1 : end]) + "\n"))
            i = end
        i += 1
    return blocks


def test_every_python_block_is_an_example_file_verbatim() -> None:
    shown: set[str] = set()
    for page in PAGES:
        for line, link, code in python_blocks(page):
            where = f"{page.relative_to(ROOT)}:{line}"
            assert link, f"{where}: a python block without a link to its examples/ file in the paragraph above"
            assert (ROOT / link).is_file(), f"{where}: {link} does not exist"
            assert code == (ROOT / link).read_text(), f"{where}: the block differs from {link}"
            shown.add(link)
    assert shown, "no page shows an example"
    unshown = [p.name for p in EXAMPLES if f"examples/{p.name}" not in shown]
    assert not unshown, f"examples no page shows: {unshown}"
    readme = [link for _, link, _ in python_blocks(ROOT / "README.md")]
    assert "examples/library.py" in readme


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_runs_as_written(path: Path, tmp_path: Path) -> None:
    first = path.read_text().splitlines()[0]
    found = COMMAND.search(first)
    assert found and found.group(2) == f"examples/{path.name}", f"{path.name}: its first line must say how it runs"
    if found.group(1) == "python":
        cmd = [sys.executable, str(path)]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(path)]
    path_env = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path_env}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"{path.name} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
