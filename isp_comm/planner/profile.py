"""A device profile: how fast a rank computes, moves bytes and talks to its peers.

A :class:`Profile` is what the step-time model reads: GEMM and attention throughput
by size, the bandwidth of element-wise operators, the host's cost per dispatched
operator, the optimizer's, each backend's collectives (latency and bandwidth, inside a
node and across nodes, with a curve of the fraction reached by message size), and the
framework's own host cost per block and per step. It is a JSON file: built from a
known target's published figures (:func:`from_target`), or measured on this machine
(:mod:`isp_comm.planner.calibrate`) and cached per user (:func:`cached`).
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import json
import math
import os
import socket
import time
from collections.abc import Iterator
from typing import Literal

from isp_comm.memory_forecast.weights import cublas_workspace_bytes
from isp_comm.planner.targets import NCCL_CURVE_IB, NCCL_CURVE_NVLINK, Cluster
from isp_comm.processes import DIE_WITH_PARENT_ENV, usable_cores

Curve = list[list[float]]
"""Points [x, y], x ascending; read by :func:`interp` (linear in log x, flat outside)."""

COLLECTIVES = ("all_gather", "reduce_scatter", "all_to_all", "all_reduce")
CACHE_ENV = "ISP_COMM_CACHE_DIR"
"""Where calibrated profiles are cached (default: $XDG_CACHE_HOME/isp-comm, else ~/.cache/isp-comm)."""


def interp(curve: Curve, x: float) -> float:
    """``curve`` at ``x``: linear in log x between points, the end values outside."""
    if not curve:
        raise ValueError("empty curve")
    xs = [p[0] for p in curve]
    if x <= xs[0]:
        return curve[0][1]
    if x >= xs[-1]:
        return curve[-1][1]
    j = bisect.bisect_right(xs, x)
    (x0, y0), (x1, y1) = curve[j - 1], curve[j]
    w = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
    return y0 + w * (y1 - y0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Link:
    """One backend's collectives over one kind of link: time of a collective whose
    busiest link carries ``b`` bytes is ``latency_s x steps + b / (bytes_per_s x
    curve(message))``."""

    latency_s: float
    """Fixed cost per ring step (a collective over g ranks takes g - 1 steps)."""
    bytes_per_s: float
    """The link's bandwidth (per rank, one direction)."""
    curve: Curve = dataclasses.field(default_factory=lambda: [[1.0, 1.0]])
    """Fraction of ``bytes_per_s`` reached by message size (bytes over the group)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Profile:
    """Everything the step-time model knows about a device (see the module note)."""

    name: str
    """What it describes: a target (``h100x8, 8 nodes``) or ``this machine``."""
    source: str
    """Where the figures come from: published ones, or a calibration (date, machine)."""
    device: Literal["cpu", "cuda"]
    """Where parameters live (the memory forecast's device)."""
    per_node: int
    """Ranks per node."""
    nodes: int
    """Nodes."""
    memory_bytes: int
    """Memory a rank can have: the GPU's, or the host's available memory over its ranks."""
    peak_flops: dict[str, float]
    """Peak FLOP/s by precision (``bf16``, ``fp32``), for MFU."""
    gemm: dict[str, Curve]
    """GEMM FLOP/s by the GEMM's FLOPs, per precision."""
    attention: dict[str, Curve]
    """Fused attention FLOP/s by one head's FLOPs (one sequence, one query head: the
    kernel's FLOP/s depends on that problem's size, not on how many there are), per
    precision (``bf16``, ``fp32``) and direction (``bf16_bwd``, ``fp32_bwd``), and
    optionally measured at a head dim (``fp32@64``, ``fp32_bwd@64``): a narrow head
    runs at a fraction of a wide one's rate (on CPU, 16 against 64: 0.6-0.8 times)."""
    elementwise: Curve
    """Element-wise operators: bytes/s by bytes read and written."""
    op_host_s: float
    """Host time per dispatched operator (eager PyTorch)."""
    op_device_s: float
    """Smallest device time of a kernel (0 on CPU: the host runs it)."""
    optimizer_bytes_per_s: float
    """AdamW's streaming rate over its parameters, gradients and two moments."""
    optimizer_tensor_s: float
    """AdamW's fixed host cost per parameter tensor (the per-tensor loop on CPU)."""
    collectives: dict[str, dict[str, dict[str, Link]]]
    """backend -> ``intra`` / ``inter`` (node) -> collective -> its :class:`Link`."""
    default_backend: str
    """What ``--backend auto`` resolves to on this device."""
    overlap: bool
    """Whether communication runs beside compute (GPUs: own engines and stream). On
    CPU the collectives' copies take the cores the compute uses: they add up."""
    host_block_s: dict[str, float] = dataclasses.field(default_factory=dict)
    """The engine's host cost per block per micro-step (hooks, waits, bookkeeping)
    beyond the operators, by ``single`` (wp 1) / ``multi`` rank runs."""
    host_step_s: dict[str, float] = dataclasses.field(default_factory=dict)
    """The loop's host cost per optimizer step beyond what is modelled (data, clip,
    logging, the loss's read-back), by ``single`` / ``multi``."""
    compute_scale: dict[str, float] = dataclasses.field(default_factory=dict)
    """How much longer the kernels (GEMMs, attention, element-wise) take inside a step
    than alone (caches shared with every other tensor of the step, and with the other
    ranks' on a shared CPU; allocation), calibrated on runs of the calibration model,
    by ``single`` / ``multi`` (1 where not calibrated)."""
    runtime_bytes: dict[str, int] = dataclasses.field(default_factory=dict)
    """CPU: what a rank's RSS holds beyond the memory forecast and the process
    baseline (code pages of the kernels run, the data, the loop's threads), measured
    on a tiny run, by ``single`` / ``multi``."""
    transient_share: dict[str, float] = dataclasses.field(default_factory=dict)
    """CPU: what a rank's peak RSS holds beyond the forecast per byte of the step's
    transient tensors (activations, their gradients, logits): memory freed inside the
    step that the allocator keeps, and temporaries the forecast does not count;
    calibrated from two runs of the calibration model that differ only in tokens, by
    ``single`` / ``multi``."""
    cores: int = 0
    """CPU: the cores the calibrated machine gives its ranks (a plan on this machine
    with an older profile takes its own; 0: each rank has a device of its own). With
    more ranks on a node than cores, each rank computes and copies a share of the
    time: the step model takes the step ranks per core times longer (the calibration
    ran a core per rank)."""
    calibration: dict = dataclasses.field(default_factory=dict)
    """What the calibration's tiny runs measured and the model predicted for them (the
    figures behind ``host_block_s``, ``host_step_s``, ``runtime_bytes`` and
    ``transient_share``)."""
    cuda: dict[str, int] = dataclasses.field(default_factory=dict)
    """CUDA: modelled parts outside the forecast's tensors: ``context`` (the CUDA
    context), ``workspace`` (cuBLAS), ``nccl_per_communicator`` (NCCL's buffers)."""
    noise: dict = dataclasses.field(default_factory=dict)
    """A calibration's: how much its measurements disagreed with themselves
    (``probe_spread``, ``run_spread``, ``repeat_spread``), the ``limit``, whether it is
    ``steady`` (all within it; only a steady one is cached) and the ``attempt`` it took
    (see [Note: a calibration's noise] in ``isp_comm/planner/calibrate.py``); empty
    for a target's published figures."""

    @property
    def world(self) -> int:
        return self.per_node * self.nodes

    def attention_rate(self, low: bool, backward: bool, head_flops: float, head_dim: int) -> float:
        """Fused attention FLOP/s for one head's ``head_flops`` at ``head_dim``: between
        the curves of the two nearest measured head dims (linear in log dim), the
        nearest one outside them, the dim-less curve where none was measured."""
        key = ("bf16" if low else "fp32") + ("_bwd" if backward else "")
        dims = sorted(int(k.split("@")[1]) for k in self.attention if k.startswith(key + "@"))
        if not dims and key not in self.attention and backward:  # no backward measured: the forward's rate
            return self.attention_rate(low, False, head_flops, head_dim)
        if not dims:
            return interp(self.attention[key], head_flops)
        lo = max((d for d in dims if d <= head_dim), default=dims[0])
        hi = min((d for d in dims if d >= head_dim), default=dims[-1])
        r_lo, r_hi = (interp(self.attention[f"{key}@{d}"], head_flops) for d in (lo, hi))
        w = math.log(head_dim / lo) / math.log(hi / lo) if hi > lo else 0.0
        return r_lo + w * (r_hi - r_lo)

    def link(self, backend: str, group: int, op: str) -> Link:
        """The link a collective over ``group`` ranks runs on (groups are contiguous
        ranks: one inside a node while it fits in one)."""
        links = self.collectives.get(backend) or self.collectives[self.default_backend]
        scope = "intra" if group <= self.per_node or "inter" not in links else "inter"
        return links[scope][op]

    def save(self, path: str) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path + ".tmp", "w") as f:
            json.dump(dataclasses.asdict(self), f, indent=1)
        os.replace(path + ".tmp", path)


