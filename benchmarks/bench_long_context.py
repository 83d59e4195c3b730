"""Long-context planning: every planner, and the adaptive planner with layer strategies and/or uneven stages.

Why it exists: the plan contract v2 (per-layer (tp, cp) strategies, ParaDySe; uneven
pipeline stages, OmniBal) is meant for long-context mixes, where one (tp, cp) per replica
and even stages leave time on the table. This script measures what they buy, judged by
the simulator (one cost model for all), against the relaxation bounds (`bound` for v1
plans, `bound_v2` for plans that may use the v2 features), and how long planning takes.
It asserts nothing (benchmarks print, tests assert).

Default: llama2-7b on h200x64, 16M-token batches, documents up to 640Ki tokens
(benchmarks/data/long_context_mix.txt, written by tools/long_context_lengths.py), every
batch of the file; static (the best single layout), dynamic-cp, cp-buckets, hydraulis, adaptive,
and adaptive with --dcp-layer-strategies on / --dcp-uneven-stages on / both, plus
--dcp-uneven-stages even (the even split written explicitly, so every stage is priced on
its own: the control that separates what the per-stage pricing does from what the
balancing does).

--table: the same variants of the adaptive planner on the long-context setting and on
shipped length files (dcp-simulate's runs, one per variant), as one markdown table.

    python benchmarks/bench_long_context.py              # -> benchmarks/results/long_context.{json,png}
    python benchmarks/bench_long_context.py --table      # -> benchmarks/results/v2_features.{json,md}
    python benchmarks/bench_long_context.py --replot benchmarks/results/long_context.json
Every row is one dcp-simulate run; the script prints the command line of each.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

from dcp_ext.cli.simulate import run  # noqa: E402
from dcp_ext.data.lengths import DATA_DIR  # noqa: E402

RESULTS = os.path.join(ROOT, "benchmarks", "results")
LONG = os.path.join(ROOT, "benchmarks", "data", "long_context_mix.txt")
BASELINES = "static,dynamic-cp,cp-buckets,hydraulis,adaptive"
# (label, --dcp-layer-strategies, --dcp-uneven-stages)
VARIANTS = [("adaptive", "off", "off"), ("adaptive +layers", "on", "off"), ("adaptive +uneven", "off", "on"),
            ("adaptive +layers +uneven", "on", "on"), ("adaptive, even stages priced per stage", "off", "even")]
LONG_SETTING = dict(lengths=LONG, model="llama2-7b", cluster="h200x64", global_batch_tokens=16 * 2**20,
                    max_seq_len=655360)
SHIPPED = [
    dict(lengths=os.path.join(DATA_DIR, "code_python_cl100k.txt"), model="llama2-7b", cluster="h200x64",
         global_batch_tokens=4 * 2**20, max_seq_len=131072),
    dict(lengths=os.path.join(DATA_DIR, "mooncake_conversation_input_tokens.txt"), model="llama2-7b",
         cluster="h200x64", global_batch_tokens=4 * 2**20, max_seq_len=131072),
    dict(lengths=os.path.join(DATA_DIR, "code_python_cl100k.txt"), model="llama2-70b", cluster="h200x64",
         global_batch_tokens=4 * 2**20, max_seq_len=131072),
    dict(lengths=os.path.join(DATA_DIR, "code_python_cl100k.txt"), model="llama3-8b", cluster="h200x64",
         global_batch_tokens=4 * 2**20, max_seq_len=131072),
]


def namespace(setting: dict, planners: str, layers: str, uneven: str, iterations: int, **extra) -> argparse.Namespace:
    return argparse.Namespace(**setting, planners=planners, iterations=iterations, start=0, profile=None,
                              memory_margin=0.1, seed=0, quiet=True, timeline=None, timeline_planner="adaptive",
                              timeline_iteration=0, dcp_layer_strategies=layers, dcp_uneven_stages=uneven, **extra)


def command(setting: dict, planners: str, layers: str, uneven: str, iterations: int) -> str:
    rel = os.path.relpath(setting["lengths"], ROOT)
    out = (f"dcp-simulate --lengths {rel} --model {setting['model']} --cluster {setting['cluster']} "
           f"--global-batch-tokens {setting['global_batch_tokens']} --max-seq-len {setting['max_seq_len']} "
           f"--iterations {iterations} --planners {planners}")
    if layers != "off":
        out += f" --dcp-layer-strategies {layers}"
    if uneven != "off":
        out += f" --dcp-uneven-stages {uneven}"
    return out


# the ParaDySe mechanism alone: the adaptive planner held to static's best layout (a fixed
# pool of one entry; planner option `layouts`, not a dcp-simulate flag), without and with
# layer strategies
FIXED = [("adaptive on static's layout", "off", "off"), ("adaptive on static's layout +layers", "on", "off")]


def run_variants(setting: dict, iterations: int, baselines: str, fixed_layout: str | None = None) -> dict:
    """One dcp-simulate run per variant (the first with the baselines), bounds computed once;
    with `fixed_layout` ("2xtp8cp4pp1"), also the FIXED rows."""
    rows, bounds, bounds_v2 = {}, None, None
    common = {}
    variants = VARIANTS + (FIXED if fixed_layout else [])
    for label, layers, uneven in variants:
        planners = baselines if label == "adaptive" else "adaptive"
        extra = {"extra_options": {"adaptive": {"layouts": [fixed_layout]}}} if label in dict((f[0], 1) for f in FIXED) else {}
        if bounds is not None:
            extra["lower_bounds"] = bounds
        if bounds_v2 is not None:
            extra["lower_bounds_v2"] = bounds_v2
        t0 = time.time()
        res = run(namespace(setting, planners, layers, uneven, iterations, **extra))
        bounds = res["lower_bound_s"]
        bounds_v2 = res.get("lower_bound_v2_s", bounds_v2)
        common.update({k: v for k, v in res.items() if k != "planners"})
        cmd = command(setting, planners, layers, uneven, iterations)
        if "extra_options" in extra:
            cmd += f"   (planner option layouts=['{fixed_layout}'])"
        print(f"  {label}: {time.time() - t0:.0f} s   {cmd}", file=sys.stderr, flush=True)
        for name, r in res["planners"].items():
            key = label if name == "adaptive" else name
            rows[key] = dict(r, command=cmd, layer_strategies=layers if name == "adaptive" else "off",
                             uneven_stages=uneven if name == "adaptive" else "off")
    if bounds_v2 is not None:
        common["lower_bound_v2_s"] = bounds_v2
        common["lower_bound_v2_mean_s"] = float(np.mean(bounds_v2))
    static = rows.get("static", {}).get("mean_s")
    lb, lb2 = np.asarray(common["lower_bound_s"]), np.asarray(bounds_v2) if bounds_v2 is not None else None
    for r in rows.values():
        if r.get("failed"):
            continue
        t = np.asarray(r["times_s"])
        r["speedup_vs_static"] = static / r["mean_s"] if static else None
        r["gap_to_bound"] = float(np.mean(t / lb) - 1)
        if lb2 is not None:
            r["gap_to_bound_v2"] = float(np.mean(t / lb2) - 1)
            r["min_ratio_to_bound_v2"] = float(np.min(t / lb2))
    return dict(common, rows=rows)


def static_layout(setting: dict, iterations: int) -> str:
    """Static's layout for the setting, as a fixed pool ("2xtp8cp4pp1")."""
    from dcp_ext.planning.planner import make_planner
    from dcp_ext.planning.specs import ClusterSpec, ModelSpec

    lengths = np.minimum(np.loadtxt(setting["lengths"], dtype=np.int64), setting["max_seq_len"])
    cluster = ClusterSpec.from_preset(setting["cluster"])
    p = make_planner("static", ModelSpec.from_preset(setting["model"]), cluster, max_seq_len=setting["max_seq_len"],
                     global_batch_tokens=setting["global_batch_tokens"], length_sample=lengths)
    return f"{cluster.num_gpus // p.layout.size}x{p.layout}"


