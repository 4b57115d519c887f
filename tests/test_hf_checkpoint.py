"""Hugging Face checkpoints in and out of the shards (isp_comm/hf_checkpoint.py), and
meta-built transformers models made real by wrapping (isp_comm/materialize.py).

Every source checkpoint is a tiny random model written by ``save_pretrained`` in
several files; every rank loads it into a meta-built, wrapped model, trains two
steps, saves it back, and transformers' ``from_pretrained`` reads the result.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil

import pytest
import torch
import transformers

from isp_comm import ISPCommunicator, ISPConfig, ParallelGroups
from isp_comm.testing import run_ranks, tiny_hf_config

VOCAB = 301  # uneven over 2, 3 and 4 ranks, as are the k/v projections (16 rows) and the MLP (100)
ARCHS = {
    "llama": dict(model_type="llama"),
    "qwen2": dict(model_type="qwen2"),  # q/k/v biases
    "mistral": dict(model_type="mistral"),
    "qwen2-tied": dict(model_type="qwen2", tied=True),
}
# (architecture, shard_outer_params, vocab_parallel, wp): every world size sees all
# four combinations at wp = world; a head tied to the embedding cannot be
# vocab-parallel (README); at world 4, wp 2 has two replicas (the first one writes)
CASES = {
    2: [
        ("llama", False, False, 2),
        ("qwen2", True, True, 2),
        ("mistral", False, True, 2),
        ("qwen2-tied", True, False, 2),
    ],
    3: [
        ("llama", False, True, 3),
        ("qwen2", True, False, 3),
        ("mistral", True, True, 3),
        ("qwen2-tied", False, False, 3),
    ],
    4: [
        ("llama", True, True, 4),
        ("qwen2", False, True, 4),
        ("mistral", False, False, 4),
        ("qwen2-tied", True, False, 4),
    ]
    + [("qwen2", True, True, 2)],
}


def _config(arch: str, **kw):
    return tiny_hf_config(vocab_size=VOCAB, **{**ARCHS[arch], **kw})


def _meta_model(config):
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)


def _from_pretrained(path: str):
    return transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa")


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("hf")
    for i, arch in enumerate(ARCHS):
        torch.manual_seed(i)
        model = transformers.AutoModelForCausalLM.from_config(_config(arch))
        model.save_pretrained(root / arch, max_shard_size="60KB")  # several files and an index
        assert os.path.isfile(root / arch / "model.safetensors.index.json")
    shutil.copytree(root / "llama", root / "truncated")  # a download cut short
    cut = root / "truncated" / sorted(os.listdir(root / "truncated"))[3]  # model-00002-of-...
    os.truncate(cut, os.path.getsize(cut) - 100)
    return str(root)


def _round_trips(rank: int, world: int, root: str) -> list[dict]:
    torch.manual_seed(0)
    x = torch.randint(0, VOCAB, (2, 12))
    out = []
    for arch, outer, vp, wp in CASES[world]:
        src, dst = os.path.join(root, arch), os.path.join(root, f"out-{arch}-{world}-{wp}")
        ref = _from_pretrained(src)
        model = _meta_model(ref.config)
        comm = ISPCommunicator(
            model, ParallelGroups.create(wp_size=wp), ISPConfig(shard_outer_params=outer, vocab_parallel=vp)
        )
        # non-persistent rotary buffers: real values from the config at wrapping
        inv_freq_exact = torch.equal(model.model.rotary_emb.inv_freq, ref.model.rotary_emb.inv_freq)
        comm.load_hf_checkpoint(src)
        loaded = comm.full_state_dict()
        weights_err = max((loaded[k] - v).abs().max().item() for k, v in ref.state_dict().items())
        with torch.no_grad():
            logits, ref_logits = model(input_ids=x).logits, ref(input_ids=x).logits
        if vp:  # [wp, batch, seq, this rank's vocab rows]: every WP rank's tokens (all alike here)
            chunk, wp_rank = -(-VOCAB // wp), rank % wp
            ref_logits, logits = ref_logits[..., wp_rank * chunk : (wp_rank + 1) * chunk], logits[wp_rank]
        logits_err = (logits - ref_logits).abs().max().item()
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        for _ in range(2):
            comm.cross_entropy(model(input_ids=x[:, :-1]).logits, x[:, 1:]).backward()
            opt.step()
            opt.zero_grad()
        trained = comm.full_state_dict()
        with torch.no_grad():
            trained_logits = model(input_ids=x).logits
        trained_logits = trained_logits[wp_rank] if vp else trained_logits
        comm.save_hf_checkpoint(dst, max_shard_bytes=40_000)
        back = _from_pretrained(dst)
        back_sd = back.state_dict()
        with torch.no_grad():
            back_logits = back(input_ids=x).logits
        if vp:
            back_logits = back_logits[..., wp_rank * chunk : (wp_rank + 1) * chunk]
        with open(os.path.join(dst, "model.safetensors.index.json")) as f:
            weight_map = json.load(f)["weight_map"]
        out.append(
            {
                "case": (arch, outer, vp, wp),
                "inv_freq_exact": inv_freq_exact,
                "weights_err": weights_err,
                "logits_err": logits_err,
                "moved": max((trained[k] - loaded[k]).abs().max().item() for k in loaded),
                "same_keys": back_sd.keys() == trained.keys(),
                "saved_err": max((back_sd[k] - trained[k]).abs().max().item() for k in trained),
                "saved_logits_err": (back_logits - trained_logits).abs().max().item(),
                "files": len(set(weight_map.values())),
                "tied_written": "lm_head.weight" in weight_map,
                "tied_after_load": back.lm_head.weight is back.model.embed_tokens.weight,
                "config_type": back.config.model_type,
            }
        )
        comm.close()
    if world == 2:
        out.append(_errors(root))
    return out


def _errors(root: str) -> dict[str, str]:
    """What a wrong checkpoint says (every rank raises the same ValueError)."""
    messages = {}
    for name, arch, src in [
        ("missing", "qwen2", "llama"),  # qwen2 wants q/k/v biases the llama files lack
        ("unexpected", "llama", "qwen2"),
        ("shape", "llama-wide", "llama"),
        ("nothing", "llama", "no-such-folder"),
        ("truncated", "llama", "truncated"),
    ]:
        config = _config("llama", intermediate_size=104) if arch == "llama-wide" else _config(arch)
        model = _meta_model(config)
        comm = ISPCommunicator(model, ParallelGroups.create(wp_size=2), ISPConfig())
        with pytest.raises(ValueError) as err:
            comm.load_hf_checkpoint(os.path.join(root, src))
        messages[name] = str(err.value)
        comm.close()
    return messages


@pytest.mark.timeout(400)
@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow), pytest.param(4, marks=pytest.mark.slow)])
def test_hf_round_trip(sources: str, world: int) -> None:
    results = run_ranks(_round_trips, world, sources, timeout_s=380)
    if world == 2:
        errors = results[0].pop()
        for r in results[1:]:
            assert r.pop() == errors  # the same message on every rank
        assert "missing keys" in errors["missing"] and "model.layers.0.self_attn.q_proj.bias" in errors["missing"]
        assert (
            "unexpected keys" in errors["unexpected"] and "model.layers.1.self_attn.k_proj.bias" in errors["unexpected"]
        )
        assert "shape mismatches" in errors["shape"] and "model.layers.0.mlp.up_proj.weight" in errors["shape"]
        assert "(104, 48)" in errors["shape"] and "(100, 48)" in errors["shape"]
        assert "no-such-folder is not a folder" in errors["nothing"]
        # safetensors' own error names no file (and stopped isp-train with a traceback on every rank)
        assert "model-00002-of-" in errors["truncated"] and "cannot be read" in errors["truncated"], errors["truncated"]
    for rank_results in results:
        for r in rank_results:
            case = r["case"]
            assert r["inv_freq_exact"], case
            # loading copies the stored values: bitwise what from_pretrained holds
            assert r["weights_err"] == 0.0, case
            # the same weights in the same ops on the same input: bitwise, also for a
            # vocab-parallel head (each column of the logits is one dot product)
            assert r["logits_err"] == 0.0, case
            assert r["moved"] > 1e-3, case  # training changed the weights
            assert r["same_keys"], case
            assert r["saved_err"] == 0.0, case  # saving writes the shards' bytes
            assert r["saved_logits_err"] == 0.0, case
            assert r["files"] > 1, case  # max_shard_bytes split the output
            tied = case[0] == "qwen2-tied"
            assert r["tied_written"] is not tied, case  # tied embeddings written once, as transformers does
            assert r["tied_after_load"] is tied, case
            assert r["config_type"] == ARCHS[case[0]]["model_type"]


def _strays(rank: int, world: int, root: str) -> dict:
    """Load the two folders with stray safetensors, save over a folder holding an
    adapter and an earlier save's extra file."""
    out = {}
    for name in ("sharded", "single"):
        src = os.path.join(root, name)
        ref = _from_pretrained(src)
        comm = ISPCommunicator(_meta_model(ref.config), ParallelGroups.create(wp_size=world), ISPConfig())
        comm.load_hf_checkpoint(src)
        loaded = comm.full_state_dict()
        out[name] = max((loaded[k] - v).abs().max().item() for k, v in ref.state_dict().items())
        if name == "single":
            comm.save_hf_checkpoint(os.path.join(root, "target"))
        comm.close()
    return out


