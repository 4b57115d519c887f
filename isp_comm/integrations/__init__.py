"""Adapters that bring isp-comm's pieces to other libraries (FSDP2, transformers)."""
