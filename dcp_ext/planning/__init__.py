"""Planning: specs, the cost model, candidate layouts, the planners, the simulator and the
plan contract. Pure Python and numpy, no torch: a plan can be made and checked anywhere."""
