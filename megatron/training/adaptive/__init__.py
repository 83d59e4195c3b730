"""The `--dcp` step kind: its configuration, its loop around the adaptive engine, and the
calibration that prices the planner's layouts on this machine (at start and online)."""
