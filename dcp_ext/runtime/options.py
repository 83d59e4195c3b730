"""What the adaptive engine is told once, at construction: one frozen record.

Why it exists: the engine used to take nineteen keyword arguments, the optimizer's two
ways. The training loop builds this record once from the validated flags (the run
configuration, `megatron/training/adaptive/run_config.py`), tests build it directly; every part of
the runtime reads its own fields from it and nothing writes it afterwards.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dcp_ext.runtime.params.sharded_optimizer import OptimizerOptions


@dataclass(frozen=True)
class EngineOptions:
    optimizer: OptimizerOptions = field(default_factory=OptimizerOptions)
    sequence_parallel: bool = False
    exchange: str = "targeted"  # targeted | allgather
    overlap: bool = False  # pull/push overlapped with compute (two exchange slots)
    bucket_numel: int | None = None  # elements per exchange bucket; None: the sharding's rule
    grad_reduce_in_bf16: bool = False
    init_seed: int = 1234
    init_std: float = 0.02
    layer_strategies: bool = False  # every stage can switch its layers' (tp, cp) per micro-batch
    device: str | None = None  # None: this process's CUDA device, else the CPU; 'meta': no memory


def default_device() -> torch.device:
    """This process's CUDA device, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
