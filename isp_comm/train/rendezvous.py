"""A look at ``--rdzv-endpoint`` before the elastic agent meets there.

torch's rendezvous asks the store at the endpoint to answer its handshake and waits
for the answer in C++ with no timeout that holds: a port held by a process that
accepts connections and never answers (another program, a stuck earlier run) kept
the launcher waiting for as long as that process lived, deaf to Ctrl-C (its main
thread never came back to Python), and it ended in C++ stack frames. The launcher
therefore asks first, with torch's own client, in a thread it waits for at most
``ANSWER_S``.
"""

from __future__ import annotations

import socket
import threading
from datetime import timedelta

CONNECT_S = 3.0
"""Seconds a plain TCP connect may take: refused or unreachable, nothing is asked
(the agent hosts the store itself, or waits for the machine that hosts it)."""

ANSWER_S = 15.0
"""Seconds a store that accepted the connection has to answer torch's handshake: a
real one answers in milliseconds, also on a loaded machine."""


def endpoint_address(endpoint: str) -> tuple[str, int]:
    """The host and port torch's c10d rendezvous meets at: its own parser and default
    port (29400), so ``[::1]:7`` and ``host`` (no port) read as torch reads them."""
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import DEFAULT_PORT
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    return parse_rendezvous_endpoint(endpoint, default_port=DEFAULT_PORT)


def store_is_silent(endpoint: str, connect_s: float = CONNECT_S, answer_s: float = ANSWER_S) -> bool:
    """Whether something at ``endpoint`` accepts TCP connections but gives torch's
    TCPStore client no answer within ``answer_s``. False for anything else (nothing
    there, a host not up, a name that does not resolve, a store that answers, or one
    that fails the handshake at once): the rendezvous then goes as torch decides and
    reports. The client runs in a daemon thread, so a Ctrl-C (``launch.Stopping``)
    still reaches the caller while it waits; one that never returns ends with the
    process."""
    import torch.distributed as dist

    try:
        host, port = endpoint_address(endpoint)
    except ValueError:  # torch's launch says so itself
        return False
    if port == 0:  # "any free port": nothing to meet there yet
        return False
    try:
        with socket.create_connection((host, port), timeout=connect_s):
            pass
    except OSError:
        return False
    done = threading.Event()

    def ask() -> None:
        try:  # its own timeout longer than the wait: the wait decides, whether or not it holds
            dist.TCPStore(host, port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=2 * answer_s))
        except Exception:  # an answer, though not a store's: torch's rendezvous reports it
            pass
        done.set()

    threading.Thread(target=ask, name="isp-train-rdzv-probe", daemon=True).start()
    return not done.wait(answer_s)


def silent_store_failure(endpoint: str, answer_s: float = ANSWER_S) -> str:
    """Why the launch stopped, for :func:`store_is_silent`'s endpoint."""
    return (
        f"the rendezvous store at --rdzv-endpoint {endpoint} did not answer within {answer_s:.0f} s: something holds "
        "that port and accepts connections but does not answer as a rendezvous store (another program, or a stuck "
        "earlier run); choose a free port"
    )
