"""What checkpoint checksums cost: a save and a load of the CPU demo's checkpoint, this code
against a checkout of the code before them (issue 37), wall clock of the whole command.

Why it exists: every save now hashes every file it wrote (sha256, `checksums.json`) and every
load reads each file once to check it before training (megatron/training/checkpoint/checksums.py).
The demo's checkpoint is small, so the ratio mostly shows that the check is lost in a run's
start-up (and in the machine's noise); the checks' own time is printed beside it: the load's
as the run reports it, the save's as `write_checksums` takes on the whole folder in one process.

    git archive f9e5f3b | tar -x -C /tmp/before       # the code before checksums
    python benchmarks/bench_checkpoint_checksums.py --baseline /tmp/before [--runs 5] [--nproc 4]

Each round runs, in turn, the baseline and this code for: static save, static load, --dcp
save, --dcp load (`examples/cpu_demo.yaml`, `--train-iters 1` and a save, then a resume for one
more iteration; no evaluation; `--dcp-calibrate-at-start off` where the code has it, since
its probes are no part of the checksums' cost). The machine is shared and noisy: medians over the rounds.
The baseline tree needs this repository's compiled kernels (dcp_ext/**/*.so, copied in) and
runs with this venv; a sitecustomize.py in it keeps this checkout's editable install out of
its imports (written by this script if missing).
"""
from __future__ import annotations

import argparse
import glob
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
ISOLATE = '''# benchmarks/bench_checkpoint_checksums.py: keep the editable install of another checkout out
import sys


def _editable(x):
    return "editable" in (getattr(x, "__module__", "") or "") + type(x).__module__ + repr(x)


sys.meta_path[:] = [f for f in sys.meta_path if not _editable(f)]
sys.path_hooks[:] = [h for h in sys.path_hooks if not _editable(h)]
sys.path[:] = [p for p in sys.path if "__editable__" not in p]
sys.path_importer_cache.clear()
'''


def prepare_baseline(tree: str) -> None:
    for so in glob.glob(os.path.join(REPO, "dcp_ext", "**", "*.so"), recursive=True):
        dst = os.path.join(tree, os.path.relpath(so, REPO))
        if not os.path.exists(dst):
            shutil.copy(so, dst)
    site = os.path.join(tree, "sitecustomize.py")
    if not os.path.exists(site):
        with open(site, "w") as f:
            f.write(ISOLATE)


def has_startup_calibration(tree: str) -> bool:
    with open(os.path.join(tree, "megatron", "training", "arguments.py")) as f:
        return "--dcp-calibrate-at-start" in f.read()


def command(tree: str, nproc: int, kind: str, op: str, ckpt: str, cache: str) -> list[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           os.path.join(tree, "pretrain_gpt_dcp.py"), "--yaml-cfg", os.path.join(tree, "examples", "cpu_demo.yaml"),
           "--data-cache-path", cache, "--eval-iters", "0", "--log-interval", "1", "--lr-decay-iters", "60"]
    if kind == "dcp":
        cmd.append("--dcp")
        if has_startup_calibration(tree):  # issue 36's probes before a fresh run's first iteration: not the checksums'
            cmd += ["--dcp-calibrate-at-start", "off"]
    if op == "save":
        return cmd + ["--train-iters", "1", "--save", ckpt, "--save-interval", "1"]
    return cmd + ["--train-iters", "2", "--load", ckpt]


VERIFIED = re.compile(r"against their checksums in ([0-9.]+) s")


def run(tree: str, cmd: list[str]) -> tuple[float, float | None]:
    """(wall clock of the command, the load's own check as it reports it, if it does)."""
    env = dict(os.environ, PYTHONPATH=tree, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    start = time.perf_counter()
    r = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    took = time.perf_counter() - start
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stderr[-3000:]}")
    m = VERIFIED.search(r.stdout)
    return took, float(m.group(1)) if m else None


def save_hash_seconds(folder: str) -> tuple[float, int]:
    """What a save adds, at most: write_checksums on the whole folder in one process (from the
    page cache; in a run each rank hashes only the shards it wrote)."""
    from megatron.training.checkpoint.checksums import CHECKSUM_FILE, write_checksums

    os.remove(os.path.join(folder, CHECKSUM_FILE))
    start = time.perf_counter()
    write_checksums(folder)
    took = time.perf_counter() - start
    return took, sum(os.path.getsize(os.path.join(folder, n)) for n in os.listdir(folder))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--baseline", required=True, help="a checkout of the code before checksums")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--nproc", type=int, default=4)
    opts = p.parse_args()
    prepare_baseline(opts.baseline)
    trees = {"before": os.path.abspath(opts.baseline), "after": REPO}
    work = tempfile.mkdtemp(prefix="bench_checksums_")
    cache = os.path.join(work, "cache")
    times = {(v, k, op): [] for v in trees for k in ("static", "dcp") for op in ("save", "load")}
    hashed, checked = {}, {k: [] for k in ("static", "dcp")}
    try:
        for kind in ("static", "dcp"):  # warm-up: the demo corpus and index caches, once per tree
            for version, tree in trees.items():
                ckpt = os.path.join(work, f"warm_{version}_{kind}")
                run(tree, command(tree, opts.nproc, kind, "save", ckpt, cache))
        for i in range(opts.runs):
            for kind in ("static", "dcp"):
                for version, tree in trees.items():
                    ckpt = os.path.join(work, f"{version}_{kind}")
                    shutil.rmtree(ckpt, ignore_errors=True)
                    for op in ("save", "load"):
                        t, check = run(tree, command(tree, opts.nproc, kind, op, ckpt, cache))
                        times[(version, kind, op)].append(t)
                        if check is not None:
                            checked[kind].append(check)
                        print(f"round {i + 1}: {kind:6s} {op} {version:6s} {t:6.2f} s", flush=True)
                    if version == "after":
                        hashed[kind] = save_hash_seconds(os.path.join(ckpt, "iter_0000001"))
        print()
        for kind in ("static", "dcp"):
            for op in ("save", "load"):
                b, a = (statistics.median(times[(v, kind, op)]) for v in ("before", "after"))
                print(f"{kind:6s} {op}: before {b:6.2f} s, after {a:6.2f} s (median of {opts.runs}), "
                      f"after/before {a / b:.3f}")
            seconds, size = hashed[kind]
            check = statistics.median(checked[kind]) if checked[kind] else float("nan")
            print(f"{kind:6s} checkpoint: {size / 2**20:.1f} MiB; its checksums written in one process "
                  f"{seconds * 1000:.0f} ms; checked at load (as the run reports it, median) {check * 1000:.0f} ms")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
