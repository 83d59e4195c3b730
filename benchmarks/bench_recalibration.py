"""The cost model's error per iteration on the CPU demo, --dcp-recalibration on vs off, side by side.

Trains the demo as `make demo` does (examples/cpu_demo.yaml with --dcp: documents up to 2048
tokens, 4096-token global batches, --dcp-device-memory 256MB; no --dcp-cost-profile, so the planner starts from
the analytic cost model) twice on 4 gloo ranks, once with online recalibration of the cost
model and once without, and reads each iteration's `predicted/measured (ms): P/M` field from
the log line. The error of an iteration is |P - M| / M. Printed: the median and mean error
per window of 10 iterations for both runs, the median over iterations 21-40 (after the
recalibration has had 20 iterations to learn) and its ratio off / on; the plot
(benchmarks/results/recalibration.png, next to recalibration.json) shows the error of every
iteration for both.

    python benchmarks/bench_recalibration.py                    # two 40-iteration runs, ~8-10 min on 2 cores
    python benchmarks/bench_recalibration.py --from-logs ON OFF # re-read two captured logs (stdout of the runs)

M is the iteration's wall time on rank 0's clock (planning wait, exchange and step included),
so the error also holds what the cost model does not price; on a shared CPU the load of
other jobs moves M, which both runs see alike only if they see the same load.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_real_win import REPO, RESULTS, BenchError, OneLineParser, launch, require_flags  # noqa: E402
from machine import describe  # noqa: E402

DEMO = os.path.join(REPO, "examples", "cpu_demo.yaml")
DEMO_FLAGS = ["--yaml-cfg", DEMO, "--dcp", "--lr-decay-iters", "60", "--log-interval", "1", "--eval-iters", "0"]
LINE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?predicted/measured \(ms\): ([\d.]+)/([\d.]+) \|")
WINDOW = 10
MEDIAN_FROM, MEDIAN_TO = 21, 40


def errors_of(text: str) -> dict[int, dict]:
    """{iteration: {predicted_ms, measured_ms, error}} from a run's log lines (--log-interval 1)."""
    out = {}
    for m in LINE.finditer(text):
        p, meas = float(m.group(2)), float(m.group(3))
        out[int(m.group(1))] = {"predicted_ms": p, "measured_ms": meas,
                                "error": abs(p - meas) / meas if meas > 0 else float("nan")}
    return out


def windows(errs: dict[int, dict], last: int) -> list[tuple[int, int, float | None, float | None]]:
    """(first, last, median, mean) of the error per window of WINDOW iterations, up to `last`."""
    rows = []
    for start in range(1, last + 1, WINDOW):
        end = min(start + WINDOW - 1, last)
        vals = [errs[i]["error"] for i in range(start, end + 1) if i in errs]
        rows.append((start, end, statistics.median(vals) if vals else None, statistics.fmean(vals) if vals else None))
    return rows


def median_between(errs: dict[int, dict], lo: int, hi: int) -> tuple[float | None, int]:
    vals = [errs[i]["error"] for i in range(lo, hi + 1) if i in errs]
    return (statistics.median(vals) if vals else None), len(vals)


def pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def report(errs: dict[str, dict[int, dict]], source: str, iters: int) -> dict:
    last = max([iters] + [max(e) for e in errs.values() if e])
    print(f"Cost-model error |predicted - measured| / measured per iteration, CPU demo (--dcp, documents up to "
          f"2048 tokens, 4096-token batches, budget 256MB, no cost profile), --dcp-recalibration on vs off")
    print(f"machine: {describe()}; {source}")
    print(f"{'iterations':>11s} {'on: median':>11s} {'mean':>7s} {'off: median':>12s} {'mean':>7s}")
    table = {name: windows(e, last) for name, e in errs.items()}
    for k, (start, end, _, _) in enumerate(table["on"]):
        on, off = table["on"][k], table["off"][k]
        print(f"{f'{start}-{end}':>11s} {pct(on[2]):>11s} {pct(on[3]):>7s} {pct(off[2]):>12s} {pct(off[3]):>7s}")
    med = {name: median_between(e, MEDIAN_FROM, MEDIAN_TO) for name, e in errs.items()}
    for name in ("on", "off"):
        value, n = med[name]
        note = "" if n == MEDIAN_TO - MEDIAN_FROM + 1 else f" (only {n} of those iterations logged)"
        print(f"median error over iterations {MEDIAN_FROM}-{MEDIAN_TO}, recalibration {name}: {pct(value)}{note}")
    if med["on"][0] and med["off"][0] is not None:
        print(f"off / on (median error, iterations {MEDIAN_FROM}-{MEDIAN_TO}): {med['off'][0] / med['on'][0]:.2f}x")
    return {"windows": {k: [dict(zip(("first", "last", "median", "mean"), w)) for w in v] for k, v in table.items()},
            "median_21_40": {k: v[0] for k, v in med.items()},
            "iterations": {k: {str(i): v for i, v in sorted(e.items())} for k, e in errs.items()}}