def load(path: str) -> Profile:
    """A profile file (what :meth:`Profile.save` and bench/calibrate.py write), or a
    ``ValueError`` naming the file."""
    try:
        with open(path) as f:
            raw = json.load(f)
        raw["collectives"] = {
            b: {s: {op: Link(**v) for op, v in ops.items()} for s, ops in scopes.items()}
            for b, scopes in raw["collectives"].items()
        }
        return Profile(**raw)
    except OSError as exc:
        raise ValueError(f"--profile {path}: {exc.strerror or exc}") from exc
    except (json.JSONDecodeError, TypeError, KeyError) as exc:
        raise ValueError(f"--profile {path}: not a profile file ({type(exc).__name__}: {exc})") from exc


def from_target(cluster: Cluster) -> Profile:
    """A profile from a target's published figures (no measurement)."""
    t = cluster.target
    peak = {"bf16": t.peak_bf16_flops, "fp32": t.peak_fp32_flops}

    def ramp(rate: float, half: float) -> Curve:
        # throughput by work: small calls are bound by launch and tile occupancy;
        # ``half``: the FLOPs at which half the rate is reached (assumed)
        return [[half * 2.0**k, rate * (2.0**k / (1.0 + 2.0**k))] for k in range(-6, 9)]

    gemm = {p: ramp(r * t.gemm_efficiency, 2e9 if t.device == "cuda" else 1e6) for p, r in peak.items()}
    # attention by one head's FLOPs: half the rate at a head of 1.3e8 FLOPs on a GPU (causal,
    # d 128: s 720; 4e9 FLOPs over a call of 32 heads, the call's half point before; assumed),
    # at 1e5 on a CPU (measured on the project's CPU: s 64, d 16 ran at a fifth of s 1024, d 64)
    attention = {p: ramp(r * t.attention_efficiency, 1.3e8 if t.device == "cuda" else 1e5) for p, r in peak.items()}
    attention.update({f"{p}_bwd": c for p, c in attention.items()})
    bw = t.hbm_bytes_per_s * t.elementwise_efficiency
    elementwise = [[2.0**k, bw * (2.0**k / (2.0**k + 2.0**20))] for k in range(10, 34, 2)]

    def links(curve_intra, curve_inter) -> dict[str, dict[str, Link]]:
        intra = Link(latency_s=t.latency_intra_s, bytes_per_s=t.nvlink_bytes_per_s, curve=[[*p] for p in curve_intra])
        inter = Link(latency_s=t.latency_inter_s, bytes_per_s=cluster.ib_bytes_per_s, curve=[[*p] for p in curve_inter])
        return {"intra": dict.fromkeys(COLLECTIVES, intra), "inter": dict.fromkeys(COLLECTIVES, inter)}

    flat = [[1.0, 1.0]]
    collectives = {"torch": links(NCCL_CURVE_NVLINK, NCCL_CURVE_IB)}
    if t.device == "cpu":
        collectives = {"symm": links(flat, NCCL_CURVE_IB), "torch": links(flat, NCCL_CURVE_IB)}
    cuda = {}
    if t.device == "cuda":
        cuda = {
            "context": 600 * 2**20,  # CUDA context and torch's kernels: ~0.5-0.7 GiB on Hopper (not allocated)
            # one cuBLAS workspace, as torch sizes it for the GPU (a step holds two: the forecast's)
            "workspace": cublas_workspace_bytes(t.compute_capability),
            # NCCL_BUFFSIZE (4 MiB) x 2 directions x 16 channels, per communicator
            "nccl_per_communicator": 128 * 2**20,
        }
    return Profile(
        name=cluster.describe(),
        source=f"target {t.name}: {'published' if t.device == 'cuda' else 'nominal'} figures "
        "(isp_comm/planner/targets.py), not measured",
        device=t.device,
        per_node=cluster.per_node,
        nodes=cluster.nodes,
        memory_bytes=t.memory_bytes,
        peak_flops=peak,
        gemm=gemm,
        attention=attention,
        elementwise=elementwise,
        op_host_s=t.op_host_s,
        op_device_s=t.op_device_s,
        optimizer_bytes_per_s=t.hbm_bytes_per_s * t.elementwise_efficiency,
        optimizer_tensor_s=12 * t.op_host_s if t.device == "cpu" else 0.0,  # fused/for-each AdamW on GPUs
        collectives=collectives,
        default_backend="symm" if t.device == "cpu" else "torch",
        overlap=t.device == "cuda",
        host_block_s={"single": 20 * t.op_host_s, "multi": 40 * t.op_host_s},
        host_step_s={"single": 200 * t.op_host_s, "multi": 400 * t.op_host_s},
        cuda=cuda,
    )


