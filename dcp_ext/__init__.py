"""dcp_ext: the adaptive-parallel engine (specs, cost model, planner, kernels, runtime).

Pure planning code lives here without torch; the torch glue (runtime, CPU compatibility
for megatron-core, attention) imports torch lazily in its own modules.
"""
