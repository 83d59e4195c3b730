"""The error that stops training with one clear line.

Why it exists: both training paths (static, --dcp) raise it and `pretrain()` reports it,
so it lives apart from either loop and neither has to import the other.
"""


class TrainingError(RuntimeError):
    """A condition that stops training with one clear line (NaN streak, missing checkpoint)."""


class AgreedTrainingError(TrainingError):
    """A TrainingError every rank raises alike (decided from reduced values): said once, by rank 0."""