def cache_dir() -> str:
    """Where calibrated profiles are kept: ``$ISP_COMM_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/isp-comm``, else ``~/.cache/isp-comm``."""
    if os.environ.get(CACHE_ENV):
        return os.environ[CACHE_ENV]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "isp-comm")


PROFILE_VERSION = 5
"""Part of a cached profile's name: a calibration that measures more, or better, gets a
new one (2: ``transient_share``; 3: attention by head and head dim; 4: the cheap
framework runs over 30 steps; 5: its ``noise``, and only steady ones cached), so an
older cache is not read in its place."""


def machine_key(local_world: int) -> str:
    """A cached profile's name: this machine's cores, CPU capability and torch, and the
    ranks it was calibrated for (1, or 2 and more)."""
    import torch

    ranks = "multi" if local_world > 1 else "single"
    cap = torch.backends.cpu.get_cpu_capability()
    return f"cpu-{usable_cores()}c-{cap}-torch{torch.__version__.split('+')[0]}-{ranks}-v{PROFILE_VERSION}.json"


LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                      "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")  # fmt: skip
"""What torchrun (torch's elastic agent) gives each rank it starts, with every
``TORCHELASTIC_*`` variable: see [Note: the calibration's own runs]."""


def launcher_free_env(**extra: str) -> dict[str, str]:
    """This process's environment without the variables a launcher gave it, plus ``extra``.

    [Note: the calibration's own runs]
    The calibration trains the calibration model with ``isp-train`` in processes of its
    own. Started from a rank of ``torchrun --nproc-per-node 4 -m isp_comm.train
    --plan``, those processes inherited the rank's ``RANK``, ``LOCAL_RANK``,
    ``WORLD_SIZE`` and ``MASTER_PORT``: each believed it was that rank of the outer
    job (``LOCAL_RANK`` set: no launch of its own) and joined the outer job's store, or
    refused its layout and left with status 2; the plan on a rank other than 0 then
    left with status 2 and no message (only rank 0 prints). The calibration's runs are
    jobs of their own: they start from an environment without the launcher's
    variables, and die with the process that started them (a ``--plan`` killed while
    it calibrates must not leave its calibration loading the cores the next one times;
    :mod:`isp_comm.processes`)."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES and not k.startswith("TORCHELASTIC_")}
    env.update({DIE_WITH_PARENT_ENV: "1", **extra})
    return env


def describe_noise(n: dict) -> str:
    """A calibration's noise in words (its figures against the limit)."""
    return (
        f"speed probes {100 * n['probe_spread']:.0f}% apart, steps of a run {100 * n['run_spread']:.0f}%, "
        f"the large run repeated {100 * n['repeat_spread']:.0f}%; the limit is {100 * n['limit']:.0f}%"
    )


