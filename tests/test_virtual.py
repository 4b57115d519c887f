"""A virtual world: one process as rank R of an N-rank job on torch's fake process
group, with collectives that take their modelled time (isp_comm/backends/virtual.py)."""

from __future__ import annotations

import math
import time

import pytest
import torch

from isp_comm import ISPCommunicator, ISPConfig, ParallelGroups
from isp_comm.backends.virtual import FlatLink
from isp_comm.models.llama import LlamaConfig, build
from isp_comm.testing import run_virtual
from isp_comm.virtual import virtual_backend

BW = 1e8  # bytes/s: a 4 MiB all-gather over 4 ranks takes 31 ms, long beside the host's noise
RING = {  # a ring over 4 ranks: each rank sends 3/4 of the buffer, twice for an all-reduce
    "all_gather": 3 / 4,
    "reduce_scatter": 3 / 4,
    "all_reduce": 2 * 3 / 4,
    "all_to_all": 3 / 4,
}
SLACK_S = 0.030
"""How much later than its modelled time a CPU collective may end: the comm thread's
wake-up and the copy of a few MiB, on a 2-core machine shared with other jobs."""


def _timed(handle_of) -> float:
    t0 = time.perf_counter()
    handle_of().wait(10.0)
    return time.perf_counter() - t0


def _collectives(rank: int, world: int) -> dict:
    backend = virtual_backend(torch.device("cpu"), FlatLink(BW))
    groups = ParallelGroups.create(wp_size=4)
    g, n = groups.wp_group, groups.wp_size
    inp = torch.randn(2**18)  # 1 MiB
    out = torch.full((n * inp.numel(),), float("nan"))
    full = out.numel() * 4
    numbered, copy = torch.arange(out.numel(), dtype=torch.float32), torch.zeros_like(out)
    got = {"wp_rank": groups.wp_rank, "modelled": {}, "measured": {}}
    cases = {
        "all_gather": lambda: backend.all_gather(out, inp, g),
        "reduce_scatter": lambda: backend.reduce_scatter(inp, numbered, g),
        "all_reduce": lambda: backend.all_reduce(out, g),
        "all_to_all": lambda: backend.all_to_all(out, copy, g),
    }
    for op, issue in cases.items():
        got["modelled"][op] = RING[op] * full / BW  # every op here moves a 4 MiB buffer
        got["measured"][op] = _timed(issue)
        got[f"{op}_finite"] = bool(torch.isfinite(out).all())
    got["rs_out"] = inp[:4].tolist()  # reduce-scatter wrote this rank's chunk into inp
    t0 = time.perf_counter()  # two issued at once on one link: the second ends after both
    backend.all_gather(out, inp, g)
    backend.all_gather(out, inp, g).wait(10.0)
    got["two_in_a_row"] = time.perf_counter() - t0
    ag = torch.empty(n * 3)
    backend.all_gather(ag, torch.tensor([1.0, 2.0, 3.0]), g).wait(10.0)
    got["ag"] = ag.tolist()
    with torch.inference_mode():  # an evaluation's tensors: the comm thread writes them in place too
        ag_inf, ar_inf = torch.empty(n * 3), torch.ones(3)
        backend.all_gather(ag_inf, torch.tensor([1.0, 2.0, 3.0]), g).wait(10.0)
        backend.all_reduce(ar_inf, g).wait(10.0)
    got["inference"] = ag_inf.tolist() + ar_inf.tolist()
    got["comm_s"] = backend.modelled_comm_s
    backend.close()
    return got


@pytest.mark.serial  # ends timed within 30 ms
@pytest.mark.timeout(120)
def test_each_collective_takes_its_modelled_time_and_writes_local_bytes() -> None:
    got = run_virtual(_collectives, 8, 5, timeout_s=100)
    assert got["wp_rank"] == 1  # rank 5 of wp groups of 4: [4, 5, 6, 7]
    for op, modelled in got["modelled"].items():
        assert modelled <= got["measured"][op] <= modelled + SLACK_S, (op, modelled, got["measured"][op])
        assert got[f"{op}_finite"], op
    ag = got["modelled"]["all_gather"]
    assert ag == pytest.approx(3 / 4 * 4 * 2**20 / 1e8)  # 31.5 ms: the hand figure the collectives are held to
    assert 2 * ag <= got["two_in_a_row"] <= 2 * ag + SLACK_S
    # this rank's own bytes only, as if every peer held the same: its input in every
    # chunk, 4 x its own chunk of a reduce-scatter
    assert got["ag"] == [1.0, 2.0, 3.0] * 4
    assert got["inference"] == [1.0, 2.0, 3.0] * 4 + [4.0] * 3
    chunk = 2**18  # out has 4 x 2**18 elements: wp rank 1's chunk starts at 2**18
    assert got["rs_out"] == [4.0 * (chunk + i) for i in range(4)]
    total = sum(got["modelled"].values()) + 2 * ag + 2 * 3 / 4 * 48 / BW  # and the five after
    total += 2 * 3 / 4 * 12 / BW  # the inference mode's all-reduce
    assert got["comm_s"] == pytest.approx(total, rel=1e-3)


