"""This rank's part of one iteration's plan, resolved once.

Why it exists: the plan (docs/contracts.md) says what every replica runs; a rank needs
only its own share: which replica it is in and at which stage, its micro-batches, how
they are padded (CP chunks, sequence parallelism, under every layer strategy they use),
which alternative layers it binds, and the key of the iteration's exchange layout.
Everything here follows from the plan alone, so every rank derives every peer's
answers the same way without talking.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from dcp_ext.data.thd import materialize
from dcp_ext.planning.plan import IterationPlan
from dcp_ext.runtime.schedule.executor import localize
from dcp_ext.runtime.stages.alternatives import stage_strategies, switch_needs


class NotRegistered(KeyError):
    """The plan names a replica type (or layer strategies) the engine was not built for."""


@dataclass(frozen=True)
class LocalPlan:
    it: IterationPlan
    index: int  # the replica's position in the plan
    replica: object  # plan.ReplicaPlan
    stage: object  # stages.bank.Stage this rank plays
    coords: tuple[int, int, int]  # (tp rank, cp rank, pp rank) in the replica
    pad_each_to: int
    pad_total_to: int
    needs: tuple  # per replica, per stage: the alternative layers it binds; () when nothing switches
    num_layers: int

    @classmethod
    def resolve(cls, it: IterationPlan, bank) -> "LocalPlan":
        """bank: the stages.bank.StageBank this rank's stages live in."""
        index, replica = next((i, r) for i, r in enumerate(it.replicas) if bank.rank in r.ranks)
        rep = replica.replica_type
        if rep not in bank.stages:
            raise NotRegistered(f"iteration {it.index}: replica {rep} was not registered at start")
        if any(mb.layer_strategies for mb in replica.micro_batches) and rep not in bank.alternatives:
            raise NotRegistered(f"iteration {it.index}: the plan gives layer strategies but the engine was built "
                                "without layer_strategies")
        needs = tuple(switch_needs(r, bank.num_layers) for r in it.replicas) if bank.alt_runs else ()
        if not any(n for per_replica in needs for n in per_replica):
            needs = ()
        each, total = padding(rep, replica, bank.sequence_parallel)
        return cls(it, index, replica, bank.stages[rep], rep.coords(bank.rank), each, total, needs, bank.num_layers)

    @property
    def my_needs(self) -> tuple:
        """The (strategy, stage-local layer) pairs this rank binds besides its stage."""
        return self.needs[self.index][self.coords[2]] if self.needs else ()

    def layout_key(self):
        """The exchange layout's cache key: the plan's layout and, when layers switch, what each binds."""
        if not self.needs:
            return self.it.layout_key()
        return self.it.layout_key(), tuple((r.replica_type, n) for r, n in zip(self.it.replicas, self.needs))

    def fetch(self, dataset, eod_mask_loss: bool = False, eod: int | None = None) -> list:
        """The replica's micro-batches read from a document dataset and packed (THD, padded)."""
        return [materialize(dataset, mb.sample_ids, pad_each_to=self.pad_each_to, pad_total_to=self.pad_total_to,
                            eod_mask_loss=eod_mask_loss, eod=eod) for mb in self.replica.micro_batches]

    def localize(self, batches: list, device) -> list:
        """This rank's CP chunk and TP slice of each packed micro-batch, on the device, with
        the strategy of each of its stage's layers when the plan switches them."""
        stage = self.stage
        out = []
        for b, mb in zip(batches, self.replica.micro_batches):
            local = localize(b, stage.rep.cp, self.coords[1], stage.rep.tp, stage.sequence_parallel,
                             stage.config.hidden_size, mb.recompute_layers, device=device,
                             lengths_on_host=stage.lengths_on_host)
            local.strategies = stage_strategies(mb, self.replica, self.coords[2], self.num_layers)
            out.append(local)
        return out


def padding(rep, replica=None, sequence_parallel: bool = False) -> tuple[int, int]:
    """(pad_each_to, pad_total_to) a micro-batch needs under replica type `rep` (and, given
    the replica's plan, under every layer strategy its micro-batches use)."""
    strategies = {(rep.tp, rep.cp)} | {(s.tp, s.cp) for mb in (replica.micro_batches if replica else ())
                                       for s in mb.layer_strategies or ()}
    cp = math.lcm(*(c for _, c in strategies))
    each = 2 * cp if cp > 1 else 1
    sp = sequence_parallel and any(t > 1 for t, _ in strategies)  # the home one included
    total = rep.tp * rep.cp if sp else 1
    return each, total
