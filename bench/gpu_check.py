"""Every GPU check in one command, in priority order, within 9 minutes.

    python bench/gpu_check.py [--out DIR] [--only NAME,...] [--dry-run] [--wheels DIR]

First the preamble: ``wheels`` installs carried nvshmem4py wheels (``*.whl`` in
--wheels, default ``.whl`` then ``wheels`` in the checkout) when nvshmem4py does not
import, and ``probe`` records torch, CUDA, NCCL, nvshmem4py, the MPS binary and the
free disk. Then the checks, the most valuable first, so that a run cut short has
done those (see docs/gpus.md for what each proves):

- ``shared-symm``: tests/gpu/test_gpu_shared.py's torch symmetric-memory tests, 2 and 4
  ranks on the one GPU (contract, parity, the refusal, a whole step without a host sync);
- ``bench-gpu``: bench/gpu.py trimmed to the eager and compiled pairs of FSDP2 and
  isp-comm, 3 windows of 5 steps;
- ``shared-nvshmem``: the nvshmem tests under a private MPS daemon, and NCCL at world 2;
- ``isp-train``: ``isp-train --device cuda --compile`` for a few steps;
- ``forecast``: the CUDA memory forecast against measured peaks (bench/forecast.py, 3 points);
- ``plan-gpu``: bench/plan_gpu.py at 680M, one run.

``tests-gpu`` (the rest of tests/gpu, which passed at 2590e51) and the virtual world's
checks (``virtual-time``, ``virtual-8b``, ``virtual-8b-best``,
``virtual-8b-same-layout``, ``virtual-8b-breakdown``, ``virtual-8b-profile``, ``virtual-70b``,
``virtual-70b-world``, ``virtual-70b-1nic``, ``virtual-scaling``: docs/virtual.md, docs/sharding.md) do
not fit beside them: they run only when named, e.g. ``--only virtual-time,virtual-8b``. ``--only``
runs the preamble and the named checks; any selection must fit in 540 s.

Each step runs in a process group of its own (in the runner's session) under its own
timeout: past it, or when the runner is interrupted, the group gets SIGINT (pytest
and the MPS helper stop their daemons on the way out), then SIGKILL. An MPS daemon a
killed step left behind in its temporary folder is stopped after it.

Writes OUT/gpu_check.json (every step: command, status, exit code, seconds, the end
of its output; the probe), OUT/gpu_check.md (a table), both rewritten after every
step, and OUT/gpu_check.log (every step's whole output); bench/gpu.py, the forecast
and plan_gpu write their own JSON beside them. ``--dry-run`` needs no GPU: one line per step,
``NAME timeout=SECONDS: COMMAND``, and ``total timeout=SECONDS``.

OUT defaults to bench/results/local/gpu_check. On the GPU machine: carry the wheels
(see docs/gpus.md) and run ``python bench/gpu_check.py --out DIR --archive
$OUT/gpu_check.tgz`` (the machine sends back a few files: ``--archive`` packs DIR
into one, rewritten after every step).
"""

from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.common import LOCAL  # noqa: E402
from tests.gpu.mps import stop_left_behind  # noqa: E402

BUDGET_S = 540
"""All the steps of one run, their timeouts summed: 9 minutes of the GPU machine's 15."""
GRACE_S = 5.0
"""Between SIGINT to a step's group and SIGKILL."""
TAIL = 4000
"""Characters of each step's output kept in the JSON."""
PY = sys.executable


@dataclass(frozen=True)
class Step:
    name: str
    timeout_s: int
    argv: list[str]
    what: str
    default: bool = True
    """In a run without --only (``tests-gpu`` is not: it does not fit)."""
    env: dict[str, str] = field(default_factory=dict)

    def line(self) -> str:
        return f"{self.name} timeout={self.timeout_s}: {shown(self.argv)}"