CALIBRATION_WAIT_ENV = "ISP_COMM_CALIBRATION_WAIT_S"
"""How long a process waits for another one calibrating this machine before it gives
up with a message (default :data:`CALIBRATION_WAIT_S`)."""
CALIBRATION_WAIT_S = 1500.0
"""Longer than a calibration may take: its process is stopped after
``CALIBRATION_TIMEOUT_S`` per attempt, two attempts at most."""
CALIBRATION_TIMEOUT_S = 600.0
"""The most one calibration attempt may take before it counts as failed."""
CALIBRATION_ATTEMPTS = 2
"""Calibrations ``isp-train --plan`` runs at most until one is steady
(:func:`~isp_comm.planner.calibrate.noise`): a second costs another minute and a half;
a third rarely helps where two in a row were noisy (the machine is busy, not unlucky).
A quick calibration, a rough profile for tests, is not repeated."""


def cached(local_world: int, progress=print, *, recalibrate: bool = False, quick: bool = False) -> Profile:
    """This machine's profile for ``local_world`` ranks: from the cache, or calibrated
    now and cached when steady; ``recalibrate``: measured again whatever the cache
    holds; ``quick``: a rough profile (:func:`~isp_comm.planner.calibrate.calibrate`),
    cached under a name of its own.

    [Note: one process calibrates]
    Every rank of ``torchrun --nproc-per-node 4 -m isp_comm.train --plan`` asks for
    the profile at once. One calibration must run, not four on the same cores (each
    would time the others' work): the first process to take the cache entry's lock
    (``flock`` on ``HOST.calibration.lock`` in the cache folder, one for every entry of
    the host, let go when its holder exits, however it exits) calibrates; the others wait for the lock, at most
    ``$ISP_COMM_CALIBRATION_WAIT_S`` seconds (then a ``ValueError`` naming the holder),
    and read what it measured: a profile written after they began to wait is theirs,
    cached or noisy, ``recalibrate`` or not. A noisy calibration (not ``steady``, see
    [Note: a calibration's noise]) is not cached: it is kept beside the cache as
    ``NAME.noisy.json`` for the processes waiting on it and for ``--profile``; the next
    ``--plan`` measures again."""
    name = machine_key(local_world).removesuffix(".json") + ("-quick" if quick else "")
    path = os.path.join(cache_dir(), name + ".json")
    noisy = os.path.join(cache_dir(), name + ".noisy.json")
    os.makedirs(cache_dir(), exist_ok=True)
    since = time.time()
    with _calibration_lock(calibration_lock(), progress):
        for fresh in (path, noisy):  # measured while this process waited: by and for the same job
            if os.path.exists(fresh) and os.path.getmtime(fresh) >= since:
                return _load_cached(fresh)
        if os.path.exists(path) and not recalibrate:
            return _load_cached(path)
        return _calibrate_into(path, noisy, local_world, quick, progress)


