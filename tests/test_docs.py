"""The docs say what the code has: every isp-train flag in docs/cli.md's table, every
ISPConfig field in docs/api.md's, every file of isp_comm/ in docs/architecture.md's
layout (and nothing that is not there), and every link between the pages lands."""

from __future__ import annotations

import argparse
import dataclasses
import re
import tomllib
from collections.abc import Callable
from pathlib import Path

from isp_comm.config import ISPConfig
from isp_comm.train.config import TrainConfig

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]


def table_names(page: Path, heading: str) -> list[str]:
    """The names in the first column of the first table under ``heading``, split on
    commas: ``| `--wp`, `--sp` | ...`` gives ``["--wp", "--sp"]``."""
    lines = page.read_text().split(heading, 1)[1].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    rows = lines[start + 2 : end]  # past the header and its rule
    return [name for row in rows for name in re.findall(r"`([^`]+)`", row.split("|")[1])]


def test_cli_flag_table_is_train_config() -> None:
    flags = table_names(DOCS / "cli.md", "## Flags")
    fields = {"--" + f.name.replace("_", "-") for f in dataclasses.fields(TrainConfig)} | {"--config"}
    assert len(flags) == len(set(flags)), "a flag twice in the table"
    assert set(flags) == fields, f"missing: {sorted(fields - set(flags))}; not flags: {sorted(set(flags) - fields)}"


def test_isp_config_table_is_isp_config() -> None:
    names = table_names(DOCS / "api.md", "## Configuration")
    fields = {f.name for f in dataclasses.fields(ISPConfig)}
    assert set(names) == fields, f"missing: {sorted(fields - set(names))}; not fields: {sorted(set(names) - fields)}"


def layout_files() -> set[str]:
    """The paths under isp_comm/ that docs/architecture.md's layout block names."""
    block = (DOCS / "architecture.md").read_text().split("```")[1]
    named, folders = set(), ["", ""]  # the folder at indent 2, and the one inside it at indent 4
    for line in block.splitlines():
        m = re.match(r"^( *)(\S+)", line)
        if not m or len(m.group(1)) > 6:  # continuation lines are indented further
            continue
        indent, name = len(m.group(1)), m.group(2)
        if indent not in (2, 4, 6) or not name.endswith(("/", ".py")):
            continue
        depth = indent // 2 - 1  # 0, 1 or 2 folders above the name
        if name.endswith("/"):  # a folder: the ones it is in stay, any deeper one ends
            folders[depth:] = [name, ""][: 2 - depth]
        else:  # a file: the folders at its depth and below end
            folders[depth:] = ["", ""][: 2 - depth]
            named.add("".join(folders[:depth]) + name)
    return named


def test_architecture_layout_names_every_file() -> None:
    """Every module is named, and every sub-package's ``__init__.py`` that defines a
    function or class (one that only gathers names may be); nothing named is missing."""
    files = {str(p.relative_to(ROOT / "isp_comm")) for p in (ROOT / "isp_comm").rglob("*.py")}
    defines = re.compile(r"^(def|class) ", re.M)
    inits = {f for f in files if f.endswith("/__init__.py")}
    required = files - {f for f in inits if not defines.search((ROOT / "isp_comm" / f).read_text())}
    named = layout_files()
    assert required <= named <= files, (
        f"not in the layout: {sorted(required - named)}; no such file: {sorted(named - files)}"
    )


def test_architecture_layers_are_the_layout_rules() -> None:
    """The layers docs/architecture.md draws (top first) are the ones
    tests/test_layout_rules.py checks (bottom first)."""
    from tests.test_layout_rules import LAYERS, TOP

    block = (DOCS / "architecture.md").read_text().split("## Layers", 1)[1].split("```")[1]
    rows = [re.split(r"\s{3,}", line)[0].split() for line in block.strip().splitlines()]
    top, *drawn = rows
    as_module = {"isp_comm/": "isp_comm", "isp_comm/__init__.py": "isp_comm.__init__"}
    names = [as_module.get(row[0], row[0].rstrip("/").replace("/", ".")) for row in drawn]
    assert {name.rstrip("/") for name in top} == TOP
    assert names[::-1] == list(LAYERS)


def test_train_listing_is_in_import_order() -> None:
    """docs/architecture.md lists train/'s modules so that each imports only ones
    listed before it (the order a reader can take them in)."""
    from tests.test_layout_rules import import_graph

    block = (DOCS / "architecture.md").read_text().split("  train/ ", 1)[1].split("\nexamples/", 1)[0]
    order, folder, gathers = [], "", None  # a folder's __init__ (it gathers its modules) counts after them
    for indent, name, kind in re.findall(r"^( {4}| {6})(\w+)(\.py|/)", block, flags=re.M):
        if len(indent) == 4 and gathers:
            order.append(gathers)
            gathers = None
        if len(indent) == 4:
            folder = f"{name}." if kind == "/" else ""
            if kind == ".py":
                order.append(f"isp_comm.train.{name}")
        elif name == "__init__":
            gathers = f"isp_comm.train.{folder}__init__"
        else:
            order.append(f"isp_comm.train.{folder}{name}")
    order += [gathers] if gathers else []
    graph = import_graph(ROOT / "isp_comm")
    position = {m: i for i, m in enumerate(order)}
    late = [f"{m} -> {t}" for m in order for t in sorted(graph[m]) if position.get(t, -1) > position[m]]
    assert len(order) > 20 and not late, f"imports of modules listed later: {late}"


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_links_between_pages_land() -> None:
    """Every relative link to a file of the repository names one that exists (the docs
    written alongside, reliability.md and data.md, once they exist), and every
    ``#anchor`` a heading of its page."""
    bad = []
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if target.startswith(("http://", "https://")):
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists():
                if file.suffix != ".md" or file.parent != DOCS:
                    bad.append(f"{page.name}: {target} (no such file)")
                continue
            if anchor:
                headings = re.findall(r"^#+ (.+)$", file.read_text(), flags=re.M)
                if anchor not in {slug(h) for h in headings}:
                    bad.append(f"{page.name}: {target} (no such heading)")
    assert not bad, "\n".join(bad)