def shown(argv: list[str]) -> str:
    """``argv`` as a command to read: this interpreter as ``python``, paths inside the
    checkout relative to it (the steps run there)."""
    words = ["python" if a == PY else os.path.relpath(a, ROOT) if a.startswith(ROOT + os.sep) else a for a in argv]
    return shlex.join(words)


def _pytest(*args: str) -> list[str]:
    return [PY, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *args]


def _virtual(out: str, folder: str, *args: str) -> list[str]:
    """``bench/virtual.py`` with ``args``, its results in ``out/folder``."""
    return [PY, "bench/virtual.py", *args, "--out", os.path.join(out, folder)]


def steps(out: str, work: str, wheels: list[str], no_wheels: str = "no wheels carried") -> list[Step]:
    """Every step in priority order; ``out``: where results go, ``work``: scratch;
    ``wheels``: to install (none: the step says ``no_wheels``)."""
    shared = "tests/gpu/test_gpu_shared.py"
    layout_8b = ("--config", "llama3-8b", "--layout", "best")
    best_8b = (*layout_8b, "--repeats", "3")  # the 8B goals, medians of 3
    # the 70B jobs of the independent sharding: one process a system, 2 timed steps
    once_70b = ("--layout", "best", "--systems", "isp-comm,fsdp2,compute-only", "--repeats", "1", "--steps", "2")
    pip = [PY, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", *wheels]
    return [
        Step("wheels", 20, pip if wheels else ["echo", no_wheels], "carried nvshmem4py wheels"),
        Step("probe", 20, [PY, "bench/gpu_check.py", "--probe", "--out", out], "versions, MPS binary, free disk"),
        Step("shared-symm", 130, _pytest(shared, "-k", "symm"), "symm on one GPU at world 2 and 4"),
        Step(
            "bench-gpu",
            90,
            [
                PY,
                "bench/gpu.py",
                "--runs",
                "fsdp2,isp,fsdp2+compile,isp+compile",
                "--steps",
                "5",
                "--windows",
                "3",
                "--out",
                os.path.join(out, "gpu.json"),
            ],  # fmt: skip
            "ms/step, MFU, peak memory: isp-comm against FSDP2, eager and compiled",
        ),
        # 5 tests of 2 to 4 PEs, each starting NVSHMEM (and one MPS daemon): never run, the tightest
        Step("shared-nvshmem", 100, _pytest(shared, "-k", "nvshmem or nccl"), "nvshmem under MPS, NCCL at world 2"),
        Step(
            "isp-train",
            50,
            [
                PY,
                "-m",
                "isp_comm.train",
                "--device",
                "cuda",
                "--compile",
                "--steps",
                "6",
                "--no-trace",
                "--no-final-save",
                "--overwrite",
                "--out",
                os.path.join(work, "isp_train"),
            ],  # fmt: skip
            "isp-train compiled on CUDA",
        ),
        Step(
            "forecast",
            70,
            [PY, "bench/forecast.py", "--device", "cuda", "--only", "0", "1", "4", "--out", out],
            "memory forecast against torch.cuda peaks",
        ),
        Step(
            "plan-gpu",
            60,
            [PY, "bench/plan_gpu.py", "--sizes", "680M", "--repeats", "1", "--steps", "6", "--out", out],
            "planner against one measured run",
        ),
        Step(
            "tests-gpu",
            150,
            _pytest("-n", "6", "tests/gpu", "--ignore", shared, "--ignore", "tests/gpu/test_gpu_virtual.py"),
            "the rest of tests/gpu but the timed virtual-time, six at once (54 s on an H100 at 6909a49)",
            default=False,
        ),
        Step(
            "virtual-time",
            60,
            _pytest("tests/gpu/test_gpu_virtual.py"),
            "the virtual backend's device-side delay against CUDA events",
            default=False,
        ),
        Step(
            "virtual-8b",
            420,
            _virtual(out, "virtual_8b", "--config", "llama3-8b", "--repeats", "3"),
            "one rank of Llama-3-8B at N=8: isp-comm, FSDP2, compute-only, the planner",
            default=False,
        ),
        Step(
            "virtual-8b-best",
            420,
            _virtual(out, "virtual_8b_best", *best_8b, "--systems", "isp-comm,fsdp2,isp-comm compiled,fsdp2 compiled"),
            "one rank of Llama-3-8B at N=8 in the planner's fastest layout, isp-comm and FSDP2 (in its own "
            "fastest), eager and compiled per block (as isp-train --compile and torchtitan), three rounds, the "
            "planner (379 s for the same 12 processes and a breakdown at 6909a49, H100)",
            default=False,
        ),
        Step(
            "virtual-8b-same-layout",
            180,
            _virtual(
                out,
                "virtual_8b_same_layout",
                "--config",
                "llama3-8b",
                "--layout",
                "best",
                "--systems",
                "isp-comm@fsdp2,fsdp2,isp-comm compiled@fsdp2,fsdp2 compiled",
                "--repeats",
                "1",
                "--steps",
                "5",
            ),
            "isp-comm in FSDP2's fastest Llama-3-8B layout at N=8, beside FSDP2, eager and compiled",
            default=False,
        ),
        Step(
            "virtual-8b-breakdown",
            120,
            _virtual(
                out,
                "virtual_8b_breakdown",
                *layout_8b,
                "--systems",
                "isp-comm,fsdp2",
                "--repeats",
                "1",
                "--steps",
                "2",
                "--breakdown",
            ),
            "the same eager runs, then a step of each under the memory breakdown: their peaks by part side by side",
            default=False,
        ),
        Step(
            "virtual-8b-profile",
            240,
            _virtual(
                out,
                "virtual_8b_profile",
                *layout_8b,
                "--systems",
                "isp-comm,fsdp2,isp-comm compiled,fsdp2 compiled",
                "--repeats",
                "1",
                "--steps",
                "2",
                "--profile",
            ),
            "the four 8B systems in their fastest layouts, then a step of each under torch.profiler: "
            "device time by kind of kernel side by side",
            default=False,
        ),
        Step(
            "virtual-70b",
            480,
            _virtual(out, "virtual_70b", "--config", "llama3-70b", "--repeats", "1", "--steps", "2"),
            "one rank of Llama-3-70B at N=64: the same, one process each",
            default=False,
        ),
        Step(
            "virtual-70b-world",
            480,
            _virtual(out, "virtual_70b_world", "--config", "llama3-70b-8k", "--kind", "world", *once_70b),
            "one rank of Llama-3-70B at N=64 in the planner's best layout with the state over the world, "
            "FSDP2 in its own best that fits 80 GB",
            default=False,
        ),
        Step(
            "virtual-70b-1nic",
            480,
            _virtual(out, "virtual_70b_1nic", "--config", "llama3-70b-8k-1nic", *once_70b),
            "the same on nodes of one 400 Gb/s NIC each: the planner's best layout of any kind, FSDP2 in its own",
            default=False,
        ),
        Step(
            "virtual-scaling",
            420,
            _virtual(out, "virtual_scaling", "--scaling", "--repeats", "1", "--steps", "2"),
            "one rank of Llama-3-8B at N = 8, 64 and 1,024, each in the planner's best layout",
            default=False,
        ),
    ]


PREAMBLE = ("wheels", "probe")


def select(all_steps: list[Step], only: str) -> list[Step]:
    """The preamble and the checks named in ``only`` (comma-separated; empty: the
    default ones), in priority order; ValueError for an unknown name or a selection
    past :data:`BUDGET_S`."""
    names = [n for n in only.split(",") if n] if only else []
    known = {s.name for s in all_steps}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"unknown step {unknown} (one of {', '.join(sorted(known - set(PREAMBLE)))})")
    chosen = [s for s in all_steps if s.name in PREAMBLE or (s.name in names if names else s.default)]
    total = sum(s.timeout_s for s in chosen)
    if total > BUDGET_S:
        raise ValueError(f"the steps chosen take up to {total} s, over {BUDGET_S} s: run them in two calls")
    return chosen


