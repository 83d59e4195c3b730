"""Planners: the adaptive one and the baselines, all behind `make_planner` (see dcp_ext.planning.planner)."""
