"""Parameter maps as strided runs, and the bucketed fixed sharding (pure, no ranks).

The runtime never lists elements: a local parameter is a few `Runs`, clipped to bucket
pieces to plan pull and push. Checked here against element-by-element ground truth:
clipping keeps exactly the elements inside the interval, in order; a TP slice's runs
are the elements torch.chunk gives; the sharding's pieces partition the vector.
"""
import random

import pytest
import torch

from dcp_ext.runtime.params.param_map import CanonicalTensor, Runs, describe
from dcp_ext.runtime.params.sharding import FixedSharding


def _elements(runs):
    return [(r.canon + k * r.canon_step + j, r.local + k * r.local_step + j)
            for r in runs for k in range(r.count) for j in range(r.length)]


def test_clip_keeps_exactly_the_elements_inside_in_order():
    rng = random.Random(0)
    for _ in range(3000):
        count, length = rng.randint(1, 6), rng.randint(1, 5)
        step = length + rng.randint(0, 4)
        r = Runs(rng.randint(0, 10), 3, length, count, step if count > 1 else 0,
                 length * rng.randint(1, 2) if count > 1 else 0)
        end = r.canon_end + 5
        s = rng.randint(0, end)
        e = rng.randint(s, end + 3)
        want = [(c, l) for c, l in _elements([r]) if s <= c < e]
        assert _elements(r.clip(s, e)) == want, (r, s, e)
        assert len(r.clip(s, e)) <= 3




@pytest.mark.parametrize("shape,dim,stride,tp", [((12, 8), 0, 1, 2), ((12, 8), 1, 1, 4), ((16, 6), 0, 2, 2),
                                                 ((6, 12), 1, 2, 3), ((4, 6, 8), 1, 1, 2)])
def test_tp_slice_runs_are_the_chunks_megatron_holds(shape, dim, stride, tp):
    offset = 100
    t = CanonicalTensor("w", shape, offset, False)
    full = torch.arange(offset, offset + t.numel).view(shape)
    for rank in range(tp):
        chunks = torch.chunk(full, tp * stride, dim=dim)
        held = torch.cat([chunks[rank + j * tp] for j in range(stride)], dim=dim)
        p = torch.empty(held.shape)
        p.tensor_model_parallel, p.partition_dim = True, dim
        runs = describe("w", p, t, tp, rank, stride)
        got = torch.empty(held.numel(), dtype=torch.int64)
        for c, l in _elements(runs):
            got[l] = c
        assert torch.equal(got.view(held.shape), held), (shape, dim, stride, tp, rank)
        assert len(runs) == stride  # O(1) descriptions per tensor, whatever its size


@pytest.mark.parametrize("numel,world,bucket", [(1000, 4, 96), (17, 8, 5), (4096, 3, 4096), (10, 16, 3)])
def test_sharding_pieces_partition_the_vector_and_round_trip(numel, world, bucket):
    sh = FixedSharding(numel, world, bucket)
    seen = sorted((p.start, p.end) for r in range(world) for p in sh.pieces(r) if p.numel)
    flat = [i for a, b in seen for i in range(a, b)]
    assert flat == list(range(numel))
    full = torch.arange(numel, dtype=torch.float32)
    shards = [sh.shard_of(full, r) for r in range(world)]
    assert [s.numel() for s in shards] == sh.shard_sizes
    assert torch.equal(sh.assemble(shards), full)
    for pos in range(0, numel, max(1, numel // 50)):
        owner = sh.owner_of(pos)
        assert any(p.start <= pos < p.end for p in sh.pieces(owner))
    # every bucket is split over all ranks: no rank's piece of a bucket exceeds its even share
    for b, (s, e) in enumerate(sh.buckets):
        assert max(sh.piece(b, r).numel for r in range(world)) == -(-(e - s) // world)