@pytest.mark.timeout(120)
def test_only_the_models_files_are_read_and_replaced(sources: str, tmp_path) -> None:
    """A folder's other ``*.safetensors`` (an adapter, Mistral's ``consolidated``, a
    stale copy) are neither read nor removed: loading takes the files the index names,
    or ``model.safetensors``; saving replaces an earlier save's files only, as
    ``from_pretrained`` and ``save_pretrained`` do."""
    import shutil

    from safetensors.torch import save_file

    ref = _from_pretrained(os.path.join(sources, "llama"))
    shifted = {k: v + 7.0 for k, v in ref.state_dict().items()}  # the same keys and shapes, other values
    shutil.copytree(os.path.join(sources, "llama"), tmp_path / "sharded")
    save_file(shifted, tmp_path / "sharded" / "consolidated.safetensors")
    save_file({"lora_A": torch.ones(2, 2)}, tmp_path / "sharded" / "adapter_model.safetensors")
    ref.save_pretrained(tmp_path / "single")  # one model.safetensors
    save_file(shifted, tmp_path / "single" / "old-model.safetensors")
    os.makedirs(tmp_path / "target")
    save_file({"lora_A": torch.ones(2, 2)}, tmp_path / "target" / "adapter_model.safetensors")
    save_file(shifted, tmp_path / "target" / "model-00002-of-00002.safetensors")  # an earlier, larger save's
    for errors in run_ranks(_strays, 2, str(tmp_path), timeout_s=100):
        assert errors == {"sharded": 0.0, "single": 0.0}  # bitwise the model's own files
    target = sorted(os.listdir(tmp_path / "target"))
    assert target == ["adapter_model.safetensors", "config.json", "model.safetensors"], target
    back = _from_pretrained(str(tmp_path / "target")).state_dict()
    assert all(torch.equal(back[k], v) for k, v in ref.state_dict().items())


