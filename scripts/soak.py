"""Soak run: N adaptive iterations of the CPU demo on 4 ranks, a checkpoint every
K, two forced kills (SIGKILL of one worker; torchrun --max-restarts brings the job back
from the last checkpoint), compared loss for loss with an unbroken run.

    python scripts/soak.py [--iters 500] [--save-interval 50] [--tokens 2048]

Prints progress, the kill points, and whether every loss (and so the final one) equals
the unbroken run's bit for bit. Exit status 0 only if they all do.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time

import psutil

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENTRY = os.path.join(REPO, "pretrain_gpt_dcp.py")


def read_log(path: str) -> dict[int, dict]:
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return {r["iteration"]: r for r in (json.loads(line) for line in f if line.strip())}


def run(args, log: str, save: str | None, kills: list[int]) -> int:
    flags = ["--yaml-cfg", os.path.join(REPO, "examples", "cpu_demo.yaml"), "--dcp", "--dcp-planner", "adaptive",
             "--dcp-global-batch-tokens", str(args.tokens), "--train-iters", str(args.iters),
             "--lr-decay-iters", str(args.iters), "--log-interval", "50", "--eval-iters", "0", "--loss-log", log,
             "--data-cache-path", os.path.join(REPO, "cache")]
    if save:
        flags += ["--save", save, "--load", save, "--save-interval", str(args.save_interval)]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
           f"--max-restarts={len(kills)}", ENTRY] + flags
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    out = open(log + ".out", "w")
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    pending = sorted(kills)
    last_report = 0
    try:
        while proc.poll() is None:
            done = len(read_log(log))
            if done - last_report >= 25:
                print(f"    {os.path.basename(log)}: {done}/{args.iters} iterations", file=sys.stderr, flush=True)
                last_report = done
            if pending and max(read_log(log), default=0) >= pending[0]:
                workers = [p for p in psutil.Process(proc.pid).children(recursive=True) if ENTRY in " ".join(p.cmdline())]
                if workers:
                    victim = random.Random(pending[0]).choice(workers)
                    print(f"    kill -9 worker {victim.pid} at iteration {pending[0]}", file=sys.stderr, flush=True)
                    os.kill(victim.pid, signal.SIGKILL)
                    pending.pop(0)
            time.sleep(0.5)
        return proc.wait()
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        out.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=500)
    ap.add_argument("--save-interval", type=int, default=50)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)
    kills = sorted(rng.sample(range(args.save_interval + 1, args.iters - 1), 2))
    with tempfile.TemporaryDirectory() as work:
        print(f"soak: {args.iters} iterations, checkpoint every {args.save_interval}, kills at {kills}")
        start = time.time()
        print("  unbroken run ...", file=sys.stderr)
        if run(args, os.path.join(work, "unbroken.jsonl"), None, []) != 0:
            return print("unbroken run failed") or 1
        print("  run with kills ...", file=sys.stderr)
        code = run(args, os.path.join(work, "broken.jsonl"), os.path.join(work, "ckpt"), kills)
        unbroken, broken = read_log(os.path.join(work, "unbroken.jsonl")), read_log(os.path.join(work, "broken.jsonl"))
        same = [i for i in unbroken if i in broken and broken[i]["lm loss"] == unbroken[i]["lm loss"]]
        print(f"exit code of the killed run: {code}; iterations logged: {len(broken)}/{args.iters}; "
              f"losses equal to the unbroken run: {len(same)}/{len(unbroken)}")
        last = args.iters
        if last in unbroken and last in broken:
            print(f"final loss: unbroken {unbroken[last]['lm loss']!r}, with kills {broken[last]['lm loss']!r} -> "
                  f"{'EQUAL' if unbroken[last]['lm loss'] == broken[last]['lm loss'] else 'DIFFERENT'}")
        print(f"wall time {time.time() - start:.0f} s")
        return 0 if code == 0 and len(same) == len(unbroken) == args.iters else 1


if __name__ == "__main__":
    sys.exit(main())
