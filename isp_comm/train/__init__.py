"""isp-train: the main job (a reference llama trained with ISP under torchrun).

Imports nothing heavy: its entry point (:func:`main`) sets the signals before torch loads."""

from __future__ import annotations


def main(argv: list[str] | None = None) -> None:
    """``isp-train``: quiet signals first (torch's import takes seconds), then the run."""
    from isp_comm.train.signals import quiet_until_handled

    quiet_until_handled()
    from isp_comm.train.__main__ import main as run

    run(argv)
