"""The optimizer state that never moves: one even sharding of the canonical flat vector.

Rank r owns elements [start_r, end_r) of the canonical parameter vector: their fp32
master values, their gradient accumulator and their Adam moments. Whatever layout an
iteration uses, parameters are pulled from here and gradients pushed back here, and the
step runs here (torch's AdamW, Megatron's optimizer without apex/TE, so the update is the
one upstream Megatron makes). Clipping uses the true global norm: every gradient element
lives in exactly one shard, so the sum of squares over shards is exact.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist


def shard_bounds(numel: int, world_size: int) -> list[tuple[int, int]]:
    """Even split; the first `numel % world` ranks get one element more."""
    base, extra = divmod(numel, world_size)
    bounds, start = [], 0
    for r in range(world_size):
        size = base + (1 if r < extra else 0)
        bounds.append((start, start + size))
        start += size
    return bounds


class ShardedAdamW:
    """AdamW over this rank's shard, with Megatron's param groups (decay / no decay)."""

    def __init__(self, initial_flat_shard: torch.Tensor, no_decay_mask: torch.Tensor, *, lr: float,
                 weight_decay: float, betas=(0.9, 0.999), eps: float = 1e-8, clip_grad: float = 1.0):
        self.clip_grad = clip_grad
        self.decay_idx = (~no_decay_mask).nonzero().flatten()
        self.no_decay_idx = no_decay_mask.nonzero().flatten()
        self.decay = torch.nn.Parameter(initial_flat_shard[self.decay_idx].clone().float())
        self.no_decay = torch.nn.Parameter(initial_flat_shard[self.no_decay_idx].clone().float())
        self.grad = torch.zeros_like(initial_flat_shard, dtype=torch.float32)
        self.inner = torch.optim.AdamW(
            [
                {"params": [self.decay], "wd_mult": 1.0, "lr_mult": 1.0},
                {"params": [self.no_decay], "wd_mult": 0.0, "lr_mult": 1.0, "weight_decay": 0.0},
            ],
            lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=False,
        )

    @property
    def param_groups(self):  # what megatron-core's OptimizerParamScheduler drives
        return self.inner.param_groups

    def master(self) -> torch.Tensor:
        """This rank's fp32 master parameters, flat, in canonical order."""
        out = torch.empty(self.grad.numel(), dtype=torch.float32)
        out[self.decay_idx] = self.decay.detach()
        out[self.no_decay_idx] = self.no_decay.detach()
        return out

    def set_master(self, values: torch.Tensor) -> None:
        with torch.no_grad():
            self.decay.copy_(values[self.decay_idx])
            self.no_decay.copy_(values[self.no_decay_idx])

    def zero_grad(self) -> None:
        self.grad.zero_()

    def global_grad_norm(self, group=None) -> float:
        sq = torch.tensor([float(self.grad.double().pow(2).sum())], dtype=torch.float64)
        dist.all_reduce(sq, group=group)
        return math.sqrt(sq.item())

    def step(self, group=None) -> tuple[bool, float]:
        """Clip to the global norm, then AdamW. Skips (returns False) on a non-finite norm."""
        norm = self.global_grad_norm(group)
        if not math.isfinite(norm):
            return False, norm
        grad = self.grad
        if self.clip_grad and self.clip_grad > 0:
            coeff = self.clip_grad / (norm + 1.0e-6)
            if coeff < 1.0:
                grad = grad * coeff
        self.decay.grad = grad[self.decay_idx].clone()
        self.no_decay.grad = grad[self.no_decay_idx].clone()
        self.inner.step()
        self.decay.grad = self.no_decay.grad = None
        return True, norm

    def moments(self) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(exp_avg, exp_avg_sq) of this shard, flat in canonical order, and the step count."""
        avg = torch.zeros(self.grad.numel(), dtype=torch.float32)
        avg_sq = torch.zeros_like(avg)
        step = 0
        for p, idx in ((self.decay, self.decay_idx), (self.no_decay, self.no_decay_idx)):
            state = self.inner.state.get(p)
            if state:
                avg[idx] = state["exp_avg"]
                avg_sq[idx] = state["exp_avg_sq"]
                step = int(state["step"])
        return avg, avg_sq, step

    def set_moments(self, avg: torch.Tensor, avg_sq: torch.Tensor, step: int) -> None:
        for p, idx in ((self.decay, self.decay_idx), (self.no_decay, self.no_decay_idx)):
            if step == 0:
                self.inner.state.pop(p, None)
                continue
            self.inner.state[p] = {
                "step": torch.tensor(float(step)),
                "exp_avg": avg[idx].clone(),
                "exp_avg_sq": avg_sq[idx].clone(),
            }
