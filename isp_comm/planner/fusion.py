"""What inductor's fusion makes of a compiled block's element-wise operators: the
kernels it launches and the bytes they move, from the storages each operator of the
meta trace reads and writes.

[Note: fused regions]
A compiled block (``torch.compile``, inductor) runs its matrix products and attention
as library calls, and fuses the element-wise operators and reductions between them
into generated kernels. A fused kernel reads its inputs from memory once and writes
only what is used outside it: what a later operator elsewhere reads (a matrix product,
attention, another kernel, the next block, the backward) and what the graph returns
(the block's output, the tensors saved for backward, the gradients). Its intermediate
values never reach memory. So a compiled graph's element-wise operators are grouped
into regions, each costed as one kernel of its external bytes:

* an operator joins the regions of the operators whose outputs it reads (producer
  and consumer fuse), unless a matrix product or attention lies on a path between
  them: one kernel cannot both feed a product and wait for it. So a residual sum
  kept across the MLP is written out (the sum after the down projection cannot be in
  its kernel), and a weight's cast joins the norm that reads it (nothing lies between);
* a region reads once each storage it did not make (the bytes the views it reads
  address, at most the storage's; an input it writes in place is read too), and
  writes each storage that is read outside it, returned by the graph, or that it did
  not make (written in place).

Program order is not the cut: in SwiGLU the up projection runs between the gate's
SiLU and the product of the two, yet nothing flows from SiLU into that projection, so
both land in one kernel, as inductor's scheduler fuses them. Not modelled: horizontal
fusion (two regions that share a read and nothing else each read it), a region split
into several kernels (reductions over different axes, as a norm's weight gradient
beside its input gradient), products with fused prologues or epilogues (max-autotune's
templates), and CUDA graphs (``mode="reduce-overhead"``).
"""

from __future__ import annotations

import dataclasses

import torch


def storage_of(t: torch.Tensor) -> int:
    """An identity of ``t``'s storage, shared by its views (unique while it lives)."""
    return t.untyped_storage()._cdata


def addressed_bytes(t: torch.Tensor) -> int:
    """Bytes of memory ``t`` addresses: a broadcast (stride 0) or a slice reads no
    more than its extent in its storage."""
    if t.numel() == 0:
        return 0
    extent = 1 + sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride()))
    return min(t.numel(), extent, t.untyped_storage().nbytes() // t.element_size()) * t.element_size()


def _bits(mask: int) -> list[int]:
    """The positions of ``mask``'s set bits."""
    out = []
    while mask:
        low = mask & -mask
        out.append(low.bit_length() - 1)
        mask ^= low
    return out


def _tensors(x: object) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, dict):
        return _tensors(list(x.values()))
    if isinstance(x, (list, tuple)):
        return [t for y in x for t in _tensors(y)]
    return []


@dataclasses.dataclass
class _Event:
    """One operator: the views it reads (by view: storage, offset, shape, stride; bytes
    addressed), the storages it writes (bytes), and whether it is a cut (a matrix
    product or attention)."""

    reads: dict[tuple, int]
    writes: dict[int, int]
    cut: bool


@dataclasses.dataclass
class _Graph:
    """One run of a compiled graph: its events, what it returns, whom to charge."""

    owner: object
    events: list[int] = dataclasses.field(default_factory=list)
    outputs: set[int] = dataclasses.field(default_factory=set)


