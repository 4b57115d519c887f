"""The engine and isp-train on one CUDA device (skipped without CUDA; CI has none).

Two ranks share the one GPU over a gloo process group with CUDA tensors (NCCL
refuses two ranks on one GPU), so every multi-rank path runs on a one-GPU machine.
``python -m pytest tests/gpu -q`` is the one command.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from isp_comm import ISPCommunicator, ISPConfig, ParallelGroups
from isp_comm.testing import free_port, run_ranks, tiny_hf_config
from tests.parity import Case, batches, loss_fn, make_optim

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
DEV = torch.device("cuda", 0)


def _model(kind: str, ckpt: bool) -> torch.nn.Module:
    if kind == "llama":
        model = Case(bias=True).build()
    else:
        import transformers

        torch.manual_seed(0)
        cfg = tiny_hf_config("qwen2", vocab_size=37)
        cfg._attn_implementation = "sdpa"
        model = transformers.AutoModelForCausalLM.from_config(cfg)
        if ckpt:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
    return model.to(DEV)


def _logits(model, x):
    out = model(x)
    return out if isinstance(out, torch.Tensor) else out.logits


def _train(model, rank: int, world: int, comm=None, steps: int = 3) -> list[float]:
    case = Case(optim="adamw", steps=steps, seq=9)
    opt = make_optim(case.optim, model.parameters())
    hook = comm.scheduler_hook() if comm is not None else None
    losses = []
    for step in batches(case, world):
        x, y = (t.to(DEV) for t in step[0])
        if comm is not None:
            x, y = x.chunk(world)[rank], y.chunk(world)[rank]
            hook.before_forward()
        loss = loss_fn(_logits(model, x).float(), y)
        if hook is not None:
            hook.before_backward()
        loss.backward()
        if hook is not None:
            hook.after_backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        if comm is not None:
            torch.distributed.all_reduce(total)
            total /= world
        losses.append(total.item())
    return losses


def _parity_worker(rank: int, world: int, kind: str, param_dtype, ckpt: bool) -> dict:
    torch.cuda.set_device(DEV)
    ref = _model(kind, False)
    ref_losses = _train(ref, 0, world)
    ref_sd = {k: v.float() for k, v in ref.state_dict().items()}
    model = _model(kind, ckpt)
    cfg = ISPConfig(
        param_dtype=param_dtype,
        reduce_dtype=torch.float32 if param_dtype else None,
        activation_checkpointing=0.5 if ckpt and kind == "llama" else 0.0,
        shard_outer_params=True,
    )
    comm = ISPCommunicator(model, ParallelGroups.create(wp_size=world), cfg)
    losses = _train(model, rank, world, comm)
    sd = comm.full_state_dict()
    comm.close()
    return {
        "loss": max(abs(a - b) for a, b in zip(losses, ref_losses)),
        "weights": max((sd[k].float() - ref_sd[k]).abs().max().item() for k in ref_sd),
        "on_gpu": all(v.is_cuda for v in sd.values()),
    }


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_fp32_parity_two_ranks_on_one_gpu(kind: str) -> None:
    for r in run_ranks(_parity_worker, 2, kind, None, True, timeout_s=280):
        assert r["on_gpu"]
        # fp32 on the GPU: the same GEMMs on half the batch, summed over 2 ranks in
        # another order than one GEMM over the whole batch (cuBLAS may split K
        # differently): a few fp32 ulps of a loss of ~3.6 after 3 AdamW steps
        assert r["loss"] < 1e-5, r
        assert r["weights"] < 1e-4, r  # AdamW's normalised updates of lr 1e-2 amplify ulps of tiny grads


@pytest.mark.timeout(200)
def test_unused_parameters_keep_no_gradient_two_ranks_on_one_gpu() -> None:
    # find_unused_parameters on CUDA: the flags copied to the device, all-reduced
    # (gloo with CUDA tensors) and read back before each step (tests/test_unused_parameters.py)
    from tests.test_unused_parameters import _unused_worker

    for (found, found_none), (zeroed, _) in run_ranks(_unused_worker, 2, 2, {}, DEV, timeout_s=150):
        assert found < 1e-4 and found_none == [], (found, found_none)  # as the fp32 parity above
        assert zeroed > 1e-3, zeroed  # without it, weight decay moves the unused parameters


@pytest.mark.timeout(300)
def test_deferred_replica_reductions_four_ranks_on_one_gpu() -> None:
    # set_requires_replica_sync on CUDA (tests/test_replica_sync.py's last-micro-step
    # skip): wp 2 x 2 replicas, the state over the world, the sums kept and added on the
    # compute stream beside the collectives' (gloo with CUDA tensors)
    from tests.test_unused_parameters import PLANS, _unused_worker

    kw = {"state_sharding": "world", "shard_outer_params": True}
    for (found, found_none), (zeroed, _) in run_ranks(
        _unused_worker, 4, 2, kw, DEV, (True, False), PLANS, True, True, timeout_s=280
    ):
        assert found < 1e-4 and found_none == [], (found, found_none)  # as the fp32 parity above
        assert zeroed > 1e-3, zeroed


@pytest.mark.timeout(200)
def test_a_block_that_uses_none_of_its_weights_two_ranks_on_one_gpu() -> None:
    # a LayerDrop that calls the block and returns its input, on rank 0 only, with
    # find_unused_parameters: the slot freed at the next block's backward, zeros
    # reduce-scattered on CUDA (tests/test_engine_parity.py, where it runs on CPU)
    from tests.test_engine_parity import _identity_block_worker

    for d in run_ranks(_identity_block_worker, 2, 2, {"find_unused_parameters": True}, (0,), DEV, timeout_s=150):
        assert d < 1e-4, d  # fp32 SGD: summation order, which cuBLAS may split otherwise than the CPU (1e-5 there)


@pytest.mark.timeout(300)
def test_bf16_tracks_fp32_two_ranks_on_one_gpu() -> None:
    for r in run_ranks(_parity_worker, 2, "llama", torch.bfloat16, False, timeout_s=280):
        # bf16 compute of every parameter against fp32 training: bf16 rounding (2^-9
        # relative) per operation, as in tests/test_mixed_precision.py
        assert r["loss"] < 2e-2, r


def test_engine_step_never_synchronises_the_host(monkeypatch) -> None:
    """World 1, bf16, everything sharded, checkpointing: forward, backward and clipping
    issue their work without one synchronising call (cudaStreamSynchronize, a
    device-to-host copy, .item()). In the pytest process: its environment is restored
    and its process group destroyed after."""
    import torch.distributed as dist

    for name, value in dict(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())).items():
        monkeypatch.setenv(name, value)
    dist.init_process_group("nccl", device_id=DEV)
    try:
        torch.cuda.set_device(DEV)
        model = Case(bias=True).build().to(DEV)
        cfg = ISPConfig(
            param_dtype=torch.bfloat16,
            reduce_dtype=torch.float32,
            shard_outer_params=True,
            activation_checkpointing=0.5,
        )
        comm = ISPCommunicator(model, ParallelGroups.create(wp_size=1), cfg)
        x = torch.randint(0, 37, (2, 16), device=DEV)
        for step in range(3):
            if step == 2:
                torch.cuda.set_sync_debug_mode("error")
            try:
                loss = F.cross_entropy(model(x).flatten(0, 1).float(), x.flatten())
                loss.backward()
                comm.clip_grad_norm_(1.0)
            finally:
                torch.cuda.set_sync_debug_mode(0)
            for p in model.parameters():
                p.grad = None
        comm.close()
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("nproc, extra", [(1, ["--compile"]), (2, ["--shard-outer"])])
def test_isp_train_on_cuda(tmp_path, nproc: int, extra: list[str]) -> None:
    out = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={nproc}",
        f"--master-port={free_port()}",
        "-m",
        "isp_comm.train",
        "--device",
        "cuda",
        "--steps",
        "4",
        "--out",
        str(out),
        "--no-trace",
        *extra,
    ]
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=280, env=env, cwd=root)
    assert res.returncode == 0, res.stderr[-3000:]
    import json

    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and all("peak_alloc_mib" in r for r in rows), rows[-1]
    assert "cuda bf16" in res.stdout + res.stderr


def test_seeded_meta_init_is_the_same_on_cpu_and_cuda_and_leaves_cuda_rng_alone() -> None:
    """[Note: seeded initialisation on the host]: init_weights of a CUDA model draws on
    the CPU, so it equals the CPU model's, and the GPU's RNG state is untouched."""
    from isp_comm.materialize import init_weights

    cpu, gpu = Case(bias=True).build(), Case(bias=True).build().to(DEV)
    before = torch.cuda.get_rng_state(DEV)
    init_weights(cpu, 11), init_weights(gpu, 11)
    assert torch.equal(torch.cuda.get_rng_state(DEV), before)
    for (name, a), b in zip(cpu.state_dict().items(), gpu.state_dict().values()):
        assert torch.equal(a, b.cpu()), name
