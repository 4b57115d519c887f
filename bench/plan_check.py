"""The planner against measurement on this machine: step time and peak memory.

    python bench/plan_check.py --profile FILE [--repeats 3] [--steps 20] [--out DIR]

For each point of a grid (world 1 and 2, one thread per rank; two sizes of the
reference llama, sequence length, batch, checkpointing, and wp against sp),
``isp-train --plan --profile FILE`` predicts the step time and the memory, and
isp-train trains the same flags ``--repeats`` times, in rounds (the whole grid once a
round). Measured per run: the median ``step_s`` of metrics.jsonl after its first two
steps (warm-up; over 20 steps, a slow stretch of a few steps is not the median), and
rank 0's ``peak_rss_mib`` (VmHWM: what the run's highest moment held, baseline included);
over runs, the median (and range) of both. Predicted: ``step_s`` and the highest of
the wrap, forward, backward and optimizer phases (the run's last checkpoint is
saved after its last metrics row). Then ``--search`` for one model and global batch
at world 2: its five fastest layouts and the grid's layouts of that model and batch
are run side by side (``--search-repeats`` rounds, 5 by default, each layout once a
round), and the first pick is compared with the fastest measured. Last, a published
figure beside a prediction (not a fit): torchtitan's Llama-3.1-8B on 8 H100 with FSDP2.

Prints markdown tables and writes OUT/plan_check.json (--out, default bench/results/local).
The profile must come from bench/calibrate.py on this machine; the grid's models are
not the calibration's.

    python bench/plan_check.py --profile FILE --rescore RESULTS

runs nothing: it scores the grid measurements saved in RESULTS (a plan_check.json, one
run or several) with FILE's predictions. Scoring the same measurements with several
calibrations tells the calibration's share of the error from the runs' own (and a
change to the calibration can be checked in minutes, not the grid's ten).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import add_out, markdown_table, progress, save_results  # noqa: E402
from isp_comm.planner.calibrate import measure_run  # noqa: E402

SMALL = ["--layers", "4", "--hidden", "128", "--heads", "8", "--kv-heads", "2"]
MEDIUM = ["--layers", "4", "--hidden", "256", "--heads", "8", "--kv-heads", "4"]
GRID: list[tuple[str, int, list[str]]] = [
    # (name, world, flags); world 2 adds --nproc-per-node 2
    ("S seq128 b4", 1, [*SMALL, "--seq", "128", "--batch", "4"]),
    ("S seq256 b4", 1, [*SMALL, "--seq", "256", "--batch", "4"]),
    ("M seq128 b4", 1, [*MEDIUM, "--seq", "128", "--batch", "4"]),
    ("M seq128 b8", 1, [*MEDIUM, "--seq", "128", "--batch", "8"]),
    ("M seq128 b4 ckpt1", 1, [*MEDIUM, "--seq", "128", "--batch", "4", "--ckpt", "1"]),
    ("S seq128 b4 wp2", 2, [*SMALL, "--seq", "128", "--batch", "4", "--wp", "2"]),
    ("S seq128 b4 sp2", 2, [*SMALL, "--seq", "128", "--batch", "4", "--wp", "1", "--sp", "2"]),
    ("M seq128 b4 wp2", 2, [*MEDIUM, "--seq", "128", "--batch", "4", "--wp", "2"]),
    ("M seq128 b4 sp2", 2, [*MEDIUM, "--seq", "128", "--batch", "4", "--wp", "1", "--sp", "2"]),
    ("M seq128 b4 wp2 sp2", 2, [*MEDIUM, "--seq", "128", "--batch", "4", "--wp", "2", "--sp", "2"]),
    ("M seq128 b4 wp2 ckpt1", 2, [*MEDIUM, "--seq", "128", "--batch", "4", "--wp", "2", "--ckpt", "1"]),
    ("M seq256 b4 wp2", 2, [*MEDIUM, "--seq", "256", "--batch", "4", "--wp", "2"]),
    ("M seq128 b8 wp2", 2, [*MEDIUM, "--seq", "128", "--batch", "8", "--wp", "2"]),
    ("S seq256 b8 wp2 ckpt0.5", 2, [*SMALL, "--seq", "256", "--batch", "8", "--wp", "2", "--ckpt", "0.5"]),
]
SEARCH = (2, [*MEDIUM, "--seq", "128", "--batch", "4"])
"""The search's check: this model and global batch at world 2 (the grid's M seq128 b4 points)."""
COMMON = ["--device", "cpu", "--no-trace", "--log-every", "1000"]
ENV = dict(os.environ, OMP_NUM_THREADS="1", ISP_COMM_PLAN_CALIBRATE="0")


def predict(profile: str, world: int, flags: list[str], search: bool = False) -> tuple[dict, list[str]]:
    cmd = [sys.executable, "-m", "isp_comm.train", "--plan", "--profile", profile, *COMMON, *flags]
    cmd += ["--nproc-per-node", str(world)] + (["--search"] if search else [])
    res = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=300)
    if res.returncode:
        raise RuntimeError(res.stderr[-2000:])
    lines = res.stdout.strip().splitlines()
    return json.loads(lines[-1]), lines


def measure(world: int, flags: list[str], steps: int, out: str) -> dict:
    return measure_run([*COMMON, *flags], world, steps, out, timeout=600)


def _peak_mib(pred: dict) -> float:
    """A plan's predicted peak: the highest of the phases a training run reaches."""
    return max(pred[ph] for ph in ("wrap", "forward", "backward", "optimizer"))


