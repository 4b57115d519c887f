"""A hang names its rank: the flight record of every rank's last collectives, the
heartbeat that leaves each rank's position in the c10d store, the diagnosis the
surviving ranks make when a wait passes its deadline, and the CUDA watchdog.

- :mod:`~isp_comm.flight.record`: the last K collectives of one rank (hot path).
- :mod:`~isp_comm.flight.heartbeat`: a thread publishing the rank's position to the
  store, answering diagnosis requests and ``isp-comm doctor --live``.
- :mod:`~isp_comm.flight.diagnosis`: who is not responding, behind or out of step;
  printed once, written to ``hang.json`` and ``hang.txt``.
- :mod:`~isp_comm.flight.watchdog`: on CUDA, where the host never waits, the poller
  of completion events that starts the diagnosis.
"""

from isp_comm.flight.record import Entry, FlightRecord

__all__ = ["Entry", "FlightRecord"]
