"""Sequence parallel (Ulysses): all-to-all around attention, sequence <-> head split."""

from isp_comm.sequence_parallel.all_to_all import all_to_all
from isp_comm.sequence_parallel.attention import DistributedAttention, kv_repeats

__all__ = ["DistributedAttention", "all_to_all", "kv_repeats"]
