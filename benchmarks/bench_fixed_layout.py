"""`--dcp --dcp-planner static` vs megatron-core's own path at one fixed layout, side by side.

Why it exists: the adaptive runtime can only win if, at a layout both paths can run, it is
not slower per token than megatron-core. This runs both at DP4, TP2·DP2 and CP4 (4 gloo
ranks, the CPU demo model, the demo corpus, 8192 tokens an iteration), alternated A B A B
so that drift in the machine's load falls on both, and prints tokens/s per pair, the ratio
dcp / megatron-core, and the `--dcp` runs' exposed communication as a share of the
iteration. `--busy 1` keeps one core busy with a competing process during every run (a
straggler, as on a shared cluster).

    python benchmarks/bench_fixed_layout.py                  # 3 layouts x 2 pairs, ~10 min on 2 cores
    python benchmarks/bench_fixed_layout.py --busy 1         # the same with one core kept busy
    python benchmarks/bench_fixed_layout.py --layouts dp4 --repeats 1

Both paths train the same tokens: the static path 4 samples of --seq-length 2048 (documents
concatenated, --reset-attention-mask --reset-position-ids, micro-batch 1), `--dcp` global
batches of 8192 tokens of whole documents up to 2048 (longer ones split). bench_real_win.py
prints the same table in its run.

Attention kernels, like with like: megatron-core's path hands its document mask to SDPA on
4-D tensors, which torch runs on its CPU flash kernel; `--dcp` runs the same kernel per
document with `--dcp-cpu-attention flash` (the default here). `--dcp-cpu-attention math`
compares the demo's default instead, whose math path keeps each document's probabilities
(several times slower on long documents).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from machine import describe  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
SPEED_BUDGET = "8GB"  # --dcp-device-memory: high enough that no layout recomputes (speed, not memory)
LAYOUTS = {"dp4": (1, 1), "tp2dp2": (2, 1), "cp4": (1, 4)}  # name -> (tp, cp), pp 1, 4 ranks


def layout_flags(tp: int, cp: int) -> list[str]:
    return (["--tensor-model-parallel-size", str(tp), "--context-parallel-size", str(cp),
             "--pipeline-model-parallel-size", "1"] + (["--sequence-parallel"] if tp > 1 else []))


def setting_and_data(args):
    """The run's corpus and sizes as bench_real_win's Setting and Data."""
    from bench_real_win import Data, Setting

    s = Setting("fixed", None, args.seq_length, args.tokens, args.budget, data_path=args.data_flags[1])
    return s, Data(args.data_flags, "", 0)


def static_run_flags(tp: int, cp: int, args) -> list[str]:
    """megatron-core's path at (tp, cp): bench_real_win's static launch line, micro-batch 1."""
    from bench_real_win import Config, static_flags

    s, data = setting_and_data(args)
    return static_flags(Config("megatron", tp, cp, 1), s, data, args.dcp_cpu_attention, args)


def dcp_run_flags(tp: int, cp: int, args) -> list[str]:
    """The same layout under --dcp's static planner: bench_real_win's --dcp line at (tp, cp)."""
    from bench_real_win import dcp_flags

    s, data = setting_and_data(args)
    return dcp_flags(s, data, args.dcp_cpu_attention, args, "static", (tp, cp, 1))


class Busy:
    """`n` processes spinning on a core each while the runs go on: a competing job."""

    def __init__(self, n: int):
        self.procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for p in self.procs:
            p.kill()
            p.wait()


def exposed_share(run, field: str = "exposed comm") -> float | None:
    """Median over the timed iterations of a `--dcp` log line's field (ms) / iteration time:
    `exposed comm` (the longest any rank was blocked on pull/push) or `exchange` (the
    quickest rank's: the exchange itself; the difference is waiting for the slowest rank)."""
    shares = []
    pattern = r"elapsed time per iteration \(ms\): ([\d.]+) \|.*?" + re.escape(field) + r" \(ms\): ([\d.]+)"
    for m in re.finditer(pattern, run.text):
        shares.append(float(m.group(2)) / float(m.group(1)))
    return statistics.median(shares[2:] or shares) if shares else None


def measure(args, work: str, note=lambda s: print(s, file=sys.stderr, flush=True)) -> list[dict]:
    """Every layout of --layouts, A B A B: one row per pair with both tokens/s and the ratio."""
    from bench_real_win import launch, throughput

    rows = []
    for name in args.layouts:
        tp, cp = LAYOUTS[name]
        for rep in range(args.repeats):
            runs = {}
            for path, flags in (("megatron-core", static_run_flags(tp, cp, args)),
                                ("dcp static", dcp_run_flags(tp, cp, args))):
                run = launch(f"{name} {path} #{rep + 1}", flags, args.nproc, work, args.run_timeout, note="[fixed] ")
                if run.error:
                    raise SystemExit(f"error: {name} {path}: {run.error}")
                runs[path] = run
            measured = args.iters - args.warmup
            a = throughput(runs["megatron-core"], measured, args.tokens)["tokens_per_s"]
            b = throughput(runs["dcp static"], measured, args.tokens)["tokens_per_s"]
            rows.append({"layout": name, "pair": rep + 1, "megatron_core_tokens_per_s": a, "dcp_tokens_per_s": b,
                         "ratio": b / a if a and b else None, "dcp_exposed_share": exposed_share(runs["dcp static"]),
                         "dcp_exchange_share": exposed_share(runs["dcp static"], "exchange"),
                         "busy": args.busy, "dcp_cpu_attention": args.dcp_cpu_attention})
            note(f"    {name} pair {rep + 1}: megatron-core {a:.0f}, dcp static {b:.0f} tokens/s "
                 f"-> {rows[-1]['ratio']:.2f}x")
    return rows


def print_rows(rows: list[dict], busy: int) -> None:
    kernel = rows[0].get("dcp_cpu_attention", "flash") if rows else "flash"
    print(f"fixed layout, --dcp --dcp-planner static --dcp-cpu-attention {kernel} / megatron-core (tokens/s after "
          f"warm-up, pairs run A B A B; "
          f"{'one core kept busy by a competing process' if busy == 1 else f'{busy} busy cores' if busy else 'quiet'})")
    print(f"{'layout':8s} {'pair':>4s} {'mcore tok/s':>11s} {'dcp tok/s':>9s} {'ratio':>6s} {'dcp exposed comm':>16s} "
          f"{'of it the exchange':>18s}")
    pct = lambda x: "-" if x is None else f"{100 * x:.0f}%"  # noqa: E731
    for r in rows:
        print(f"{r['layout']:8s} {r['pair']:4d} {r['megatron_core_tokens_per_s']:11.0f} {r['dcp_tokens_per_s']:9.0f} "
              f"{r['ratio']:6.2f} {pct(r['dcp_exposed_share']):>16s} {pct(r.get('dcp_exchange_share')):>18s}")
    print("(exposed comm: the longest time a rank was blocked on pull/push, as a share of the iteration; the "
          "exchange: the quickest rank's, the transfer itself; the rest is waiting for the slowest rank's compute)")
    for name in dict.fromkeys(r["layout"] for r in rows):
        ratios = [r["ratio"] for r in rows if r["layout"] == name and r["ratio"]]
        print(f"{name}: median ratio {statistics.median(ratios):.2f}x over {len(ratios)} pairs")


def parse_cli(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), default=list(LAYOUTS))
    ap.add_argument("--repeats", type=int, default=2, help="A B pairs per layout")
    ap.add_argument("--busy", type=int, default=0, help="cores kept busy by competing processes")
    ap.add_argument("--iters", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--seq-length", type=int, default=2048)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--budget", default=SPEED_BUDGET, help="--dcp-device-memory (high: this compares speed, not memory)")
    ap.add_argument("--run-timeout", type=float, default=420.0)
    ap.add_argument("--dcp-cpu-attention", choices=["flash", "math"], default="flash",
                    help="--dcp's document attention kernel (default flash: torch's CPU flash kernel, the one "
                         "megatron-core's masked attention runs here too; math keeps probabilities)")
    ap.add_argument("--data-path", default=None, help="a .bin/.idx prefix, byte-level (default: the long-tailed corpus)")
    ap.add_argument("--json", default=os.path.join(REPO, "benchmarks", "results", "fixed_layout.json"))
    args = ap.parse_args(argv)
    if args.data_path:
        args.data_flags = ["--data-path", args.data_path, "--tokenizer-type", "ByteLevelTokenizer"]
    else:
        from long_tail_corpus import ensure_long_tail_corpus

        args.data_flags = ["--data-path", ensure_long_tail_corpus(os.path.join(REPO, "cache")),
                           "--tokenizer-type", "ByteLevelTokenizer"]
    return args


def main(argv=None) -> int:
    args = parse_cli(argv)
    t0 = time.perf_counter()
    with Busy(args.busy), tempfile.TemporaryDirectory() as work:
        rows = measure(args, work)
    print(f"machine: {describe()}")
    print_rows(rows, args.busy)
    print(f"benchmark took {(time.perf_counter() - t0) / 60:.1f} min")
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"machine": describe(), "busy": args.busy, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
