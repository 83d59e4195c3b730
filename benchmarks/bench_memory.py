"""Peak worker memory: megatron-core's static path vs the adaptive runtime, side by side in one run.

Trains a 103M-parameter Llama-style GPT (8 layers, hidden 1024, ffn 2816, 16 heads,
SwiGLU, RMSNorm, RoPE, byte-level tokens from the demo corpus; fp32, the CPU default) on
4 gloo ranks for 2 iterations of 4096-token global batches, no eval, no save, under
  static    megatron-core's DP4 with --use-distributed-optimizer (4 x 1024-token sequences)
  dcp       --dcp, the adaptive planner, --dcp-global-batch-tokens 4096 (documents up to 1024)
and prints each run's peak RSS of its largest worker, measured from outside the training
processes, and the ratio dcp / static (target <= 1.25x, goal 1.1x), plus the runtime's own
account of what a rank holds for the whole run (`> adaptive runtime: ... rank 0 holds ...`).

    python benchmarks/bench_memory.py                 # ~5-6 min on 2 cores
    python benchmarks/bench_memory.py --iters 1       # quicker, same peaks in practice

Measurement: GNU time (`/usr/bin/time -f %M`) over torchrun reports the largest peak RSS
of any process in the tree (it waits for the launcher, which waits for its workers); where
GNU time is missing (`apt-get install -y time`), a small Python wrapper reads the same
number from `getrusage(RUSAGE_CHILDREN)`. Beside it each worker's VmHWM is read from
/proc while it runs (labelled by its RANK), to show whether one rank stands out. RSS
counts everything a worker maps: torch and megatron-core's code (~0.5 GB), the model
state, activations and allocator slack.

A third run, the adaptive runtime with a fixed pool that gives each rank many replica
types (`AdaptivePlanner(layouts=...)`), is not made: no flag exposes a fixed pool
(`training_adaptive.build_planner` passes none).

Numbers are from whatever machine runs it (the table says which); on a small CPU the
ranks share cores, which changes the time, not the memory.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from machine import describe  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MODEL = ["--num-layers", "8", "--hidden-size", "1024", "--ffn-hidden-size", "2816", "--num-attention-heads", "16",
         "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
         "--hidden-dropout", "0", "--attention-dropout", "0", "--init-method-std", "0.02"]
DATA = ["--tokenizer-type", "ByteLevelTokenizer", "--demo-corpus", "--split", "98,2,0",
        "--reset-position-ids", "--reset-attention-mask"]
GNU_TIME = "/usr/bin/time"
RUNTIME_LINE = re.compile(r"^> adaptive runtime: .*$", re.M)

# Wraps a command and prints its descendants' largest peak RSS (KiB), like `time -f %M`.
RUSAGE_WRAPPER = ("import resource, subprocess, sys; code = subprocess.call(sys.argv[2:]); "
                  "open(sys.argv[1], 'w').write(str(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)); "
                  "sys.exit(code)")


def common_flags(args) -> list[str]:
    return MODEL + DATA + [
        "--seq-length", str(args.seq_length), "--max-position-embeddings", str(args.seq_length),
        "--lr", "3e-4", "--train-iters", str(args.iters), "--eval-iters", "0", "--log-interval", "1",
        "--seed", "1234"]


def runs(args) -> dict[str, list[str]]:
    per_batch = args.tokens // args.seq_length
    return {
        "static": ["--use-distributed-optimizer", "--micro-batch-size", "1", "--global-batch-size", str(per_batch)],
        "dcp": ["--dcp", "--dcp-global-batch-tokens", str(args.tokens), "--dcp-max-seq-len", str(args.seq_length)],
    }


def descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/task/{p}/children") as f:
                kids = [int(x) for x in f.read().split()]
        except OSError:
            continue
        out += kids
        todo += kids
    return out


def worker_rank(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
    except OSError:
        return None
    return int(env[b"RANK"]) if b"RANK" in env and b"TORCHELASTIC_RUN_ID" in env else None


def vm_hwm_kib(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def measure(name: str, flags: list[str], args, work: str) -> dict:
    """Run one training job; its largest peak RSS (outside), each rank's VmHWM, its output."""
    rss_file = os.path.join(work, f"{name}.maxrss")
    log = os.path.join(work, f"{name}.jsonl")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
                os.path.join(REPO, "pretrain_gpt_dcp.py")] + common_flags(args) + flags + ["--loss-log", log]
    gnu_time = GNU_TIME if os.path.exists(GNU_TIME) else None
    cmd = ([gnu_time, "-f", "%M", "-o", rss_file] if gnu_time else [sys.executable, "-c", RUSAGE_WRAPPER, rss_file]) \
        + torchrun
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    print(f"  running {name:7s} ({args.iters} iterations, {args.nproc} ranks) ...", file=sys.stderr, flush=True)
    hwm: dict[int, int] = {}
    t0 = time.perf_counter()
    with open(os.path.join(work, f"{name}.out"), "w+") as out, open(os.path.join(work, f"{name}.err"), "w+") as err:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=err, start_new_session=True)
        last_note = t0
        try:
            while proc.poll() is None:
                for pid in descendants(proc.pid):
                    rank = worker_rank(pid)
                    kib = vm_hwm_kib(pid) if rank is not None else None
                    if kib is not None:
                        hwm[rank] = max(hwm.get(rank, 0), kib)
                if time.perf_counter() - last_note > 30:
                    last_note = time.perf_counter()
                    peak = max(hwm.values()) * 1024 / 1e9 if hwm else 0.0
                    print(f"    {name}: {last_note - t0:5.0f} s, largest worker VmHWM so far {peak:.2f} GB",
                          file=sys.stderr, flush=True)
                time.sleep(0.25)
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # the launcher's group: nothing outlives the run
            except ProcessLookupError:
                pass
        wall = time.perf_counter() - t0
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    if proc.returncode != 0:
        sys.exit(f"run failed ({name}, exit {proc.returncode}):\n{stderr[-3000:]}")
    with open(rss_file) as f:
        maxrss_kib = int(f.read().split()[-1])
    with open(log) as f:
        records = [json.loads(line) for line in f if line.strip()]
    m = RUNTIME_LINE.search(stdout)
    print(f"    {name}: done in {wall:.0f} s", file=sys.stderr, flush=True)
    return {"maxrss_gb": maxrss_kib * 1024 / 1e9, "ranks_gb": {r: v * 1024 / 1e9 for r, v in sorted(hwm.items())},
            "wall_s": wall, "records": records, "runtime_line": m.group(0) if m else None,
            "how": "GNU time -f %M" if gnu_time else "getrusage(RUSAGE_CHILDREN)"}