def calibration_lock(folder: str | None = None) -> str:
    """The lock a calibrating process holds in the cache ``folder`` (default
    :func:`cache_dir`): one for the host, not per cache entry, since two calibrations
    at once would time each other's work."""
    return os.path.join(folder or cache_dir(), f"{socket.gethostname()}.calibration.lock")


def _load_cached(path: str) -> Profile:
    """A profile of the cache, or a ``ValueError`` that names it as the cache's (not a
    ``--profile`` the user gave) and says how to measure afresh."""
    try:
        return load(path)
    except ValueError as exc:
        why = str(exc).removeprefix(f"--profile {path}: ")
        raise ValueError(
            f"--plan: the cached calibration {path} cannot be read ({why}): plan again with --recalibrate, or delete it"
        ) from None


def _calibrate_into(path: str, noisy: str, local_world: int, quick: bool, progress) -> Profile:
    """Calibrate in a process of its own (this one's RSS is the plan's baseline),
    without a launcher's variables (see [Note: the calibration's own runs]); cache the
    profile when steady, else keep it as ``noisy``."""
    import subprocess
    import sys

    verb = "calibrating this machine again" if os.path.exists(path) else "calibrating this machine once"
    progress(f"isp-train --plan: {verb} (a minute or two); cached in {path} if steady")
    tmp = f"{path}.{os.getpid()}.tmp"
    cmd = [sys.executable, "-m", "isp_comm.planner.calibrate", "--profile", tmp]
    cmd += ["--worlds", "2" if local_world > 1 else "1"]  # the runs this plan reads
    attempts = 1 if quick else CALIBRATION_ATTEMPTS
    cmd += ["--attempts", str(attempts)] + (["--quick"] if quick else [])
    try:
        res = subprocess.run(
            cmd, capture_output=True, text=True, timeout=attempts * CALIBRATION_TIMEOUT_S, env=launcher_free_env()
        )
    except subprocess.TimeoutExpired as exc:
        raise ValueError(f"calibrating this machine took over {exc.timeout:.0f} s and was stopped") from exc
    if res.returncode:
        raise ValueError(f"calibrating this machine failed: {res.stderr.strip()[-1500:]}")
    return keep(tmp, path, noisy, progress)


