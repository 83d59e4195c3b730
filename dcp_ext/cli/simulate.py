"""dcp-simulate: every planner on the same global batches, priced by one cost model.

Why it exists: "what would adaptive parallelism buy on my data and my cluster?",
answered on a laptop. Prints a table (mean iteration time, speedup vs static, gap to the
lower bound, planning time, peak predicted memory) and can draw one iteration.

    dcp-simulate --lengths data.txt --model llama2-7b --cluster h200x64 \
        --global-batch-tokens 4194304 --max-seq-len 131072 --iterations 20 \
        [--planners adaptive,static,...] [--timeline it.png] [--json results.json]
"""
from __future__ import annotations

import json
import sys
import time

import numpy as np

from dcp_ext.cli.boundary import check_output, writing
from dcp_ext.cli.common import (CLIError, Parser, add_common_args, batches, cluster_spec, load_lengths, model_spec,
                                planner_options, run_tool, validate_common_args)
from dcp_ext.planning.cost_model import CostModel
from dcp_ext.data.progress import Progress
from dcp_ext.planning.plan import validate_iteration
from dcp_ext.planning.planner import OLD_NAMES, PLANNERS, make_planner
from dcp_ext.planning.planners.errors import PlanningError
from dcp_ext.planning.simulator import lower_bound, simulate_iteration


