"""Checkpoints: Megatron's layout written crash-safely, the adaptive runtime's fixed sharding,
checksums, the one-job-per-directory lock, and what a resume must agree on.

`megatron.training.checkpointing` (upstream's name) is the static loop's entry.
"""
