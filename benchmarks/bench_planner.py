"""Planner speed: building it and planning each iteration, C++ kernels vs the Python reference.

Why it exists: every rank builds the planner at every start of a job (before its first
iteration) and plans every iteration beside the step it overlaps, so both times are part
of the job's; the issue asks for the build in <= 10 s at h200x64 and <= 60 s at h200x1024,
and per-iteration planning in milliseconds. Per setting it prints, for the C++ kernels and
for the Python reference side by side (DCP_KERNELS=python), the build time, the
median and max planning time per iteration, and the plans' mean predicted iteration time,
which must agree. A lengths file too short for the batches is repeated in seeded shuffles.
`--compare-planners` prints every planner's times instead; with
`--profile FILE` (written by dcp-profile) it also fits the profile on part of its records
and prints the mean absolute error on held-out lengths (goal: <= 15% on the CPU demo).

    python benchmarks/bench_planner.py                      # h200x64 and h200x1024
    python benchmarks/bench_planner.py --large              # and h200x4096, 256M-token batches
    python benchmarks/bench_planner.py --large --settings "code 256M" --reference-plans-only --iterations 3
    python benchmarks/bench_planner.py --compare-planners
    python benchmarks/bench_planner.py --settings "code 4M" --layer-strategies --no-reference   # issue 16's point
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


LONG_MIX = os.path.join(os.path.dirname(__file__), "data", "long_context_mix.txt")
# (label, model, cluster, lengths file, global batch tokens, max sequence length)
SETTINGS = [
    ("code 4M", "llama2-7b", "h200x64", os.path.join(DATA, "code_python_cl100k.txt"), 4 * 2**20, 131072),
    ("long-context 16M", "llama2-7b", "h200x64", LONG_MIX, 16 * 2**20, 655360),
    ("code 64M", "llama2-7b", "h200x1024", os.path.join(DATA, "code_python_cl100k.txt"), 64 * 2**20, 131072),
]
LARGE = [("code 256M", "llama2-7b", "h200x4096", os.path.join(DATA, "code_python_cl100k.txt"), 256 * 2**20, 131072)]


def corpus(path: str, max_seq: int, tokens: int) -> np.ndarray:
    """The file's lengths (capped), repeated in seeded shuffles until they hold `tokens`:
    a 1024-GPU batch holds more documents than some whole files."""
    base = np.minimum(np.loadtxt(path, dtype=np.int64), max_seq)
    rng = np.random.default_rng(0)
    parts, total = [base], int(base.sum())
    while total < tokens:
        parts.append(rng.permutation(base))
        total += int(base.sum())
    return np.concatenate(parts)


def engine_times(setting, impl: str, iterations: int, layer_strategies: bool = False, planner=None) -> dict:
    """Build the adaptive planner and plan `iterations` batches with the C++ kernels
    ("cpp") or the Python reference ("python"); `layer_strategies`: with
    --dcp-layer-strategies on (each micro-batch's layers may re-factor their tp*cp).
    `planner`: plan with this one (built by the other engine; reset first) instead of
    building one (build time NaN); the result's "planner" is the one that planned."""
    _, model, cluster, path, tokens, max_seq = setting
    before = os.environ.get("DCP_KERNELS")
    os.environ["DCP_KERNELS"] = impl
    try:
        lengths = corpus(path, max_seq, tokens * iterations)
        batches = global_batches(lengths.tolist(), tokens, max_seq, count=iterations)
        t0 = time.perf_counter()
        if planner is None:
            p = make_planner("adaptive", ModelSpec.from_preset(model), ClusterSpec.from_preset(cluster),
                             max_seq_len=max_seq, global_batch_tokens=tokens, length_sample=lengths,
                             **({"layer_strategies": True} if layer_strategies else {}))
            build = time.perf_counter() - t0
        else:
            p, build = planner, float("nan")
            p.reset()
        ts, predicted = [], []
        for i, ids in enumerate(batches):
            t = time.perf_counter()
            plan = p.plan_iteration(i, ids, lengths[ids].tolist())
            ts.append(time.perf_counter() - t)
            predicted.append(plan.predicted_time_s)
    finally:
        if before is None:
            os.environ.pop("DCP_KERNELS", None)
        else:
            os.environ["DCP_KERNELS"] = before
    return dict(build=build, median=1000 * float(np.median(ts)), max=1000 * float(np.max(ts)), predicted=predicted,
                planner=p)


def compare_engines(settings, iterations: int, reference: bool, layer_strategies: bool = False,
                    reference_builds: bool = True) -> None:
    """`reference_builds` False: the Python reference plans on the pool the kernels built
    (the build's kernels equal their reference, tests/planning/test_planner_kernels.py), so only
    the per-iteration times are compared (the reference build at h200x4096 takes long)."""
    print(f"{'setting':17s} {'cluster':9s} {'engine':7s} {'build s':>8s} {'plan median ms':>15s} {'plan max ms':>12s} "
          f"{'predicted s':>12s}", flush=True)
    for setting in settings:
        res = {}
        for impl in ("cpp", "python") if reference else ("cpp",):
            built = res["cpp"]["planner"] if impl == "python" and not reference_builds else None
            r = res[impl] = engine_times(setting, impl, iterations, layer_strategies, planner=built)
            print(f"{setting[0]:17s} {setting[2]:9s} {impl:7s} {r['build']:8.1f} {r['median']:15.1f} {r['max']:12.1f} "
                  f"{float(np.mean(r['predicted'])):12.4f}", flush=True)
        if reference:
            c, py = res["cpp"], res["python"]
            same = "the same plans' times" if c["predicted"] == py["predicted"] else "PREDICTED TIMES DIFFER"
            build = f"{py['build'] / c['build']:7.1f}x" if reference_builds else f"{'(same)':>8s}"
            print(f"{'':17s} {'':9s} {'py/cpp':7s} {build} {py['median'] / c['median']:14.1f}x "
                  f"{py['max'] / c['max']:11.1f}x  {same}", flush=True)
        res.clear()  # the planners (gigabytes at h200x4096) go before the next setting


def compare_planners(iterations: int, names, data: str) -> None:
    for f in ["code_python_cl100k.txt", "mooncake_conversation_input_tokens.txt"]:
        path = os.path.join(data, f)
        if not os.path.exists(path):
            continue
        for model, cluster in [("llama2-7b", "h200x64"), ("llama2-7b", "h200x256"), ("llama2-70b", "h200x64")]:
            res = planning_times(model, cluster, path, iterations, names)
            for name, (build, med, p90, mx) in res.items():
                print(f"{f:42s} {model:11s} {cluster:9s} {name:11s} build {build:5.1f} s  plan median {med:6.1f} ms  "
                      f"p90 {p90:6.1f} ms  max {mx:6.1f} ms", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iterations", type=int, default=10)
    ap.add_argument("--large", action="store_true", help="also h200x4096 with 256M-token batches")
    ap.add_argument("--no-reference", action="store_true", help="the C++ kernels only (the reference is slow at scale)")
    ap.add_argument("--reference-plans-only", action="store_true",
                    help="the Python reference plans on the pool the kernels built (its own build is not timed)")
    ap.add_argument("--compare-planners", action="store_true", help="every planner's build and planning times")
    ap.add_argument("--layer-strategies", action="store_true",
                    help="the adaptive planner with layer strategies on (--dcp-layer-strategies on)")
    ap.add_argument("--settings", default=None,
                    help="comma-separated labels of the settings to run (default: all of them)")
    ap.add_argument("--planners", default=",".join(PLANNERS))
    ap.add_argument("--profile", default=None)
    ap.add_argument("--data", default=DATA)
    a = ap.parse_args()
    if a.profile:
        profile_accuracy(a.profile)
    if a.compare_planners:
        compare_planners(a.iterations, [n for n in a.planners.split(",") if n], a.data)
        return 0
    settings = SETTINGS + (LARGE if a.large else [])
    if a.settings:
        wanted = [w.strip() for w in a.settings.split(",") if w.strip()]
        unknown = [w for w in wanted if w not in {st[0] for st in settings}]
        if unknown:
            print(f"error: --settings {', '.join(unknown)}: not a setting (choose from "
                  f"{', '.join(repr(st[0]) for st in settings)})", file=sys.stderr)
            return 2
        settings = [st for st in settings if st[0] in wanted]
    if a.layer_strategies:
        print("layer strategies on")
    compare_engines(settings, a.iterations, not a.no_reference, a.layer_strategies,
                    reference_builds=not a.reference_plans_only)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