def dry_run(chosen: list[Step]) -> str:
    lines = [s.line() for s in chosen]
    lines.append(f"total timeout={sum(s.timeout_s for s in chosen)}")
    return "\n".join(lines)


def archive(out: str, path: str) -> None:
    """Everything in ``out`` (the archive itself left out, when it lies there) as one
    gzipped tar at ``path``, replaced whole: a run cut short leaves the last one."""
    import tarfile

    skip = {path, path + ".tmp"}
    with tarfile.open(path + ".tmp", "w:gz") as tar:
        for folder, _dirs, files in os.walk(out):
            for name in sorted(files):
                full = os.path.join(folder, name)
                if full not in skip:
                    tar.add(full, arcname=os.path.relpath(full, out))
    os.replace(path + ".tmp", path)


# ---- running one step ----------------------------------------------------------------
def run_step(step: Step, env: dict[str, str], log) -> dict:
    """``step`` in a process group of its own, its output to ``log`` (an open file)
    and, the end of it, into the record; past its timeout the group gets SIGINT, then
    SIGKILL after :data:`GRACE_S`."""
    log.write(f"\n===== {step.line()}\n".encode())
    log.flush()
    start = log.tell()
    t0 = time.monotonic()
    # a process group of its own in this session: killed as one, and still ended with
    # the session if this runner is killed (the device machine's cleanup). A runner
    # started with SIGINT ignored (in the background of a non-interactive shell) would
    # pass that on through exec, and the step could not clean up on SIGINT: SIGINT is
    # handled here while the step starts, and a handled signal is SIG_DFL after exec.
    ignored = signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    if ignored:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        proc = subprocess.Popen(
            step.argv, cwd=ROOT, env={**env, **step.env}, stdout=log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, process_group=0,
        )  # fmt: skip
    finally:
        if ignored:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
    timed_out = False
    try:
        proc.wait(timeout=step.timeout_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        _interrupt(proc)
    except BaseException:  # Ctrl-C on the runner (the step's group is not the terminal's)
        _interrupt(proc)
        raise
    finally:
        _signal_group(proc.pid, signal.SIGKILL)  # whatever of the group is left, the step's own children too
        proc.wait()
    wall = time.monotonic() - t0
    log.flush()
    with open(log.name, "rb") as f:
        f.seek(start)
        output = f.read().decode(errors="replace")
    status = "timeout" if timed_out else ("passed" if proc.returncode == 0 else "failed")
    if status == "passed" and _all_skipped(output):
        status = "skipped"
    return {
        "name": step.name,
        "what": step.what,
        "command": shown(step.argv),
        "timeout_s": step.timeout_s,
        "status": status,
        "returncode": proc.returncode,
        "seconds": round(wall, 1),
        "summary": _summary(output),
        "output_tail": output[-TAIL:],
    }


def _interrupt(proc: subprocess.Popen) -> None:
    """SIGINT to the step's group (pytest, and the MPS helper inside it, clean up on
    the way out), and up to :data:`GRACE_S` for it to end."""
    _signal_group(proc.pid, signal.SIGINT)
    try:
        proc.wait(timeout=GRACE_S)
    except subprocess.TimeoutExpired:
        pass


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _summary(output: str) -> str:
    """pytest's closing line, else the last non-empty line."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    for line in reversed(lines):
        if any(w in line for w in (" passed", " failed", " skipped", " error")) and " in " in line:
            return line.strip("= ")
    return lines[-1][:300] if lines else ""


def _all_skipped(output: str) -> bool:
    s = _summary(output)
    return "skipped" in s and not any(w in s for w in ("passed", "failed", "error"))


def run(chosen: list[Step], out: str, tmp: str, env: dict[str, str], after=None) -> list[dict]:
    """Every step of ``chosen`` in turn, each with its own TMPDIR under ``tmp``;
    ``after(records)`` once each step is done (the report so far)."""
    records: list[dict] = []
    with open(os.path.join(out, "gpu_check.log"), "wb") as log:
        for step in chosen:
            step_tmp = os.path.join(tmp, step.name)
            os.makedirs(step_tmp, exist_ok=True)
            try:
                rec = run_step(step, {**env, "TMPDIR": step_tmp}, log)
            finally:  # on every way out, an interrupted runner's too
                left = stop_left_behind(step_tmp)
            if left:
                rec["mps_daemons_stopped"] = left
            records.append(rec)
            if step.name == "probe" and machine(records):
                rec["summary"] = probe_line(machine(records))
            print(f"{rec['name']}: {rec['status']} in {rec['seconds']:.0f} s  {rec['summary']}", flush=True)
            if after is not None:
                after(records)
    return records


def write_report(out: str, head: dict, records: list[dict]) -> str:
    """OUT/gpu_check.json and OUT/gpu_check.md from the steps run so far (rewritten
    after each, so that a run cut short keeps what it did); ``head``: the commit and
    the start time. Returns the table."""
    started = head["started"]
    report = {
        "commit": head["commit"],
        "started": started,
        "budget_s": BUDGET_S,
        "probe": machine(records),
        "steps": records,
    }
    with open(os.path.join(out, "gpu_check.json"), "w") as f:
        json.dump(report, f, indent=1)
    md = f"commit {report['commit']}, started {started}\n\n{table(records)}\n"
    with open(os.path.join(out, "gpu_check.md"), "w") as f:
        f.write(md)
    return md


def machine(records: list[dict]) -> dict | None:
    """The probe step's JSON line (its last line that parses), or None."""
    found = next((r for r in records if r["name"] == "probe"), None)
    for line in reversed(found["output_tail"].splitlines() if found else []):
        try:
            got = json.loads(line)
        except ValueError:
            continue
        if isinstance(got, dict):
            return got
    return None


# ---- the probe -------------------------------------------------------------------------
def probe(folder: str) -> dict:
    """What the machine has, each item on its own (one failing says so and the rest go on)."""
    out: dict = {"python": sys.version.split()[0]}

    def item(name: str, fn) -> None:
        try:
            out[name] = fn()
        except Exception as exc:  # noqa: BLE001 - the probe reports, it does not fail
            out[name] = f"unavailable: {type(exc).__name__}: {exc}"

    import torch

    out["torch"] = torch.__version__
    out["cuda_build"] = torch.version.cuda
    out["cuda_available"] = torch.cuda.is_available()
    if out["cuda_available"]:
        item("device", lambda: torch.cuda.get_device_name(0))
        item("device_count", torch.cuda.device_count)
        item("memory_gib", lambda: round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1))
        item("nccl", lambda: ".".join(map(str, torch.cuda.nccl.version())))
    item("driver", _driver)
    item("nvshmem4py", lambda: _version("nvshmem4py-cu13") or _version("nvshmem4py-cu12"))
    item("nvshmem_import", _nvshmem_import)
    item("cuda-core", lambda: _version("cuda-core"))
    item("cuda-pathfinder", lambda: _version("cuda-pathfinder"))  # nvshmem.core imports it; not carried
    item("nvshmem_lib", lambda: _version("nvidia-nvshmem-cu13") or _version("nvidia-nvshmem-cu12"))
    item("transformers", lambda: _version("transformers"))
    item("flash_attn", lambda: _version("flash-attn"))
    out["mps_binary"] = shutil.which("nvidia-cuda-mps-control")
    for where, path in (("disk_free_gib_out", folder), ("disk_free_gib_tmp", tempfile.gettempdir())):
        item(where, lambda p=path: round(shutil.disk_usage(p).free / 2**30, 1))
    return out


