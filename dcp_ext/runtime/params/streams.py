"""The pull and push streams of one step: parameters into the stage, gradients out.

Why it exists: the engine overlaps its exchange with compute (a layer's pre-forward hook
waits only for the buckets it needs; a bucket's gradients leave as soon as the last
backward has produced them). The bookkeeping of which buckets are in flight, in the same
order on every rank, is this module's one job; the engine only starts and finishes them.
When they overlap compute, each wait for a transfer is timed on the step's device clock
(`clock`, key "exchange-wait"): how long the compute stood waiting, the exposed exchange.
"""
from __future__ import annotations

from collections import deque
from contextlib import nullcontext

from dcp_ext.runtime.params.exchange import ParamExchange

WAIT = "exchange-wait"


def _waiting(clock):
    return clock.span(WAIT) if clock is not None else nullcontext()


class PullStream:
    """This step's pull, bucket by bucket in canonical order. Overlapped: `slots` buckets in
    flight, a layer's pre-forward hook waits for the buckets it needs and starts the next;
    every rank takes part in every bucket, so a stage that waits on a peer first drains."""

    def __init__(self, exchange: ParamExchange, plan, master, params, overlap: bool, clock=None):
        self.exchange, self.plan, self.master, self.params = exchange, plan, master, params
        self.clock = clock if overlap else None
        self.total = len(plan.pull)
        self.launched = self.done = 0
        self.inflight: deque = deque()
        if not overlap:
            for b in range(self.total):
                exchange.start_pull(plan, b, master, params, slot=0).wait()
            self.launched = self.done = self.total
        else:
            self._launch()

    def _launch(self) -> None:
        while self.launched < self.total and len(self.inflight) < self.exchange.num_slots:
            b = self.launched
            self.inflight.append(self.exchange.start_pull(self.plan, b, self.master, self.params,
                                                          slot=b % self.exchange.num_slots))
            self.launched += 1

    def need(self, bucket: int) -> None:
        while self.done <= min(bucket, self.total - 1):
            with _waiting(self.clock):
                self.inflight.popleft().wait()
            self.done += 1
            self._launch()

    def drain(self) -> None:
        self.need(self.total - 1)


class PushStream:
    """This step's push, bucket by bucket from the last. Overlapped: during the last
    micro-batch's backward each parameter's final gradient marks its buckets; a bucket is
    sent once it and every later bucket are complete (the same order on every rank)."""

    def __init__(self, exchange: ParamExchange, plan, grads, grad_shard, push_buckets, overlap: bool, clock=None):
        self.exchange, self.plan, self.grads, self.grad_shard = exchange, plan, grads, grad_shard
        self.overlap = overlap
        self.clock = clock if overlap else None
        self.tracking = False
        self.pending = [0] * len(plan.push)
        for buckets in push_buckets:
            for b in buckets:
                self.pending[b] += 1
        self.next = len(plan.push) - 1
        self.inflight: deque = deque()

    def last_backward(self) -> None:
        """The last micro-batch's backward is about to run: from now on gradients are final."""
        if self.overlap:
            self.tracking = True
            self._issue()

    def ready(self, buckets) -> None:
        for b in buckets:
            self.pending[b] -= 1
        self._issue()

    def _issue(self, force: bool = False) -> None:
        """Send every complete bucket there is a free slot for. Inside backward a slot never
        frees (a full one waits for `finish`): a peer stage may be waiting on this rank's
        activation gradient before it can join the transfer, and whether a transfer has
        completed depends on timing, so freeing one when it happened to be done would issue
        the next bucket at a different point on each rank: on NCCL, ranks that issue their
        collectives over two communicators in different orders can hang each other
        (tests/runtime/test_device_paths.py checks the order)."""
        slots = self.exchange.num_slots
        while self.next >= 0 and (force or self.pending[self.next] <= 0):
            if len(self.inflight) == slots:
                if not force:
                    return
                with _waiting(self.clock):
                    self.inflight.popleft().wait()
            b = self.next
            self.inflight.append(self.exchange.start_push(self.plan, b, self.grads, self.grad_shard, slot=b % slots))
            self.next -= 1

    def finish(self) -> None:
        self.tracking = False
        self._issue(force=True)
        while self.inflight:
            with _waiting(self.clock):
                self.inflight.popleft().wait()
