"""One GPU, world 1: step time, MFU and peak memory of plain PyTorch, FSDP2 and isp-comm.

    python bench/gpu.py [--runs plain,fsdp2,isp,plain+compile,fsdp2+compile,isp+compile]
                        [--steps 10] [--windows 3] [--profile NAME] [--small]
                        [--device cpu --dtype fp32]

Every run trains the same llama (697M parameters: hidden 2048, 12 layers, MLP 5632,
vocab 32000; ``--small`` for a quick check) on seq 2048 x batch 4 of random tokens
with fused AdamW, in bf16:
- ``plain``: the model on the GPU in fp32 under ``torch.autocast(bfloat16)``;
- ``fsdp2``: ``fully_shard`` per block and root, ``MixedPrecisionPolicy(bf16, fp32)``;
- ``isp``: ``ISPCommunicator`` with ``param_dtype=bf16, reduce_dtype=fp32``;
- ``+compile``: every block ``.compile()``d first (the torchtitan recipe).

``--device cpu`` runs the same rows on the CPU (gloo; no MFU or memory columns),
which is how the compile-vs-eager rows are measured where no GPU is lent.

Each run: 3 warm-up steps (compilation included), then ``--windows`` windows of
``--steps`` steps, each timed with a device synchronisation at its ends only. The
table gives the median window's ms/step with the range, MFU (FLOPs counted as in
isp_comm/model_flops.py, against the device's peak from isp_comm/train/metrics.py's
table) and peak allocated / reserved memory. Raw figures go to --out (default bench/results/local/gpu.json). ``--profile
NAME`` also writes ``torch.profiler`` key averages (by CUDA time and by self CPU
time) of two steps of run NAME to gpu_profile_NAME.txt beside the JSON.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench.common import LOCAL, wrap_world1  # noqa: E402
from isp_comm.model_flops import flops_per_token  # noqa: E402
from isp_comm.models.llama import Llama, LlamaConfig  # noqa: E402
from isp_comm.train.metrics import peak_tflops  # noqa: E402

RUNS = ("plain", "fsdp2", "isp", "plain+compile", "fsdp2+compile", "isp+compile")
BIG = dict(vocab_size=32000, hidden=2048, ffn_hidden=5632, n_layers=12, n_heads=16, n_kv_heads=8, max_seq_len=2048)
SMALL = dict(vocab_size=8000, hidden=512, ffn_hidden=1408, n_layers=4, n_heads=8, n_kv_heads=4, max_seq_len=512)


def build(kind: str, cfg: LlamaConfig, device: torch.device, bf16: bool):
    """The model, the step's forward context and the communicator to close (isp)."""
    torch.manual_seed(0)
    with torch.device(device):
        model = Llama(cfg)
    compiled = kind.endswith("+compile")
    base = kind.removesuffix("+compile")
    if compiled:
        for block in model.layers:
            block.compile()
    comm = wrap_world1(base, model, bf16)
    autocast = base == "plain" and bf16
    return model, autocast, comm


def train_step(model, opt, x, y, autocast: bool) -> None:
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=autocast):
        logits = model(x)
    F.cross_entropy(logits.flatten(0, 1).float(), y.flatten()).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def measure(kind: str, cfg: LlamaConfig, args, device: torch.device) -> dict:
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    model, autocast, comm = build(kind, cfg, device, args.dtype == "bf16")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    g = torch.Generator(device=device).manual_seed(1)
    x = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), device=device, generator=g)
    y = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), device=device, generator=g)
    t0 = time.perf_counter()
    for _ in range(3):
        train_step(model, opt, x, y, autocast)
    sync(device)
    warmup_s = time.perf_counter() - t0
    windows = []
    for _ in range(args.windows):
        t0 = time.perf_counter()
        for _ in range(args.steps):
            train_step(model, opt, x, y, autocast)
        sync(device)
        windows.append((time.perf_counter() - t0) / args.steps)
    if args.profile == kind:
        profile(kind, model, opt, x, y, autocast, os.path.dirname(args.out))
    ms = statistics.median(windows) * 1e3
    tokens = args.batch * args.seq
    peak = peak_tflops(device)
    fpt = flops_per_token(model, args.seq)
    out = {
        "run": kind,
        "ms_per_step": ms,
        "ms_windows": [w * 1e3 for w in windows],
        "mfu_pct": 100 * tokens * fpt / (ms / 1e3) / (peak * 1e12) if peak else None,
        "peak_alloc_mib": torch.cuda.max_memory_allocated(device) / 2**20 if cuda else None,
        "peak_reserved_mib": torch.cuda.max_memory_reserved(device) / 2**20 if cuda else None,
        "warmup_s": warmup_s,
    }
    if comm is not None:
        comm.close()
    del model, opt, comm
    gc.collect()
    torch._dynamo.reset()
    return out


