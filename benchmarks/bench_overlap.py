"""Exposed communication with and without overlapped pull/push, side by side in one run.

Trains the CPU demo (examples/cpu_demo.yaml: byte-level standard-library sources, 4 gloo
ranks) with `--dcp` twice on the same data: once plain, once with
`--overlap-param-gather --overlap-grad-reduce` (the runtime pulls the next bucket of
parameters while a layer computes and pushes each bucket's gradients as soon as the last
backward has produced them), both with the same `--ddp-bucket-size` so there are several
buckets (13 for the demo's 0.8M parameters; the runtime's default gives a model this
small one). From the `--loss-log` records it prints the median exposed communication per
iteration (`exposed_comm_s`: the longest time any rank spent blocked on pull/push), the
ratio overlap / no-overlap, the median iteration time (`elapsed_s`) and each command's
wall time measured from outside, and the largest |loss difference| between the two runs
(overlap must not change the math).

    python benchmarks/bench_overlap.py [--iters 25] [--nproc 4] [--bucket-size 65536]

Without overlap the runtime counts its whole pull + push time as exposed; with overlap,
only the time a rank waits for a transfer. Numbers are from whatever machine runs it (the
output says which); on a small CPU the ranks and gloo's transfer threads share the same
cores, so hidden communication still takes compute time away: on GPUs (copy engines,
NCCL) overlap is nearer to free.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from machine import describe  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OVERLAP = ["--overlap-param-gather", "--overlap-grad-reduce"]


def run(name: str, extra: list[str], args, workdir: str) -> tuple[list[dict], float, str]:
    log = os.path.join(workdir, f"{name}.jsonl")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
           os.path.join(REPO, "pretrain_gpt_dcp.py"), "--yaml-cfg", os.path.join(REPO, "examples", "cpu_demo.yaml"),
           "--dcp", "--dcp-global-batch-tokens", str(args.tokens), "--train-iters", str(args.iters),
           "--log-interval", str(args.iters), "--eval-iters", "0", "--loss-log", log,
           "--ddp-bucket-size", str(args.bucket_size)] + extra
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", DCP_OVERLAP_ON_CPU="1")  # measure it here
    print(f"  running {name:10s} ({args.iters} iterations) ...", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        sys.exit(f"run failed ({name}):\n{done.stderr[-2000:]}")
    print(f"    {name}: done in {wall:.0f} s", file=sys.stderr, flush=True)
    buckets = [line for line in done.stdout.splitlines() if line.startswith("> adaptive runtime:")]
    with open(log) as f:
        return [json.loads(line) for line in f if line.strip()], wall, (buckets[0] if buckets else "")


def machine() -> str:
    return describe()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=25)
    ap.add_argument("--warmup", type=int, default=2, help="first iterations left out of the medians")
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=8192, help="--dcp-global-batch-tokens")
    ap.add_argument("--bucket-size", type=int, default=65536, help="--ddp-bucket-size (elements per bucket)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as work:
        results = {name: run(name, extra, args, work) for name, extra in (("no overlap", []), ("overlap", OVERLAP))}

    print(f"CPU demo (examples/cpu_demo.yaml), --dcp, {args.nproc} gloo ranks, {args.tokens} tokens/batch, "
          f"{args.iters} iterations ({args.warmup} warm-up left out of the medians), --ddp-bucket-size "
          f"{args.bucket_size}; machine: {machine()}")
    line = results["no overlap"][2]
    if " in " in line and " buckets" in line:
        print("  " + line.split(";")[0].replace("> adaptive runtime: ", "runtime: "))
    print(f"{'run':12s} {'exposed comm (ms)':>18s} {'iteration (ms)':>15s} {'wall (s)':>9s} {'final loss':>11s}  layouts")
    med = {}
    for name, (records, wall, _) in results.items():
        steady = records[args.warmup:] or records
        comm = statistics.median(r["exposed_comm_s"] for r in steady)
        elapsed = statistics.median(r["elapsed_s"] for r in steady)
        med[name] = (comm, elapsed, wall)
        layouts = sorted({r["layout"].split(" | ")[0].replace("layout: ", "") for r in records})
        print(f"{name:12s} {1000 * comm:18.1f} {1000 * elapsed:15.1f} {wall:9.1f} {records[-1]['lm loss']:11.4f}  "
              f"{', '.join(layouts)}")
    (c0, e0, w0), (c1, e1, w1) = med["no overlap"], med["overlap"]
    print(f"exposed comm, overlap / no overlap (medians): {c1 / c0 if c0 else float('nan'):.2f}x")
    print(f"iteration time, overlap / no overlap (medians of elapsed_s): {e1 / e0:.2f}x; "
          f"whole command (wall, from outside): {w1 / w0:.2f}x")
    a, b = results["no overlap"][0], results["overlap"][0]
    n = min(len(a), len(b))
    dloss = max(abs(x["lm loss"] - y["lm loss"]) for x, y in zip(a[:n], b[:n]))
    dnorm = max(abs(x["grad norm"] - y["grad norm"]) for x, y in zip(a[:n], b[:n]))
    same_layouts = all(x["layout"] == y["layout"] for x, y in zip(a[:n], b[:n]))
    print(f"same math: max |loss difference| over {n} iterations {dloss:.3g}, max |grad norm difference| "
          f"{dnorm:.3g}; same layouts every iteration: {'yes' if same_layouts else 'no'}")
    print("(without overlap the runtime counts its whole pull + push time as exposed; with overlap, only the "
          "time a rank is blocked on a transfer)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
