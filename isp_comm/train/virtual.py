"""``isp-train --virtual-world N [--virtual-rank R]``: this process trains as rank R
of an N-rank job whose collectives take their modelled time (see
[Note: what a virtual collective does] in ``isp_comm/backends/virtual.py``).

The flags' checks, the link model they pick, the run's first line and its closing
line live here; the loop (``__main__``) asks :func:`leads` where it would ask for rank
0 (the one process of a virtual world writes the run's files, whatever its rank).
"""

from __future__ import annotations

import torch

from isp_comm.backends.virtual import FlatLink, LinkModel, VirtualBackend
from isp_comm.virtual import init_virtual_world, is_virtual

NO_CHECKPOINT = "a virtual run holds one rank's shards, which are not a checkpoint of the job"
REFUSED = {
    "save_every": f"{NO_CHECKPOINT}, so it saves none; drop the flag",
    "async_save": f"{NO_CHECKPOINT}, so it saves none; drop the flag",
    "resume": "a virtual run saves no checkpoint, so there is none to continue from; drop the flag (it starts anew)",
    "init_from": (
        "a virtual run measures a rank's memory and time, which the weights do not change, and its values are "
        "not the job's (its collectives mirror this rank's data); drop the flag"
    ),
    "nproc_per_node": (
        "a virtual run is one process that plays one rank of the --virtual-world job; drop the flag, or drop "
        "--virtual-world to launch real ranks"
    ),
    "plan": (
        "--plan forecasts a job without running it, --virtual-world runs one rank of it; give one of them "
        "(--plan --target NAMExG --nodes K plans a job of that size)"
    ),
}
"""Flags a virtual run refuses, each with its reason and what to do: one rank's shards
are not a checkpoint (save, resume), its weights change nothing it measures (init),
and there is one process (no launch; --plan plans without running)."""


def check(cfg) -> None:
    """The virtual flags against the others: a ``ValueError`` of one line."""
    if not cfg.virtual_world:
        for name in ("virtual_rank", "virtual_gbps"):
            if getattr(cfg, name):
                raise ValueError(f"--{name.replace('_', '-')} needs --virtual-world N")
        return
    n, r = cfg.virtual_world, cfg.virtual_rank
    if n < 1 or not 0 <= r < n:
        raise ValueError(f"--virtual-world {n} --virtual-rank {r}: the world must be >= 1 and the rank in [0, {n})")
    for name, why in REFUSED.items():
        if getattr(cfg, name):
            raise ValueError(f"--{name.replace('_', '-')} with --virtual-world: {why}")
    if not cfg.virtual_gbps >= 0:  # 0: not given
        raise ValueError(f"--virtual-gbps must be > 0 (the bus bandwidth in GB/s), got {cfg.virtual_gbps}")
    if cfg.virtual_gbps and (cfg.target or cfg.profile):
        raise ValueError("--virtual-gbps and --target/--profile: give one link model")
    if cfg.target:
        from isp_comm.planner.targets import parse_target

        cluster = parse_target(cfg.target, cfg.nodes)
        if cluster.world != n:
            raise ValueError(
                f"--target {cfg.target} --nodes {cfg.nodes} is {cluster.world} ranks; --virtual-world is {n}: "
                "give the nodes of the job"
            )
    if not (cfg.virtual_gbps > 0 or cfg.target or cfg.profile):
        raise ValueError(
            "--virtual-world needs a link model: --virtual-gbps G (one bus bandwidth), --target NAMExG "
            "--nodes K (published figures), or --profile FILE"
        )


def link_model(cfg) -> LinkModel:
    """--virtual-gbps's flat link, or the planner's links of --target/--nodes or --profile."""
    if cfg.virtual_gbps > 0:
        return FlatLink(cfg.virtual_gbps * 1e9)
    from isp_comm.planner import profile as profiles
    from isp_comm.planner.links import ProfileLink
    from isp_comm.planner.step import backend_of
    from isp_comm.planner.targets import parse_target

    if cfg.profile:
        prof = profiles.load(cfg.profile)
    else:
        prof = profiles.from_target(parse_target(cfg.target, cfg.nodes, cfg.network_gbit))
    return ProfileLink(prof, backend_of(cfg.backend, prof))  # the backend --plan times for these flags


def start(cfg) -> None:
    """The process group: torch's fake one, as rank R of N."""
    init_virtual_world(cfg.virtual_world, cfg.virtual_rank)


def backend(cfg, device: torch.device, timeout_s: float) -> VirtualBackend | None:
    """The communicator's backend in a virtual run (``None`` otherwise)."""
    if not cfg.virtual_world:
        return None
    return VirtualBackend(device, link_model(cfg), timeout_s)


def leads(rank: int) -> bool:
    """Whether this process does rank 0's duties (the run's files, the log): rank 0,
    or the one process of a virtual world."""
    return rank == 0 or is_virtual()


def first_line(cfg, link: LinkModel) -> str:
    return (
        f"isp-train: VIRTUAL run: rank {cfg.virtual_rank} of {cfg.virtual_world}; real: this rank's shards, "
        f"gathered blocks, activations, optimizer state, compute and schedule; modelled: every collective's "
        f"time ({link.describe()}), its data (this rank's own bytes); no checkpoint; tok/s below: the whole "
        f"job's, at this machine's compute"
    )


def row(stats: dict, before: dict) -> dict:
    """A virtual step's own fields: the modelled collective time issued in the step,
    the time the step stood waiting for collectives, and how far this machine's own
    copies ran past the modelled ends (in the waits, not in the model)."""
    return {k: stats[k] - before[k] for k in ("comm_s", "exposed_comm_s", "comm_late_s")}


def summary(cfg, last: dict, link: LinkModel) -> str:
    late = last.get("comm_late_s", 0.0)
    behind = f"; this machine's copies ran {late:.3f} s past the modelled ends (its time, not the model's)"
    behind = behind if late >= 0.0005 else ""
    return (
        f"isp-train: VIRTUAL run done (rank {cfg.virtual_rank} of {cfg.virtual_world}; collectives modelled: "
        f"{link.describe()}): last step {last.get('step_s', 0):.3f} s, modelled comm {last.get('comm_s', 0):.3f} s "
        f"issued, {last.get('exposed_comm_s', 0):.3f} s exposed{behind}; no checkpoint saved"
    )