def error_pct(predicted: float, measured: list[float]) -> float:
    """Predicted against the median of the measured runs, in percent."""
    return 100 * (predicted / statistics.median(measured) - 1)


def rescore(profile: str, results: str) -> list[dict]:
    """Each saved run's grid measurements against ``profile``'s predictions (one
    prediction per point, shared by the runs)."""
    with open(results) as f:
        saved = json.load(f)
    predicted: dict[tuple, dict] = {}
    out = []
    for i, run in enumerate(saved.get("runs", [saved])):
        steps, memory = [], []
        for g in (g for row in run["rows"] for g in row["grid"]):
            key = (g["world"], tuple(g["flags"]))
            if key not in predicted:
                predicted[key] = predict(profile, g["world"], g["flags"])[0]
            pred = predicted[key]
            steps.append(error_pct(pred["step_s"], g["step_s"]))
            memory.append(error_pct(_peak_mib(pred), g["peak_rss_mib"]))
        out.append(
            {
                "run": i,
                "points": len(steps),
                "step_median_abs_error_pct": statistics.median(abs(e) for e in steps),
                "step_largest_abs_error_pct": max(abs(e) for e in steps),
                "step_mean_error_pct": statistics.fmean(steps),
                "memory_largest_abs_error_pct": max(abs(e) for e in memory),
                "step_error_pct": steps,
            }
        )
    return out


def _rng(values: list[float], fmt: str) -> str:
    return f"{statistics.median(values):{fmt}} ({min(values):{fmt}}-{max(values):{fmt}})"


def error_table(rows: list[dict], first: dict[str, str], memory: str, memory_head: str, mib: str = ".1f") -> str:
    """Predicted against measured, a row per point (markdown): ``first`` maps the
    leading columns' heads to the rows' keys, ``memory`` is the measured memory's key
    (plan_gpu.py's grid reads the same way)."""
    table = [
        [
            *(str(r[k]) for k in first.values()),
            f"{r['predicted_step_s'] * 1e3:.1f}",
            _rng([s * 1e3 for s in r["step_s"]], ".1f"),
            f"{r['step_error_pct']:+.1f}",
            f"{r['predicted_peak_mib']:{mib}}",
            _rng(r[memory], mib),
            f"{r['memory_error_pct']:+.1f}",
        ]
        for r in rows
    ]
    head = [*first, "predicted ms", "measured ms, median (range)", "step error %"]
    head += ["predicted MiB", memory_head, "memory error %"]
    return markdown_table(head, table, "l" + "r" * (len(head) - 1))


def check_grid(points: list[tuple[str, int, list[str]]], args, tmp: str) -> list[dict]:
    """Each point predicted, then measured in ``--repeats`` rounds, one run of each
    point a round: a point's runs lie minutes apart, so a slow stretch of the machine
    reaches one run of several points, not every run of one (the median drops it)."""
    preds = [predict(args.profile, world, flags)[0] for _, world, flags in points]
    runs: list[list[dict]] = [[] for _ in points]
    for r in range(args.repeats):
        for i, (_, world, flags) in enumerate(points):
            runs[i].append(measure(world, flags, args.steps, os.path.join(tmp, f"run{i}")))
        progress(f"grid: round {r + 1} of {args.repeats} measured")
    rows = []
    for (name, world, flags), pred, measured in zip(points, preds, runs):
        head = {"name": name, "world": world, "flags": flags}
        rows.append(scored_row(head, pred["step_s"], _peak_mib(pred), measured, "peak_rss_mib"))
    return rows


