"""Memory over a run's whole life: initialise, train, save, async save, load.

    python bench/lifecycle.py [--world 4] [--repeats 1] [--hf]

A reference llama of about 125M parameters (hidden 768, 12 layers, FFN 2048, 12/4
heads, vocab 32000), AdamW, sequence 128, global batch 4. Three runs:

- ``isp``: isp-comm, everything sharded (``shard_outer_params`` and
  ``vocab_parallel``), the model built on meta and initialised module by module
  (``init_seed``); checkpoints through ``comm.state_dict()`` /
  ``comm.optimizer_state_dict(opt)`` and DCP;
- ``fsdp2``: ``fully_shard`` per block and root on a meta-built model, ``to_empty``
  then ``reset_parameters`` on the DTensors; checkpoints through
  ``torch.distributed.checkpoint.state_dict.get_state_dict`` / ``set_state_dict``;
- ``isp-lean``: the same with the memory knobs turned: ``comm_granularity="module"``
  (gathers land in the slots, no landing buffer) and ``max_inflight_reduce_scatter=1``;
- ``single``: one process, the model built whole; the same state-dict APIs.

Each phase's figure is the peak RSS per rank (VmHWM, reset at the phase's start;
the largest rank): ``init`` (build and wrap), ``train`` (two optimizer steps, the
first creating AdamW's states), ``save`` (``dcp.save``), ``async save``
(``dcp.async_save`` until the write completes) and ``load`` (in fresh processes:
build, wrap, an optimizer, then ``dcp.load`` and loading into model and optimizer;
the figure covers the load only). Prints a markdown table and writes
OUT/lifecycle.json (--out, default bench/results/local) (every repeat's raw figures).

``--hf``: the same shape as a transformers ``LlamaForCausalLM`` going through
Hugging Face checkpoints instead. ``single`` is ``from_pretrained`` (load), two
training steps, ``save_pretrained`` (save); ``isp`` builds on meta, wraps (init),
``comm.load_hf_checkpoint`` (load), trains, ``comm.save_hf_checkpoint`` (save). The
source folder is written once by ``save_pretrained`` in 2 GB files; results in
OUT/lifecycle_hf.json (--out, default bench/results/local).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import statistics
import sys
import tempfile

import torch
import torch.distributed.checkpoint as dcp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import MIB, add_out, markdown_table, proc_status_bytes, reset_peak_rss, save_results  # noqa: E402
from isp_comm.models.llama import LlamaConfig, build  # noqa: E402
from isp_comm.testing import run_ranks  # noqa: E402

SEQ, BATCH, CORES = 128, 4, os.cpu_count() or 1
PHASES = ("init", "train", "save", "async save", "load")
RUNS = lambda world: (("single", 1), ("fsdp2", world), ("isp", world), ("isp-lean", world))  # noqa: E731


def model_config() -> LlamaConfig:
    return LlamaConfig(
        vocab_size=32000, hidden=768, ffn_hidden=2048, n_layers=12, n_heads=12, n_kv_heads=4, max_seq_len=SEQ
    )


class _Phase:
    """Peak RSS (MiB) from entering the block to leaving it."""

    def __init__(self, out: dict, name: str) -> None:
        self.out, self.name = out, name

    def __enter__(self) -> None:
        reset_peak_rss()

    def __exit__(self, *exc: object) -> None:
        self.out[self.name] = proc_status_bytes("VmHWM") / MIB


def _build(kind: str, world: int):
    """(model, comm or None, optimizer) for ``kind``."""
    import torch.distributed as dist

    from isp_comm import ISPCommunicator, ISPConfig, ParallelGroups

    comm = None
    if kind == "single":
        model = build(model_config())
    elif kind == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        with torch.device("meta"):
            model = build(model_config())
        for m in [*model.layers, model]:
            fully_shard(m)
        model.to_empty(device="cpu")
        with torch.no_grad():
            for m in model.modules():
                if hasattr(m, "reset_parameters"):
                    m.reset_parameters()
    else:
        with torch.device("meta"):
            model = build(model_config())
        cfg = ISPConfig(shard_outer_params=True, vocab_parallel=True, init_seed=0)
        if kind == "isp-lean":  # gathers land in the slots (no landing buffer), one reduce-scatter in flight
            cfg = dataclasses.replace(cfg, comm_granularity="module", max_inflight_reduce_scatter=1)
        comm = ISPCommunicator(model, ParallelGroups.create(wp_size=world), cfg)
    assert dist.is_initialized()
    return model, comm, torch.optim.AdamW(model.parameters(), lr=1e-4)


def _state(kind: str, model, comm, opt) -> dict:
    if comm is not None:
        return {"model": comm.state_dict(), "optim": comm.optimizer_state_dict(opt)}
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd}


def _set_state(kind: str, model, comm, opt, state: dict) -> None:
    if comm is not None:
        comm.load_state_dict(state["model"])
        comm.load_optimizer_state_dict(opt, state["optim"])
        return
    from torch.distributed.checkpoint.state_dict import set_state_dict

    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])


def _train(rank: int, world: int, model, comm, opt, forward) -> None:
    """Two AdamW steps on this rank's part of a random global batch (the first one
    creates the optimizer's states)."""
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(1)
    per = BATCH // world
    for _ in range(2):
        x = torch.randint(0, 32000, (BATCH, SEQ + 1), generator=g)[rank * per : (rank + 1) * per]
        logits = forward(x[:, :-1])
        y = x[:, 1:]
        loss = comm.cross_entropy(logits, y) if comm else F.cross_entropy(logits.flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        del logits, loss


def _save_worker(rank: int, world: int, kind: str, path: str) -> dict:
    torch.set_num_threads(max(1, CORES // world))
    peaks: dict = {}
    with _Phase(peaks, "init"):
        model, comm, opt = _build(kind, world)
    with _Phase(peaks, "train"):
        _train(rank, world, model, comm, opt, lambda x: model(x))
    with _Phase(peaks, "save"):
        dcp.save(_state(kind, model, comm, opt), checkpoint_id=path)
    with _Phase(peaks, "async save"):  # DCP's default stager for every run (a copy, then a background write)
        dcp.async_save(_state(kind, model, comm, opt), checkpoint_id=path + "-async").result()
    if comm is not None:
        comm.close()
    return peaks


def _load_worker(rank: int, world: int, kind: str, path: str) -> dict:
    torch.set_num_threads(max(1, CORES // world))
    model, comm, opt = _build(kind, world)
    peaks: dict = {}
    with _Phase(peaks, "load"):
        state = _state(kind, model, comm, opt)
        dcp.load(state, checkpoint_id=path)
        _set_state(kind, model, comm, opt, state)
        del state
    if comm is not None:
        comm.close()
    return peaks


def _hf_config():
    from transformers import LlamaConfig as HFLlamaConfig

    c = model_config()
    return HFLlamaConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden,
        intermediate_size=c.ffn_hidden,
        num_hidden_layers=c.n_layers,
        num_attention_heads=c.n_heads,
        num_key_value_heads=c.n_kv_heads,
        max_position_embeddings=SEQ,
    )


def _hf_worker(rank: int, world: int, kind: str, src: str, dst: str) -> dict:
    from transformers import AutoModelForCausalLM

    from isp_comm import ISPCommunicator, ISPConfig, ParallelGroups

    torch.set_num_threads(max(1, CORES // world))
    peaks: dict = {}
    comm = None
    with _Phase(peaks, "init"):
        if kind != "single":
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(_hf_config(), attn_implementation="sdpa")
            cfg = ISPConfig(shard_outer_params=True, vocab_parallel=True)
            comm = ISPCommunicator(model, ParallelGroups.create(wp_size=world), cfg)
    with _Phase(peaks, "load"):
        if comm is None:
            model = AutoModelForCausalLM.from_pretrained(src, attn_implementation="sdpa", dtype=torch.float32)
        else:
            comm.load_hf_checkpoint(src)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    with _Phase(peaks, "train"):
        _train(rank, world, model, comm, opt, lambda x: model(input_ids=x, use_cache=False).logits)
    with _Phase(peaks, "save"):
        if comm is None:
            model.save_pretrained(dst, max_shard_size="2GB")
        else:
            comm.save_hf_checkpoint(dst, max_shard_bytes=2 * 10**9)
    if comm is not None:
        comm.close()
    return peaks


def _hf_source(path: str) -> None:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(_hf_config()).save_pretrained(path, max_shard_size="2GB")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=1, help="repeat every run; the table shows medians and ranges")
    ap.add_argument("--hf", action="store_true", help="Hugging Face checkpoints in and out (see above)")
    add_out(ap)
    args = ap.parse_args()
    if args.hf:
        return main_hf(args)
    n_params = _count()
    raw: list[dict] = []
    for repeat in range(args.repeats):
        for kind, world in RUNS(args.world):
            tmp = tempfile.mkdtemp(prefix="isp-lifecycle-")
            try:
                path = os.path.join(tmp, "ckpt")
                saved = run_ranks(_save_worker, world, kind, path, timeout_s=3600, start="spawn")
                loaded = run_ranks(_load_worker, world, kind, path, timeout_s=3600, start="spawn")
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
            peaks = {p: max(r[p] for r in saved + loaded if p in r) for p in PHASES}
            raw.append({"repeat": repeat, "run": kind, "world": world, **peaks})
            print(f"repeat {repeat} {kind}: " + ", ".join(f"{p} {v:.0f}" for p, v in peaks.items()), flush=True)
    rows, table = [], []
    single_train = statistics.median(r["train"] for r in raw if r["run"] == "single")
    for kind, world in RUNS(args.world):
        mine = [r for r in raw if r["run"] == kind]
        med = {p: statistics.median(r[p] for r in mine) for p in PHASES}
        cells = [f"{med[p]:.0f} ({min(r[p] for r in mine):.0f}-{max(r[p] for r in mine):.0f})" for p in PHASES]
        worst = max(med["save"], med["async save"], med["load"]) / med["train"]
        table.append([kind, world, *cells, f"{worst:.2f}x", f"{med['train'] / single_train:.2f}x"])
        rows.append({"run": kind, "world": world, "median": med})
    print(
        f"\n{n_params / 1e6:.0f}M parameters, AdamW, seq {SEQ}, global batch {BATCH}, {CORES} cores, "
        f"peak RSS per rank in MiB: median of {args.repeats} (range)\n"
    )
    header = ["run", "world", *PHASES, "max(save, async, load) / train", "train vs single"]
    print(markdown_table(header, table, "lr" + "r" * (len(header) - 2)))
    save_results("lifecycle", args, {"raw": raw, "median": rows, "n_params": n_params})


def main_hf(args: argparse.Namespace) -> None:
    phases = ("init", "load", "train", "save")
    runs = (("single", 1), ("isp", args.world))
    raw: list[dict] = []
    tmp = tempfile.mkdtemp(prefix="isp-lifecycle-hf-")
    try:
        src = os.path.join(tmp, "src")
        _hf_source(src)
        for repeat in range(args.repeats):
            for kind, world in runs:
                dst = os.path.join(tmp, f"out-{kind}")
                peaks = run_ranks(_hf_worker, world, kind, src, dst, timeout_s=3600, start="spawn")
                shutil.rmtree(dst, ignore_errors=True)
                worst = {p: max(r[p] for r in peaks) for p in phases}
                raw.append({"repeat": repeat, "run": kind, "world": world, **worst})
                print(f"repeat {repeat} {kind}: " + ", ".join(f"{p} {raw[-1][p]:.0f}" for p in phases), flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    rows, table = [], []
    for kind, world in runs:
        mine = [r for r in raw if r["run"] == kind]
        med = {p: statistics.median(r[p] for r in mine) for p in phases}
        cells = [f"{med[p]:.0f} ({min(r[p] for r in mine):.0f}-{max(r[p] for r in mine):.0f})" for p in phases]
        table.append([kind, world, *cells, f"{max(med['load'], med['save']) / med['train']:.2f}x"])
        rows.append({"run": kind, "world": world, "median": med})
    print(
        f"\ntransformers LlamaForCausalLM, {_count() / 1e6:.0f}M parameters, AdamW, seq {SEQ}, global batch {BATCH}, "
        f"{CORES} cores, peak RSS per rank in MiB: median of {args.repeats} (range)\n"
    )
    header = ["run", "world", *phases, "max(load, save) / train"]
    print(markdown_table(header, table, "lr" + "r" * (len(header) - 2)))
    save_results("lifecycle_hf", args, {"raw": raw, "median": rows})


def _count() -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in build(model_config()).parameters())


if __name__ == "__main__":
    main()