def run(args) -> dict:
    lengths = load_lengths(args.lengths)
    truncated = np.minimum(lengths, args.max_seq_len)
    model, cluster = model_spec(args.model), cluster_spec(args.cluster)
    names = [OLD_NAMES.get(n.strip(), n.strip()) for n in args.planners.split(",") if n.strip()]
    for n in names:
        if n not in PLANNERS:
            raise CLIError(f"--planners: unknown planner {n!r}; choose from {', '.join(PLANNERS)}")
    if not names:
        raise CLIError(f"--planners is empty; choose from {', '.join(PLANNERS)}")
    bs = batches(args, lengths, "dcp-simulate")
    cm = CostModel(model, cluster, None, args.memory_margin)
    results: dict = {"model": model.name, "cluster": cluster.name, "iterations": len(bs),
                     "global_batch_tokens": args.global_batch_tokens, "max_seq_len": args.max_seq_len,
                     "lengths": args.lengths, "planners": {}}
    plans = {}
    for name in names:
        t0 = time.perf_counter()
        planner = make_planner(name, model, cluster, max_seq_len=args.max_seq_len,
                               global_batch_tokens=args.global_batch_tokens, length_sample=truncated,
                               profile=args.profile, memory_margin=args.memory_margin, seed=args.seed,
                               progress=not args.quiet, **planner_options(name, args),
                               **(getattr(args, "extra_options", None) or {}).get(name, {}))
        build_s = time.perf_counter() - t0
        if name == names[0] and planner.cm.profile is not None:
            cm = planner.cm
        times, plan_s, plan_cpu, peaks, layouts, valid, failed = [], [], [], [], [], True, None
        its = []
        mbs_all, mbs_layered, splits = 0, 0, set()
        with Progress(f"simulate {name}", total=len(bs), unit="it", enabled=not args.quiet) as bar:
            for i, ids in enumerate(bs):
                lens = truncated[ids]
                t1, c1 = time.perf_counter(), time.thread_time()
                try:
                    it = planner.plan_iteration(i, ids, lens.tolist())
                except PlanningError as e:  # a planner that cannot run this data: a result, reported
                    failed = f"iteration {i}: {e}"
                    break
                plan_s.append(time.perf_counter() - t1)
                plan_cpu.append(time.thread_time() - c1)
                try:
                    validate_iteration(it, cluster.num_gpus, model.num_layers, model.num_attention_heads, model.num_query_groups)
                except ValueError as e:
                    valid = False
                    print(f"{name} iteration {i}: INVALID: {e}", file=sys.stderr)
                res = simulate_iteration(planner.cm, it, dict(zip(ids, lens.tolist())))
                valid &= res.memory_ok
                times.append(res.time_s)
                peaks.append(res.peak_memory_fraction)
                layouts.append("+".join(sorted({f"tp{r.tp}cp{r.cp}pp{r.pp}" for r in it.replicas})))
                mbs_all += sum(len(r.micro_batches) for r in it.replicas)
                mbs_layered += sum(1 for r in it.replicas for mb in r.micro_batches if mb.layer_strategies)
                splits.update(f"tp{r.tp}cp{r.cp}pp{r.pp}{r.stage_layers}" for r in it.replicas if r.stage_layers)
                its.append(it)
                bar.update(1)
        if failed:
            print(f"{name}: cannot plan: {failed}", file=sys.stderr)
            results["planners"][name] = {"describe": planner.describe(), "build_s": build_s, "failed": failed,
                                         "times_s": [], "mean_s": float("nan"), "valid": False}
            continue
        plans[name] = its
        results["planners"][name] = {
            "describe": planner.describe(), "build_s": build_s, "times_s": times, "mean_s": float(np.mean(times)),
            "plan_ms_median": 1000 * float(np.median(plan_s)), "plan_ms_max": 1000 * float(np.max(plan_s)),
            "plan_cpu_ms_median": 1000 * float(np.median(plan_cpu)),
            "peak_memory_fraction": float(np.max(peaks)), "valid": bool(valid),
            "distinct_layouts": len(set(layouts)),
            "micro_batches": mbs_all, "layered_micro_batches": mbs_layered, "stage_splits": sorted(splits),
            "options": planner_options(name, args),
        }
    lb_cm = cm
    lbs = getattr(args, "lower_bounds", None)  # a caller that already has them (benchmarks)
    if lbs is None:
        lbs = []
        with Progress("lower bound", total=len(bs), unit="it", enabled=not args.quiet) as bar:
            for ids in bs:
                lbs.append(lower_bound(lb_cm, truncated[ids].tolist()))
                bar.update(1)
    results["lower_bound_s"] = list(lbs)
    results["lower_bound_mean_s"] = float(np.mean(lbs))
    # plans with layer strategies or uneven stages are bounded by the widened bound only
    v2 = any(r.get("options") for r in results["planners"].values())
    lbs2 = getattr(args, "lower_bounds_v2", None) if v2 else None
    if v2 and lbs2 is None:
        from dcp_ext.planning.bound_v2 import lower_bound_v2

        lbs2 = []
        with Progress("lower bound (v2)", total=len(bs), unit="it", enabled=not args.quiet) as bar:
            for ids in bs:
                lbs2.append(lower_bound_v2(lb_cm, truncated[ids].tolist()))
                bar.update(1)
    if v2:
        results["lower_bound_v2_s"] = list(lbs2)
        results["lower_bound_v2_mean_s"] = float(np.mean(lbs2))
    static = results["planners"].get("static", {}).get("mean_s")
    for name, r in results["planners"].items():
        if r.get("failed"):
            r.update(speedup_vs_static=None, gap_to_bound=float("nan"), min_ratio_to_bound=float("nan"))
            continue
        r["speedup_vs_static"] = static / r["mean_s"] if static else None
        r["gap_to_bound"] = float(np.mean(np.asarray(r["times_s"]) / np.asarray(lbs)) - 1)
        r["min_ratio_to_bound"] = float(np.min(np.asarray(r["times_s"]) / np.asarray(lbs)))
        if v2:
            r["gap_to_bound_v2"] = float(np.mean(np.asarray(r["times_s"]) / np.asarray(lbs2)) - 1)
            r["min_ratio_to_bound_v2"] = float(np.min(np.asarray(r["times_s"]) / np.asarray(lbs2)))
    if args.timeline:
        from dcp_ext.planning.timeline import render_timeline

        tl = args.timeline_planner if args.timeline_planner in plans else next(iter(plans))
        if tl != args.timeline_planner:
            print(f"dcp-simulate: --timeline-planner {args.timeline_planner} was not run (or could not plan); the "
                  f"timeline draws {tl}", file=sys.stderr)
        k = min(args.timeline_iteration, len(bs) - 1)
        if k != args.timeline_iteration:
            print(f"dcp-simulate: --timeline-iteration {args.timeline_iteration} is past the {len(bs)} iterations run; "
                  f"the timeline draws iteration {k}", file=sys.stderr)
        ids = bs[k]
        with writing("--timeline", args.timeline, "the image"):
            render_timeline(cm, plans[tl][k], dict(zip(ids, truncated[ids].tolist())), args.timeline,
                            title=f"{tl}: {model.name} on {cluster.name}, iteration {k}, "
                                  f"predicted {plans[tl][k].predicted_time_s:.3f} s")
        results["timeline"] = args.timeline
    return results


