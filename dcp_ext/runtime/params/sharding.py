"""The fixed sharding of the canonical parameter vector: buckets, each split over all ranks.

The canonical flat vector (every parameter of the full model, end to end) is cut into
buckets of about `bucket_numel` elements, in model order; every bucket is then split
evenly over all ranks. Rank r's shard is its piece of every bucket, laid end to end.
Splitting each bucket (not the whole vector) over the ranks is what keeps pull and push
balanced: a layer's parameters are served by every rank, not by the one or two ranks
whose contiguous slice happened to hold it, and the exchange buffers of one bucket never
exceed about one bucket, whatever the layout. (Megatron's distributed optimizer shards
each gradient bucket over the data-parallel ranks for the same reason.)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from dcp_ext.planning.layout import bucket_numel_for


def even_split(numel: int, parts: int) -> list[tuple[int, int]]:
    """[lo, hi) of each of `parts` pieces; the first `numel % parts` get one element more."""
    base, extra = divmod(numel, parts)
    out, start = [], 0
    for r in range(parts):
        size = base + (1 if r < extra else 0)
        out.append((start, start + size))
        start += size
    return out


@dataclass(frozen=True)
class Piece:
    """Rank `rank`'s piece of bucket `bucket`: canonical [start, end), at `offset` in its shard."""
    bucket: int
    rank: int
    start: int
    end: int
    offset: int

    @property
    def numel(self) -> int:
        return self.end - self.start

    def at(self, position: int) -> int:
        """Where canonical `position` (within this piece) lies in its rank's shard."""
        return self.offset + position - self.start

    def local(self, lo: int, hi: int) -> slice:
        """Where canonical [lo, hi) (within this piece) lies in its rank's shard."""
        return slice(self.at(lo), self.at(hi))


class FixedSharding:
    def __init__(self, numel: int, world: int, bucket_numel: int | None = None):
        self.numel = numel
        self.world = world
        self.bucket_numel = bucket_numel_for(numel, bucket_numel or 0)
        self.buckets = [(s, min(s + self.bucket_numel, numel)) for s in range(0, numel, self.bucket_numel)] or [(0, 0)]
        self._pieces: list[list[Piece]] = [[] for _ in range(world)]  # per rank, in bucket order
        offsets = [0] * world
        for b, (bs, be) in enumerate(self.buckets):
            for r, (lo, hi) in enumerate(even_split(be - bs, world)):
                self._pieces[r].append(Piece(b, r, bs + lo, bs + hi, offsets[r]))
                offsets[r] += hi - lo
        self.shard_sizes = offsets

    @property
    def num_buckets(self) -> int:
        return len(self.buckets)

    @property
    def max_bucket_numel(self) -> int:
        return max(e - s for s, e in self.buckets)

    def pieces(self, rank: int) -> list[Piece]:
        return self._pieces[rank]

    def piece(self, bucket: int, rank: int) -> Piece:
        return self._pieces[rank][bucket]

    def shard_numel(self, rank: int) -> int:
        return self.shard_sizes[rank]

    def buckets_of(self, start: int, end: int) -> range:
        """Buckets that canonical [start, end) touches."""
        if end <= start:
            return range(0)
        return range(start // self.bucket_numel, (end - 1) // self.bucket_numel + 1)

    def owner_of(self, position: int) -> int:
        """The rank whose shard holds canonical element `position`."""
        b = position // self.bucket_numel
        for r in range(self.world):
            if self._pieces[r][b].start <= position < self._pieces[r][b].end:
                return r
        raise IndexError(position)

    # ------------------------------------------------------------ whole-vector helpers
    def shard_of(self, full: torch.Tensor, rank: int) -> torch.Tensor:
        """This rank's shard cut out of a full canonical vector."""
        return torch.cat([full[p.start : p.end] for p in self._pieces[rank]]) if self._pieces[rank] else full[:0]

    def assemble(self, shards: list[torch.Tensor]) -> torch.Tensor:
        """The full canonical vector from every rank's shard (in rank order)."""
        full = torch.empty(self.numel, dtype=shards[0].dtype, device=shards[0].device)
        for r, shard in enumerate(shards):
            for p in self._pieces[r]:
                full[p.start : p.end] = shard[p.offset : p.offset + p.numel]
        return full

    def overlaps(self, rank: int, start: int, end: int):
        """(piece, lo, hi): the parts of canonical [start, end) in `rank`'s shard."""
        for b in self.buckets_of(start, end):
            p = self._pieces[rank][b]
            lo, hi = max(start, p.start), min(end, p.end)
            if lo < hi:
                yield p, lo, hi