class StorageLog:
    """Every operator's reads and writes by storage, in the order they ran, and the
    compiled graphs' runs among them. The storages are kept alive, so their identities
    stay unique for the whole trace; the tensors are not, which would change what
    autograd does (a gradient referenced elsewhere is copied into ``.grad``, not stolen)."""

    def __init__(self) -> None:
        self.events: list[_Event] = []
        self.graphs: list[_Graph] = []
        self.readers: dict[int, set[int]] = {}  # storage -> events reading it
        self.storage_bytes: dict[int, int] = {}
        self.born: dict[int, int] = {}  # storage -> the first event that touched it
        self.alive: dict[int, torch.UntypedStorage] = {}
        self.running: _Graph | None = None

    def record(self, args: object, out: object, cut: bool) -> None:
        """An operator that ran: its tensor arguments read, its outputs written."""
        index, reads, writes = len(self.events), {}, {}
        for t in _tensors(args):
            key = storage_of(t)
            reads[(key, t.storage_offset(), tuple(t.shape), tuple(t.stride()))] = addressed_bytes(t)
            self.readers.setdefault(key, set()).add(index)
            self.born.setdefault(key, index)
            self._keep(key, t)
        for t in _tensors(out):
            key = storage_of(t)
            writes[key] = writes.get(key, 0) + addressed_bytes(t)
            self.born.setdefault(key, index)
            self._keep(key, t)
        self.events.append(_Event(reads, writes, cut))
        if self.running is not None:
            self.running.events.append(index)

    def _keep(self, key: int, t: torch.Tensor) -> None:
        if key not in self.alive:
            self.alive[key] = t.untyped_storage()
            self.storage_bytes[key] = self.alive[key].nbytes()

    def begin(self, owner: object) -> None:
        """A compiled graph starts running, charged to ``owner``."""
        self.running = _Graph(owner)
        self.graphs.append(self.running)

    def end(self, outputs: object) -> None:
        """The running graph returned ``outputs``."""
        assert self.running is not None
        self.running.outputs = {storage_of(t) for t in _tensors(outputs)}
        for t in _tensors(outputs):
            self._keep(storage_of(t), t)
        self.running = None

    def regions(self) -> list[tuple[object, list[float]]]:
        """Per graph run: its owner and the external bytes of each fused region
        ([Note: fused regions]), in the order the regions start."""
        return [(g.owner, self._regions(g)) for g in self.graphs]

    def _regions(self, g: _Graph) -> list[float]:
        made: dict[int, int] = {}  # storage -> the graph's event writing it (its position in g.events)
        above: list[int] = []  # per event: a bit for each event it depends on
        cuts, region_of, regions = 0, [], []  # regions: [members' bits, what they depend on, events]
        for pos, e in enumerate(g.events):
            ev = self.events[e]
            sources = {made[k] for k, *_ in ev.reads if k in made}
            above.append(0)
            for s in sources:
                above[pos] |= above[s] | 1 << s
            for k in ev.writes:
                made.setdefault(k, pos)
            region_of.append(None)
            if ev.cut:
                cuts |= 1 << pos
                continue
            mine = [1 << pos, above[pos], [e]]
            for r in {region_of[s] for s in sources if region_of[s] is not None}:
                if self._fusable(mine, regions[r], above, cuts):
                    mine = [mine[0] | regions[r][0], mine[1] | regions[r][1], mine[2] + regions[r][2]]
                    regions[r] = None
            regions.append(mine)
            for pos_ in _bits(mine[0]):
                region_of[pos_] = len(regions) - 1
        kept = sorted((r[2] for r in regions if r is not None), key=min)
        return [float(self._external(set(m), g)) for m in kept]

    @staticmethod
    def _fusable(a: list, b: list, above: list[int], cuts: int) -> bool:
        """Whether two regions fuse: no matrix product or attention depends on one of
        them and is depended on by the other (one kernel would wait on itself)."""
        members, depends = a[0] | b[0], a[1] | b[1]
        return not any(above[c] & members for c in _bits(depends & cuts))

    def _maker(self, key: int) -> int | None:
        """The operator that made storage ``key``: its first in the whole trace, when
        that one writes it without reading it (else it came from outside the trace's
        operators, or the first saw it as an input written in place)."""
        first = self.born[key]
        made = key in self.events[first].writes and all(view[0] != key for view in self.events[first].reads)
        return first if made else None

    def _external(self, region: set[int], g: _Graph) -> int:
        """Bytes a region reads from memory and writes to it: what it reads of storages
        it did not make, and what it writes that leaves it (read by another operator,
        returned by the graph, or a storage it did not make, written in place)."""
        written = {k for e in region for k in self.events[e].writes}
        own = {k for k in written if self._maker(k) in region}
        views = {view: n for e in region for view, n in self.events[e].reads.items() if view[0] not in own}
        reads: dict[int, int] = {}
        for (k, *_), nbytes in views.items():
            reads[k] = reads.get(k, 0) + nbytes
        total = sum(min(n, self.storage_bytes[k]) for k, n in reads.items())
        for k in written:
            used = any(r not in region for r in self.readers.get(k, ()))
            if used or k in g.outputs or k not in own:
                total += min(self.storage_bytes[k], max(self.events[e].writes.get(k, 0) for e in region))
        return total
