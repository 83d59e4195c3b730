"""Adaptive vs static on the real runtime, side by side in one run.

Trains the CPU demo (examples/cpu_demo.yaml: byte-level standard-library sources, 4 gloo
ranks) with `--dcp` under the static planner and the adaptive planner on the same data,
and with the targeted pull/push vs the all-gather baseline. Prints tokens per second
(warm-up iterations excluded) and bytes moved per iteration, as ratios.

    python benchmarks/bench_runtime.py [--iters 20] [--nproc 4] [--tokens 8192]

Numbers are from whatever machine runs it; on a 2-core CPU the ranks share cores, so the
speed ratio says little about GPUs (no memory pressure, no fast links): the planner's
cost model is what carries to GPUs, and `dcp-simulate` reports that.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(planner: str, exchange: str, args, workdir: str) -> list[dict]:
    log = os.path.join(workdir, f"{planner}-{exchange}.jsonl")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
           os.path.join(REPO, "pretrain_gpt_dcp.py"), "--yaml-cfg", os.path.join(REPO, "examples", "cpu_demo.yaml"),
           "--dcp", "--dcp-planner", planner, "--dcp-exchange", exchange,
           "--dcp-global-batch-tokens", str(args.tokens), "--train-iters", str(args.iters),
           "--log-interval", str(args.iters), "--eval-iters", "0", "--loss-log", log,
           "--data-cache-path", os.path.join(REPO, "cache")]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    print(f"  running {planner:9s} {exchange:9s} ({args.iters} iterations) ...", file=sys.stderr, flush=True)
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"run failed ({planner}, {exchange}):\n{done.stderr[-2000:]}")
    with open(log) as f:
        return [json.loads(line) for line in f]


def summary(records: list[dict], warmup: int) -> dict:
    steady = records[warmup:]
    tokens = sum(r["tokens"] for r in steady)
    seconds = sum(r["elapsed_s"] for r in steady)
    layouts = sorted({r["layout"].split(" | ")[0] for r in records})
    return {
        "tokens_per_s": tokens / seconds,
        "bytes_per_iter": statistics.mean(r["bytes_moved"] for r in steady),
        "final_loss": records[-1]["lm loss"],
        "layouts": layouts,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=8192, help="--dcp-global-batch-tokens")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as work:
        results = {(p, x): summary(run(p, x, args, work), args.warmup)
                   for p, x in (("static", "targeted"), ("adaptive", "targeted"), ("adaptive", "allgather"))}
    st, ad, ag = results["static", "targeted"], results["adaptive", "targeted"], results["adaptive", "allgather"]
    print(f"CPU demo, {args.nproc} gloo ranks, {args.tokens} tokens/batch, {args.iters} iterations "
          f"({args.warmup} warm-up excluded); data: Python standard library sources (byte-level)")
    print(f"{'run':28s} {'tokens/s':>10s} {'MB moved/iter':>14s} {'final loss':>11s}  layouts")
    for (p, x), r in results.items():
        print(f"{p + ' / ' + x:28s} {r['tokens_per_s']:10.0f} {r['bytes_per_iter'] / 1e6:14.3f} "
              f"{r['final_loss']:11.4f}  {', '.join(r['layouts'])}")
    print(f"speed, adaptive / static (tokens/s): {ad['tokens_per_s'] / st['tokens_per_s']:.2f}x")
    print(f"bytes moved per iteration, all-gather / targeted: {ag['bytes_per_iter'] / ad['bytes_per_iter']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