def _lanes(rank: int, world: int) -> dict:
    """The CUDA path's code (a lane per backend, the bytes written on it) on the host,
    through the runtime seam (see [Note: one runtime seam])."""
    from isp_comm.backends.streams import HostRuntime
    from isp_comm.backends.virtual import VirtualBackend

    backend = VirtualBackend(torch.device("cpu"), FlatLink(BW), runtime=HostRuntime())
    g = ParallelGroups.create(wp_size=4).wp_group
    ag, rs, ar = torch.empty(12), torch.empty(2), torch.tensor([1.5, -2.0])
    handles = [
        backend.all_gather(ag, torch.tensor([1.0, 2.0, 3.0]), g),
        backend.reduce_scatter(rs, torch.arange(8.0), g),
        backend.all_reduce(ar, g),
    ]
    for h in handles:
        h.wait(1.0)
    return {"ag": ag.tolist(), "rs": rs.tolist(), "ar": ar.tolist(), "done": all(h.is_completed() for h in handles)}


@pytest.mark.timeout(60)
def test_the_cuda_path_writes_the_same_bytes_through_the_runtime_seam() -> None:
    got = run_virtual(_lanes, 8, 6, timeout_s=50)  # rank 6: wp rank 2 of [4, 5, 6, 7]
    assert got == {"ag": [1.0, 2.0, 3.0] * 4, "rs": [16.0, 20.0], "ar": [6.0, -8.0], "done": True}


def _train(rank: int, world: int, wp: int, sp: int, gbps: float, steps: int, outer: bool) -> dict:
    cfg = LlamaConfig(vocab_size=40, hidden=32, ffn_hidden=48, n_layers=3, n_heads=4, n_kv_heads=2, max_seq_len=16)
    model = build(cfg, seed=0)
    groups = ParallelGroups.create(wp_size=wp, sp_size=sp)
    backend = virtual_backend(torch.device("cpu"), FlatLink(gbps * 1e9))
    icfg = ISPConfig(activation_checkpointing=0.5, shard_outer_params=outer, vocab_parallel=outer)
    comm = ISPCommunicator(model, groups, icfg, backend=backend)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(rank)
    losses, norms = [], []
    for _ in range(steps):
        tokens = torch.randint(0, 40, (2, 16 // sp + 1), generator=gen)
        loss = comm.cross_entropy(model(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        norms.append(float(comm.clip_grad_norm_(1.0)))
        opt.step()
        opt.zero_grad()
        losses.append(float(comm.all_reduce(loss.detach().clone(), what="the loss")))
    objs = comm.all_gather_object({"rank": rank}, what="a test gather")
    stats = comm.stats()
    comm.close()
    return {
        "losses": losses,
        "norms": norms,
        "objs": objs,
        "stats": stats,
        "finite": all(bool(torch.isfinite(p).all()) for p in model.parameters()),
    }


@pytest.mark.timeout(150)
@pytest.mark.parametrize("wp,sp,outer", [(8, 1, True), (4, 2, False)])
def test_a_rank_of_eight_trains_without_hanging(wp: int, sp: int, outer: bool) -> None:
    """Rank 3 of 8, the WP, SP and replica groups of the real job: every collective
    (block gathers and reduce-scatters, the SP all-to-alls, the vocab-parallel head's
    gathers, written on the comm thread inside autograd functions; the clip's norm,
    the loss, an object gather) goes to the virtual backend and ends; values stay
    finite."""
    got = run_virtual(_train, 8, 3, wp, sp, 1.0, 3, outer, timeout_s=130)
    assert all(math.isfinite(x) for x in got["losses"] + got["norms"]) and got["finite"]
    assert got["objs"] == [{"rank": 3}] * 8  # this rank's own object in every place: no peer's claimed
    s = got["stats"]
    assert s["comm_s"] > 0 and s["all_gathers"] > 0 and s["reduce_scatters"] > 0
    assert s["outstanding_handles"] == 0
