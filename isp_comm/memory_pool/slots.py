"""WHERE gathered bytes land: a fixed set of slots, one block per slot at a time."""

from __future__ import annotations

from collections.abc import Callable

import torch

from isp_comm.memory_pool.plan import MemoryPlan

Alloc = Callable[[int, torch.dtype], torch.Tensor]
RETIRED = -1
"""The owner of a slot an abandoned collective may still write (``SlotPool.retire``)."""


class SlotPool:
    """``n_slots`` gathered-block buffers per dtype, plus one staging buffer.

    [Note: slot lifetime] A slot is owned by one block from ``acquire`` to ``release``.
    Autograd may hold views of a slot for a block's backward (saved weights); the
    engine re-gathers that block into the *same* slot before its backward, so those
    views see the right bytes again. With ``pooled=False`` (for comparison) a slot's
    storage is allocated on acquire and freed on release (resized to 0, as FSDP2
    frees unsharded parameters, so the saved views stay valid handles); the capacity
    rule is the same.
    """

    def __init__(self, plan: MemoryPlan, alloc: Alloc, pooled: bool) -> None:
        self.plan = plan
        self._alloc = alloc
        self._pooled = pooled
        self._slots: dict[torch.dtype, list[torch.Tensor]] = {}
        self._owner: dict[torch.dtype, list[int | None]] = {}
        self._staging: dict[torch.dtype, torch.Tensor | None] = {}
        for dt, n in plan.slot_numel.items():
            self._slots[dt] = [alloc(n if pooled else 0, dt) for _ in range(plan.n_slots)]
            self._owner[dt] = [None] * plan.n_slots
            sn = plan.staging_numel[dt]
            self._staging[dt] = alloc(sn, dt) if pooled and sn else None
        self._send = {dt: alloc(n, dt) for dt, n in plan.send_numel.items() if pooled and n}
        self.live_bytes = 0
        self.peak_live_bytes = 0
        self.fallbacks = 0

    def owner(self, dtype: torch.dtype, slot: int) -> int | None:
        return self._owner[dtype][slot]

    def free_slot(self, dtype: torch.dtype, preferred: int, strict: bool) -> int | None:
        """The preferred slot when free; else (unless ``strict``) any free one."""
        owners = self._owner[dtype]
        if owners[preferred] is None:
            return preferred
        if strict:
            return None
        for i, o in enumerate(owners):
            if o is None:
                return i
        return None

    def acquire(self, dtype: torch.dtype, slot: int, block: int, numel: int, preferred: int) -> torch.Tensor:
        owners = self._owner[dtype]
        assert owners[slot] is None, f"slot {slot} is held by block {owners[slot]}"
        owners[slot] = block
        if slot != preferred:
            self.fallbacks += 1
        buf = self._slots[dtype][slot]
        if not self._pooled:
            storage = buf.untyped_storage()
            storage.resize_(numel * dtype.itemsize)
            buf = torch.empty(0, dtype=dtype, device=buf.device).set_(storage, 0, (numel,))
        self.live_bytes += numel * dtype.itemsize
        self.peak_live_bytes = max(self.peak_live_bytes, self.live_bytes)
        return buf[:numel]

    def release(self, dtype: torch.dtype, slot: int, block: int, numel: int) -> None:
        owners = self._owner[dtype]
        assert owners[slot] == block, f"block {block} releases slot {slot} held by {owners[slot]}"
        owners[slot] = None
        self.live_bytes -= numel * dtype.itemsize
        if not self._pooled:
            self._slots[dtype][slot].untyped_storage().resize_(0)

    def retire(self, dtype: torch.dtype, slot: int, block: int, numel: int) -> None:
        """Like ``release``, but the slot is never handed out again: a collective that
        may still write it was abandoned (its memory stays with whoever keeps it)."""
        owners = self._owner[dtype]
        assert owners[slot] == block, f"block {block} retires slot {slot} held by {owners[slot]}"
        owners[slot] = RETIRED
        self.live_bytes -= numel * dtype.itemsize

    def retire_staging(self, dtype: torch.dtype) -> None:
        """The landing buffer may still be written by an abandoned gather: later
        gathers get a buffer of their own."""
        self._staging[dtype] = None

    def staging(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        buf = self._staging[dtype]
        if buf is None or not self._pooled:
            return self._alloc(numel, dtype)
        return buf[:numel]

    def send(self, dtype: torch.dtype, numel: int) -> torch.Tensor | None:
        """The pool's cast send buffer of ``dtype`` when it holds ``numel`` elements
        (a symmetric one on a backend that serves them), else ``None``."""
        buf = self._send.get(dtype)
        return buf if buf is not None and buf.numel() >= numel else None

    def held(self) -> int:
        return sum(o is not None for owners in self._owner.values() for o in owners)

    def close(self) -> None:
        self._slots.clear()
        self._staging.clear()
        self._send.clear()


class ReduceScatterBuffers:
    """``k`` reusable (input, output) buffer pairs per reduce dtype; bounds in-flight RS.

    [Note: reduce-scatter pairs between backwards]
    The pooled pairs are sized once, by the plan, for every block. Kept for the whole
    run (``release=False``) they are alive at every moment of a step, the forward's and
    the loss's included, when no block reduces. With ``release=True`` none is made at
    wrap: a pair is made when a reduce finds none free (so at most ``k`` per dtype, as
    the engine never has more in flight), and :meth:`release_idle`, called when the
    backward has drained, drops them all, so that the forward, the loss's backward
    and the optimizer step can use their bytes. It is called only when every pair is
    back, that is after the engine has waited for each pair's collectives on the current
    stream. On CUDA the caching allocator hands a freed block out again to work on the
    stream it was made on: the forward's, on which autograd runs the blocks' backward,
    while the backward's end runs on the stream ``backward()`` was called on. Where the
    two differ (a forward on a side stream), each pair is recorded on the ending stream
    before it is dropped, so its bytes are not reused before that stream's waits (on
    the allocation stream itself the record is nothing). A pair
    that an abandoned step may still write is never handed back (``in_use`` stays
    above zero), as [Note: buffers of a failed step] in ``isp_comm/hooks/engine.py`` says.
    """

    def __init__(self, plan: MemoryPlan, alloc: Alloc, pooled: bool, release: bool = False) -> None:
        self._plan = plan
        self._alloc = alloc
        self._pooled = pooled
        self._release = pooled and release
        self._free: dict[torch.dtype, list[tuple[torch.Tensor, torch.Tensor]]] = {dt: [] for dt in plan.rs_numel}
        self._made: dict[torch.dtype, list[tuple[torch.Tensor, torch.Tensor]]] = {dt: [] for dt in plan.rs_numel}
        """Every pooled pair alive, free or in use (what the memory breakdown reads)."""
        self._lent: list[tuple[torch.Tensor, torch.Tensor]] = []
        """Without the pool: the pairs made for the reduces in flight (the breakdown reads them too)."""
        if pooled and not self._release:
            for dt in plan.rs_numel:
                for _ in range(plan.rs_buffers):
                    self._free[dt].append(self._make(dt))
        self.in_use = 0
        self.peak_in_use = 0

    def _make(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        pair = (self._alloc(self._plan.rs_numel[dtype], dtype), self._alloc(self._plan.rs_out_numel(dtype), dtype))
        self._made[dtype].append(pair)
        return pair

    def acquire(self, dtype: torch.dtype, numel: int, out_numel: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A free (input, output) pair at least ``numel`` / ``out_numel`` long (the
        pooled ones are sized by the plan for every group); the caller slices it and
        hands the same pair back to ``release``."""
        if self._pooled:
            free = self._free[dtype]
            inp, out = free.pop() if free or not self._release else self._make(dtype)
            assert inp.numel() >= numel and out.numel() >= out_numel, "the plan sized the buffers for every group"
        else:
            inp, out = self._alloc(numel, dtype), self._alloc(out_numel, dtype)
            self._lent.append((inp, out))
        self.in_use += 1
        self.peak_in_use = max(self.peak_in_use, self.in_use)
        return inp, out

    def release(self, dtype: torch.dtype, pair: tuple[torch.Tensor, torch.Tensor]) -> None:
        self.in_use -= 1
        if self._pooled:
            self._free[dtype].append(pair)
        else:
            self._lent[:] = [p for p in self._lent if p[0] is not pair[0]]  # in place: the breakdown holds the list

    def held_bytes(self) -> int:
        """Bytes of the pooled pairs alive now."""
        return sum(t.nbytes for pairs in self._made.values() for pair in pairs for t in pair)

    def release_idle(self) -> None:
        """With ``release``: drop every pair when none is in use (see the note above)."""
        if self._release and self.in_use == 0:
            for dt in self._free:
                for t in (t for pair in self._made[dt] for t in pair if t.is_cuda):
                    t.record_stream(torch.cuda.current_stream(t.device))
                self._free[dt], self._made[dt] = [], []

    def close(self) -> None:
        self._free.clear()
        self._made.clear()
        self._lent.clear()
