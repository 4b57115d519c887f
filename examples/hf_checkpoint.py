"""A Hugging Face model in and out of the shards: torchrun --standalone --nproc-per-node 2 examples/hf_checkpoint.py"""

import torch
import torch.distributed as dist
import transformers

from isp_comm import ISPCommunicator, ISPConfig, ParallelGroups
from isp_comm.testing import tiny_hf_config

dist.init_process_group()
folder = "tiny-llama"  # a model folder as from_pretrained reads it; made here, use your own
if dist.get_rank() == 0:
    transformers.AutoModelForCausalLM.from_config(tiny_hf_config("llama")).save_pretrained(folder)
dist.barrier()
with torch.device("meta"):  # nothing allocated
    config = transformers.AutoConfig.from_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
comm = ISPCommunicator(model, ParallelGroups.create(wp_size=2), ISPConfig(shard_outer_params=True))
comm.load_hf_checkpoint(folder)  # each rank reads only its own rows of every sharded tensor
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
x = torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(dist.get_rank()))
model(input_ids=x, labels=x).loss.backward()
opt.step()
comm.save_hf_checkpoint("tiny-llama-trained")  # what AutoModelForCausalLM.from_pretrained loads
full = comm.full_state_dict(rank0_only=True)  # every rank takes part; rank 0 keeps it
if dist.get_rank() == 0:
    saved = transformers.AutoModelForCausalLM.from_pretrained("tiny-llama-trained").state_dict()
    assert all(torch.equal(saved[k], v) for k, v in full.items()), "the saved folder differs from the shards"
    print(f"saved {len(full)} tensors to tiny-llama-trained/, equal to the trained shards")
comm.close()
dist.destroy_process_group()
