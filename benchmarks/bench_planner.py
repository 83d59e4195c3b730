"""Planner speed (ms per iteration) and, given a profile file, cost-model accuracy.

Why it exists: the planner runs every iteration on every rank, so its time is part of the
step; the acceptance asks for <= 20 ms (median) at 64 GPUs and <= 100 ms at 256. With
`--profile FILE` (written by dcp-profile) it also fits the profile on part of its records
and prints the mean absolute error on held-out lengths (goal: <= 15% on the CPU demo).

    python benchmarks/bench_planner.py
    python benchmarks/bench_planner.py --profile cache/profile-demo.json
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from dcp_ext.data.lengths import DATA_DIR  # noqa: E402
from dcp_ext.planning.batching import global_batches  # noqa: E402
from dcp_ext.planning.planner import PLANNERS, make_planner  # noqa: E402
from dcp_ext.planning.specs import ClusterSpec, ModelSpec  # noqa: E402

DATA = os.environ.get("DCP_LENGTHS_DIR", DATA_DIR)


def planning_times(model: str, cluster: str, path: str, iterations: int, names) -> dict:
    lengths = np.minimum(np.loadtxt(path, dtype=np.int64), 131072)
    batches = global_batches(lengths.tolist(), 4 * 2**20, 131072, count=iterations)
    out = {}
    for name in names:
        t0 = time.perf_counter()
        p = make_planner(name, ModelSpec.from_preset(model), ClusterSpec.from_preset(cluster), max_seq_len=131072,
                         global_batch_tokens=4 * 2**20, length_sample=lengths)
        build = time.perf_counter() - t0
        ts = []
        for i, ids in enumerate(batches):
            lens = lengths[ids].tolist()
            t = time.perf_counter()
            p.plan_iteration(i, ids, lens)
            ts.append(time.perf_counter() - t)
        out[name] = (build, 1000 * float(np.median(ts)), 1000 * float(np.quantile(ts, 0.9)), 1000 * float(np.max(ts)))
    return out


def profile_accuracy(path: str) -> None:
    from dcp_ext.planning.profile import Profile, evaluate_profile, fit_profile, split_holdout

    prof = Profile.load(path)
    fit, held = split_holdout(prof.records)
    if not held:
        print("profile has too few distinct lengths per strategy to hold any out")
        return
    refit = fit_profile(fit, prof.model, prof.cluster)
    err = evaluate_profile(refit, held)
    print(f"profile {path}: {len(prof.records)} records, {len(prof.fits)} strategies; fitted on {len(fit)}, "
          f"held out {len(held)}: mean absolute error {err:.1f}%")
    for key, f in sorted(refit.fits.items()):
        hk = [r for r in held if r.key == key]
        if hk:
            print(f"  tp{key[0]} cp{key[1]} pp{key[2]} recompute {key[3]}: {evaluate_profile(refit, hk):5.1f}% "
                  f"on {len(hk)} held-out records (fit rms {100 * f.rms_rel_err:.1f}%)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iterations", type=int, default=20)
    ap.add_argument("--planners", default=",".join(PLANNERS))
    ap.add_argument("--profile", default=None)
    ap.add_argument("--data", default=DATA)
    a = ap.parse_args()
    if a.profile:
        profile_accuracy(a.profile)
    names = [n for n in a.planners.split(",") if n]
    for f in ["code_python_cl100k.txt", "mooncake_conversation_input_tokens.txt"]:
        path = os.path.join(a.data, f)
        if not os.path.exists(path):
            continue
        for model, cluster in [("llama2-7b", "h200x64"), ("llama2-7b", "h200x256"), ("llama2-70b", "h200x64")]:
            res = planning_times(model, cluster, path, a.iterations, names)
            for name, (build, med, p90, mx) in res.items():
                print(f"{f:42s} {model:11s} {cluster:9s} {name:11s} build {build:5.1f} s  plan median {med:6.1f} ms  "
                      f"p90 {p90:6.1f} ms  max {mx:6.1f} ms", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