def probe_line(found: dict) -> str:
    """The probe in one line, for the table."""
    keys = ("device", "torch", "cuda_build", "nccl", "driver", "nvshmem4py", "nvshmem_import", "mps_binary")
    said = [f"{k} {found[k]}" for k in keys if k in found]
    free = found.get("disk_free_gib_out")
    return ", ".join([*said, f"{free} GiB free" if free is not None else "disk unknown"])


def _version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def _nvshmem_import() -> str:
    import nvshmem.core  # noqa: F401

    return "ok"


def _driver() -> str | None:
    if shutil.which("nvidia-smi") is None:
        return None
    query = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
    res = subprocess.run(query, capture_output=True, text=True, timeout=15)
    return res.stdout.strip() or res.stderr.strip()


def find_wheels(folders: list[str]) -> list[str]:
    """The carried wheels, from the first of ``folders`` that holds any."""
    for folder in folders:
        found = sorted(glob.glob(os.path.join(folder, "*.whl")))
        if found:
            return found
    return []


def nvshmem_imports(env: dict[str, str]) -> bool:
    res = subprocess.run([PY, "-c", "import nvshmem.core"], env=env, capture_output=True, timeout=60)
    return res.returncode == 0


# ---- the report ------------------------------------------------------------------------
def table(records: list[dict]) -> str:
    rows = ["| step | status | seconds (timeout) | summary |", "|---|---|---:|---|"]
    for r in records:
        summary = r["summary"].replace("|", "/")
        rows.append(f"| {r['name']} | {r['status']} | {r['seconds']:.0f} ({r['timeout_s']}) | {summary} |")
    return "\n".join(rows)


