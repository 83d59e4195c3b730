"""The bucket order rule, held by the parameter server's streams alone.

Why it exists: every rank takes part in every bucket's transfer (a bucket is one
collective over all ranks), so every rank must start the same buckets in the same order,
whatever its stage needs first or whichever of its gradients are ready first; otherwise two
ranks wait on different collectives and the run hangs. The rule lives in
`dcp_ext/runtime/params/streams.py`; these tests drive the streams against a fake exchange
that records the order, so they need no process group.
"""
from __future__ import annotations

import itertools
import random

import pytest

from dcp_ext.runtime.params.streams import PullStream, PushStream


class FakeTransfer:
    def __init__(self, log, kind, bucket):
        self.log, self.kind, self.bucket = log, kind, bucket
        self.finished = False

    def done(self) -> bool:
        return self.finished

    def wait(self) -> None:
        if not self.finished:
            self.finished = True
            self.log.append(("done", self.kind, self.bucket))


class FakeExchange:
    """Records every transfer started; `slots` buffers, as ParamExchange has."""

    def __init__(self, slots: int):
        self.num_slots = slots
        self.log = []
        self.inflight = []

    def _start(self, kind, bucket, slot):
        assert 0 <= slot < self.num_slots
        live = [t for t in self.inflight if not t.finished]
        assert len(live) < self.num_slots, f"{kind} of bucket {bucket} started with every slot busy"
        t = FakeTransfer(self.log, kind, bucket)
        self.inflight.append(t)
        self.log.append(("start", kind, bucket))
        return t

    def start_pull(self, plan, bucket, master, params, slot=0):
        return self._start("pull", bucket, slot)

    def start_push(self, plan, bucket, grads, grad_shard, slot=0):
        return self._start("push", bucket, slot)

    def started(self, kind):
        return [b for what, k, b in self.log if what == "start" and k == kind]


class Plan:
    def __init__(self, buckets: int):
        self.pull = [None] * buckets
        self.push = [None] * buckets


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("seed", range(5))
def test_pulls_start_in_bucket_order_whatever_the_stage_needs_first(overlap, seed):
    n = 7
    ex = FakeExchange(slots=2 if overlap else 1)
    stream = PullStream(ex, Plan(n), None, None, overlap)
    needs = [random.Random(seed).randrange(n) for _ in range(6)]
    for b in needs:
        stream.need(b)
        done = [k for what, kind, k in ex.log if what == "done"]
        assert set(range(b + 1)) <= set(done), f"need({b}) returned before buckets 0..{b} arrived"
    stream.drain()
    assert ex.started("pull") == list(range(n))


@pytest.mark.parametrize("overlap", [False, True])
def test_pushes_start_from_the_last_bucket_whatever_order_gradients_are_ready(overlap):
    n = 5
    params = [[0], [1, 2], [2], [3], [4], [4], [1]]  # the buckets each parameter's gradient touches
    orders = list(itertools.permutations(range(len(params))))
    for order in random.Random(0).sample(orders, 40):
        ex = FakeExchange(slots=2 if overlap else 1)
        stream = PushStream(ex, Plan(n), None, None, params, overlap)
        stream.last_backward()
        for i in order:
            if stream.tracking:
                stream.ready(params[i])
            started = ex.started("push")
            assert started == list(range(n - 1, n - 1 - len(started), -1)), (order, started)
        stream.finish()
        assert ex.started("push") == list(range(n - 1, -1, -1)), order
        assert all(t.finished for t in ex.inflight)


def test_a_push_waits_for_every_later_bucket():
    """Bucket 1 complete before bucket 2: nothing leaves until bucket 2 is complete too."""
    params = [[0], [1], [2]]
    ex = FakeExchange(slots=2)
    stream = PushStream(ex, Plan(3), None, None, params, overlap=True)
    stream.last_backward()
    stream.ready([1])
    assert ex.started("push") == []
    stream.ready([2])
    assert ex.started("push") == [2, 1]
    stream.ready([0])
    stream.finish()
    assert ex.started("push") == [2, 1, 0]
