"""Will it fit? A 7B llama on 8 GPUs, forecast on one CPU process: python examples/forecast.py"""

import torch

from isp_comm import ISPConfig, forecast
from isp_comm.models.llama import Llama, LlamaConfig

with torch.device("meta"):  # no memory: the forecast reads shapes and traces one forward
    cfg = LlamaConfig(vocab_size=32000, hidden=4096, ffn_hidden=11008, n_layers=32, n_heads=32, n_kv_heads=32)
    model = Llama(cfg)
config = ISPConfig(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, activation_checkpointing=1.0)
fc = forecast(model, config, world=8, wp=8, sp=1, batch=8, seq=4096, optimizer="adamw", device="cuda")
print(fc.table())  # MiB per rank: parts down, phases (wrap ... load) across
worst = fc.worst()  # the phase with the highest peak
part, nbytes = fc.biggest(worst)
print(f"highest: {worst}, {fc.peak(worst) / 2**30:.1f} GiB per GPU; its biggest part: {part}, {nbytes / 2**30:.1f} GiB")
