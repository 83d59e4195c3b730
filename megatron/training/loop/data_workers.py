"""--num-workers on the static path: samples read by DataLoader worker processes.

Why a module of its own: with --num-workers 0 the static loop reads its micro-batches in
the main process (`static.training_static.micro_batches`); with N > 0 the same samples, in the same
(Megatron) order, come from N workers that read ahead, and are collated in the main
process, where the token-id check of every micro-batch runs. A data error in a worker
is re-raised here as the one-line DataError it was.
"""
from __future__ import annotations

import re

import torch


class _MegatronOrder:
    """Index lists of one micro-batch each, for one DP rank, from `consumed_samples` on
    (the order of `static.training_static.micro_batches`); global batches of `sizes` (an iterator of the
    global batch sizes from there: --global-batch-size, or a batch-size schedule's)."""

    def __init__(self, dataset_len: int, consumed: int, micro_batch_size: int, dp_rank: int, dp_size: int, sizes):
        self.n, self.consumed = dataset_len, consumed
        self.mbs, self.sizes = micro_batch_size, sizes
        self.dp_rank, self.dp_size = dp_rank, dp_size

    def __iter__(self):
        consumed = self.consumed
        step = self.mbs * self.dp_size
        for gbs in self.sizes:
            for m in range(gbs // step):
                start = consumed + m * step + self.dp_rank * self.mbs
                yield [(start + i) % self.n for i in range(self.mbs)]
            consumed += gbs


def _as_list(samples):
    return samples


class WorkerBatches:
    """`next_global_batch()`: this rank's micro-batches of the next global batch.
    `batch_sizes`: a `batch_schedule.GlobalBatchSizes`; `num_workers`: --num-workers."""

    def __init__(self, dataset, consumed: int, micro_batch_size: int, batch_sizes, num_workers: int, dp_rank: int,
                 dp_size: int, collate, first_iteration: int = 0):
        import itertools

        self.collate = collate
        self.step = micro_batch_size * dp_size
        sizes = (batch_sizes.of_iteration(k) for k in itertools.count(first_iteration))
        loader = torch.utils.data.DataLoader(
            dataset, batch_sampler=_MegatronOrder(len(dataset), consumed, micro_batch_size, dp_rank, dp_size, sizes),
            num_workers=num_workers, collate_fn=_as_list, persistent_workers=True)
        self.loader = loader
        self.it = iter(loader)

    def next_global_batch(self, global_batch_size: int) -> list:
        from dcp_ext.data.errors import DataError

        out = []
        for _ in range(global_batch_size // self.step):
            try:
                samples = next(self.it)
            except DataError as e:  # the worker's traceback text: keep its last line, the message
                lines = [line for line in str(e).splitlines() if line.strip()]
                raise DataError(re.sub(r"^\w*DataError: ", "", lines[-1]) if lines else str(e)) from None
            out.append(self.collate(samples))
        return out

    def close(self) -> None:
        shutdown = getattr(self.it, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()
