"""How one replica runs its micro-batches: 1F1B over its pipeline stages (`executor`),
context-parallel chunks, per-micro-batch layer switching (`layer_switch`) and timing."""