def commit() -> str | None:
    res = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    if res.returncode:
        return None
    dirty = subprocess.run(["git", "status", "--porcelain", "-uno"], capture_output=True, text=True, cwd=ROOT).stdout
    return res.stdout.strip() + (" (with uncommitted changes)" if dirty.strip() else "")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(LOCAL, "gpu_check"), help="folder for the JSON, table and log")
    ap.add_argument("--only", default="", help="comma-separated steps (the preamble always runs)")
    ap.add_argument("--dry-run", action="store_true", help="print the steps and their timeouts, run nothing")
    ap.add_argument("--wheels", default="", help="folder of carried wheels (default: .whl, then wheels)")
    ap.add_argument(
        "--archive", default="",
        help="also write OUT as one .tar.gz here after every step (a lent GPU machine sends back few files)",
    )  # fmt: skip
    ap.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)  # the probe step itself
    args = ap.parse_args(argv)
    out = os.path.abspath(args.out)
    if args.probe:
        print(json.dumps(probe(out if os.path.isdir(out) else ROOT)))
        return 0
    folders = [args.wheels] if args.wheels else [os.path.join(ROOT, ".whl"), os.path.join(ROOT, "wheels")]
    wheels = find_wheels(folders)
    tmp = tempfile.mkdtemp(prefix="isp_gpu_check_")
    try:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
        env["PYTHONUNBUFFERED"] = "1"
        no_wheels = f"no wheels carried (looked in {', '.join(os.path.relpath(f, ROOT) for f in folders)})"
        if wheels and not args.dry_run and nvshmem_imports(env):
            wheels, no_wheels = [], "nvshmem4py imports already: the carried wheels are not installed"
        try:
            chosen = select(steps(out, tmp, wheels, no_wheels), args.only)
        except ValueError as exc:
            print(f"gpu_check: {exc}", file=sys.stderr)
            return 2
        if args.dry_run:
            print(dry_run(chosen))
            return 0
        os.makedirs(out, exist_ok=True)
        started = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
        head = {"commit": commit(), "started": started}
        keep = os.path.abspath(args.archive) if args.archive else ""

        def after(recs: list[dict]) -> str:
            table = write_report(out, head, recs)
            if keep:
                archive(out, keep)
            return table

        records = run(chosen, out, tmp, env, after=after)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print("\n" + after(records))
    return 0 if all(r["status"] in ("passed", "skipped") for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