PLACEHOLDERS = {  # the README's placeholders, and a sample value each parses with
    "N": "2",
    "K": "2",
    "R": "8",
    "S": "60",
    "FILE": "corpus.txt",
    "DIR": "folder",
    "RUN": "runs/isp-train",
    "TRACE": "runs/isp-train/trace.json",
    "PNG": "timeline.png",
}
GENERIC = {"[FLAGS]"}  # stands for any flags: nothing to parse


def command_parsers() -> dict[str, Callable[[], argparse.ArgumentParser]]:
    """Each console script's parser, by the name pyproject.toml installs it under."""
    from isp_comm import cli
    from isp_comm.train import config, export, store, timeline

    parsers = {
        "isp-train": config.parser,
        "isp-prepare-data": store.parser,
        "isp-export": export.parser,
        "isp-timeline": timeline.parser,
        "isp-comm": cli.parser,
    }
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert set(parsers) == set(scripts), "a command without its parser here, or a parser of no command"
    return parsers


def command_lines(page: Path) -> list[list[str]]:
    """The command lines in the first column of every table headed ``| command |``, as
    argument lists with placeholders replaced and optional parts (``[...]``) given. A
    code span that does not start with a command adds to the one before it
    (`` `isp-train --resume` / `--overwrite` ``)."""
    lines: list[list[str]] = []
    in_table = False
    for row in page.read_text().splitlines():
        if row.startswith("| command |"):
            in_table = True
            continue
        if not row.startswith("|"):
            in_table = False
        if not in_table or row.startswith("|---"):
            continue
        for span in re.findall(r"`([^`]+)`", row.split("|")[1]):
            words = [w for w in span.split() if w not in GENERIC]
            words = [PLACEHOLDERS.get(w.strip("[]"), w.strip("[]")) for w in words]
            if words[0].startswith("isp-"):
                lines.append(words)
            else:
                lines.append([*lines[-1][:2], *words] if lines[-1][0] == "isp-comm" else [lines[-1][0], *words])
    return lines


def test_every_command_line_in_the_readme_parses(capsys) -> None:
    parsers = command_parsers()
    lines = command_lines(ROOT / "README.md")
    assert len(lines) >= 12 and {line[0] for line in lines} == set(parsers)
    bad = []
    for command, *args in lines:
        left = [a for a in args if a.isupper() and a.isalpha()]
        if left:
            bad.append(f"{command} {' '.join(args)}: placeholder(s) {left} without a sample value")
            continue
        try:
            parsers[command]().parse_args(args)
        except SystemExit as exc:  # --help leaves with 0 after printing the help
            if exc.code:
                bad.append(f"{command} {' '.join(args)}: {capsys.readouterr().err.strip()}")
    assert not bad, "\n".join(bad)


def test_the_command_line_check_sees_a_line_that_does_not_parse(tmp_path, capsys) -> None:
    page = tmp_path / "README.md"
    page.write_text("| command | what |\n|---|---|\n| `isp-prepare-data --tokenizer DIR` | no data |\n")
    ((command, *args),) = command_lines(page)
    try:
        command_parsers()[command]().parse_args(args)
    except SystemExit:
        assert "DATA" in capsys.readouterr().err
    else:
        raise AssertionError("parsed without the data")


DEVELOPMENT_REFERENCE = re.compile(r"\b(?:issues?|PRs?|pull requests?|tickets?)\s*#?\d+|(?<![\w&/])#\d+\b", re.I)
"""A development issue or pull request by number ("issue 48", "issues 47 and 48",
"PR 12", "#47"): a reader of the docs cannot look one up."""


def development_references(text: str) -> list[str]:
    """The references to development issues in a page's prose: code blocks (fenced,
    also inside lists) and code spans are left out, as program output numbers its own
    things there ("collective #19")."""
    prose = re.sub(r"^[ \t]*```.*?^[ \t]*```", "", text, flags=re.M | re.S)
    prose = re.sub(r"`[^`\n]*`", "", prose)
    return [m.group(0) for m in DEVELOPMENT_REFERENCE.finditer(prose)]


def test_docs_name_no_development_issue() -> None:
    """The README and docs say what was measured and when, not which issue asked."""
    found = [f"{page.name}: {ref!r}" for page in PAGES for ref in development_references(page.read_text())]
    assert not found, "\n".join(found)


def test_the_issue_check_sees_a_reference() -> None:
    text = "Measured for issue 48 (and #47).\n\n```\ncollective #19\n```\n`#3` in code, and issues 5 and 6.\n"
    assert development_references(text) == ["issue 48", "#47", "issues 5"]
    assert development_references("the section's [anchor](#one-h100) and A&#38;B") == []
