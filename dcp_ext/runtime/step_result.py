"""What one step of the adaptive engine returns, and the one way a batch can refuse to train.

Why it exists: the training loop reads a step's outcome (loss over the global batch,
gradient norm, whether the update applied, traffic and waiting, this rank's timings)
without knowing how the engine produced it.
"""
from __future__ import annotations

from dataclasses import dataclass

from dcp_ext.runtime.schedule.timing import LocalTimings


@dataclass
class StepResult:
    loss_sum: float  # summed over the global batch (every token once)
    loss_tokens: float
    grad_norm: float
    update_successful: bool
    bytes_moved: float = 0.0  # pull + push, all ranks together, this step
    exposed_comm_s: float = 0.0  # time this rank spent blocked on pull/push (max over ranks)
    loss_scale: float = 1.0
    timings: LocalTimings | None = None  # this rank's (timing.reduce_step makes them global)
    exchange_s: float = 0.0  # the quickest rank's time blocked on pull/push: the exchange itself (the
    # last rank to arrive waits for nobody); exposed_comm_s minus this is waiting for the slowest rank

    @property
    def loss(self) -> float:
        return self.loss_sum / max(self.loss_tokens, 1.0)


class ForwardStepError(ValueError):
    """The entry point's forward_step or loss function does what --dcp cannot run."""


class NoTrainableTokens(ValueError):
    """The global batch has no token whose loss counts (all masked, or one-token samples)."""
