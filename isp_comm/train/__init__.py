"""isp-train: the main job (a reference llama trained with ISP under torchrun)."""
