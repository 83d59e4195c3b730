"""Initial parameter values and the per-step RNG streams, independent of the layout.

Why it exists: a model trained under any sequence of layouts must start from the same
values and draw the same dropout streams as the single-process reference, so values are
drawn per canonical tensor chunk from a seeded stream and megatron-core's RNG tracker is
re-seeded per step and TP rank.
"""
from __future__ import annotations

import math
import zlib

import torch

INIT_CHUNK = 1 << 20  # initial values are drawn per (tensor, chunk): a rank draws only its own


def seed_rng_tracker(seed: int, iteration: int, tp_rank: int) -> None:
    """megatron-core's model-parallel RNG tracker is one global; its streams depend on the TP
    rank, which changes with the layout, so it is re-seeded for every step (Megatron's
    offsets: +2718 per TP rank for the model-parallel stream)."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    tracker = get_cuda_rng_tracker()
    tracker.reset()
    base = seed + 1_000_003 * iteration
    tracker.add("model-parallel-rng", base + 2718 + tp_rank)
    tracker.add("data-parallel-rng", base)
    tracker.add("expert-parallel-rng", base + 1024 + tp_rank)


def init_values(name: str, chunk: int, numel: int, seed: int, std: float, num_layers: int,
                norm_init: float = 1.0) -> torch.Tensor:
    """Megatron's defaults: norms 1 (0 when zero-centred, --apply-layernorm-1p), biases 0, output
    projections N(0, std/sqrt(2L)), else N(0, std); drawn per chunk of a tensor from a stream
    seeded by (seed, name, chunk)."""
    if name.endswith(".bias"):
        return torch.zeros(numel)
    if "norm" in name.rsplit(".", 2)[-2] or name.endswith("layer_norm_weight"):
        return torch.full((numel,), norm_init)
    scaled = name.endswith("linear_proj.weight") or name.endswith("linear_fc2.weight")
    sigma = std / math.sqrt(2.0 * num_layers) if scaled else std
    gen = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode()) + 7919 * chunk) % 2**63)
    return torch.randn(numel, generator=gen) * sigma