def fmt(x, spec, suffix=""):
    return "-" if x is None or (isinstance(x, float) and not np.isfinite(x)) else f"{x:{spec}}{suffix}"


def table(result: dict, title: str) -> str:
    rows = result["rows"]
    ref = rows.get("adaptive", {}).get("mean_s")
    lines = [f"### {title}", "",
             f"lower bound {result['lower_bound_mean_s']:.3f} s/iter (v1 plans)"
             + (f", {result['lower_bound_v2_mean_s']:.3f} s/iter (widened, v2 plans)" if "lower_bound_v2_mean_s" in result else ""),
             "", "| planner | layer strategies | stages | mean s/iter | vs static | vs adaptive | gap to bound | "
             "gap to v2 bound | layered mbs | stage splits | plan ms median / max | plan cpu ms | peak mem/cap | valid |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        if r.get("failed"):
            lines.append(f"| {name} | | | cannot plan: {r['failed'][:60]} | | | | | | | | | | NO |")
            continue
        stages = {"off": "even (v1 price)", "on": "uneven", "even": "even (per stage)"}[r["uneven_stages"]]
        splits = ", ".join(r.get("stage_splits") or []) or "-"
        lines.append(
            f"| {name} | {r['layer_strategies']} | {stages} | {r['mean_s']:.3f} | {fmt(r.get('speedup_vs_static'), '.3f', 'x')} | "
            f"{fmt(ref / r['mean_s'] if ref else None, '.4f', 'x')} | {100 * r['gap_to_bound']:.1f}% | "
            f"{fmt(100 * r['gap_to_bound_v2'] if 'gap_to_bound_v2' in r else None, '.1f', '%')} | "
            f"{r.get('layered_micro_batches', 0)}/{r.get('micro_batches', 0)} | {splits} | "
            f"{r['plan_ms_median']:.1f} / {r['plan_ms_max']:.1f} | {r['plan_cpu_ms_median']:.1f} | "
            f"{r['peak_memory_fraction']:.2f} | {'yes' if r['valid'] else 'NO'} |")
    return "\n".join(lines)


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = {k: v for k, v in result["rows"].items() if not v.get("failed")}
    static = rows["static"]["mean_s"]
    names = list(rows)
    sp = [static / rows[n]["mean_s"] for n in names]
    fig, ax = plt.subplots(figsize=(10, 4.2))
    ax.bar(range(len(names)), sp, color=["#888" if not n.startswith("adaptive") else "#3a7" for n in names])
    ax.axhline(static / result["lower_bound_mean_s"], color="k", ls="--", lw=1, label="bound (v1 plans)")
    if "lower_bound_v2_mean_s" in result:
        ax.axhline(static / result["lower_bound_v2_mean_s"], color="r", ls=":", lw=1, label="widened bound (v2 plans)")
    for i, v in enumerate(sp):
        ax.text(i, v + 0.01, f"{v:.3f}x", ha="center", fontsize=8)
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels(names, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("speedup over static (simulated)")
    ax.set_title(f"{result['model']} on {result['cluster']}, {result['iterations']} batches of "
                 f"{result['global_batch_tokens'] // 2**20}M tokens, documents up to {result['max_seq_len'] // 1024}K")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def summary(result: dict) -> str:
    rows = result["rows"]
    a = rows["adaptive"]["mean_s"]
    out = [f"adaptive vs static {rows['static']['mean_s'] / a:.3f}x; bound allows {rows['static']['mean_s'] / result['lower_bound_mean_s']:.3f}x"]
    for label, _, _ in VARIANTS[1:] + FIXED:
        r = rows.get(label)
        base, what = (a, "adaptive") if label != FIXED[1][0] else (rows.get(FIXED[0][0], {}).get("mean_s"), FIXED[0][0])
        if r and not r.get("failed") and base:
            out.append(f"{label}: {base / r['mean_s']:.4f}x of {what}, {r['layered_micro_batches']}/{r['micro_batches']} "
                       f"micro-batches layered, splits {r.get('stage_splits') or 'none'}, plan {r['plan_ms_median']:.1f} ms "
                       f"median / {r['plan_ms_max']:.1f} max (cpu {r['plan_cpu_ms_median']:.1f})")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iterations", type=int, default=16, help="batches of the long-context setting (its file holds 16 full ones)")
    ap.add_argument("--table", action="store_true", help="the v2-feature table on the long-context and shipped settings")
    ap.add_argument("--table-iterations", type=int, default=8, help="batches per shipped setting in --table")
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None)
    ap.add_argument("--replot", default=None, help="draw --plot from a saved --json instead of running")
    a = ap.parse_args()
    os.makedirs(RESULTS, exist_ok=True)
    if a.replot:
        with open(a.replot) as f:
            result = json.load(f)
        plot(result, a.plot or os.path.join(RESULTS, "long_context.png"))
        print(table(result, "long context"))
        return 0
    if not a.table:
        result = run_variants(LONG_SETTING, a.iterations, BASELINES, static_layout(LONG_SETTING, a.iterations))
        path = a.json or os.path.join(RESULTS, "long_context.json")
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
        plot(result, a.plot or os.path.join(RESULTS, "long_context.png"))
        print(table(result, f"long context: {result['model']} on {result['cluster']}"))
        print()
        print(summary(result))
        return 0
    out, md = [], []
    long_json = os.path.join(RESULTS, "long_context.json")
    if os.path.exists(long_json):  # the long-context setting as the default run measured it
        with open(long_json) as f:
            result = json.load(f)
        out.append(result)
        md.append(table(result, f"long_context_mix.txt: {result['model']} on {result['cluster']}, {result['iterations']} "
                                f"batches of {result['global_batch_tokens'] // 2**20}M tokens, max-seq-len "
                                f"{result['max_seq_len']} (from long_context.json)"))
    for setting, iters in [(s, a.table_iterations) for s in SHIPPED]:
        print(f"{os.path.basename(setting['lengths'])} {setting['model']} {setting['cluster']}", file=sys.stderr)
        result = run_variants(setting, iters, "static,adaptive")
        out.append(result)
        md.append(table(result, f"{os.path.basename(setting['lengths'])}: {setting['model']} on {setting['cluster']}, "
                                f"{result['iterations']} batches of {setting['global_batch_tokens'] // 2**20}M tokens, "
                                f"max-seq-len {setting['max_seq_len']}"))
        with open(a.json or os.path.join(RESULTS, "v2_features.json"), "w") as f:
            json.dump(out, f, indent=1)
        with open(os.path.join(RESULTS, "v2_features.md"), "w") as f:
            f.write("\n\n".join(md) + "\n")
    print("\n\n".join(md))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
