"""Pull parameters into an iteration's layout, push gradients back to their owner shards.

Both directions go bucket by bucket over the fixed sharding (`sharding.py`), so the
buffers never exceed about one bucket and a bucket's transfer can overlap compute.
Everything is described by strided runs (`param_map.Runs`), never by per-element lists:
a layout's plan is derived, per bucket and per peer, by clipping every rank's runs to the
bucket pieces; each rank learns its peers' runs (O(tensors) each) once at start.

Two implementations of the same contract, so each checks the other:
- `targeted`: each rank receives exactly the elements its stage needs from their owners
  and sends each gradient contribution straight to the owner (one all_to_all per bucket
  each way);
- `allgather`: every rank gathers each whole bucket (pull) and all-reduces a bucket-size
  gradient (push). Simple, and the baseline for bytes moved.
Bytes moved count what crosses between ranks (a rank's copy to itself is free).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist

from dcp_ext.runtime.params.param_map import Runs
from dcp_ext.runtime.params.sharding import FixedSharding

# One peer's stage as the exchange sees it: (runs in buffer coordinates, pushes_grad) per
# local parameter, in parameter order.
StageRuns = Sequence[tuple[tuple[Runs, ...], bool]]


@dataclass(frozen=True)
class Copy:
    """`count` runs of `length` elements starting at `offset`, `step` apart, in some flat
    tensor (a rank's parameter/main-grad buffer, or its shard)."""
    offset: int
    length: int
    count: int
    step: int

    @property
    def numel(self) -> int:
        return self.length * self.count

    def view(self, flat: torch.Tensor) -> torch.Tensor:
        if self.count == 1:
            return flat[self.offset : self.offset + self.length]
        return flat[self.offset :].as_strided((self.count, self.length), (self.step, 1))


def _local_copies(runs: tuple[Runs, ...], start: int, end: int) -> list[Copy]:
    return [Copy(c.local, c.length, c.count, c.local_step) for r in runs for c in r.clip(start, end)]


def _shard_copies(runs: tuple[Runs, ...], piece) -> list[Copy]:
    return [Copy(piece.at(c.canon), c.length, c.count, c.canon_step)
            for r in runs for c in r.clip(piece.start, piece.end)]


def _merge(copies: list[Copy]) -> list[Copy]:
    """Join contiguous single runs (adjacent tensors of an unsplit stage)."""
    out: list[Copy] = []
    for c in copies:
        if out and c.count == 1 and out[-1].count == 1 and out[-1].offset + out[-1].length == c.offset:
            out[-1] = Copy(out[-1].offset, out[-1].length + c.length, 1, 0)
        else:
            out.append(c)
    return out


class BucketPlan:
    """One bucket of one layout: what this rank receives from / serves to every peer."""

    def __init__(self, sharding: FixedSharding, bucket: int, rank: int, layout: Sequence[StageRuns], push: bool):
        world = sharding.world
        mine = layout[rank]
        # need[r]: copies into my buffers of what owner r serves me (pull) / what I send to r (push)
        self.need = [_merge([c for runs, pushes in mine if pushes or not push
                             for c in _local_copies(runs, *_span(sharding.piece(bucket, r)))]) for r in range(world)]
        piece = sharding.piece(bucket, rank)
        self.serve = [_merge([c for runs, pushes in layout[q] if pushes or not push
                              for c in _shard_copies(runs, piece)]) for q in range(world)]
        # allgather mode: my runs against the whole bucket (local copy, copy inside the bucket)
        bs, be = sharding.buckets[bucket]
        self.whole = [(Copy(c.local, c.length, c.count, c.local_step), Copy(c.canon - bs, c.length, c.count, c.canon_step))
                      for runs, pushes in mine if pushes or not push for r in runs for c in r.clip(bs, be)]
        self.need_counts = [sum(c.numel for c in cs) for cs in self.need]
        self.serve_counts = [sum(c.numel for c in cs) for cs in self.serve]


def _span(piece) -> tuple[int, int]:
    return piece.start, piece.end


class LayoutPlan:
    def __init__(self, sharding: FixedSharding, rank: int, layout: Sequence[StageRuns]):
        self.pull = [BucketPlan(sharding, b, rank, layout, push=False) for b in range(sharding.num_buckets)]
        self.push = [BucketPlan(sharding, b, rank, layout, push=True) for b in range(sharding.num_buckets)]


class ParamExchange:
    """Owns the exchange buffers; runs one bucket's pull or push at a time (or two, when
    overlapping: `slots` = 2 double-buffers)."""

    def __init__(self, sharding: FixedSharding, *, device, param_dtype=torch.float32, reduce_dtype=torch.float32,
                 mode: str = "targeted", slots: int = 1):
        if mode not in ("targeted", "allgather"):
            raise ValueError(f"exchange mode {mode!r}: use 'targeted' or 'allgather'")
        self.sharding = sharding
        self.mode = mode
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.device = torch.device(device)
        self.param_dtype = param_dtype
        self.reduce_dtype = reduce_dtype
        # a bucket's send or receive side never exceeds world * (its largest piece)
        per = self.world * -(-sharding.max_bucket_numel // self.world)
        self.slot_bytes = per * max(_itemsize(param_dtype), _itemsize(reduce_dtype))
        self._slots = [(torch.empty(self.slot_bytes, dtype=torch.uint8, device=self.device),
                        torch.empty(self.slot_bytes, dtype=torch.uint8, device=self.device)) for _ in range(slots)]
        self._plans: dict[object, LayoutPlan] = {}
        self.bytes_pulled = 0  # received from other ranks, cumulative
        self.bytes_pushed = 0  # sent to other ranks, cumulative

    @property
    def num_slots(self) -> int:
        return len(self._slots)

    def persistent_bytes(self) -> int:
        return 2 * self.slot_bytes * len(self._slots)

    def plan(self, key, layout) -> LayoutPlan:
        """The cached plan of layout `key`; `layout`: every rank's StageRuns, or a function
        returning them (called only when the plan is not cached)."""
        if key not in self._plans:
            layout = layout() if callable(layout) else layout
            if len(self._plans) >= 256:  # long runs with many layouts: keep the recent ones
                self._plans.pop(next(iter(self._plans)))
            self._plans[key] = LayoutPlan(self.sharding, self.rank, layout)
        return self._plans[key]

    def _buffers(self, slot: int, dtype, n_send: int, n_recv: int):
        need = max(n_send, n_recv) * _itemsize(dtype)
        if need > self.slot_bytes:
            # a rank that holds some layers in two strategies' shapes (layer-wise switching)
            # receives those elements twice: the slots grow to the largest bucket seen
            self.slot_bytes = need
            self._slots = [(torch.empty(need, dtype=torch.uint8, device=self.device),
                            torch.empty(need, dtype=torch.uint8, device=self.device)) for _ in self._slots]
        send, recv = self._slots[slot]
        return send.view(dtype)[:n_send], recv.view(dtype)[:n_recv]

    # ------------------------------------------------------------------ pull
    def start_pull(self, plan: LayoutPlan, bucket: int, master: torch.Tensor, params: torch.Tensor, slot: int = 0):
        """Begin filling this rank's parameters of `bucket` from the owners (collective);
        returns a handle whose `wait()` finishes it."""
        bp = plan.pull[bucket]
        dtype = params.dtype
        if self.mode == "allgather":
            return _Done(lambda: self._allgather_pull(bucket, bp, master, params))
        send, recv = self._buffers(slot, dtype, sum(bp.serve_counts), sum(bp.need_counts))
        _pack(send, bp.serve, master)
        work = dist.all_to_all_single(recv, send, bp.need_counts, bp.serve_counts, async_op=True)
        self.bytes_pulled += _itemsize(dtype) * (sum(bp.need_counts) - bp.need_counts[self.rank])
        return _Pending(self, work, lambda: _unpack(recv, bp.need, params, add=False))

    def _allgather_pull(self, bucket: int, bp: BucketPlan, master: torch.Tensor, params: torch.Tensor) -> None:
        full = self._gather_bucket([self.sharding.piece(bucket, r) for r in range(self.world)], master)
        for local, inside in bp.whole:
            local.view(params).copy_(inside.view(full))

    # ------------------------------------------------------------------ push
    def start_push(self, plan: LayoutPlan, bucket: int, grads: torch.Tensor, grad_shard: torch.Tensor, slot: int = 0):
        """Begin adding this rank's gradient contributions of `bucket` into their owners'
        shards (collective); `wait()` finishes it."""
        bp = plan.push[bucket]
        if self.mode == "allgather":
            return _Done(lambda: self._allreduce_push(bucket, bp, grads, grad_shard))
        send, recv = self._buffers(slot, self.reduce_dtype, sum(bp.need_counts), sum(bp.serve_counts))
        _pack(send, bp.need, grads)
        work = dist.all_to_all_single(recv, send, bp.serve_counts, bp.need_counts, async_op=True)
        self.bytes_pushed += _itemsize(self.reduce_dtype) * (sum(bp.need_counts) - bp.need_counts[self.rank])
        return _Pending(self, work, lambda: _unpack(recv, bp.serve, grad_shard, add=True))

    def _allreduce_push(self, bucket: int, bp: BucketPlan, grads: torch.Tensor, grad_shard: torch.Tensor) -> None:
        bs, be = self.sharding.buckets[bucket]
        full = torch.zeros(be - bs, dtype=self.reduce_dtype, device=self.device)
        for local, inside in bp.whole:
            inside.view(full).add_(local.view(grads).to(full.dtype))
        dist.all_reduce(full)
        mine = self.sharding.piece(bucket, self.rank)
        grad_shard[mine.offset : mine.offset + mine.numel] += full[mine.start - bs : mine.end - bs].float()
        self.bytes_pushed += _itemsize(self.reduce_dtype) * 2 * (be - bs) * (self.world - 1) // self.world

    # ------------------------------------------------------------------ helpers
    def _gather_bucket(self, pieces, shard: torch.Tensor) -> torch.Tensor:
        biggest = max(p.numel for p in pieces)
        mine = pieces[self.rank]
        padded = torch.zeros(biggest, dtype=shard.dtype, device=shard.device)
        padded[: mine.numel] = shard[mine.offset : mine.offset + mine.numel]
        parts = [torch.empty_like(padded) for _ in range(self.world)]
        dist.all_gather(parts, padded)
        self.bytes_pulled += _itemsize(shard.dtype) * sum(p.numel for r, p in enumerate(pieces) if r != self.rank)
        return torch.cat([parts[r][: p.numel] for r, p in enumerate(pieces)])

    def allgather(self, shard: torch.Tensor) -> torch.Tensor:
        """The whole canonical vector from every rank's shard, on every rank (collective;
        checkpoint export and tests: O(model) memory)."""
        sizes = self.sharding.shard_sizes
        padded = torch.zeros(max(sizes), dtype=shard.dtype, device=shard.device)
        padded[: shard.numel()] = shard
        parts = [torch.empty_like(padded) for _ in range(self.world)]
        dist.all_gather(parts, padded)
        self.bytes_pulled += _itemsize(shard.dtype) * sum(s for r, s in enumerate(sizes) if r != self.rank)
        return self.sharding.assemble([parts[r][: sizes[r]] for r in range(self.world)])


def _pack(send: torch.Tensor, per_peer: list[list[Copy]], source: torch.Tensor) -> None:
    o = 0
    for copies in per_peer:
        for c in copies:
            n = c.numel
            dst = send[o : o + n]
            dst.view(c.count, c.length).copy_(c.view(source)) if c.count > 1 else dst.copy_(c.view(source))
            o += n


def _unpack(recv: torch.Tensor, per_peer: list[list[Copy]], target: torch.Tensor, add: bool) -> None:
    o = 0
    for copies in per_peer:
        for c in copies:
            n = c.numel
            src = recv[o : o + n]
            src = src.view(c.count, c.length) if c.count > 1 else src
            if add:
                c.view(target).add_(src)
            else:
                c.view(target).copy_(src)
            o += n


def _itemsize(dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


class _Pending:
    def __init__(self, exchange: ParamExchange, work, finish):
        self.exchange, self.work, self.finish = exchange, work, finish

    def wait(self) -> None:
        self.work.wait()  # NCCL: the compute stream waits, not the host (the streams time it)
        self.finish()


class _Done:
    def __init__(self, run):
        self.run = run

    def wait(self) -> None:
        self.run()
