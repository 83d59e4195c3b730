"""What the checkpoint package needs to know of a run, read from the flags once.

Why it exists: saving and loading are below the flags' door (issue 39): they take this
frozen record, filled by `flags.records.checkpoint_config_for` after the flags are checked
and the vocabulary padded, never the argparse namespace. The one piece of the flags that a
checkpoint stores whole, Megatron's `args` in common.pt, travels as plain (name, value)
pairs (`stored_flags`) so the record stays immutable.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field, replace


@dataclass(frozen=True)
class CheckpointConfig:
    save: str | None = None  # --save
    load: str | None = None  # --load (after --pretrained-checkpoint's rule)
    save_optim: bool = True  # not --no-save-optim
    save_rng: bool = True  # not --no-save-rng
    load_optim: bool = True  # not --no-load-optim
    load_rng: bool = True  # not --no-load-rng
    finetune: bool = False  # --finetune: weights only, the iteration count from 0
    verify: bool = True  # not --no-verify-checkpoint
    exit_on_missing: bool = False  # --exit-on-missing-checkpoint
    override_scheduler: bool = False  # --override-opt_param-scheduler
    use_checkpoint_scheduler: bool = False  # --use-checkpoint-opt_param-scheduler
    adaptive: bool = False  # --dcp: the adaptive runtime's checkpoints
    layout: tuple[int, int, int, int] = (1, 1, 1, 1)  # world size, TP, PP, CP
    distributed_optimizer: bool = False  # --use-distributed-optimizer
    mixed_precision: bool = False  # --bf16 or --fp16: the model's weights are copies of the fp32 master
    padded_vocab_size: int | None = None
    vocab_divisor: int = 128  # --make-vocab-size-divisible-by
    vocab_size: int | None = None  # --vocab-size
    swiglu: bool = False
    model_flags: tuple[tuple[str, object], ...] = ()  # this run's model-shaping flags (resume_checks compares them)
    stored_flags: tuple[tuple[str, object], ...] = field(default=(), repr=False)  # common.pt's "args"

    @property
    def tensor_parallel(self) -> int:
        return self.layout[1]

    def loads_optimizer(self) -> bool:
        """Whether a load reads the optimizer state and the LR schedule."""
        return self.load_optim and not self.finetune

    def loads_rng(self) -> bool:
        return self.load_rng and not self.finetune

    def as_finetune(self) -> "CheckpointConfig":
        """The same run loading weights only (an upstream release checkpoint is loaded so)."""
        return replace(self, finetune=True)

    def stored_args(self, **extra) -> argparse.Namespace:
        """Megatron's `args` for common.pt: the run's flags, plus `extra` (what upstream's
        loader reads there, e.g. the consumed samples)."""
        return argparse.Namespace(**{**dict(self.stored_flags), **extra})