def format_table(results: dict) -> str:
    head = (f"{results['model']} on {results['cluster']}, {results['lengths']}, {results['iterations']} iterations of "
            f"{results['global_batch_tokens']} tokens, max-seq-len {results['max_seq_len']}; "
            f"lower bound {results['lower_bound_mean_s']:.3f} s/iter"
            + (f" (v2 plans: {results['lower_bound_v2_mean_s']:.3f})" if "lower_bound_v2_mean_s" in results else "")
            + "\n"
            f"(plan ms/iter: median wall time; plan cpu ms: median CPU time of the planning thread)")
    cols = ["planner", "mean s/iter", "vs static", "gap to bound", "plan ms/iter", "plan cpu ms", "peak mem/cap", "valid", "layouts"]
    v2 = "lower_bound_v2_mean_s" in results
    if v2:
        cols[4:4] = ["gap to v2 bound", "layered mbs"]
    rows = []
    for name, r in results["planners"].items():
        if r.get("failed"):
            rows.append([name, "cannot plan", "-", "-"] + (["-", "-"] if v2 else []) + ["-", "-", "-", "NO", r["failed"]])
            continue
        sp = f"{r['speedup_vs_static']:.3f}x" if r.get("speedup_vs_static") else "-"
        row = [name, f"{r['mean_s']:.3f}", sp, f"{100 * r['gap_to_bound']:.1f}%", f"{r['plan_ms_median']:.1f}",
               f"{r['plan_cpu_ms_median']:.1f}", f"{r['peak_memory_fraction']:.2f}", "yes" if r["valid"] else "NO",
               str(r["distinct_layouts"])]
        if v2:
            row[4:4] = [f"{100 * r['gap_to_bound_v2']:.1f}%", f"{r['layered_micro_batches']}/{r['micro_batches']}"]
        rows.append(row)
    w = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(cols)]
    line = lambda xs: "| " + " | ".join(x.ljust(w[i]) for i, x in enumerate(xs)) + " |"  # noqa: E731
    out = [head, "", line(cols), "|" + "|".join("-" * (x + 2) for x in w) + "|"]
    out += [line(r) for r in rows]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    return run_tool(lambda: _main(argv))


def _main(argv: list[str] | None) -> int:
    p = Parser(prog="dcp-simulate", description=__doc__.split("\n\n")[0])
    add_common_args(p)
    p.add_argument("--planners", default=",".join(PLANNERS), help="comma-separated; default all")
    p.add_argument("--timeline", default=None, help="PNG of one iteration")
    p.add_argument("--timeline-planner", default="adaptive")
    p.add_argument("--timeline-iteration", type=int, default=0)
    p.add_argument("--json", default=None, help="write all numbers here")
    args = p.parse_args(argv)
    validate_common_args(args)
    if args.timeline_iteration < 0:
        raise CLIError(f"--timeline-iteration {args.timeline_iteration} must be >= 0")
    for flag, path in (("--timeline", args.timeline), ("--json", args.json)):
        if path:
            check_output(flag, path)  # before the planners run, not after
    results = run(args)
    print(format_table(results))
    if args.json:
        with writing("--json", args.json, "the results"), open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0 if all(r["valid"] for r in results["planners"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
