"""The layout-independent state: the canonical space, its fixed sharding over all ranks, the
optimizer on this rank's shard, initial values, and the bucketed exchange (pull/push
streams) that moves parameters into a layout and gradients back. Nothing here knows a
stage or a schedule; `server.ParameterServer` is the one object the engine holds."""