MOE = {
    # 4 experts over wp 2; Mixtral's router is renamed too (block_sparse_moe.gate -> mlp.gate)
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=48),
    # 3 experts over wp 2, and each WP shard's experts cut again over 2 replicas; the head tied
    "qwen3_moe": dict(
        num_experts=3, num_experts_per_tok=2, moe_intermediate_size=24, decoder_sparse_step=1, tie_word_embeddings=True
    ),
}


def _tiny_moe_config(kind: str):
    """A tiny MoE of 2 blocks: transformers 5 fuses its experts' per-expert checkpoint
    tensors (Mixtral's ``block_sparse_moe.experts.N.w1``...) into one 3-D parameter per
    projection while loading, and ``save_pretrained`` writes them back per expert."""
    return transformers.AutoConfig.for_model(
        kind, vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=64, pad_token_id=0, **MOE[kind],
    )  # fmt: skip


def _published_moe(rank: int, world: int, root: str, wp: int, sharding: str) -> dict:
    """A published MoE checkpoint read into a meta-built wrapped model, each rank
    counting the tensors it reads; then saved back."""
    import safetensors

    read: list[str] = []
    opened = safetensors.safe_open

    class Counting:  # safe_open, counting get_tensor
        def __init__(self, *args, **kwargs) -> None:
            self.f = opened(*args, **kwargs)

        def __enter__(self):
            self.h = self.f.__enter__()
            return self

        def __exit__(self, *exc) -> None:
            self.f.__exit__(*exc)

        def __getattr__(self, name: str):
            return getattr(self.h, name)

        def get_tensor(self, key: str):
            read.append(key)
            return self.h.get_tensor(key)

    ref = _from_pretrained(os.path.join(root, "src"))
    groups = ParallelGroups.create(wp_size=wp)
    comm = ISPCommunicator(_meta_model(ref.config), groups, ISPConfig(state_sharding=sharding))
    safetensors.safe_open = Counting
    try:
        comm.load_hf_checkpoint(os.path.join(root, "src"))
    finally:
        safetensors.safe_open = opened
    loaded = comm.full_state_dict()
    comm.save_hf_checkpoint(os.path.join(root, "out"))
    comm.load_hf_checkpoint(os.path.join(root, "fused"))  # what isp-comm wrote before: the model's own layout
    fused = comm.full_state_dict()
    comm.close()
    err = max(
        max((loaded[k] - v).abs().max().item(), (fused[k] - v).abs().max().item()) for k, v in ref.state_dict().items()
    )
    return {"err": err, "read": [k for k in read if ".experts." in k]}


