"""The planners' acceptance matrix: every planner on the same batches, as dcp-simulate tables.

Why it exists: the planners' acceptance report quotes these tables; this script
reproduces them in one go and prints the measured ratios the acceptance asks about
(speedups vs each baseline, gap to the lower bound, planning time). It asserts nothing
(benchmarks print, tests assert).

    python benchmarks/bench_simulate.py                 # full matrix (several minutes)
    python benchmarks/bench_simulate.py --quick         # two settings, 4 iterations
    python benchmarks/bench_simulate.py --json out.json --plot speedups.png
    python benchmarks/bench_simulate.py --replot out.json --plot speedups.png   # no re-run
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from dcp_ext.data.lengths import DATA_DIR  # noqa: E402
from dcp_ext.cli.simulate import format_table, run  # noqa: E402

DATA = os.environ.get("DCP_LENGTHS_DIR", DATA_DIR)
FILES = ["code_python_cl100k.txt", "mooncake_conversation_input_tokens.txt"]
SETTINGS = [("llama2-7b", "h200x64"), ("llama2-7b", "h200x256"), ("llama2-13b", "h200x64"),
            ("llama2-70b", "h200x64"), ("llama2-7b", "a800x64")]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--iterations", type=int, default=20)
    ap.add_argument("--json", default=None)
    ap.add_argument("--data", default=DATA)
    ap.add_argument("--plot", default=None, help="PNG: speedup over static per setting and planner")
    ap.add_argument("--replot", default=None, help="draw --plot from a saved --json instead of running")
    a = ap.parse_args()
    if a.replot:
        with open(a.replot) as fh:
            plot_speedups(json.load(fh), a.plot or "speedups.png")
        return 0
    settings = SETTINGS[:1] + SETTINGS[3:4] if a.quick else SETTINGS
    iters = 4 if a.quick else a.iterations
    out = []
    for f in FILES:
        path = os.path.join(a.data, f)
        if not os.path.exists(path):
            print(f"skipping {f}: not found under {a.data}", file=sys.stderr)
            continue
        for model, cluster in settings:
            args = argparse.Namespace(
                lengths=path, model=model, cluster=cluster, global_batch_tokens=4 * 2**20, max_seq_len=131072,
                iterations=iters, start=0, profile=None, memory_margin=0.1, seed=0, quiet=True,
                planners="adaptive,static,dynamic-cp,cp-buckets,hydraulis", timeline=None, timeline_planner="adaptive",
                timeline_iteration=0,
            )
            t0 = time.time()
            res = run(args)
            res["wall_s"] = time.time() - t0
            out.append(res)
            print(format_table(res))
            pl = res["planners"]
            ad = pl["adaptive"]["mean_s"]
            ratios = ", ".join(f"{n} {pl[n]['mean_s'] / ad:.3f}x" if not pl[n].get("failed") else f"{n} cannot plan"
                               for n in pl if n != "adaptive")
            print(f"adaptive speedup over: {ratios}; min sim/bound over iterations "
                  f"{min(p['min_ratio_to_bound'] for p in pl.values()):.4f}\n", flush=True)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(out, fh, indent=1)
    if a.plot:
        plot_speedups(out, a.plot)
    return 0


def plot_speedups(results: list[dict], path: str) -> None:
    """Grouped bars: each planner's speedup over static per setting, and a tick at what
    the lower bound allows (static / bound), so the gap to the physical limit shows."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results[0]["planners"])
    labels, rows, limits = [], [], []
    for r in results:
        st = r["planners"]["static"]["mean_s"]
        data = os.path.basename(r["lengths"]).split("_")[0]
        labels.append(f"{r['model'].replace('llama2-', '')}\n{r['cluster']}\n{data}")
        rows.append([st / r["planners"][n]["mean_s"] for n in names])
        limits.append(st / r["lower_bound_mean_s"])
    width = 0.8 / len(names)
    fig, ax = plt.subplots(figsize=(max(8, 1.3 * len(results)), 4.5))
    for j, n in enumerate(names):
        xs = [i + (j - (len(names) - 1) / 2) * width for i in range(len(results))]
        ax.bar(xs, [row[j] for row in rows], width, label=n)
    ax.scatter(range(len(results)), limits, marker="_", s=900, color="black", zorder=3, label="lower bound allows")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xticks(range(len(results)))
    ax.set_xticklabels(labels, fontsize=8)
    ax.set_ylabel("speedup over static (simulated)")
    ax.set_title("dcp-simulate: 4M-token batches, max-seq-len 131072 (analytic cost model)")
    ax.legend(fontsize=8, ncol=6, loc="upper center", bbox_to_anchor=(0.5, -0.2))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    raise SystemExit(main())
