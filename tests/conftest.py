"""Suite-wide checks."""

from __future__ import annotations

import os

import pytest


def _segments() -> set[str]:
    try:
        return {n for n in os.listdir("/dev/shm") if n.startswith("isp_")}
    except FileNotFoundError:
        return set()


@pytest.fixture(autouse=True)
def no_leaked_shared_memory():
    """A test that leaves an isp-comm segment in /dev/shm fails."""
    before = _segments()
    yield
    left = _segments() - before
    assert not left, f"shared-memory segments left behind: {sorted(left)}"
