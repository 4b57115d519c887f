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


def test_a_rank_waits_for_every_rank_to_join_before_its_function_runs(tmp_path) -> None:
    """``_all_joined``: returns once ``world`` ranks have come through, and a rank left
    alone ends at its deadline saying how many joined (not waiting for ever)."""
    import threading

    import torch.distributed as dist

    from isp_comm.testing import _all_joined

    store = dist.FileStore(str(tmp_path / "store"), 2)
    with pytest.raises(TimeoutError, match="1 of 2 ranks joined"):
        _all_joined(store, 2, timeout_s=0.2)
    store2 = dist.FileStore(str(tmp_path / "store2"), 2)
    done: list[str] = []
    late = threading.Thread(target=lambda: (_all_joined(store2, 2), done.append("late")))
    late.start()
    _all_joined(store2, 2, timeout_s=10.0)
    late.join(timeout=10.0)
    assert done == ["late"]
