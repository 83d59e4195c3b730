"""The process groups a set of replica types needs, counted per rank.

Why it exists: the runtime creates every group its replica types use once, at start
(`dcp_ext.runtime.groups`), and on NCCL each group of two or more ranks is a communicator
with its own device buffers. The planner decides which types exist, so it must know how
many communicators a rank ends up in and charge their memory (`CostModel.state_bytes`);
`scripts/scale_check.py` prints the count at scale. Pure functions: the registry and the
planner walk the same rank sets in the same order.
"""
from __future__ import annotations

from typing import Iterable, Iterator

from dcp_ext.planning.layout import ReplicaType


def rank_sets(rep: ReplicaType) -> Iterator[tuple[int, ...]]:
    """Every rank set a replica's megatron-core groups use (tp, cp, tp-cp, pp, embedding,
    position embedding, model parallel, one-rank), in a deterministic order."""
    for p in range(rep.pp):
        for c in range(rep.cp):
            yield rep.tp_ranks(c, p)
        for t in range(rep.tp):
            yield rep.cp_ranks(t, p)
        yield rep.tp_cp_ranks(p)
    for c in range(rep.cp):
        for t in range(rep.tp):
            yield rep.pp_ranks(t, c)
            yield tuple(sorted({rep.rank_at(t, c, 0), rep.rank_at(t, c, rep.pp - 1)}))
            yield (rep.rank_at(t, c, 0),)
        yield tuple(rep.rank_at(tt, c, pp) for pp in range(rep.pp) for tt in range(rep.tp))
    for r in rep.ranks:
        yield (r,)


def distinct_groups(types: Iterable[ReplicaType]) -> list[tuple[int, ...]]:
    """The distinct rank sets of `types`, in creation order (sorted types, then `rank_sets`)."""
    seen: dict[tuple[int, ...], None] = {}
    for rep in sorted(set(types), key=ReplicaType.sort_key):
        for ranks in rank_sets(rep):
            seen.setdefault(tuple(sorted(ranks)), None)
    return list(seen)


def communicators_per_rank(types: Iterable[ReplicaType], world: int) -> list[int]:
    """For each rank, the groups of two or more ranks it belongs to: its communicators
    (a one-rank group moves no data and holds no transport buffers)."""
    counts = [0] * world
    for ranks in distinct_groups(types):
        if len(ranks) > 1:
            for r in ranks:
                counts[r] += 1
    return counts
