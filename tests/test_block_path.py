"""How one block's path moves between the engine's files: a block's forward (the
engine's ``block_forward``: wait for its gather, swap in, compute, reshard) moves
between engine.py, block_state.py and units.py and comes back to a file it left at
most 3 times (see [Note: who swaps a block] in isp_comm/hooks/block_state.py).

The path is traced with ``sys.setprofile`` over one middle block's forward at world 1
and 2, with grad (training) and without (evaluation). A move is a call from one of the
three files into another of them; it returns when its file was on the path already.
Calls made while prefetching the next block belong to that block's path, not this
one's, and calls through other files (autograd.py, layout.py, casting.py, torch) are
not moves between these three. Consecutive moves into one file are one visit. Before
the state owned every swap-out, the engine swapped the block out itself before
resharding it: 4 returns with grad, as issue 50 counted them; now 2.
"""

from __future__ import annotations

import sys

import pytest
import torch

from isp_comm import ISPCommunicator, ISPConfig, ParallelGroups
from isp_comm.testing import run_ranks
from tests.parity import Case

FILES = ("isp_comm/hooks/engine.py", "isp_comm/hooks/block_state.py", "isp_comm/units.py")
MAX_RETURNS = 3


def _file(code) -> str | None:
    return next((f for f in FILES if code.co_filename.replace("\\", "/").endswith(f)), None)


class PathTrace:
    """The moves of block ``index``'s ``block_forward``, from its call to its return."""

    def __init__(self, index: int) -> None:
        self.index, self.frame, self.in_prefetch = index, None, 0
        self.moves: list[tuple[str, str, str]] = []  # (from file, to file, function)

    def __call__(self, frame, event: str, _arg) -> None:
        code = frame.f_code
        if self.frame is None:  # not started: wait for the block's forward
            if event == "call" and code.co_name == "block_forward" and frame.f_locals["unit"].index == self.index:
                self.frame = frame
            return
        if code.co_name == "prefetch" and _file(code) == FILES[0]:
            self.in_prefetch += {"call": 1, "return": -1}.get(event, 0)
            return
        if event == "return" and frame is self.frame:
            sys.setprofile(None)
            return
        if event != "call" or self.in_prefetch or frame.f_back is None:
            return
        callee, caller = _file(code), _file(frame.f_back.f_code)
        if callee and caller and callee != caller:
            self.moves.append((caller, callee, code.co_name))

    def visits(self) -> list[str]:
        """The files the moves enter, in order, consecutive moves into one file as one
        visit (block_state.py's swap-in asking units.py for three things is one)."""
        files: list[str] = []
        for _, callee, _ in self.moves:
            if not files or files[-1] != callee:
                files.append(callee)
        return files

    def returns(self) -> int:
        """Visits to a file the path had been in already (it starts in engine.py)."""
        seen, back = {FILES[0]}, 0
        for f in self.visits():
            back += f in seen
            seen.add(f)
        return back


def _path_worker(rank: int, world: int) -> dict[bool, tuple[int, list]]:
    torch.manual_seed(0)
    model = Case().build()
    comm = ISPCommunicator(model, ParallelGroups.create(wp_size=world, sp_size=1), ISPConfig())
    x = torch.randint(0, 16, (2, 7))
    out = {}
    try:
        for grad in (True, False):
            with torch.set_grad_enabled(grad):
                model(x)  # a first forward: every lazy setup done
                trace = PathTrace(index=1)
                sys.setprofile(trace)
                try:
                    loss = model(x).float().sum()
                finally:
                    sys.setprofile(None)
                if grad:
                    loss.backward()
            out[grad] = (trace.returns(), trace.moves)
    finally:
        comm.close()
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [1, 2])
def test_a_blocks_forward_returns_to_a_file_it_left_at_most_3_times(world: int) -> None:
    for grad, (returns, moves) in run_ranks(_path_worker, world, timeout_s=100)[0].items():
        path = " ".join(f"{callee.rsplit('/', 1)[1]}:{fn}" for _, callee, fn in moves)
        assert moves, "the trace saw no move between the files"
        assert returns <= MAX_RETURNS, f"grad={grad}: {returns} returns: {path}"


def test_the_count_sees_a_path_that_wanders() -> None:
    """The moves traced (world 2, with grad) before the state owned every swap-out:
    the engine refreshed the unit itself, then swapped the block out before resharding
    it: 4 returns. The same trace now: 2 (block_state.py, units.py, block_state.py,
    units.py)."""
    e, b, u = FILES
    before = PathTrace(index=1)
    before.moves = [
        (e, u, "refresh_trainable"), (e, b, "wait_for_unshard"), (e, b, "swap_in"), (b, u, "requires_grad"),
        (b, u, "anchor"), (b, u, "swap_in"), (e, b, "swap_out"), (b, u, "swap_out"), (e, b, "reshard"),
    ]  # fmt: skip
    assert before.visits() == [u, b, u, b, u, b] and before.returns() == 4
    now = PathTrace(index=1)
    now.moves = [(e, b, "wait_for_unshard"), (e, b, "begin_forward"), (b, u, "swap_in"), (e, b, "reshard")]
    now.moves.append((b, u, "swap_out"))
    assert now.returns() == 2
