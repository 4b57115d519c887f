"""isp-train: the main job (a reference llama trained with ISP under torchrun).

Imports nothing heavy: its entry point (:func:`main`) sets the signals before torch loads."""

from __future__ import annotations


def main(argv: list[str] | None = None) -> None:
    """``isp-train``: quiet signals first (torch's import takes seconds), then the run."""
    from isp_comm.processes import leave_on_signals
    from isp_comm.train.survive import restart_refused, said_before_handlers

    # until the run's own handlers (launch.Stopping, signals.Signals); one line says why it stops
    leave_on_signals(said=said_before_handlers(argv))
    restart_refused()  # before torch's import: [Note: no restart for a mistake]
    from isp_comm.train.__main__ import main as run

    run(argv)