def versions(device: torch.device) -> dict:
    """torch, CUDA, NCCL and nvshmem4py versions, as the docs quote them."""
    out = {"torch": torch.__version__, "cuda": torch.version.cuda}
    if device.type == "cuda":
        out["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    try:
        from importlib.metadata import version

        out["nvshmem4py"] = version("nvshmem4py-cu13")
    except Exception:  # noqa: BLE001 - not installed: None
        out["nvshmem4py"] = None
    return out


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def profile(kind: str, model, opt, x, y, autocast: bool, folder: str) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof

    cuda = x.device.type == "cuda"
    with prof(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]) as p:
        for _ in range(2):
            train_step(model, opt, x, y, autocast)
        sync(x.device)
    ka = p.key_averages()
    path = os.path.join(folder, f"gpu_profile_{kind}.txt")
    with open(path, "w") as f:
        f.write(f"# {kind}: two steps\n## by CUDA time\n")
        f.write(ka.table(sort_by="cuda_time_total" if cuda else "cpu_time_total", row_limit=30))
        f.write("\n## by self CPU time\n")
        f.write(ka.table(sort_by="self_cpu_time_total", row_limit=30))
    print(f"profile written to {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", default=",".join(RUNS))
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--windows", type=int, default=3)
    ap.add_argument("--seq", type=int, default=0)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--small", action="store_true", help="a small model, for a quick check")
    ap.add_argument("--profile", default="")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    ap.add_argument("--out", default=os.path.join(LOCAL, "gpu.json"), help="the raw JSON (untracked by default)")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench/gpu.py: needs a CUDA device (or --device cpu)")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)  # --profile writes beside it
    shape = SMALL if args.small else BIG
    args.seq = args.seq or shape["max_seq_len"]
    cfg = LlamaConfig(**{**shape, "max_seq_len": args.seq})
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29571")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    with torch.device("meta"):
        n = sum(p.numel() for p in Llama(cfg).parameters())
    rows = []
    for kind in args.runs.split(","):
        if kind not in RUNS:
            sys.exit(f"bench/gpu.py: unknown run {kind!r} (one of {', '.join(RUNS)})")
        rows.append(measure(kind, cfg, args, device))
        r = rows[-1]
        print(f"{kind}: {r['ms_per_step']:.1f} ms/step", flush=True)
    dist.destroy_process_group()
    base = {r["run"].removesuffix("+compile") + ("+c" if r["run"].endswith("compile") else ""): r for r in rows}
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({os.cpu_count()} cores)"
    print(
        f"\n{name}, torch {torch.__version__}, {n / 1e6:.0f}M params, "
        f"seq {args.seq} x batch {args.batch}, {args.dtype}, fused AdamW; "
        f"median of {args.windows} windows of {args.steps} steps\n"
    )
    print("| run | ms/step (range) | vs FSDP2 | MFU | peak alloc MiB | peak reserved MiB |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        ref = base.get("fsdp2+c" if r["run"].endswith("compile") else "fsdp2")
        vs = f"{r['ms_per_step'] / ref['ms_per_step']:.2f}x" if ref else "-"
        lo, hi = min(r["ms_windows"]), max(r["ms_windows"])
        mfu = f"{r['mfu_pct']:.1f}%" if r["mfu_pct"] is not None else "-"
        mem = [f"{r[k]:.0f}" if r[k] is not None else "-" for k in ("peak_alloc_mib", "peak_reserved_mib")]
        print(f"| {r['run']} | {r['ms_per_step']:.1f} ({lo:.1f}-{hi:.1f}) | {vs} | {mfu} | {mem[0]} | {mem[1]} |")
    meta = {"device": name, "params": n, "args": vars(args), **versions(device)}
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
