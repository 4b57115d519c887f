"""isp_comm.testing.run_ranks: how its ranks start (see [Note: how ranks start])."""

from __future__ import annotations

import os

import pytest

from isp_comm.testing import run_ranks

VAR = "ISP_COMM_TEST_RUN_RANKS_VAR"


def _seen(rank: int, world: int) -> str | None:
    return os.environ.get(VAR)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("start", ["forkserver", "spawn"])
def test_ranks_see_the_environment_of_the_moment_they_start(start: str, monkeypatch) -> None:
    # the forkserver started earlier in the session (or now) with another environment:
    # a forked rank must still see what the caller set just before
    run_ranks(_seen, 2, start=start)
    for value in ("one", "two"):
        monkeypatch.setenv(VAR, value)
        assert run_ranks(_seen, 2, start=start) == [value, value]
    monkeypatch.delenv(VAR)
    assert run_ranks(_seen, 2, start=start) == [None, None]


def test_an_unknown_start_method_is_one_line(monkeypatch) -> None:
    monkeypatch.setenv("ISP_COMM_RANKS_START", "fork")
    with pytest.raises(ValueError, match=r"start 'fork' is not one of \('spawn', 'forkserver'\)"):
        run_ranks(_seen, 2)
