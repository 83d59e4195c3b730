"""The one error a planner raises: a batch (or a sequence in it) that no allowed layout can run.

Why a module of its own: the planners, the CLI tools and the training loops all catch it,
and none of them should import a planner's insides to do so.
"""
from __future__ import annotations


class PlanningError(ValueError):
    """A batch (or a sequence in it) that no allowed layout can run."""
