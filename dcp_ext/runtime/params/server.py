"""The parameter server: the state that does not move whatever layout an iteration uses.

Why it exists: the optimizer state lives in one fixed sharding over all ranks
(docs/contracts.md); each step pulls parameters from it into the iteration's layout and
pushes gradients back. This object owns that state and the traffic in and out of it:
the canonical space's sharding, the optimizer on this rank's shard (with its loss
scaler under fp16), the initial values, the exchange and the per-step streams. It knows
no stage: a layout reaches it as every rank's runs (`layout_plan`), buffers as tensors.

The bucket order rule lives here: every rank takes part in every bucket's transfer, in
the same order (pull from the first bucket, push from the last), whatever its stage
needs; `streams.PullStream` / `PushStream` hold it and tests/runtime/test_param_streams.py checks
it on a fake exchange.
"""
from __future__ import annotations

from typing import Callable, Iterator, Sequence

import torch
import torch.distributed as dist

from dcp_ext.runtime.params.exchange import ParamExchange
from dcp_ext.runtime.params.initial_values import INIT_CHUNK, init_values
from dcp_ext.runtime.params.param_map import CanonicalSpace
from dcp_ext.runtime.params.sharded_optimizer import OptimizerOptions, ShardedOptimizer
from dcp_ext.runtime.params.sharding import FixedSharding
from dcp_ext.runtime.params.streams import PullStream, PushStream

STATE_KINDS = ("param", "exp_avg", "exp_avg_sq")  # what a checkpoint holds per canonical tensor


def _groups(tensors, limit: int):
    """Consecutive tensors in groups of at most `limit` elements (a larger tensor alone)."""
    group, size = [], 0
    for t in tensors:
        if group and size + t.numel > limit:
            yield group
            group, size = [], 0
        group.append(t)
        size += t.numel
    if group:
        yield group


# Canonical tensors megatron-core's LanguageModule marks `is_embedding_or_output_parameter`
# (a tied output layer is the word embedding itself).
EMBEDDING_OR_OUTPUT = ("embedding.word_embeddings.weight", "output_layer.weight")