def held_bytes(line: str) -> dict[str, float]:
    """`rank 0 holds parameters 197 MiB, main_grads 197 MiB, ...` -> {kind: MiB}."""
    held = line.split(" holds ", 1)[1]
    return {k: float(v) for k, v in re.findall(r"(\w+) (\d+(?:\.\d+)?) MiB", held)}


def machine() -> str:
    return describe()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=2)
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=4096, help="tokens per global batch")
    ap.add_argument("--seq-length", type=int, default=1024, help="static: sequence length; dcp: --dcp-max-seq-len")
    ap.add_argument("--only", choices=["static", "dcp"], nargs="*", default=None, help="run a subset (development)")
    args = ap.parse_args(argv)
    if not os.path.exists(GNU_TIME):
        print("  GNU time not found (apt-get install -y time): reading getrusage(RUSAGE_CHILDREN) instead",
              file=sys.stderr)
    todo = {k: v for k, v in runs(args).items() if args.only is None or k in args.only}
    with tempfile.TemporaryDirectory() as work:
        results = {name: measure(name, flags, args, work) for name, flags in todo.items()}

    params = "103M parameters (8 layers, hidden 1024, ffn 2816, SwiGLU, RMSNorm, 16 heads, byte-level vocab)"
    print(f"Peak worker memory, {params}, fp32, {args.nproc} gloo ranks, {args.tokens}-token global batches, "
          f"{args.iters} iterations, no eval, no save")
    print(f"machine: {machine()}; peak RSS measured outside the training processes "
          f"({next(iter(results.values()))['how']} over torchrun); GB = 1e9 bytes")
    print(f"{'run':8s} {'peak RSS (GB)':>14s} {'per-rank VmHWM (GB)':>26s} {'wall (s)':>9s} {'last loss':>10s}  layouts")
    for name, r in results.items():
        ranks = " ".join(f"{v:.2f}" for v in r["ranks_gb"].values())
        layouts = sorted({rec.get("layout", "").split(" | ")[0].replace("layout: ", "") for rec in r["records"]})
        layouts = ", ".join(x for x in layouts if x) or "DP4 (static)"
        print(f"{name:8s} {r['maxrss_gb']:14.2f} {ranks:>26s} {r['wall_s']:9.0f} "
              f"{r['records'][-1]['lm loss']:10.4f}  {layouts}")
    print("(c) dcp with a fixed pool of many replica types per rank: skipped, no flag exposes "
          "AdaptivePlanner(layouts=...) (training_adaptive.build_planner passes none)")
    if "static" in results and "dcp" in results:
        ratio = results["dcp"]["maxrss_gb"] / results["static"]["maxrss_gb"]
        print(f"peak RSS, dcp / static: {ratio:.2f}x  (target <= 1.25x, goal 1.1x)")
    if "dcp" in results and results["dcp"]["runtime_line"]:
        line = results["dcp"]["runtime_line"]
        held = held_bytes(line)
        print("runtime's own account (persistent bytes, second opinion):")
        print(f"  {line}")
        print(f"  = {sum(held.values()) * 2**20 / 1e9:.2f} GB held for the whole run by rank 0 "
              f"(the rest of its peak: torch, activations, allocator)")
        n = re.search(r"([\d,]+) parameters", line)
        if n:
            n = int(n.group(1).replace(",", ""))
            static = n * (4 + 4 + 8 / args.nproc)
            print(f"  static DP{args.nproc} by the same account (estimate, not self-reported): fp32 weights 4 B + "
                  f"grad buffer 4 B + Adam 8 B / {args.nproc} per parameter (megatron-core's distributed optimizer "
                  f"uses fp32 weights as its main params) = {static / 1e9:.2f} GB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