def keep(measured: str, path: str, noisy: str, progress) -> Profile:
    """A calibration just written to ``measured``: moved into the cache (``path``)
    when steady, else kept as ``noisy`` beside it and not cached (see [Note: one
    process calibrates]). A noisy one also removes the entry it was measured to
    replace (``--recalibrate``'s): the next plan measures again, as it says."""
    prof = load(measured)
    if prof.noise.get("steady", True):
        os.replace(measured, path)
        if os.path.exists(noisy):
            os.remove(noisy)
        return prof
    os.replace(measured, noisy)
    if os.path.exists(path):
        os.remove(path)
    progress(
        f"isp-train --plan: this machine's speed moved while it was measured ({describe_noise(prof.noise)}), "
        f"in {prof.noise.get('attempt', 1)} attempt(s): not cached; this plan uses the least noisy one, kept in "
        f"{noisy} (--profile {noisy} plans on it again); plan on a quieter machine, or give --target"
    )
    return prof


@contextlib.contextmanager
def _calibration_lock(lock_path: str, progress) -> Iterator[None]:
    """Hold ``lock_path`` (an exclusive ``flock``), waiting at most
    ``$ISP_COMM_CALIBRATION_WAIT_S`` for another process to let go (see [Note: one
    process calibrates])."""
    import fcntl

    wait_s = float(os.environ.get(CALIBRATION_WAIT_ENV) or CALIBRATION_WAIT_S)
    with open(lock_path, "a+") as f:
        deadline, told = time.monotonic() + wait_s, False
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                f.seek(0)
                holder = f.read().strip() or "another process"
                if time.monotonic() >= deadline:
                    raise ValueError(
                        f"--plan: {holder} has been calibrating this machine for over {wait_s:.0f} s (lock "
                        f"{lock_path}); wait for it and plan again, or give --profile FILE or --target"
                    ) from None
                if not told and os.environ.get("RANK", "0") == "0":
                    progress(f"isp-train --plan: waiting for {holder}, calibrating this machine (lock {lock_path})")
                    told = True
                time.sleep(0.2)
        try:
            f.seek(0)
            f.truncate()
            f.write(f"process {os.getpid()} on {socket.gethostname()}")
            f.flush()
            yield
        finally:
            f.seek(0)
            f.truncate()
            f.flush()
            fcntl.flock(f, fcntl.LOCK_UN)