def scored_row(head: dict, step_s: float, peak_mib: float, measured: list[dict], memory: str) -> dict:
    """A point's row: ``head``, the predicted step and peak, the measured runs' step
    and ``memory`` figures, and the errors against their medians (printed as it goes)."""
    row = {**head, "predicted_step_s": step_s, "predicted_peak_mib": peak_mib}
    row.update(step_s=[m["step_s"] for m in measured], **{memory: [m[memory] for m in measured]})
    row["step_error_pct"] = error_pct(step_s, row["step_s"])
    row["memory_error_pct"] = error_pct(peak_mib, row[memory])
    progress(f"{row['name']}: {row['step_error_pct']:+.1f}% step, {row['memory_error_pct']:+.1f}% memory")
    return row


def search_check(args, tmp: str) -> dict:
    """The search's first pick against the fastest of its rivals, measured side by side:
    the search's next picks (``--search-picks`` in all) and the grid's layouts of the same model and global
    batch (of its first ``--only`` points), run in ``--search-repeats`` rounds, one run
    of each layout per round (so a drift of the machine's speed during the check
    reaches every layout alike)."""
    world, flags = SEARCH
    _, lines = predict(args.profile, world, flags, search=True)
    picks = [
        _strip_world(line.split("isp-train", 1)[1].split())
        for line in lines
        if line[:1].isdigit() and ": isp-train" in line
    ][: args.search_picks]
    grid = GRID[: args.only or None]  # a smoke run's rivals are its points too
    rivals = [(name, f) for name, w, f in grid if w == world and _model_batch(f) == _model_batch(flags)]
    candidates: dict[tuple, tuple[str, list[str]]] = {}
    for i, f in enumerate(picks, 1):
        candidates.setdefault(_layout(f, world), (f"search #{i}", f))
    for name, f in rivals:
        candidates.setdefault(_layout(f, world), (name, f))
    runs: dict[str, list[float]] = {name: [] for name, _ in candidates.values()}
    for r in range(args.search_repeats):
        for name, f in candidates.values():
            runs[name].append(measure(world, f, args.steps, os.path.join(tmp, f"search{r}"))["step_s"])
    measured = {name: statistics.median(v) for name, v in runs.items()}
    fastest = min(measured, key=measured.get)
    gap = 100 * (measured["search #1"] / measured[fastest] - 1)
    progress(f"search: first pick {gap:+.1f}% against the fastest measured ({fastest})")
    flags_of = {name: f for name, f in candidates.values()}
    return {"pick": picks[0], "flags": flags_of, "runs": runs, "measured": measured, "fastest": fastest, "gap_pct": gap}


def _strip_world(args: list[str]) -> list[str]:
    """A search's command line without ``--nproc-per-node N`` (measure adds the world)."""
    return [a for i, a in enumerate(args) if a != "--nproc-per-node" and (i == 0 or args[i - 1] != "--nproc-per-node")]


def _values(flags: list[str]) -> dict[str, str]:
    """Each flag's value; a switch (--shard-outer) alone is "on"."""
    value, i = {}, 0
    while i < len(flags):
        if i + 1 < len(flags) and not flags[i + 1].startswith("--"):
            value[flags[i]] = flags[i + 1]
            i += 2
        else:
            value[flags[i]] = "on"
            i += 1
    return value


def _model_batch(flags: list[str]) -> tuple:
    """A run's model, sequence and global batch (what a search keeps fixed)."""
    value = _values(flags)
    keys = ("--layers", "--hidden", "--heads", "--kv-heads", "--seq")
    batch = int(value.get("--batch", 8)) * int(value.get("--grad-accum", 1))
    return (*(value.get(k) for k in keys), batch)


def _layout(flags: list[str], world: int) -> tuple:
    """What a search varies, with isp-train's defaults (``--wp 0``: the world over sp)."""
    v = _values(flags)
    sp = int(v.get("--sp", 1))
    wp = int(v.get("--wp", 0)) or world // sp
    switches = tuple(k in v for k in ("--shard-outer", "--vocab-parallel"))
    return (wp, sp, float(v.get("--ckpt", 0)), *switches, int(v.get("--batch", 8)), int(v.get("--grad-accum", 1)))


