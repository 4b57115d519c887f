"""CUDA: what the caching allocator holds that no tracked tensor does, from its own
snapshot (``torch.cuda.memory._snapshot``), by what it is.

[Note: untracked blocks]
Every block the allocator has handed out and not taken back (``active_allocated``) is
either a tracked storage (its address is one's data pointer) or not. The ones that
are not were allocated outside any operator: cuBLAS's workspaces ([Note: cuBLAS's
workspaces] in ``isp_comm/memory_forecast/weights.py``), NCCL's or a library's own
buffers. A block is a cuBLAS workspace when the stack recorded with it names one
(``torch.cuda.memory._record_memory_history(stacks="all")`` records C++ frames:
``getNewWorkspace``, ``setWorkspaceForHandle``), or, without a recorded stack, when
its size is exactly a cuBLAS workspace's. Taken at the end of a run, the snapshot
shows what persists (the workspaces do, for the process's life), not what a phase's
peak held for a moment.
"""

from __future__ import annotations

from typing import Any

WORKSPACE_FRAMES = ("getNewWorkspace", "setWorkspaceForHandle", "getCUDABlasLtWorkspace", "cublas")
"""Names in a block's recorded stack that make it a cuBLAS (or cuBLASLt) workspace."""


def _is_workspace(block: dict[str, Any], workspace_bytes: int) -> bool:
    frames = block.get("frames") or []
    if frames:
        return any(any(w in str(f.get("name", "")) for w in WORKSPACE_FRAMES) for f in frames)
    return block.get("size") == workspace_bytes


def untracked_blocks(snapshot: dict[str, Any], tracked: set[int], workspace_bytes: int) -> dict[str, int]:
    """Bytes of the snapshot's allocated blocks whose address is no tracked storage's
    (``tracked``: data pointers), as ``workspace: cuBLAS`` and ``untracked (other)``
    (see [Note: untracked blocks])."""
    out = {"workspace: cuBLAS": 0, "untracked (other)": 0}
    for segment in snapshot.get("segments", []):
        address = segment.get("address", 0)
        for block in segment.get("blocks", []):
            start = block.get("address", address)
            address = start + block["size"]
            if block.get("state") != "active_allocated" or start in tracked:
                continue
            kind = "workspace: cuBLAS" if _is_workspace(block, workspace_bytes) else "untracked (other)"
            out[kind] += block["size"]
    return {k: v for k, v in out.items() if v}


def allocator_now(tracked: set[int]) -> dict[str, int]:
    """This process's allocator now: its untracked blocks by kind (an empty dict
    without CUDA in use)."""
    import torch

    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return {}
    from isp_comm.memory_forecast.weights import cublas_workspace_bytes

    return untracked_blocks(torch.cuda.memory._snapshot(), tracked, cublas_workspace_bytes())
