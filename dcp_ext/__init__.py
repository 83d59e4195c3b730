"""dcp_ext: the adaptive-parallel engine.

    planning/  specs, cost model, candidates, planners, simulator, plan contract (no torch)
    assign/    the C++ stage-1/stage-2 kernels (pybind11) and their Python reference
    runtime/   torch glue: model, attention, context parallel, the engine and its exchange
    data/      documents, tokenizers, indexed datasets, packing
    compat/    megatron-core shims for CPU ranks and the pinned version
    cli/       dcp-plan, dcp-simulate, dcp-profile
"""
