"""Process groups of every candidate replica, created once at start and reused.

`torch.distributed.new_group` is collective (every rank calls it, in the same order) and
megatron-core's `destroy_model_parallel` leaks, so the runtime never re-initialises:
the registry walks the planner's finite set of replica types in one deterministic
order, creates each distinct rank set once, and hands each rank a megatron-core
`ProcessGroupCollection` for every replica it can be part of. Megatron order inside a
replica: tp fastest, then cp, then pp.

On GPU runs the registry also creates one gloo group over every rank, last (`host_group`):
the step's host numbers (its timings) reduce over it without waiting for the device.
megatron-core's embedding group is not handed to the stages: its one use there, summing
a tied embedding's initial values over the first and last stage at construction, has
no values to sum (the pull fills them) and the runtime sums tied gradients at the owner.

Every group waits as long as the default one (`--distributed-timeout-minutes`, which the
start-up hands over with `set_group_timeout`; torch's own default for a new group is 30
minutes whatever the default group's is), so a rank that stops answering ends the job in
that time on any layout.
"""
from __future__ import annotations

import datetime
from typing import Optional, Sequence

import torch.distributed as dist

from dcp_ext.planning.layout import ReplicaType, distinct_groups

_timeout: Optional[datetime.timedelta] = None


def set_group_timeout(timeout: Optional[datetime.timedelta]) -> None:
    """The timeout of every group a registry creates from now on (None: torch's default)."""
    global _timeout
    _timeout = timeout


def group_timeout() -> Optional[datetime.timedelta]:
    return _timeout


class GroupRegistry:
    """Creates (once) and serves the process groups of a fixed set of replica types."""

    def __init__(self, replica_types: Sequence[ReplicaType], host_group: bool = False,
                 timeout: Optional[datetime.timedelta] = None):
        """host_group: also create a gloo group over every rank (GPU runs; CPU runs use the
        default group, which is gloo already: `host_group` is then None). timeout: of every
        group (default: `set_group_timeout`'s, the run's --distributed-timeout-minutes)."""
        self.timeout = timeout if timeout is not None else _timeout
        self.replica_types = sorted(set(replica_types), key=ReplicaType.sort_key)
        self.world_size = dist.get_world_size()
        self.rank = dist.get_rank()
        self._groups: dict[tuple[int, ...], object] = {}
        for rank_set in distinct_groups(self.replica_types):
            self._group(rank_set)
        self._collections: dict[ReplicaType, object] = {}
        self.host_group = dist.new_group(backend="gloo", use_local_synchronization=False,
                                         timeout=self.timeout) if host_group else None

    @property
    def num_groups(self) -> int:
        return len(self._groups)

    def _group(self, ranks: tuple[int, ...]):
        ranks = tuple(sorted(ranks))
        if ranks not in self._groups:
            # every rank takes part in every creation, in the same order
            self._groups[ranks] = dist.new_group(list(ranks), use_local_synchronization=False, timeout=self.timeout)
        return self._groups[ranks]

    def rank_sets(self) -> list[tuple[int, ...]]:
        """Every rank set a group was created for, in creation order."""
        return list(self._groups)

    def group(self, ranks: Sequence[int]):
        key = tuple(sorted(ranks))
        if key not in self._groups:
            raise KeyError(f"no process group for ranks {key}: not part of any registered replica")
        return self._groups[key]

    def single_rank_collection(self):
        """Groups of size one: for building the full model (canonical space, references)."""
        from megatron.core.process_groups_config import ProcessGroupCollection

        me = self._group((self.rank,))
        return ProcessGroupCollection(tp=me, cp=me, pp=me, tp_cp=me, mp=me, embd=None, pos_embd=me, dp=me,
                                      dp_cp=me, intra_dp_cp=me, tp_dp_cp=me)

    def collection(self, rep: ReplicaType):
        """megatron-core ProcessGroupCollection for this rank's position in `rep`."""
        if rep in self._collections:
            return self._collections[rep]
        from megatron.core.process_groups_config import ProcessGroupCollection

        t, c, p = rep.coords(self.rank)
        first = rep.rank_at(t, c, 0)
        pgs = ProcessGroupCollection(
            tp=self.group(rep.tp_ranks(c, p)),
            cp=self.group(rep.cp_ranks(t, p)),
            pp=self.group(rep.pp_ranks(t, c)),
            tp_cp=self.group(rep.tp_cp_ranks(p)),
            mp=self.group([rep.rank_at(tt, c, pp) for pp in range(rep.pp) for tt in range(rep.tp)]),
            embd=None,  # see the module's note
            pos_embd=self.group([first]),
            dp=self.group([self.rank]),
            dp_cp=self.group(rep.cp_ranks(t, p)),
            intra_dp_cp=self.group(rep.cp_ranks(t, p)),
            tp_dp_cp=self.group(rep.tp_cp_ranks(p)),
        )
        self._collections[rep] = pgs
        return pgs

