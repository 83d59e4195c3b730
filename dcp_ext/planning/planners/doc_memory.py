"""Memory checks by documents, for layouts whose activations are quadratic in their lengths.

Why a module of its own: on the CPU the core attention keeps each document's softmax
probabilities, so whether a micro-batch fits depends on its documents (sum and max of
their squares), not on its token count (`CostModel.quadratic`). There the planners' token
caps are only upper bounds, and every memory decision goes through these checks of the
micro-batch's padded documents, the same arithmetic as the simulator's memory check. On
GPUs (no quadratic term) none of this is called: their plans stay what the token caps made.

A document alone: `CostModel.max_doc_length` per recompute level (exact); a packed
micro-batch: `bin_check` while packing (its real peak; pipelines: their windows),
`level_bytes` when recompute is raised for 1F1B windows.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from dcp_ext.planning.cost_model import CostModel
from dcp_ext.planning.layout import Layout


def doc_caps(cm: CostModel, layout: Layout, levels: Sequence[int], in_flight: int) -> list[int]:
    """Longest document per recompute level (made monotone: level i holds what a cheaper
    one holds), alone (in_flight 1) or with in_flight - 1 copies of it held (pipelines)."""
    return [int(c) for c in np.maximum.accumulate([cm.max_doc_length(layout, rs, in_flight) for rs in levels])]


def mb_lengths(cm: CostModel, layout: Layout, s: Sequence[int], docs: Sequence[int]) -> list[int]:
    """The padded document lengths of the micro-batch of these document positions (in order)."""
    return cm.padded_lengths(layout, [s[d] for d in docs])


class BinCheck:
    """Whether a micro-batch being packed may take one more document, by its documents.

    pp == 1: the micro-batch fits alone at the packing level `rs`. Pipelines: pp like it fit
    in flight at `rs` (the analogue of the token cap), and at the `top` recompute level pp
    times the replica's largest kept bytes plus its largest transient fit, over every
    micro-batch packed so far and the `fixed` ones (documents already alone): then
    fit_memory, raising recompute where a 1F1B window overflows, always ends with a fit,
    whatever the order. (With token caps both maxima come from the largest micro-batch; with
    squares one may have the most tokens and another the longest document.) A document
    alone in a new micro-batch is never checked: the longest goes first, and kept and
    transient bytes of one document grow with its length, so it never raises the maxima."""

    def __init__(self, cm: CostModel, layout: Layout, s: Sequence[int], rs: int, top: int, fixed=()):
        self.cm, self.layout, self.s, self.rs, self.top = cm, Layout(*layout), s, rs, top
        self.pp = self.layout.pp
        self.free = cm.capacity_bytes - cm.state_bytes(self.layout)
        self.fixed = [self._at_top(docs) for docs in fixed] if self.pp > 1 else []
        self.bins: dict[int, tuple[float, float]] = {}

    def _at_top(self, docs) -> tuple[float, float]:
        keep, trans, _ = self.cm.micro_batch_bytes(self.layout, self.top, mb_lengths(self.cm, self.layout, self.s, docs))
        return keep, trans

    def fits(self, i: int, docs: list[int]) -> bool:
        """Whether bin i (a new one: i not packed yet) may hold these documents."""
        lens = mb_lengths(self.cm, self.layout, self.s, docs)
        if not self.cm.fits_in_flight(self.layout, self.rs, lens, self.pp):
            return False
        if self.pp == 1:
            return True
        others = self.fixed + [kt for j, kt in self.bins.items() if j != i] + [self._at_top(docs)]
        return self.pp * max(k for k, _ in others) + max(t for _, t in others) <= self.free

    def put(self, i: int, docs: list[int]) -> None:
        """Bin i now holds these documents."""
        if self.pp > 1:
            self.bins[i] = self._at_top(docs)


def bin_check(cm: CostModel, layout: Layout, s: Sequence[int], rs: int, top: int, fixed=()) -> BinCheck | None:
    """The packing check of a replica of `layout`; None when its memory has no quadratic
    term (the token caps are then exact)."""
    return BinCheck(cm, layout, s, rs, top, fixed) if cm.quadratic(layout) else None


def fits_alone(cm: CostModel, layout: Layout, s: Sequence[int], mbs) -> bool:
    """Whether every micro-batch (doc positions, rs) fits alone (pp == 1: the replica's peak)."""
    return all(cm.fits_in_flight(layout, rs, mb_lengths(cm, layout, s, docs), 1) for docs, rs in mbs)


def level_bytes(cm: CostModel, layout: Layout, levels: Sequence[int], s: Sequence[int],
                mbs) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(kept, transient, peak alone) bytes of every micro-batch at every recompute level:
    arrays [micro-batch, level] for fit_memory."""
    out = np.empty((3, len(mbs), len(levels)))
    for i, (docs, _) in enumerate(mbs):
        lens = mb_lengths(cm, layout, s, docs)
        for j, rs in enumerate(levels):
            out[:, i, j] = cm.micro_batch_bytes(layout, rs, lens)
    return out[0], out[1], out[2]
