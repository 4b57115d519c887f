"""Bytes a block moves: the reference llama (isp_comm/models/llama.py) and transformers' Llama
at the same shape, from the planner's meta trace (isp_comm/planner/ops.py).

    python bench/model_bytes.py                      # Llama-3-8B's block at 8,192 tokens, bf16
    python bench/model_bytes.py --seq 4096 --ops     # and the bytes by operator

Nothing is computed: one forward and backward of each model on meta tensors, at one
sequence a rank, records every element-wise operator's bytes read and written
(matrix products and fused attention are timed by their FLOPs, not counted here),
and every dispatch. Prints a markdown table of one block's figures and writes
OUT/model_bytes.json (--out, default bench/results/local).
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import add_out, markdown_table, save_results  # noqa: E402

GIB = 2**30
LLAMA3_8B = dict(vocab=128256, hidden=4096, ffn=14336, heads=32, kv_heads=8, theta=500000.0)
"""Llama-3-8B's shape (its config.json), two blocks: enough for one block's figures."""


def reference(seq: int):
    from isp_comm.models.llama import LlamaConfig, build

    s = LLAMA3_8B
    cfg = LlamaConfig(
        vocab_size=s["vocab"], hidden=s["hidden"], ffn_hidden=s["ffn"], n_layers=2, n_heads=s["heads"],
        n_kv_heads=s["kv_heads"], max_seq_len=seq, rope_theta=s["theta"],
    )  # fmt: skip
    with torch.device("meta"):
        return build(cfg)


def transformers_llama(seq: int):
    import transformers

    s = LLAMA3_8B
    cfg = transformers.LlamaConfig(
        vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["ffn"], num_hidden_layers=2,
        num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"], max_position_embeddings=seq,
        rope_theta=s["theta"], attn_implementation="sdpa",
    )  # fmt: skip
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(cfg)


def block_bytes(model, seq: int) -> dict:
    """Block 0's element-wise bytes and dispatches, forward and backward, and its
    bytes by operator (``direction operator`` -> GiB)."""
    from isp_comm.discovery import find_blocks
    from isp_comm.planner import ops

    by_op: collections.Counter = collections.Counter()
    record = ops._Recorder.__torch_dispatch__

    def counting(self, func, types, args=(), kwargs=None):
        before = len(self._ops().moved)
        out = record(self, func, types, args, kwargs)
        moved = self._ops().moved
        if len(moved) > before and self.current[0] == 0:
            by_op[f"{'backward' if self.backward[0] else 'forward'} {func.overloadpacket.__name__}"] += moved[-1]
        return out

    ops._Recorder.__torch_dispatch__ = counting
    try:
        traced = ops.trace_ops(model, list(find_blocks(model)), 1, seq, torch.bfloat16)
    finally:
        ops._Recorder.__torch_dispatch__ = record
    fwd, bwd = traced.block_fwd[0], traced.block_bwd[0]
    return {
        "forward_gib": sum(fwd.moved) / GIB,
        "backward_gib": sum(bwd.moved) / GIB,
        "elementwise_ops": len(fwd.moved) + len(bwd.moved),
        "dispatches": fwd.dispatches + bwd.dispatches,
        "by_op_gib": {k: v / GIB for k, v in by_op.most_common()},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))  # the first paragraph
    ap.add_argument("--seq", type=int, default=8192, help="tokens of the one sequence a rank (default 8192)")
    ap.add_argument("--ops", action="store_true", help="also the bytes by operator")
    add_out(ap)
    args = ap.parse_args()
    rows = []
    for name, build in (("isp_comm.models.llama", reference), ("transformers Llama (sdpa)", transformers_llama)):
        got = block_bytes(build(args.seq), args.seq)
        rows.append({"model": name, **got})
    print(f"one block of Llama-3-8B's shape, {args.seq} tokens, bf16; element-wise bytes from a meta trace\n")
    table = []
    for r in rows:
        gib = (r["forward_gib"], r["backward_gib"], r["forward_gib"] + r["backward_gib"])
        table.append([r["model"], *(f"{g:.2f}" for g in gib), r["elementwise_ops"], r["dispatches"]])
    header = ["model", "forward GiB", "backward GiB", "total GiB", "element-wise ops", "dispatches"]
    print(markdown_table(header, table, "lrrrrr"))
    if args.ops:
        for r in rows:
            print(f"\n{r['model']}: GiB by operator")
            print(markdown_table(["operator", "GiB"], [[k, f"{v:.3f}"] for k, v in r["by_op_gib"].items()], "lr"))
    print(f"\nraw JSON: {save_results('model_bytes', args, rows)}")


if __name__ == "__main__":
    main()
