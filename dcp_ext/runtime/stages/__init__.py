"""What a rank can play: process groups of every replica type, the megatron-core model
stages (and layer-wise alternatives) built under them, the shared buffers they all view,
and the hooks that tie a stage's forward and backward to the step's streams.
`bank.StageBank` is the one object the engine holds."""
