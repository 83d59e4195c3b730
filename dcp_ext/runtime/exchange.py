"""Pull parameters into an iteration's layout, push gradients back to their owner shards.

Two implementations of the same contract, so each checks the other:
- `allgather`: every rank gathers the whole canonical vector (pull) and all-reduces a
  full-size gradient vector (push). Simple, and the baseline for bytes moved.
- `targeted`: every rank receives exactly the elements its local parameters need and
  sends each gradient contribution straight to the element's owner (one all_to_all each
  way). What each rank needs is exchanged once per layout and cached.
Bytes moved count what crosses between ranks (a rank's copy to itself is free).
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from dcp_ext.runtime.param_map import LocalParam


class ParamExchange:
    def __init__(self, bounds: Sequence[tuple[int, int]], numel: int, mode: str = "targeted"):
        if mode not in ("targeted", "allgather"):
            raise ValueError(f"exchange mode {mode!r}: use 'targeted' or 'allgather'")
        self.bounds = list(bounds)
        self.numel = numel
        self.mode = mode
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self._plans: dict[object, _TargetedPlan] = {}
        self.bytes_pulled = 0  # received from other ranks, cumulative
        self.bytes_pushed = 0  # sent to other ranks, cumulative

    # ------------------------------------------------------------------ pull
    def pull(self, key, local: list[LocalParam], master_shard: torch.Tensor) -> None:
        """Fill every local parameter from the owners' master values (collective)."""
        if self.mode == "allgather":
            full = self.allgather(master_shard)
            with torch.no_grad():
                for lp in local:
                    lp.param.copy_(full[lp.index].to(lp.param.dtype))
            return
        plan = self._plan(key, local)
        send = master_shard[plan.serve_local_offsets]
        recv = torch.empty(plan.need.numel(), dtype=master_shard.dtype)
        dist.all_to_all_single(recv, send, plan.need_counts, plan.serve_counts)
        self.bytes_pulled += 4 * (plan.need.numel() - plan.need_counts[self.rank])
        with torch.no_grad():
            for lp, pos in zip(local, plan.positions):
                lp.param.copy_(recv[pos].to(lp.param.dtype))

    # ------------------------------------------------------------------ push
    def push(self, key, local: list[LocalParam], grad_shard: torch.Tensor) -> None:
        """Add every local gradient contribution into its owner's shard (collective)."""
        if self.mode == "allgather":
            full = torch.zeros(self.numel, dtype=torch.float32)
            for lp in local:
                if lp.pushes_grad and lp.param.grad is not None:
                    full.index_add_(0, lp.index.flatten(), lp.param.grad.detach().float().flatten())
            dist.all_reduce(full)
            start, end = self.bounds[self.rank]
            grad_shard += full[start:end]
            self.bytes_pushed += 4 * 2 * self.numel * (self.world - 1) // self.world
            return
        plan = self._plan(key, local)
        contrib = torch.zeros(plan.need.numel(), dtype=torch.float32)
        for lp, pos in zip(local, plan.positions):
            if lp.pushes_grad and lp.param.grad is not None:
                contrib.index_add_(0, pos.flatten(), lp.param.grad.detach().float().flatten())
        recv = torch.empty(int(plan.serve_local_offsets.numel()), dtype=torch.float32)
        dist.all_to_all_single(recv, contrib, plan.serve_counts, plan.need_counts)
        grad_shard.index_add_(0, plan.serve_local_offsets, recv)
        self.bytes_pushed += 4 * (plan.need.numel() - plan.need_counts[self.rank])

    # ------------------------------------------------------------------ helpers
    def allgather(self, shard: torch.Tensor) -> torch.Tensor:
        sizes = [e - s for s, e in self.bounds]
        biggest = max(sizes)
        padded = torch.zeros(biggest, dtype=shard.dtype)
        padded[: shard.numel()] = shard
        parts = [torch.empty(biggest, dtype=shard.dtype) for _ in range(self.world)]
        dist.all_gather(parts, padded)
        self.bytes_pulled += 4 * sum(sizes[r] for r in range(self.world) if r != self.rank)
        return torch.cat([parts[r][: sizes[r]] for r in range(self.world)])

    def _plan(self, key, local: list[LocalParam]) -> "_TargetedPlan":
        if key not in self._plans:
            self._plans[key] = _TargetedPlan(local, self.bounds, self.rank, self.world)
        return self._plans[key]


class _TargetedPlan:
    """Who sends which elements to whom, for one set of local parameters on every rank."""

    def __init__(self, local: list[LocalParam], bounds, rank: int, world: int):
        indices = [lp.index.flatten() for lp in local]
        need = torch.unique(torch.cat(indices)) if indices else torch.zeros(0, dtype=torch.int64)
        self.need = need  # sorted canonical elements this rank holds locally
        self.positions = [torch.searchsorted(need, lp.index) for lp in local]
        starts = torch.tensor([s for s, _ in bounds])
        owner = torch.searchsorted(starts, need, right=True) - 1
        self.need_counts = [int((owner == r).sum()) for r in range(world)]
        # tell every owner what this rank needs (once per layout)
        wanted = [None] * world
        dist.all_gather_object(wanted, need)
        start, end = bounds[rank]
        serve = []
        for r in range(world):
            w = wanted[r]
            mine = w[(w >= start) & (w < end)]
            serve.append(mine - start)
        self.serve_counts = [int(s.numel()) for s in serve]
        self.serve_local_offsets = torch.cat(serve) if serve else torch.zeros(0, dtype=torch.int64)
