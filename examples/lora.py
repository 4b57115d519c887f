"""LoRA through peft, adapters sharded with their blocks: torchrun --standalone --nproc-per-node 2 examples/lora.py"""

import peft
import torch
import torch.distributed as dist
import transformers

from isp_comm import ISPCommunicator, ISPConfig, ParallelGroups
from isp_comm.testing import tiny_hf_config

dist.init_process_group()
torch.manual_seed(0)  # the same base weights and adapters on every rank
base = transformers.AutoModelForCausalLM.from_config(tiny_hf_config("llama"))
model = peft.get_peft_model(base, peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
comm = ISPCommunicator(model, ParallelGroups.create(wp_size=2), ISPConfig())  # wrap after get_peft_model
opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
torch.manual_seed(1 + dist.get_rank())  # each rank: its own batch
for _ in range(3):
    x = torch.randint(0, 300, (2, 16))
    model(input_ids=x, labels=x).loss.backward()  # only the adapters' gradients are reduce-scattered
    opt.step()
    opt.zero_grad()
reduced = comm.stats()["bytes_reduced"]  # the adapters' gradients, a few KB a step
if dist.get_rank() == 0:
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    print(f"{trainable} adapter values in rank 0's shards; {reduced} bytes of gradients reduced in 3 steps")
comm.close()
dist.destroy_process_group()
