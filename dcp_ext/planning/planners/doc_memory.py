"""Memory checks by documents, for layouts whose activations are quadratic in their lengths.

Why a module of its own: on the CPU the core attention keeps each document's softmax
probabilities, so whether a micro-batch fits depends on its documents (sum and max of
their squares), not on its token count (`CostModel.quadratic`). There the planners' token
caps are only upper bounds, and every memory decision goes through these checks of the
micro-batch's padded documents, the same arithmetic as the simulator's memory check. On
GPUs (no quadratic term) none of this is called: their plans stay what the token caps made.

A document alone: `CostModel.max_doc_length` per recompute level (exact); a packed
micro-batch: `bin_check` while packing (its real peak), `level_bytes` when recompute is
raised for 1F1B windows.
"""
from __future__ import annotations

from typing import Callable, Sequence

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


def bin_check(cm: CostModel, layout: Layout, s: Sequence[int], rs: int = 0,
              in_flight: int = 1) -> Callable[[list[int]], bool] | None:
    """For packing: whether a micro-batch of the given document positions fits at `rs`
    (alone; with pipelines as `in_flight` like it, the analogue of a token cap). None when
    the layout's memory has no quadratic term (token caps are then exact)."""
    if not cm.quadratic(layout):
        return None
    return lambda docs: cm.fits_in_flight(layout, rs, mb_lengths(cm, layout, s, docs), in_flight)


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