def torchtitan_point() -> list[dict]:
    """Llama-3.1-8B on the h100x8 profile at wp 8, one sequence of 8192 per GPU, bf16,
    beside torchtitan's published FSDP2 figures (5,762 tokens/s/GPU eager, 6,667
    compiled). A prediction, not a fit."""
    import torch

    from isp_comm import ISPConfig
    from isp_comm.models.llama import LlamaConfig, build
    from isp_comm.planner.profile import from_target
    from isp_comm.planner.step import step_time
    from isp_comm.planner.targets import parse_target

    cfg = LlamaConfig(vocab_size=128256, hidden=4096, ffn_hidden=14336, n_layers=32, n_heads=32, n_kv_heads=8)
    with torch.device("meta"):
        model = build(cfg)
    prof = from_target(parse_target("h100x8"))
    out = []
    for ckpt in (0.0, 1.0):
        icfg = ISPConfig(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, activation_checkpointing=ckpt)
        st = step_time(model, icfg, prof, world=8, wp=8, sp=1, batch=8, seq=8192)
        out.append({"ckpt": ckpt, "tokens_per_s_per_gpu": st.tokens_per_s / 8, "mfu_pct": st.mfu_pct, **st.as_dict()})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--profile", required=True, help="a profile of this machine (bench/calibrate.py)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument(
        "--search-repeats",
        type=int,
        default=5,
        help="rounds of the search's check (its top layouts are predicted a few percent apart, "
        "and two runs of one layout at two ranks can differ by more)",
    )
    ap.add_argument(
        "--search-picks",
        type=int,
        default=5,
        help="the search's top layouts measured in its check (the first pick and its rivals; 2 for a smoke run)",
    )
    ap.add_argument(
        "--only", type=int, default=0, help="the first N points only, in the grid and as the search's rivals (smoke)"
    )
    ap.add_argument("--rescore", metavar="RESULTS", help="score a saved plan_check.json's runs; run nothing")
    add_out(ap)
    args = ap.parse_args()
    if args.rescore:
        scored = rescore(args.profile, args.rescore)
        table = [
            [s["run"], s["points"]]
            + [f"{s[k]:{f}}" for k, f in (("step_median_abs_error_pct", ".1f"), ("step_largest_abs_error_pct", ".1f"),
                                          ("step_mean_error_pct", "+.1f"), ("memory_largest_abs_error_pct", ".1f"))]
            for s in scored
        ]  # fmt: skip
        head = ["saved run", "points", "step median |error| %", "largest %", "mean %", "memory largest |error| %"]
        print(markdown_table(head, table, "rrrrrr"))
        print(save_results("plan_check_rescore", args, scored))
        return
    with tempfile.TemporaryDirectory() as tmp:
        rows = check_grid(GRID[: args.only or None], args, tmp)
        search = search_check(args, tmp)
    titan = torchtitan_point()
    print(error_table(rows, {"point": "name", "world": "world"}, "peak_rss_mib", "measured peak RSS MiB"))
    errors = [abs(r["step_error_pct"]) for r in rows]
    mem = [abs(r["memory_error_pct"]) for r in rows]
    print(
        f"\nstep time: median |error| {statistics.median(errors):.1f}%, largest {max(errors):.1f}% "
        f"({sum(e > 20 for e in errors)} over 20%); memory: largest |error| {max(mem):.1f}% "
        f"({sum(e > 5 for e in mem)} over 5%)"
    )
    print(f"\nthe search's first pick ({' '.join(search['pick'])}) against its rivals, side by side:")
    table = [[name, _rng([s * 1e3 for s in v], ".1f")] for name, v in search["runs"].items()]
    print(markdown_table(["layout", "measured ms, median (range)"], table, "lr"))
    print(f"fastest measured: {search['fastest']}; the first pick's gap: {search['gap_pct']:+.1f}%")
    for t in titan:
        print(
            f"torchtitan Llama-3.1-8B, 8 H100, seq 8192, local batch 1: isp-comm wp 8 ckpt {t['ckpt']:g} predicted "
            f"{t['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU (MFU {t['mfu_pct']:.1f}%), published FSDP2 5,762 eager / "
            f"6,667 compiled: {100 * (t['tokens_per_s_per_gpu'] / 5762 - 1):+.0f}% / "
            f"{100 * (t['tokens_per_s_per_gpu'] / 6667 - 1):+.0f}%"
        )
    print(save_results("plan_check", args, [{"grid": rows, "search": search, "torchtitan": titan}]))


if __name__ == "__main__":
    main()
