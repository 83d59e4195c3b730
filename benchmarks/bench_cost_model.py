"""Cost model vs reality on this machine: predicted vs measured micro-batch times on
document lengths the profile was not fitted on, for the profiled and the analytic model.

Why it exists: the planner is only as good as its prices. The acceptance asks that, after
`dcp-profile` on the CPU demo model, predicted micro-batch times be within 15% mean
absolute error of measured ones on held-out lengths. This prints the evidence (ratios,
no asserts on time).

    python benchmarks/bench_cost_model.py                      # profile + held-out, one session
    python benchmarks/bench_cost_model.py --mode sequential    # dcp-profile first, then held-out
    python benchmarks/bench_cost_model.py --profile cache/profile-demo.json   # an earlier profile

Held-out micro-batches, per profiled strategy (layout, recompute): totals at the geometric
midpoints between the grid's totals (never a fitted length), as one document and as a
pack of 2-3 unequal documents (the grid packs only equal ones).
Modes: `interleaved` (default) times grid and held-out micro-batches in the same shuffled
rounds of one harness session, so both see the same load of a shared machine, and fits on
the grid only; `sequential` runs dcp-profile, then times the held-out set in a second
session (as a user would); `--profile FILE` is sequential with an existing profile.
Other flags go to dcp-profile (--layouts, --points, --repeats, --nproc, Megatron flags;
default --yaml-cfg examples/cpu_demo.yaml).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import numpy as np

REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, REPO)

from dcp_ext.cli import profile as harness  # noqa: E402
from megatron.training.adaptive import profiling  # noqa: E402
from dcp_ext.planning.cost_model import CostModel, Layout  # noqa: E402
from dcp_ext.planning.profile import Profile, fit_profile  # noqa: E402
from dcp_ext.planning.specs import ModelSpec  # noqa: E402


def machine() -> str:
    cpu = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    import torch

    gpu = f", GPU {torch.cuda.get_device_name()} x{torch.cuda.device_count()}" if torch.cuda.is_available() else ""
    return (f"{cpu}, {os.cpu_count()} logical cores ({harness.usable_cores()} usable){gpu}; "
            f"{platform.system()} {platform.release()}; python {platform.python_version()}, torch {torch.__version__}")


def load() -> str:
    try:
        return "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "load average n/a"


def held_out_points(strategies, fitted: list[dict], min_doc: int = 2, seed: int = 7) -> list[dict]:
    """Micro-batches none of `fitted` has: per strategy (tp, cp, pp, recompute_layers), totals
    at the geometric midpoints of its fitted totals, one document and 2-3 unequal ones."""
    rng = np.random.default_rng(seed)
    out = []
    for key in strategies:
        tp, cp, pp, rc = key
        mine = [p for p in fitted if (p["tp"], p["cp"], p["pp"], p["recompute_layers"]) == key]
        totals = sorted({sum(p["lengths"]) for p in mine})
        used = {tuple(sorted(p["lengths"])) for p in mine}
        for lo, hi in zip(totals, totals[1:]):
            total = int(round(np.sqrt(lo * hi)))
            if total in totals:
                continue
            k = int(rng.integers(2, 4))
            least = max(min_doc, 2 * cp)
            if total >= k * least:
                w = rng.dirichlet(np.full(k, 2.0))
                lens = np.maximum(least, np.floor(w * total)).astype(int)
                lens[np.argmax(lens)] += total - lens.sum()
                packs = [[total], sorted(lens.tolist(), reverse=True)]
            else:
                packs = [[total]]
            for lens in packs:
                if tuple(sorted(lens)) in used or min(lens) < least:
                    continue
                out.append({"tp": tp, "cp": cp, "pp": pp, "recompute_layers": rc, "lengths": [int(x) for x in lens]})
    return out


def predict(cm: CostModel, p: dict) -> float:
    lay = Layout(p["tp"], p["cp"], p["pp"])
    return cm.mb_replica_time(p["lengths"], lay, cm.stage_recompute(lay, p["recompute_layers"]))


def compare(st, profile: Profile, held: list, statistic: str | None = None) -> list[dict]:
    """One row per held-out micro-batch: measured (the timing's statistic unless named),
    predicted by the profiled and by the analytic cost model, and their errors."""
    # priced for the model that was timed (fewer layers with --profile-layers)
    profiled = CostModel(st.timed.model, st.cluster, profile)
    analytic = CostModel(st.timed.model, st.cluster)
    rows = []
    for t in held:
        p = t.point
        meas = t.value(statistic or t.statistic)
        pp_, pa = predict(profiled, p), predict(analytic, p)
        rows.append(dict(layout=f"tp{p['tp']}cp{p['cp']}pp{p['pp']}", recompute=p["recompute_layers"],
                         lengths=p["lengths"], measured_s=meas, spread=t.spread, samples_s=t.samples, profiled_s=pp_,
                         analytic_s=pa, err_profiled=abs(pp_ - meas) / meas, err_analytic=abs(pa - meas) / meas))
    return rows


def mae(rows: list[dict], key: str) -> float:
    return 100 * float(np.mean([r[key] for r in rows]))


def report(st, rows: list[dict], mode: str, elapsed: float, loads: tuple[str, str]) -> dict:
    print(f"# bench_cost_model: {st.spec.name} ({st.spec.num_layers} layers, hidden {st.spec.hidden_size}, "
          f"vocab {st.spec.vocab_size}) on {st.cluster.name}")
    print(f"# machine: {machine()}")
    print(f"# {st.ours.threads} torch thread(s) per rank; mode {mode}; {st.ours.repeats} timed repeats ({st.ours.statistic}) after "
          f"{st.ours.warmup} warm-up; {loads[0]} at start, {loads[1]} at end; {elapsed:.0f} s")
    print(f"{'layout':10s} {'rc':>2s} {'docs':>4s} {'tokens':>6s} {'measured ms':>11s} {'IQR':>6s} "
          f"{'profiled ms':>11s} {'err':>6s} {'analytic ms':>11s} {'err':>7s} {'meas/analytic':>13s}")
    for r in rows:
        print(f"{r['layout']:10s} {r['recompute']:2d} {len(r['lengths']):4d} {sum(r['lengths']):6d} "
              f"{1e3 * r['measured_s']:11.1f} {100 * r['spread']:5.0f}% {1e3 * r['profiled_s']:11.1f} "
              f"{100 * r['err_profiled']:5.1f}% {1e3 * r['analytic_s']:11.1f} {100 * r['err_analytic']:6.1f}% "
              f"{r['measured_s'] / r['analytic_s']:13.2f}")
    print()
    print(f"{'strategy':16s} {'n':>3s} {'MAE profiled':>12s} {'MAE analytic':>12s} {'median IQR':>13s}")
    for key in sorted({(r["layout"], r["recompute"]) for r in rows}):
        sel = [r for r in rows if (r["layout"], r["recompute"]) == key]
        print(f"{key[0]:10s} rc {key[1]:<2d} {len(sel):3d} {100 * np.mean([r['err_profiled'] for r in sel]):11.1f}% "
              f"{100 * np.mean([r['err_analytic'] for r in sel]):11.1f}% "
              f"{100 * np.median([r['spread'] for r in sel]):12.0f}%")
    mae_p, mae_a = mae(rows, "err_profiled"), mae(rows, "err_analytic")
    spread = 100 * float(np.median([r["spread"] for r in rows]))
    print(f"{'overall':16s} {len(rows):3d} {mae_p:11.1f}% {mae_a:11.1f}% {spread:12.0f}%")
    print(f"held-out mean absolute error: profiled {mae_p:.1f}% (goal <= 15%), analytic {mae_a:.1f}%; "
          f"repeat spread (IQR/median): median {spread:.0f}%")
    return dict(model=st.spec.name, cluster=st.cluster.name, machine=machine(), mode=mode, repeats=st.ours.repeats,
                statistic=st.ours.statistic,
                load=list(loads), mae_profiled_pct=mae_p, mae_analytic_pct=mae_a, median_spread_pct=spread,
                rows=rows)


def sequential(st, given: Profile | None):
    """A profile (given, or dcp-profile now), then the held-out set timed in a new session."""
    if given is None:
        given, _ = harness.run_profile(st)
        mode = f"sequential (dcp-profile -> {st.ours.out}, then held-out)"
    else:
        mode = "sequential (a given profile, then held-out)"
        if given.model and ModelSpec.from_json(given.model).to_json() != st.spec.to_json():
            print(f"warning: the profile was made for {given.model.get('name')} {given.model}, not {st.spec}",
                  file=sys.stderr)
    fitted = [dict(tp=r.tp, cp=r.cp, pp=r.pp, recompute_layers=r.recompute_layers, lengths=r.lengths)
              for r in given.records]
    keys = [k for k in sorted(given.fits) if tuple(k[:3]) in set(map(tuple, st.layouts))]
    held_pts = held_out_points(keys, fitted)
    held = harness.time_points(harness.job_for(st, held_pts, "held-out", seed_offset=1))
    return given, held, mode


def interleaved(st):
    """Grid and held-out points in the same shuffled rounds of one session; fit on the grid."""
    max_len = st.ours.max_seq_len or st.args.dcp_max_seq_len or st.args.seq_length
    grid = harness.grid(st.ours, st.timed, st.layouts, max_len)
    keys = sorted({(p["tp"], p["cp"], p["pp"], p["recompute_layers"]) for p in grid})
    held_pts = held_out_points(keys, grid)
    print(f"bench_cost_model: {len(grid)} grid + {len(held_pts)} held-out micro-batches x ({st.ours.warmup} warm-up "
          f"+ {st.ours.repeats} timed)", file=sys.stderr, flush=True)
    timings = harness.time_points(harness.job_for(st, grid + held_pts, "bench"))
    fit_t, held = timings[: len(grid)], timings[len(grid):]
    profile = fit_profile(harness.records(fit_t, st.args.num_layers), model=st.spec.to_json(),
                          cluster=st.cluster.to_json())
    os.makedirs(os.path.dirname(os.path.abspath(st.ours.out)), exist_ok=True)
    profile.save(st.ours.out)
    print(f"profile fitted on the grid only: {st.ours.out}", file=sys.stderr)
    return profile, held, fit_t


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--profile", default=None, help="use this dcp-profile file instead of profiling now")
    ap.add_argument("--mode", choices=["interleaved", "sequential"], default="interleaved")
    ap.add_argument("--json", default=None, help="also write the table here")
    ours, rest = ap.parse_known_args(argv)
    if not any(a in rest for a in ("--yaml-cfg", "--num-layers")):
        rest += ["--yaml-cfg", os.path.join(REPO, "examples", "cpu_demo.yaml")]
    if "--out" not in rest:
        rest += ["--out", os.path.join(REPO, "cache", "profile-bench.json")]
    given = Profile.load(ours.profile) if ours.profile else None
    if given is not None and "--layouts" not in rest:
        rest += ["--layouts", ",".join(sorted({f"tp{k[0]}cp{k[1]}pp{k[2]}" for k in given.fits}))]
    st = profiling.setup(rest)
    loads0, t0 = load(), time.perf_counter()
    if given is not None or ours.mode == "sequential":
        profile, held, mode = sequential(st, given)
        if given is not None:
            mode = f"sequential (profile {ours.profile})"
    else:
        profile, held, fit_t = interleaved(st)
        mode = "interleaved (grid and held-out in the same shuffled rounds; fit on the grid only)"
    result = report(st, compare(st, profile, held), mode, time.perf_counter() - t0, (loads0, load()))
    if given is None and ours.mode == "interleaved":
        # the same session's samples summarised the other way: how much of the error is load
        other = "min" if st.ours.statistic == "median" else "median"
        alt = fit_profile(harness.records(fit_t, st.args.num_layers, other), model=st.spec.to_json(),
                          cluster=st.cluster.to_json())
        rows = compare(st, alt, held, other)
        result[f"mae_profiled_pct_{other}"] = mae(rows, "err_profiled")
        result[f"mae_analytic_pct_{other}"] = mae(rows, "err_analytic")
        print(f"same samples, {other} of the repeats for fit and measurement: profiled {mae(rows, 'err_profiled'):.1f}%, "
              f"analytic {mae(rows, 'err_analytic'):.1f}%")
    if ours.json:
        with open(ours.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