class ParameterServer:
    def __init__(self, space: CanonicalSpace, options: OptimizerOptions, *, device: torch.device, param_dtype,
                 num_layers: int, norm_init: float, init_seed: int, init_std: float, bucket_numel: int | None,
                 exchange: str, overlap: bool, reduce_dtype=torch.float32, grad_scaler=None):
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.space, self.device, self.overlap = space, device, overlap
        self.num_layers, self.norm_init = num_layers, norm_init
        self.grad_scaler = grad_scaler
        self.sharding = FixedSharding(space.numel, self.world, bucket_numel)
        self.optimizer = ShardedOptimizer(self.initial_shard(init_seed, init_std), self.decay_runs(), options,
                                          grad_scaler=grad_scaler)
        self.exchange = ParamExchange(self.sharding, device=device, param_dtype=param_dtype, reduce_dtype=reduce_dtype,
                                      mode=exchange, slots=2 if overlap else 1)

    # ------------------------------------------------------------ initial values
    def initial_shard(self, seed: int, std: float) -> torch.Tensor:
        """Megatron's init scheme, drawn per canonical tensor chunk from its own seeded
        stream, so the initial model is the same whatever the world size or layout."""
        shard = torch.empty(self.sharding.shard_numel(self.rank), dtype=torch.float32, device=self.device)
        if self.device.type == "meta":
            return shard
        for t in self.space.tensors.values():
            for piece, lo, hi in self.sharding.overlaps(self.rank, t.offset, t.offset + t.numel):
                for c in range((lo - t.offset) // INIT_CHUNK, (hi - 1 - t.offset) // INIT_CHUNK + 1):
                    c0 = t.offset + c * INIT_CHUNK
                    values = init_values(t.name, c, min(INIT_CHUNK, t.offset + t.numel - c0), seed, std,
                                         self.num_layers, norm_init=self.norm_init)
                    a, b = max(lo, c0), min(hi, c0 + values.numel())
                    shard[piece.local(a, b)] = values[a - c0 : b - c0]
        return shard

    def decay_runs(self) -> list[tuple[int, int, bool, bool]]:
        """(shard start, shard end, no_weight_decay, embedding_or_output) of this rank's shard:
        megatron-core's param groups (the last flag: the tensors --decoupled-lr applies to,
        those megatron-core marks `is_embedding_or_output_parameter`)."""
        flags = [(t.offset, t.offset + t.numel, t.no_weight_decay, t.name in EMBEDDING_OR_OUTPUT)
                 for t in self.space.tensors.values()]
        out = []
        for piece in self.sharding.pieces(self.rank):
            for s, e, nwd, dec in flags:
                lo, hi = max(s, piece.start), min(e, piece.end)
                if lo < hi:
                    out.append((piece.at(lo), piece.at(hi), nwd, dec))
        merged = []
        for run in out:
            if merged and merged[-1][2:] == run[2:] and merged[-1][1] == run[0]:
                merged[-1] = (merged[-1][0], run[1], run[2], run[3])
            else:
                merged.append(run)
        return merged

    def set_canonical(self, flat: torch.Tensor, reset_optimizer: bool = False) -> None:
        """Replace the master parameters by a full canonical vector (tests, imports);
        optionally start the optimizer state afresh."""
        shard = self.sharding.shard_of(flat.to(self.device).float(), self.rank)
        if reset_optimizer:
            self.optimizer = ShardedOptimizer(shard, self.decay_runs(), self.optimizer.options,
                                              grad_scaler=self.grad_scaler)
        else:
            self.optimizer.set_master(shard)

    # ------------------------------------------------------------ whole tensors
    def gather_tensor(self, shard: torch.Tensor, tensor, dst: int) -> torch.Tensor | None:
        """One canonical tensor's values assembled on rank `dst` from every rank's shard
        (collective; checkpoints: O(tensor) memory, never the whole model). None elsewhere."""
        pieces = [list(self.sharding.overlaps(r, tensor.offset, tensor.offset + tensor.numel))
                  for r in range(self.world)]
        sizes = [sum(hi - lo for _, lo, hi in p) for p in pieces]
        send = torch.zeros(max(sizes), dtype=shard.dtype, device=shard.device)
        o = 0
        for piece, lo, hi in pieces[self.rank]:
            send[o : o + hi - lo] = shard[piece.local(lo, hi)]
            o += hi - lo
        parts = [torch.empty_like(send) for _ in range(self.world)] if self.rank == dst else None
        dist.gather(send, parts, dst=dst)
        if self.rank != dst:
            return None
        out = torch.empty(tensor.numel, dtype=shard.dtype, device=shard.device)
        for r in range(self.world):
            o = 0
            for piece, lo, hi in pieces[r]:
                out[lo - tensor.offset : hi - tensor.offset] = parts[r][o : o + hi - lo]
                o += hi - lo
        return out.view(tensor.shape)

    def gather_canonical(self) -> torch.Tensor:
        """The whole master vector on every rank (collective; checkpoints export, tests)."""
        return self.exchange.allgather(self.optimizer.master())

    # ------------------------------------------------------------ the state in canonical tensors
    def canonical_state(self, kinds: Sequence[str] = STATE_KINDS) -> Iterator[tuple[str, str, torch.Tensor | None]]:
        """(tensor name, kind, values) for every canonical tensor and each of `kinds` (the
        fp32 master weights "param", Adam's "exp_avg" and "exp_avg_sq"): the values whole on
        the rank that owns the tensor's first element, None on the others. Tensor by tensor
        (collective: every rank walks it to the end), so no rank ever holds the whole model
        (a 7B model's master and moments are 84 GB)."""
        avg, avg_sq, _ = self.optimizer.moments()
        shards = {"param": self.optimizer.master(), "exp_avg": avg, "exp_avg_sq": avg_sq}
        for t in self.space.tensors.values():
            writer = self.sharding.owner_of(t.offset)
            for kind in kinds:
                yield t.name, kind, self.gather_tensor(shards[kind], t, writer)

    def load_canonical_state(self, read: Callable[[list], dict], kinds: Sequence[str] = STATE_KINDS,
                             adam_step: int | None = None, group_numel: int = 1 << 26) -> None:
        """This rank's shard of every kind in `kinds` from canonical tensors: `read(tensors)`
        returns {(name, kind): whole values} for a group of canonical tensors of at most
        `group_numel` elements (a larger tensor alone); the groups are the same on every rank,
        so `read` may be collective. Without the moments in `kinds` the optimizer keeps its own
        (weights only); with them, `adam_step` is the step they were saved at."""
        shard = {kind: torch.zeros(self.sharding.shard_numel(self.rank)) for kind in kinds}
        for group in _groups(list(self.space.tensors.values()), group_numel):
            values = read(group)
            for t in group:
                for piece, lo, hi in self.sharding.overlaps(self.rank, t.offset, t.offset + t.numel):
                    for kind in kinds:
                        shard[kind][piece.local(lo, hi)] = values[t.name, kind].flatten()[lo - t.offset : hi - t.offset]
            del values
        self.optimizer.set_master(shard["param"])
        if "exp_avg" in shard:
            self.optimizer.set_moments(shard["exp_avg"], shard["exp_avg_sq"], int(adam_step))

    def canonical_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        """Every canonical tensor's name and shape, in the canonical order."""
        return [(t.name, tuple(t.shape)) for t in self.space.tensors.values()]

    # ------------------------------------------------------------ one step's traffic
    def layout_plan(self, key, layout):
        """The exchange's cached plan for a layout: `layout` is every rank's runs in buffer
        coordinates, or a function making them (called only on a cache miss)."""
        return self.exchange.plan(key, layout)

    def pull(self, plan, params: torch.Tensor, clock=None) -> PullStream:
        """Start this step's pull into `params` (whole, unless overlapping; `clock` times the
        overlapped waits)."""
        return PullStream(self.exchange, plan, self.optimizer.master(), params, self.overlap, clock)

    def push(self, plan, main_grads: torch.Tensor, push_buckets: list, clock=None) -> PushStream:
        """This step's push of `main_grads` into the shard's gradient; the optimizer's
        gradient is zeroed here, before any bucket lands."""
        self.optimizer.zero_grad()
        return PushStream(self.exchange, plan, main_grads, self.optimizer.grad, push_buckets, self.overlap, clock)

    def loss_scale(self) -> float:
        return float(self.grad_scaler.scale.item()) if self.grad_scaler is not None else 1.0

    def unscale(self, scale: float) -> None:
        """fp16: the pushed gradient back to its true scale, before its norm is taken."""
        if self.grad_scaler is not None:
            self.optimizer.unscale(1.0 / scale)

    def step(self, norm: float) -> bool:
        """Clip on the global gradient norm (`norm`, reduced by the caller) and update the
        shard; False (nothing applied) when the norm is not finite."""
        ok = self.optimizer.step(norm=norm)[0]
        if self.grad_scaler is not None:
            self.grad_scaler.update(not ok)
        return ok

    def bytes_moved(self) -> int:
        """Bytes pulled and pushed so far, this rank."""
        return self.exchange.bytes_pulled + self.exchange.bytes_pushed

    def persistent_bytes(self) -> dict[str, int]:
        out = dict(self.optimizer.persistent_bytes())
        out["exchange"] = self.exchange.persistent_bytes()
        return out
