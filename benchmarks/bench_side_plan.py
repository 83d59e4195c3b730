"""What the side plan decides: the pinned adaptive and hydraulis plans with it on and off.

Why it exists: the side plan (planners/side_plan.py: the leading candidate planned a second
time, its stage 1 by search, planners/stage1_search.py) costs planning time on every
iteration of up to `side_plan_max_docs` documents. This prints what it buys, iteration by
iteration, on the cases tests/planning/test_plan_digests.py pins (the shipped length files):
the predicted time with it on and off, their ratio, and the median planning time of each.
Predicted times are the planner's cost model, not a measured run; it asserts nothing.

    python benchmarks/bench_side_plan.py
"""
from __future__ import annotations

import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from dcp_ext.cli.common import cluster_spec, load_lengths, model_spec  # noqa: E402
from dcp_ext.planning.batching import global_batches  # noqa: E402
from dcp_ext.planning.planner import make_planner  # noqa: E402
from tests.planning.test_plan_digests import CASES, LENGTHS  # noqa: E402

ITERATIONS = 3  # as pinned


def run(planner_name: str, case, side_plan: str) -> tuple[list[float], float]:
    """(predicted seconds per iteration, median planning ms) of one pinned case."""
    lengths_file, model, cluster, gbt, msl, _ = case
    lengths = load_lengths(os.path.join(LENGTHS, lengths_file))
    truncated = np.minimum(lengths, msl)
    planner = make_planner(planner_name, model_spec(model), cluster_spec(cluster), max_seq_len=msl,
                           global_batch_tokens=gbt, length_sample=truncated, side_plan=side_plan)
    times, spent = [], []
    for i, ids in enumerate(global_batches(lengths.tolist(), gbt, msl, count=ITERATIONS)):
        t0 = time.perf_counter()
        times.append(planner.plan_iteration(i, ids, truncated[ids].tolist()).predicted_time_s)
        spent.append(time.perf_counter() - t0)
    return times, 1000 * float(np.median(spent))


def main() -> int:
    print("| planner | lengths | cluster | iteration | on (s) | off (s) | off/on | plan ms on / off |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    decided, total, gains = 0, 0, []
    for case in CASES:
        for name in ("adaptive", "hydraulis"):
            if name not in case[5]:
                continue
            on, ms_on = run(name, case, "on")
            off, ms_off = run(name, case, "off")
            for i, (a, b) in enumerate(zip(on, off)):
                total += 1
                if a != b:
                    decided += 1
                    gains.append(b / a - 1)
                print(f"| {name} | {case[0]} | {case[2]} | {i} | {a:.6f} | {b:.6f} | {b / a:.5f} | "
                      f"{ms_on:.1f} / {ms_off:.1f} |", flush=True)
    span = f"; off is {100 * min(gains):.3f}-{100 * max(gains):.3f}% slower there" if gains else ""
    print(f"\nthe side plan decides {decided} of {total} iterations{span}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
