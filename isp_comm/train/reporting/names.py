"""``--report-to``: which trackers a run reports to, checked before any rank starts.

The names follow the Hugging Face Trainer's ``report_to``: ``none`` (the default),
``tensorboard``, ``wandb``, or a comma list of them. Each tracker is an optional
package; a missing one is a ``ValueError`` of one line naming the package, raised while
the flags are checked, so that the run stops before it starts instead of at its first
logged step.
"""

from __future__ import annotations

import importlib
import importlib.util

PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb"}
"""Each tracker, and the package that must be installed for it (``torch.utils.tensorboard``
writes event files only with the ``tensorboard`` package installed)."""


def missing_package(name: str, exc: ImportError | None = None) -> str:
    """The one line for a tracker whose package is not installed, or is installed but
    fails to import (``exc``, quoted: installing it again would not help)."""
    package = PACKAGES[name]
    if exc is not None and importlib.util.find_spec(package) is not None:
        return (
            f"--report-to {name}: the {package} package is installed but fails to import: {type(exc).__name__}: {exc}"
        )
    return (
        f"--report-to {name}: the {package} package is not installed "
        f"(pip install {package}, or pip install 'isp-comm[{package}]')"
    )


def check_imports(names: tuple[str, ...]) -> None:
    """Import each tracker's package: a ``ValueError`` of one line for one that fails.
    The launcher calls it before any rank starts (``parse_report_to`` only looks for the
    packages: importing W&B takes a second, in every process that parses the flags)."""
    for name in names:
        try:
            importlib.import_module("torch.utils.tensorboard" if name == "tensorboard" else PACKAGES[name])
        except ImportError as exc:
            raise ValueError(missing_package(name, exc)) from None


def parse_report_to(value: str) -> tuple[str, ...]:
    """The trackers that ``value`` names, in order, each once: ``()`` for ``none``.
    A ``ValueError`` of one line for an empty list, an unknown name, ``none`` beside
    another name, or a tracker whose package is not installed."""
    names = [n.strip().lower() for n in value.split(",")]
    if not all(names):
        raise ValueError(f"--report-to {value!r}: give none, tensorboard, wandb, or a comma list of them")
    unknown = [n for n in names if n != "none" and n not in PACKAGES]
    if unknown:
        raise ValueError(f"--report-to: unknown {unknown[0]!r}; give none, tensorboard, wandb, or a comma list of them")
    if "none" in names:
        if len(set(names)) > 1:
            raise ValueError(f"--report-to {value}: none reports nowhere; drop it, or drop the others")
        return ()
    chosen = tuple(dict.fromkeys(names))
    for name in chosen:
        if importlib.util.find_spec(PACKAGES[name]) is None:
            raise ValueError(missing_package(name))
    return chosen