def _headers(folder) -> dict[str, tuple]:
    """Every tensor's name and shape in a folder's safetensors files."""
    from safetensors import safe_open

    shapes = {}
    for name in os.listdir(folder):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(folder, name), framework="pt") as f:
                shapes.update({k: tuple(f.get_slice(k).get_shape()) for k in f.keys()})  # noqa: SIM118
    return shapes


@pytest.mark.timeout(150)
@pytest.mark.parametrize(
    "kind, world, wp, sharding",
    [("mixtral", 2, 2, "wp"), pytest.param("qwen3_moe", 4, 2, "world", marks=pytest.mark.slow)],
)
def test_a_published_moe_checkpoint_is_read_expert_by_expert(tmp_path, kind, world, wp, sharding) -> None:
    """An MoE checkpoint as published (one tensor per expert and projection, what
    ``save_pretrained`` writes; transformers 5 fuses them into one 3-D parameter per
    projection while loading) loads into a meta-built wrapped model bitwise as
    ``from_pretrained`` does, each rank reading the tensors of its own experts and no
    other (a folder in the model's own, fused layout loads too: what isp-comm saved
    before); ``save_hf_checkpoint`` writes it back in the same layout (every name and
    shape ``save_pretrained`` wrote), which ``from_pretrained`` reads bitwise. Before,
    such a checkpoint was refused and each rank had to build the whole model first."""
    if importlib.util.find_spec("transformers.conversion_mapping") is None:
        pytest.skip("transformers 4 stores every parameter under its own name")
    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(_tiny_moe_config(kind))
    ref.save_pretrained(tmp_path / "src", max_shard_size="60KB")  # several files and an index
    from safetensors.torch import save_file

    from isp_comm.hf_checkpoint import tied_aliases

    os.makedirs(tmp_path / "fused")
    tied = tied_aliases(ref)  # written once, as isp-comm writes them
    save_file({k: v for k, v in ref.state_dict().items() if k not in tied}, tmp_path / "fused" / "model.safetensors")
    published = _headers(tmp_path / "src")
    experts = [k for k in published if ".experts." in k]
    assert len(experts) == 2 * 3 * MOE[kind].get("num_local_experts", MOE[kind].get("num_experts")), experts
    results = run_ranks(_published_moe, world, str(tmp_path), wp, sharding, timeout_s=130)
    assert all(r["err"] == 0.0 for r in results), [r["err"] for r in results]
    read = [k for r in results for k in r["read"]]
    assert sorted(read) == sorted(experts)  # every expert's tensors read once, by the rank holding it
    assert all(len(r["read"]) < len(experts) for r in results)
    assert _headers(tmp_path / "out") == published
    back = _from_pretrained(str(tmp_path / "out")).state_dict()
    assert all(torch.equal(back[k], v) for k, v in ref.state_dict().items())