def plot(errs: dict[str, dict[int, dict]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4))
    for name, color in (("on", "tab:green"), ("off", "tab:gray")):
        its = sorted(errs[name])
        if its:
            ax.plot(its, [100 * errs[name][i]["error"] for i in its], marker="o", markersize=3, color=color,
                    label=f"--dcp-recalibration {name}")
    ax.axvspan(MEDIAN_FROM - 0.5, MEDIAN_TO + 0.5, color="tab:blue", alpha=0.07, label=f"median window {MEDIAN_FROM}-{MEDIAN_TO}")
    ax.set_xlabel("iteration")
    ax.set_ylabel("|predicted - measured| / measured (%)")
    values = [e["error"] for run in errs.values() for e in run.values() if e["error"] > 0]
    if values and max(values) / min(values) > 20:  # recalibration may cut the error by orders of magnitude
        ax.set_yscale("log")
    else:
        ax.set_ylim(bottom=0)
    ax.set_title("cost-model error per iteration, CPU demo (no cost profile)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    ap = OneLineParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=MEDIAN_TO, help=f"iterations per run (default {MEDIAN_TO})")
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--from-logs", nargs=2, metavar=("ON_LOG", "OFF_LOG"), default=None,
                    help="read two captured runs' stdout instead of training")
    ap.add_argument("--run-timeout", type=float, default=900.0, help="seconds before a run is killed")
    ap.add_argument("--json", default=os.path.join(RESULTS, "recalibration.json"))
    ap.add_argument("--plot", default=os.path.join(RESULTS, "recalibration.png"))
    t0 = time.perf_counter()
    try:
        args = ap.parse_args(argv)
        if args.iters < 1 or args.nproc < 1:
            raise BenchError("--iters and --nproc must be >= 1")
        texts = {}
        if args.from_logs:
            for name, path in zip(("on", "off"), args.from_logs):
                try:
                    with open(path, errors="replace") as f:
                        texts[name] = f.read()
                except OSError as e:
                    raise BenchError(f"--from-logs {path}: {e.strerror}") from None
            source = f"read from {args.from_logs[0]} (on) and {args.from_logs[1]} (off)"
        else:
            require_flags(["--dcp-recalibration", "--dcp-device-memory"], "this benchmark")
            with tempfile.TemporaryDirectory() as work:
                cache = ["--data-cache-path", os.path.join(REPO, "cache")]
                for k, name in enumerate(("on", "off")):
                    run = launch(f"recalibration {name}", DEMO_FLAGS + cache + [
                        "--train-iters", str(args.iters), "--dcp-recalibration", name], args.nproc, work,
                        args.run_timeout, note=f"[{k + 1}/2] ")
                    if run.error:
                        raise BenchError(f"the run with --dcp-recalibration {name} failed: {run.error}")
                    print(f"    done in {run.wall_s:.0f} s", file=sys.stderr, flush=True)
                    texts[name] = run.text
            source = f"{args.nproc} gloo ranks, {args.iters} iterations a run"
        errs = {name: errors_of(text) for name, text in texts.items()}
        empty = [name for name, e in errs.items() if not e]
        if empty:
            raise BenchError(f"no `predicted/measured (ms)` field in the {' and '.join(empty)} log: "
                             "runs need --dcp and --log-interval 1")
    except BenchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    result = report(errs, source, args.iters)
    result.update(machine=describe(), source=source, minutes=(time.perf_counter() - t0) / 60)
    print(f"benchmark took {result['minutes']:.1f} min")
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
    plot(errs, args.plot)
    print(f"results: {args.json}, plot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
