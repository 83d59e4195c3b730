"""The optimizer state that never moves: this rank's shard of the fixed sharding.

Rank r owns its piece of every bucket (`sharding.py`): their fp32 master values, their
fp32 gradient accumulator and the optimizer's state, all flat and on the model's device.
Whatever layout an iteration uses, parameters are pulled from here and gradients pushed
back here, and the step runs here with the torch optimizer megatron-core builds without
apex/TE (`--optimizer adam`: AdamW with --adam-beta1/2, --adam-eps; `--optimizer sgd`: SGD
with --sgd-momentum), so the update is the one upstream Megatron makes. Param groups as
megatron-core's: no weight decay on biases and 1-D parameters (norms), and with
`--decoupled-lr` the embedding and output layer on their own LR schedule (max_lr /
min_lr of their group, which megatron-core's OptimizerParamScheduler reads). The shard is
cut into runs of equal group; each run is a torch Parameter that is a view of the flat
master, with a view of the flat gradient as its `.grad`, so nothing is copied per step.
Clipping (--clip-grad) uses the true global norm: every gradient element lives in exactly
one shard.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

NORM_CHUNK = 1 << 22  # elements per float64 partial sum of the gradient norm (32 MiB transient)


@dataclass(frozen=True)
class OptimizerOptions:
    """Megatron's optimizer flags, as the fixed sharding's optimizer takes them."""

    optimizer: str = "adam"  # adam | sgd
    lr: float = 1e-3
    min_lr: float = 0.0
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    sgd_momentum: float = 0.9
    clip_grad: float = 1.0
    decoupled_lr: float | None = None
    decoupled_min_lr: float | None = None


class ShardedOptimizer:
    """AdamW or SGD over this rank's shard, with megatron-core's param groups.

    `runs`: (shard_start, shard_end, no_weight_decay[, decoupled_lr]) covering the shard."""

    def __init__(self, initial_shard: torch.Tensor, runs: list[tuple], options: OptimizerOptions | None = None,
                 grad_scaler=None, **flags):
        o = options or OptimizerOptions()
        if flags:  # the old keyword form (lr=, weight_decay=, betas=, eps=, clip_grad=)
            o = OptimizerOptions(**{**o.__dict__, **flags})
        if o.optimizer not in ("adam", "sgd"):
            raise ValueError(f"optimizer {o.optimizer!r}: the fixed sharding runs adam or sgd")
        self.options = o
        self.clip_grad = o.clip_grad
        self.flat = initial_shard.detach().clone().float()
        self.grad = torch.zeros_like(self.flat)
        self.runs = [(r[0], r[1], bool(r[2]), bool(r[3]) if len(r) > 3 else False) for r in runs]
        self.pieces = []
        for start, end, _, _ in self.runs:
            p = torch.nn.Parameter(self.flat[start:end])
            p.grad = self.grad[start:end]
            self.pieces.append(p)
        decoupled = o.decoupled_lr is not None
        groups = []
        # the default-schedule groups first; every schedule there is gets a group on every
        # rank, an empty one where the shard holds none of its parameters: the log line reads
        # each schedule's LR from whichever rank logs (a rank holding only the output layer's
        # elements under --decoupled-lr logged NaN)
        for is_dec in ((False, True) if decoupled else (False,)):
            kinds = []
            for nwd in (False, True):
                params = [p for p, (_, _, n, d) in zip(self.pieces, self.runs) if n == nwd and (d and decoupled) == is_dec]
                if params:
                    kinds.append((nwd, params))
            for nwd, params in kinds or [(False, [torch.nn.Parameter(self.flat[:0])])]:
                g = {"params": params, "wd_mult": 0.0 if nwd else 1.0, "lr_mult": 1.0, "is_decoupled_lr": is_dec,
                     "default_config": not is_dec, "max_lr": o.lr, "min_lr": o.min_lr}
                if nwd:
                    g["weight_decay"] = 0.0
                if is_dec:
                    g["max_lr"], g["lr"] = o.decoupled_lr, o.decoupled_lr
                    if o.decoupled_min_lr is not None:
                        g["min_lr"] = o.decoupled_min_lr
                groups.append(g)
        if o.optimizer == "sgd":
            self.inner = torch.optim.SGD(groups, lr=o.lr, weight_decay=o.weight_decay, momentum=o.sgd_momentum,
                                         foreach=self.flat.is_cuda)
        else:
            self.inner = torch.optim.AdamW(groups, lr=o.lr, betas=tuple(o.betas), eps=o.eps,
                                           weight_decay=o.weight_decay, foreach=self.flat.is_cuda)
        self._sgd_steps = 0
        self.grad_scaler = grad_scaler  # megatron-core's loss scaler under --fp16

    def get_loss_scale(self) -> torch.Tensor:
        """What Megatron's log line reports (1 without a loss scaler)."""
        return self.grad_scaler.scale if self.grad_scaler is not None else torch.ones(1)

    @property
    def param_groups(self):  # what megatron-core's OptimizerParamScheduler drives
        return self.inner.param_groups

    def persistent_bytes(self) -> dict[str, int]:
        n = self.flat.numel()
        if self.options.optimizer == "sgd":
            return {"master": 4 * n, "grad_shard": 4 * n, "momentum": 4 * n if self.options.sgd_momentum else 0}
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

    def grad_square_sum(self) -> torch.Tensor:
        """This shard's sum of squared gradients, a float64 scalar on the device (no host wait).
        Summed in float64 chunk by chunk: a transient of NORM_CHUNK elements, never a float64
        copy of the whole shard."""
        total = torch.zeros((), dtype=torch.float64, device=self.grad.device)
        for chunk in self.grad.split(NORM_CHUNK):
            c = chunk.double()
            total += torch.dot(c, c)
        return total

    def global_grad_norm(self, group=None) -> float:
        sq = self.grad_square_sum().reshape(1)
        dist.all_reduce(sq, group=group)
        return math.sqrt(sq.item())

    def step(self, group=None, norm: float | None = None) -> tuple[bool, float]:
        """Clip to the global norm (`norm` when the caller reduced it, else reduced here over
        `group`), then AdamW / SGD. Skips (returns False) on a non-finite norm."""
        if norm is None:
            norm = self.global_grad_norm(group)
        if not math.isfinite(norm):
            return False, norm
        coeff = self.clip_grad / (norm + 1.0e-6) if self.clip_grad and self.clip_grad > 0 else 1.0
        if coeff < 1.0:
            self.grad.mul_(coeff)  # in place, as Megatron clips: no second gradient copy
        self.inner.step()  # each piece's .grad is a view of self.grad
        self._sgd_steps += 1
        if coeff < 1.0:
            self.grad.div_(coeff)  # leave the pushed gradient readable (tests, logging)
        return True, norm

    def moments(self) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(exp_avg, exp_avg_sq) of this shard, flat in shard order, and the step count.
        SGD: (momentum buffer, zeros, steps), so checkpoints keep one format."""
        avg = torch.zeros_like(self.flat)
        avg_sq = torch.zeros_like(self.flat)
        step = 0
        sgd = self.options.optimizer == "sgd"
        for p, (start, end, _, _) in zip(self.pieces, self.runs):
            state = self.inner.state.get(p)
            if not state:
                continue
            if sgd:
                if state.get("momentum_buffer") is not None:
                    avg[start:end] = state["momentum_buffer"]
            else:
                avg[start:end] = state["exp_avg"]
                avg_sq[start:end] = state["exp_avg_sq"]
                step = int(state["step"])
        return avg, avg_sq, (self._sgd_steps if sgd else step)

    def step_count(self) -> int:
        """The step count `moments` returns, without gathering the moments."""
        if self.options.optimizer == "sgd":
            return self._sgd_steps
        step = 0
        for p in self.pieces:
            state = self.inner.state.get(p)
            if state:
                step = int(state["step"])
        return step

    def set_moments(self, avg: torch.Tensor, avg_sq: torch.Tensor, step: int) -> None:
        sgd = self.options.optimizer == "sgd"
        if sgd:
            self._sgd_steps = int(step)
        for p, (start, end, _, _) in zip(self.pieces, self.runs):
            if step == 0:
                self.inner.state.pop(p, None)
                continue
            if sgd:
                if self.options.sgd_momentum:
                    self.inner.state[p] = {"momentum_buffer": avg[start:end].to(self.flat.device).clone()}
                continue
            self.inner.state[p] = {
                "step": torch.tensor(float(step)),
                "exp_avg": avg[start:end].to(self.flat.device).clone(),
                "exp_avg_sq": avg_sq[start:end].to(self.flat.device).clone(),
            }


ShardedAdamW = ShardedOptimizer  # the name it had when it ran AdamW only
