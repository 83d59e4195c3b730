"""The optimizer state that never moves: this rank's shard of the fixed sharding.

Rank r owns its piece of every bucket (`sharding.py`): their fp32 master values, their
fp32 gradient accumulator and their Adam moments, all flat and on the model's device.
Whatever layout an iteration uses, parameters are pulled from here and gradients pushed
back here, and the step runs here (torch's AdamW, Megatron's optimizer without apex/TE,
so the update is the one upstream Megatron makes). The shard is cut into runs of equal
weight-decay flag; each run is a torch Parameter that is a view of the flat master, with
a view of the flat gradient as its `.grad`, so nothing is copied per step. Clipping uses
the true global norm: every gradient element lives in exactly one shard.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist


class ShardedAdamW:
    """AdamW over this rank's shard, with Megatron's param groups (decay / no decay).

    `decay_runs`: (shard_start, shard_end, no_weight_decay) covering the shard."""

    def __init__(self, initial_shard: torch.Tensor, decay_runs: list[tuple[int, int, bool]], *, lr: float,
                 weight_decay: float, betas=(0.9, 0.999), eps: float = 1e-8, clip_grad: float = 1.0):
        self.clip_grad = clip_grad
        self.flat = initial_shard.detach().clone().float()
        self.grad = torch.zeros_like(self.flat)
        self.runs = list(decay_runs)
        self.pieces = []
        for start, end, _ in self.runs:
            p = torch.nn.Parameter(self.flat[start:end])
            p.grad = self.grad[start:end]
            self.pieces.append(p)
        decay = [p for p, (_, _, nwd) in zip(self.pieces, self.runs) if not nwd]
        no_decay = [p for p, (_, _, nwd) in zip(self.pieces, self.runs) if nwd]
        groups = []
        if decay:
            groups.append({"params": decay, "wd_mult": 1.0, "lr_mult": 1.0})
        if no_decay:
            groups.append({"params": no_decay, "wd_mult": 0.0, "lr_mult": 1.0, "weight_decay": 0.0})
        if not groups:  # an empty shard (more ranks than elements): keep the schedulers' shape
            groups = [{"params": [torch.nn.Parameter(self.flat[:0])], "wd_mult": 1.0, "lr_mult": 1.0}]
        self.inner = torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                       foreach=self.flat.is_cuda)

    grad_scaler = None  # megatron-core's loss scaler under --fp16 (the engine sets it)

    def get_loss_scale(self) -> torch.Tensor:
        """What Megatron's log line reports (1 without a loss scaler)."""
        return self.grad_scaler.scale if self.grad_scaler is not None else torch.ones(1)

    @property
    def param_groups(self):  # what megatron-core's OptimizerParamScheduler drives
        return self.inner.param_groups

    def persistent_bytes(self) -> dict[str, int]:
        n = self.flat.numel()
        return {"master": 4 * n, "grad_shard": 4 * n, "adam": 8 * n}

    def master(self) -> torch.Tensor:
        """This rank's fp32 master parameters, flat, in shard order (a view: do not write)."""
        return self.flat

    def set_master(self, values: torch.Tensor) -> None:
        with torch.no_grad():
            self.flat.copy_(values)

    def zero_grad(self) -> None:
        self.grad.zero_()

    def unscale(self, inv_scale: float) -> None:
        self.grad.mul_(inv_scale)

    def global_grad_norm(self, group=None) -> float:
        sq = self.grad.double().pow(2).sum().reshape(1)
        dist.all_reduce(sq, group=group)
        return math.sqrt(sq.item())

    def step(self, group=None) -> tuple[bool, float]:
        """Clip to the global norm, then AdamW. Skips (returns False) on a non-finite norm."""
        norm = self.global_grad_norm(group)
        if not math.isfinite(norm):
            return False, norm
        coeff = self.clip_grad / (norm + 1.0e-6) if self.clip_grad and self.clip_grad > 0 else 1.0
        if coeff < 1.0:
            self.grad.mul_(coeff)  # in place, as Megatron clips: no second gradient copy
        self.inner.step()  # each piece's .grad is a view of self.grad
        if coeff < 1.0:
            self.grad.div_(coeff)  # leave the pushed gradient readable (tests, logging)
        return True, norm

    def moments(self) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(exp_avg, exp_avg_sq) of this shard, flat in shard order, and the step count."""
        avg = torch.zeros_like(self.flat)
        avg_sq = torch.zeros_like(self.flat)
        step = 0
        for p, (start, end, _) in zip(self.pieces, self.runs):
            state = self.inner.state.get(p)
            if state:
                avg[start:end] = state["exp_avg"]
                avg_sq[start:end] = state["exp_avg_sq"]
                step = int(state["step"])
        return avg, avg_sq, step

    def set_moments(self, avg: torch.Tensor, avg_sq: torch.Tensor, step: int) -> None:
        for p, (start, end, _) in zip(self.pieces, self.runs):
            if step == 0:
                self.inner.state.pop(p, None)
                continue
            self.inner.state[p] = {
                "step": torch.tensor(float(step)),
                "exp_avg": avg[start:end].to(self.flat.device).clone(),
                "exp_avg_sq": avg_sq[start:end].to(self.flat.device).clone(),
            }