@pytest.mark.parametrize("conversion", ["transpose", "interleave"])
def test_a_conversion_that_is_not_a_cut_is_refused(monkeypatch, conversion: str) -> None:
    """A conversion transformers applies while loading that is not a rename or experts
    cut into parts (a transpose of a square matrix; an interleave of the experts' rows:
    both keep every shape) is refused rather than read as a cut: its tensors would load into the wrong
    rows without a word."""
    if importlib.util.find_spec("transformers.conversion_mapping") is None:
        pytest.skip("transformers 4 stores every parameter under its own name")
    from transformers import conversion_mapping
    from transformers.core_model_loading import Interleave, MergeModulelist, Transpose, WeightConverter

    from isp_comm.hf_layouts import stored_layout

    ops = {
        # a square matrix: the stored tensor's shape is the parameter's
        "transpose": ("self_attn.q_proj.weight_t", "self_attn.q_proj.weight", [Transpose(dim0=0, dim1=1)]),
        "interleave": ("mlp.experts.*.gate_up.weight", "mlp.experts.gate_up_proj", [MergeModulelist(0), Interleave(1)]),
    }
    source, target, operations = ops[conversion]
    monkeypatch.setattr(
        conversion_mapping,
        "get_model_conversion_mapping",
        lambda *_, **__: [WeightConverter(source_patterns=source, target_patterns=target, operations=operations)],
    )
    model = _meta_model(_tiny_moe_config("qwen3_moe"))
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="not cut into one tensor per expert and part") as refused:
        stored_layout(model, shapes)
    assert "from_pretrained(path) before wrapping" in str(refused.value)
    monkeypatch.undo()
    layout = stored_layout(model, shapes)  # the real conversion: cuts, read expert by expert
    assert {type(w).__name__ for w in layout.values()} == {"str", "Fused"}


def test_a_quantized_checkpoint_is_refused_saying_so(tmp_path) -> None:
    """Every published GPT-OSS holds its experts in MXFP4 (``gate_up_proj_blocks`` and
    ``_scales`` for ``gate_up_proj``), which ``from_pretrained`` dequantizes while
    loading; a meta-built model is built unquantized. isp-train --model on such a folder
    stopped with missing and unexpected keys alone: the refusal now says the files are
    quantized and what to do. Refused before any rank reads a tensor, so no process
    group is needed here."""
    from safetensors.torch import save_file

    from isp_comm.hf_checkpoint import load_hf_checkpoint

    config = tiny_hf_config("gpt_oss", vocab_size=64, head_dim=8, num_local_experts=2, num_experts_per_tok=1)
    config.quantization_config = {"quant_method": "mxfp4"}
    with torch.device("meta"):  # GPT-OSS has no SDPA attention
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    tensors = {}
    for key, value in model.state_dict().items():
        if key.endswith(("experts.gate_up_proj", "experts.down_proj")):  # stored [experts, out, in / 32, 16]
            experts, rows, cols = value.shape
            tensors[key + "_blocks"] = torch.zeros(experts, cols, rows // 32 + 1, 16, dtype=torch.uint8)
            tensors[key + "_scales"] = torch.zeros(experts, cols, rows // 32 + 1, dtype=torch.uint8)
        else:
            tensors[key] = torch.zeros(value.shape)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="unexpected keys") as refused:
        load_hf_checkpoint(model, model.state_dict(), str(tmp_path))
    assert "quantization_config (quant_method mxfp4)" in str(refused.value)
    assert "dequantize=True" in str(refused.value)
