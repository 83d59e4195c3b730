"""The GPU check in one command (scripts/gpu_check.sh runs it): setup, then four phases, one
summary JSON.

    bash scripts/gpu_check.sh              # on the GPU machine: about 8 minutes at most
    bash scripts/gpu_check.sh --dry-run    # the same phases on the CPU at tiny sizes (CI)

Phases (each with a time budget, its elapsed time printed and kept in the summary):
- setup: the carried wheels (scripts/fetch_gpu_wheels.sh) installed offline, only those whose
  distribution this Python lacks (`pip install --no-index --no-deps --target`, put first on
  PYTHONPATH: the machine's torch is used, nothing is downloaded); the C++ kernels built
  (`setup.py build_ext --inplace`); the demo corpus built once for every run.
- a_equivalence: a small Llama-like model (RoPE, RMSNorm, SwiGLU, GQA, document-masked
  batches) trained by the static path and by --dcp, fp32 and bf16, on the device and on
  this machine's CPU (`CUDA_VISIBLE_DEVICES=`, gloo); the losses of every iteration
  (--loss-log) compared within TOLERANCES. The CPU runs go on beside the device ones.
- b_device_and_syncs: the device runs of (a) go through scripts/gpu_check_entry.py: host
  synchronisations per training step by call site (`torch.cuda.set_sync_debug_mode("warn")`)
  and every tensor Python reaches counted by device after step 3.
- c_speed: tokens/s of `--dcp --dcp-planner static` against megatron-core's static path at
  TP1 on one device, same kernel (`--dcp-cpu-attention flash`), same tokens per iteration,
  a ~180M-parameter model in bf16, run one after the other; the ratio (no threshold: speed
  is reported, never asserted).
- d_memory: scripts/gpu_memory_check.py (one TP1 replica's measured peaks against the cost
  model's predictions), its table copied into the summary.
- e_gpu_tests: the suite's gpu-marked tests (pytest -m gpu).

--dry-run: the same phases on the CPU at tiny sizes: (a) compares a CPU run with a CPU run,
(b) checks what the CPU allows (the step wrapper, the tensor scan) and says why the sync
count is skipped, (c) gives a ratio at a tiny size, (d) and (e) are skipped (they need CUDA).

The summary ($OUT/gpu_check_summary.json, path printed) has, per phase, `status` (passed,
failed or skipped, with `reason` unless passed), `elapsed_s`, `budget_s` and its numbers;
every run's output goes to $OUT/gpu_check.log. Exit code 0 when no phase failed.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_WHEELS = os.path.join(".gpu_check", "wheels")
SUMMARY_NAME = "gpu_check_summary.json"
LOG_NAME = "gpu_check.log"
SCHEMA = "gpu-check/v1"
PHASES = ("setup", "a_equivalence", "b_device_and_syncs", "c_speed", "d_memory", "e_gpu_tests")
PINNED = {"megatron-core": "0.16.1"}  # setup.py's pin: installed from the wheel unless this very version is there

# Per-iteration relative loss difference |device - cpu| / |cpu| allowed, by dtype. fp32: the same
# arithmetic in another summation order (GEMM blocking, kernels) drifts ~1e-6..1e-5 over a few dozen
# Adam steps; bf16 rounds every activation to 8 bits of mantissa (~4e-3 per value), so the two
# devices' trajectories part by up to a few 1e-2 within the same number of steps.
TOLERANCES = {"fp32": {"max_rel": 1e-3, "mean_rel": 3e-4}, "bf16": {"max_rel": 5e-2, "mean_rel": 2e-2}}

# seconds per phase; the whole run stops at BUDGET_S (each phase gets the smaller of the two)
# (the GPU runs compile megatron-core's fused bias-SwiGLU/dropout with torch.compile at their first steps)
BUDGETS = {"gpu": {"setup": 90, "a_equivalence": 170, "b_device_and_syncs": 10, "c_speed": 140, "d_memory": 50,
                   "e_gpu_tests": 40},
           "dry-run": {"setup": 90, "a_equivalence": 90, "b_device_and_syncs": 10, "c_speed": 60, "d_memory": 10,
                       "e_gpu_tests": 10}}
BUDGET_S = {"gpu": 480, "dry-run": 240}


@dataclass(frozen=True)
class Model:
    layers: int
    hidden: int
    heads: int
    groups: int
    ffn: int | None
    seq: int

    def flags(self) -> list[str]:
        return (["--num-layers", str(self.layers), "--hidden-size", str(self.hidden), "--num-attention-heads",
                 str(self.heads), "--num-query-groups", str(self.groups), "--seq-length", str(self.seq),
                 "--max-position-embeddings", str(self.seq), "--position-embedding-type", "rope",
                 "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear", "--hidden-dropout", "0",
                 "--attention-dropout", "0"]
                + (["--ffn-hidden-size", str(self.ffn)] if self.ffn else []))

    def parameters(self, vocab: int = 384) -> int:
        """Weights of the model (tied embedding; the byte-level vocabulary padded to 128)."""
        h, d = self.hidden, self.hidden // self.heads
        ffn = self.ffn or int((4 * h * 2 / 3) / 64) * 64  # Megatron's SwiGLU default
        layer = h * (h + 2 * self.groups * d) + h * h + h * 2 * ffn + ffn * h + 2 * h
        return self.layers * layer + vocab * h + h

    def describe(self) -> dict:
        return {"num_layers": self.layers, "hidden_size": self.hidden, "num_attention_heads": self.heads,
                "num_query_groups": self.groups, "ffn_hidden_size": self.ffn or "SwiGLU default",
                "seq_length": self.seq, "parameters": self.parameters(),
                "features": "RoPE, RMSNorm, SwiGLU, GQA, no biases, tied embeddings, byte-level vocabulary "
                            "(257 padded to 384), documents masked (--reset-attention-mask, --reset-position-ids)"}


@dataclass(frozen=True)
class Sizes:
    eq_model: Model
    eq_micro_batch: int
    eq_global_batch: int
    eq_iters: int
    speed_model: Model
    speed_micro_batch: int
    speed_global_batch: int
    speed_iters: int
    speed_warmup: int
    scan_at: int


SIZES = {
    "gpu": Sizes(eq_model=Model(4, 256, 8, 4, None, 512), eq_micro_batch=2, eq_global_batch=4, eq_iters=20,
                 speed_model=Model(12, 1024, 16, 4, 4096, 2048), speed_micro_batch=4, speed_global_batch=32,
                 speed_iters=12, speed_warmup=3, scan_at=3),
    "dry-run": Sizes(eq_model=Model(2, 64, 4, 2, None, 128), eq_micro_batch=2, eq_global_batch=4, eq_iters=4,
                     speed_model=Model(2, 64, 4, 2, 176, 128), speed_micro_batch=2, speed_global_batch=4,
                     speed_iters=4, speed_warmup=1, scan_at=3),
}


ENVIRONMENT_PROBE = """
import json, os, platform, sys
d = {'python': sys.version.split()[0], 'machine': platform.machine(), 'cpu_count': os.cpu_count()}
import torch
d.update(torch=torch.__version__, torch_cuda=torch.version.cuda, cuda_available=torch.cuda.is_available())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    d.update(gpu=p.name, gpu_count=torch.cuda.device_count(), gpu_memory_gib=round(p.total_memory / 2**30, 1))
import megatron.core
d['megatron_core'] = megatron.core.__version__
for m in ('transformer_engine', 'flash_attn', 'apex'):
    try:
        __import__(m)
        d[m] = 'importable'
    except Exception:
        d[m] = 'missing'
for m in ('numpy', 'yaml', 'psutil', 'filelock', 'pybind11'):
    d[m] = getattr(__import__(m), '__version__', 'importable')
from dcp_ext import kernels
d['planner_kernels_cpp'] = kernels.built()
print('ENV', json.dumps(d))
"""


# (d): the model scripts/gpu_memory_check.py was written for (micro-batches of 1K to 16K tokens)
MEMORY_MODEL = Model(4, 256, 8, 4, None, 1024)


def say(msg: str) -> None:
    print(f"[gpu_check] {msg}", flush=True)


# ----------------------------------------------------------------------------------------- runs


@dataclass
class Job:
    name: str
    cmd: list[str]
    env: dict
    cores: list[int] | None = None
    threads: int = 1
    # filled in by run_lanes
    rc: int | None = None
    wall_s: float | None = None
    timed_out: bool = False
    output: str = ""
    _proc: subprocess.Popen | None = field(default=None, repr=False)
    _log: object = field(default=None, repr=False)
    _t0: float = 0.0


class Runner:
    """Starts jobs (each in a process group of its own), lanes in parallel, and appends every
    job's output to the combined log."""

    def __init__(self, work: str, log_path: str):
        self.work, self.log_path = work, log_path
        self.count = 0

    def _start(self, job: Job) -> None:
        self.count += 1
        path = os.path.join(self.work, "logs", f"{self.count:02d}_{re.sub(r'[^A-Za-z0-9]+', '_', job.name)}.log")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        job._log = open(path, "w+")
        env = dict(job.env, OMP_NUM_THREADS=str(job.threads))
        cores = job.cores

        def bind():  # in the child, before exec: never raise (that would abort the start)
            if cores:
                try:
                    os.sched_setaffinity(0, cores)
                except (OSError, AttributeError):
                    pass

        job._t0 = time.perf_counter()
        job._proc = subprocess.Popen(job.cmd, cwd=REPO, env=env, stdout=job._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=bind)
        say(f"  start {job.name}")

    def _finish(self, job: Job, timed_out: bool = False) -> None:
        proc = job._proc
        if timed_out:
            job.timed_out = True
            kill_group(proc)
        rc = proc.wait()
        kill_group(proc)  # helpers the run left behind in its group
        job.rc = rc if not timed_out else 124
        job.wall_s = time.perf_counter() - job._t0
        job._log.seek(0)
        job.output = job._log.read()
        job._log.close()
        with open(self.log_path, "a") as log:
            log.write(f"\n===== {job.name} (rc {job.rc}{', timed out' if timed_out else ''}, "
                      f"{job.wall_s:.1f} s)\n$ {' '.join(job.cmd)}\n{job.output}")
        say(f"  done  {job.name}: rc {job.rc}{' (timed out)' if timed_out else ''}, {job.wall_s:.1f} s")

    def run_lanes(self, lanes: list[list[Job]], deadline: float) -> None:
        """Each lane's jobs one after another, the lanes side by side, all stopped at `deadline`."""
        queues = [list(lane) for lane in lanes if lane]
        running: list[Job | None] = [None] * len(queues)
        while True:
            for i, queue in enumerate(queues):
                if running[i] is None and queue:
                    running[i] = queue.pop(0)
                    self._start(running[i])
            if all(job is None for job in running):
                return
            for i, job in enumerate(running):
                if job is not None and job._proc.poll() is not None:
                    self._finish(job)
                    running[i] = None
            if time.monotonic() > deadline:
                for i, job in enumerate(running):
                    if job is not None:
                        self._finish(job, timed_out=True)
                        running[i] = None
                for queue in queues:  # never started: out of time
                    for job in queue:
                        job.rc, job.timed_out, job.output = 124, True, "not started: the phase ran out of time"
                    queue.clear()
                return
            time.sleep(0.2)


def kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def tail(text: str, lines: int = 6) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def read_loss_log(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


ITERATION_LINE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?elapsed time per iteration \(ms\): ([\d.]+) \|")


def iteration_times(text: str) -> dict[int, float]:
    """Seconds per iteration from Megatron's log lines (--log-interval 1)."""
    return {int(m.group(1)): float(m.group(2)) / 1000.0 for m in ITERATION_LINE.finditer(text)}


# ---------------------------------------------------------------------------------------- check


class Check:
    def __init__(self, opts):
        self.opts = opts
        self.mode = "dry-run" if opts.dry_run else "gpu"
        self.sizes = SIZES[self.mode]
        self.t0 = time.monotonic()
        self.deadline = self.t0 + (opts.budget_s or BUDGET_S[self.mode])
        self.out = os.path.abspath(opts.out)
        os.makedirs(self.out, exist_ok=True)
        self.summary_path = os.path.join(self.out, SUMMARY_NAME)
        self.log_path = os.path.join(self.out, LOG_NAME)
        open(self.log_path, "w").close()
        self.work = opts.work or tempfile.mkdtemp(prefix="gpu_check_")
        os.makedirs(self.work, exist_ok=True)
        self.runner = Runner(self.work, self.log_path)
        self.site: str | None = None
        self.prefix: str | None = None
        self.cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(
            range(os.cpu_count() or 1))
        self.summary = {"schema": SCHEMA, "mode": self.mode, "passed": None, "summary_path": self.summary_path,
                        "log_path": self.log_path, "budget_s": round(self.deadline - self.t0),
                        "elapsed_s": None, "environment": None,
                        "phases": {p: {"status": "skipped", "reason": "not reached"} for p in PHASES}}
        self.device_runs: dict[str, tuple[Job, str]] = {}  # (a)'s device runs -> (job, entry report path)

    # -- helpers

    def env(self, cpu_only: bool = False) -> dict:
        env = {k: v for k, v in os.environ.items()
               if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                            "GROUP_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE", "TORCHELASTIC_RESTART_COUNT")}
        path = [REPO] + ([self.site] if self.site else []) + ([os.environ["PYTHONPATH"]]
                                                              if os.environ.get("PYTHONPATH") else [])
        env.update(PYTHONPATH=os.pathsep.join(path), PYTHONUNBUFFERED="1", PYTHONWARNINGS="ignore",
                   CUDA_DEVICE_MAX_CONNECTIONS="1")
        if cpu_only:
            env["CUDA_VISIBLE_DEVICES"] = ""
        return env

    def phase_deadline(self, phase: str) -> tuple[float, float]:
        budget = BUDGETS[self.mode][phase]
        return min(self.deadline, time.monotonic() + budget), budget

    def write(self) -> None:
        self.summary["elapsed_s"] = round(time.monotonic() - self.t0, 1)
        tmp = self.summary_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.summary, f, indent=1, default=str)
        os.replace(tmp, self.summary_path)

    def run_phase(self, phase: str, fn) -> dict:
        start = time.monotonic()
        deadline, budget = self.phase_deadline(phase)
        say(f"phase {phase}: start (budget {budget} s, {self.deadline - start:.0f} s left in all)")
        if deadline - start < 5:
            result = {"status": "failed", "reason": "no time left in the whole run's budget"}
        else:
            try:
                result = fn(deadline)
            except Exception as e:  # a bug here must still leave a summary
                import traceback

                result = {"status": "failed", "reason": f"{type(e).__name__}: {e}",
                          "traceback": traceback.format_exc()[-2000:]}
        result["elapsed_s"] = round(time.monotonic() - start, 1)
        result["budget_s"] = budget
        self.summary["phases"][phase] = result
        self.write()
        why = f" ({result['reason']})" if result.get("reason") else ""
        say(f"phase {phase}: {result['status']} in {result['elapsed_s']:.1f} s{why}")
        return result

    # -- setup

    def setup(self, deadline: float) -> dict:
        out: dict = {}
        out["wheels"] = self.install_wheels(deadline)
        if out["wheels"].get("error"):
            return {"status": "failed", "reason": out["wheels"]["error"], **out}
        # side by side: the kernels' build (every core), the demo corpus, the environment's probe
        build = self.build_job()
        corpus = Job("demo corpus", [sys.executable, "-c", "from dcp_ext.data.demo_corpus import ensure_demo_corpus; "
                                    f"print('PREFIX', ensure_demo_corpus({self.corpus_dir()!r}))"], self.env())
        probe = Job("environment", [sys.executable, "-c", ENVIRONMENT_PROBE], self.env())
        self.runner.run_lanes([[build], [corpus], [probe]], deadline)
        out["build"] = {"rc": build.rc, "wall_s": round(build.wall_s or 0, 1), "parallel_jobs": build.threads,
                        "up_to_date": "building '" not in build.output,
                        "tail": tail(build.output, 3) if build.rc else None}
        found = re.findall(r"^ENV (.+)$", probe.output, re.M)
        self.summary["environment"] = env = json.loads(found[-1]) if found else {"error": tail(probe.output, 3)}
        if not found:
            where = self.opts.wheels or DEFAULT_WHEELS
            return {"status": "failed", **out,
                    "reason": f"torch or megatron-core does not import ({tail(probe.output, 1)}): run "
                              f"scripts/fetch_gpu_wheels.sh where the package index is reachable and carry {where}"}
        if self.mode == "gpu" and not env.get("cuda_available"):
            return {"status": "failed", **out,
                    "reason": "no CUDA device here (torch.cuda.is_available() is False): run with --dry-run"}
        found = re.findall(r"^PREFIX (.+)$", corpus.output, re.M)
        if corpus.rc != 0 or not found:
            return {"status": "failed", "reason": f"the demo corpus did not build: {tail(corpus.output, 2)}", **out}
        self.prefix = found[-1].strip()
        out["corpus"] = {"prefix": self.prefix, "wall_s": round(corpus.wall_s, 1)}
        if build.rc != 0:
            return {"status": "failed", **out,
                    "reason": "the C++ kernels did not build (the runs below use the Python reference planner)"}
        return {"status": "passed", **out}

    def corpus_dir(self) -> str:
        """`--demo-corpus`'s own cache (cache/demo, ignored): built once, safe to share (a file lock)."""
        return os.path.join(REPO, "cache", "demo")

    def install_wheels(self, deadline: float) -> dict:
        """The carried wheels whose distribution this Python lacks (or has in another version
        than PINNED), into a folder put first on the runs' PYTHONPATH."""
        from importlib import metadata

        folder = os.path.join(REPO, self.opts.wheels or DEFAULT_WHEELS)
        wheels = sorted(f for f in os.listdir(folder) if f.endswith(".whl")) if os.path.isdir(folder) else []
        newest: dict[str, tuple[str, str]] = {}
        for w in wheels:  # name-version-...whl; one of each (two versions stop pip)
            name, version = w.split("-")[:2]
            key = re.sub(r"[-_.]+", "-", name).lower()
            if key in PINNED and version != PINNED[key]:
                continue
            if key not in newest or _version_key(version) > _version_key(newest[key][0]):
                newest[key] = (version, w)
        needed, present = [], {}
        for key, (version, w) in sorted(newest.items()):
            try:
                have = metadata.version(key)
            except metadata.PackageNotFoundError:
                have = None
            present[key] = have
            if have is None or (key in PINNED and have != PINNED[key]):
                needed.append(w)
        out = {"folder": os.path.relpath(folder, REPO), "wheels": wheels, "installed_here": present,
               "installed": [], "target": None}
        if not needed:
            out["note"] = "nothing to install" if wheels else "no carried wheels (none needed if everything imports)"
            return out
        self.site = os.path.join(self.work, "site")
        out["target"] = self.site
        files = [os.path.join(folder, w) for w in needed]
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
               "--no-cache-dir", "--disable-pip-version-check", "--target", self.site] + files
        import importlib.util

        if importlib.util.find_spec("pip") is not None:
            job = Job("pip install (offline)", cmd, self.env(), threads=1)
            self.runner.run_lanes([[job]], deadline)
            if job.rc != 0:
                out["error"] = f"pip could not install the carried wheels: {tail(job.output, 3)}"
                return out
            out["method"] = "pip install --no-index --no-deps --target"
        else:  # no pip in this Python: a wheel is a zip laid out as site-packages
            import zipfile

            try:
                for f in files:
                    with zipfile.ZipFile(f) as z:
                        z.extractall(self.site)
            except (OSError, zipfile.BadZipFile) as e:
                out["error"] = f"could not unpack the carried wheels (no pip here): {e}"
                return out
            out["method"] = "unzipped into the target (this Python has no pip)"
        out["installed"] = needed
        return out

    def build_job(self) -> Job:
        """`setup.py build_ext --inplace`, its sources compiled in parallel (pybind11's ParallelCompile)."""
        jobs = max(1, len(self.cores))
        code = ("import runpy, sys\n"
                "try:\n"
                "    from pybind11.setup_helpers import ParallelCompile\n"
                f"    ParallelCompile(default={jobs}).install()\n"
                "except ImportError:\n"
                "    pass\n"
                "sys.argv = ['setup.py', 'build_ext', '--inplace']\n"
                "runpy.run_path('setup.py', run_name='__main__')\n")
        return Job("build_ext --inplace", [sys.executable, "-c", code], self.env(), threads=jobs)

    # -- common flags

    def run_flags(self, name: str, model: Model, micro: int, global_batch: int, iters: int, dtype: str,
                  path: str, loss_log: str, planner: str | None = None) -> list[str]:
        flags = model.flags() + [
            "--data-path", self.prefix, "--tokenizer-type", "ByteLevelTokenizer", "--split", "98,2,0",
            "--reset-position-ids", "--reset-attention-mask",
            "--data-cache-path", os.path.join(self.work, "cache", re.sub(r"\W+", "_", name)),
            "--micro-batch-size", str(micro), "--global-batch-size", str(global_batch),
            "--train-iters", str(iters), "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine",
            "--lr-warmup-iters", "2", "--weight-decay", "0.1", "--clip-grad", "1.0", "--seed", "1234",
            "--log-interval", "1", "--eval-iters", "0", "--dcp-cpu-attention", "flash", "--loss-log", loss_log]
        if dtype == "bf16":
            flags.append("--bf16")
        if path == "dcp":
            flags += ["--dcp", "--dcp-global-batch-tokens", str(global_batch * model.seq), "--dcp-max-seq-len",
                      str(model.seq), "--dcp-split-long-documents"]
            if planner:
                flags += ["--dcp-planner", planner]
        return flags

    # -- (a) and (b)

    def equivalence(self, deadline: float) -> dict:
        s = self.sizes
        configs = [(path, dtype) for path in ("static", "dcp") for dtype in ("fp32", "bf16")]
        paths = {}
        # cores: the device runs get the first ones (two lanes side by side on a machine with 8 cores or
        # more: their start-up is CPU work), the CPU runs share the rest (four lanes there, else one)
        n = len(self.cores)
        n_dev_lanes, n_ref_lanes = (2, 4) if n >= 8 else (1, 1)
        dev_cores = self.cores[:4] if n >= 8 else self.cores[:max(1, n // 2)]
        rest = [c for c in self.cores if c not in dev_cores] or self.cores
        split = lambda cores, k: [cores[i * len(cores) // k:(i + 1) * len(cores) // k] for i in range(k)]  # noqa: E731
        dev_groups, ref_groups = split(dev_cores, n_dev_lanes), split(rest, n_ref_lanes)
        device_lanes = [[] for _ in range(n_dev_lanes)]
        ref_lanes = [[] for _ in range(n_ref_lanes)]
        for i, (path, dtype) in enumerate(configs):
            key = f"{path} {dtype}"
            dev_log = os.path.join(self.work, f"a_{path}_{dtype}_device.jsonl")
            ref_log = os.path.join(self.work, f"a_{path}_{dtype}_cpu.jsonl")
            report = os.path.join(self.work, f"b_{path}_{dtype}_entry.json")
            dev_flags = self.run_flags(f"a {key} device", s.eq_model, s.eq_micro_batch, s.eq_global_batch,
                                       s.eq_iters, dtype, path, dev_log)
            ref_flags = self.run_flags(f"a {key} cpu", s.eq_model, s.eq_micro_batch, s.eq_global_batch,
                                       s.eq_iters, dtype, path, ref_log) + ["--distributed-backend", "gloo"]
            entry = [sys.executable, os.path.join(REPO, "scripts", "gpu_check_entry.py"), "--report", report,
                     "--scan-at", str(s.scan_at)] + (["--static-cpu-init"] if path == "static" else []) + ["--"]
            dev_cores_i = dev_groups[i % n_dev_lanes]
            dev = Job(f"a {key} on the {'GPU' if self.mode == 'gpu' else 'CPU (device stand-in)'}",
                      entry + dev_flags, self.env(), cores=dev_cores_i, threads=len(dev_cores_i))
            ref_cores = ref_groups[i % n_ref_lanes]
            ref = Job(f"a {key} on the CPU", [sys.executable, os.path.join(REPO, "pretrain_gpt_dcp.py")] + ref_flags,
                      self.env(cpu_only=True), cores=ref_cores, threads=len(ref_cores))
            device_lanes[i % n_dev_lanes].append(dev)
            ref_lanes[i % n_ref_lanes].append(ref)
            paths[key] = (dev, ref, dev_log, ref_log)
            self.device_runs[key] = (dev, report)
        self.runner.run_lanes(device_lanes + ref_lanes, deadline)
        runs, failures = {}, []
        for key, (dev, ref, dev_log, ref_log) in paths.items():
            dtype = key.split()[1]
            row = compare_losses(read_loss_log(dev_log), read_loss_log(ref_log), s.eq_iters, TOLERANCES[dtype])
            row.update(device_rc=dev.rc, cpu_rc=ref.rc, device_wall_s=round(dev.wall_s or 0, 1),
                       cpu_wall_s=round(ref.wall_s or 0, 1))
            for job, where in ((dev, "device"), (ref, "cpu")):
                if job.rc != 0:
                    row["passed"] = False
                    row.setdefault("problems", []).append(
                        f"{where} run {'timed out' if job.timed_out else f'exited {job.rc}'}: {tail(job.output, 2)}")
            if not row["passed"]:
                failures.append(key)
            runs[key] = row
        result = {"status": "failed" if failures else "passed", "model": s.eq_model.describe(),
                  "tokens_per_iteration": s.eq_global_batch * s.eq_model.seq, "iterations": s.eq_iters,
                  "tolerances": TOLERANCES,
                  "tolerance_rule": "per logged iteration |loss_device - loss_cpu| / |loss_cpu| <= max_rel, and "
                                    "its mean over the iterations <= mean_rel; every iteration finite and logged "
                                    "by both runs",
                  "device": "cuda" if self.mode == "gpu" else "cpu (dry run: a CPU run against a CPU run)",
                  "cpu_runs": "CUDA_VISIBLE_DEVICES= --distributed-backend gloo, beside the device runs",
                  "init": "the static path's device runs initialise on the CPU (scripts/gpu_check_entry.py "
                          "--static-cpu-init: megatron-core's use_cpu_initialization, then .cuda()), as the CPU "
                          "runs do; --dcp draws its initial values on the CPU on every device",
                  "runs": runs}
        if failures:
            result["reason"] = "outside tolerance or not run: " + ", ".join(failures)
        return result

    def device_and_syncs(self, deadline: float) -> dict:
        if not self.device_runs:
            return {"status": "skipped", "reason": "phase a_equivalence made no device runs"}
        on_gpu = self.mode == "gpu"
        runs, problems = {}, []
        for key, (job, path) in self.device_runs.items():
            if not os.path.exists(path):
                problems.append(f"{key}: no report from scripts/gpu_check_entry.py (rc {job.rc})")
                continue
            with open(path) as f:
                rep = json.load(f)
            scan = rep.get("tensor_scan") or {}
            by_device = scan.get("by_device", {})
            row = {"steps_wrapped": rep.get("steps_wrapped"), "path": rep.get("path"), "device": rep.get("device"),
                   "tensors_by_device": by_device, "cpu_offenders": scan.get("offenders"),
                   "largest_cpu_tensors": scan.get("largest_cpu_tensors"), "scanned_after_step": scan.get("after_step"),
                   "static_cpu_init": rep.get("static_cpu_init")}
            expected_path = key.split()[0]
            if rep.get("steps_wrapped") != self.sizes.eq_iters or rep.get("path") != expected_path:
                problems.append(f"{key}: {rep.get('steps_wrapped')} steps wrapped on the {rep.get('path')} path "
                                f"(expected {self.sizes.eq_iters} on {expected_path})")
            if not scan:
                problems.append(f"{key}: no tensor scan")
            target = "cuda" if on_gpu else "cpu"
            if scan and by_device.get(target, {}).get("parameters", 0) == 0:
                problems.append(f"{key}: no parameter found on {target}")
            if on_gpu and scan.get("offenders"):
                problems.append(f"{key}: CPU tensors that belong on the GPU: "
                                + ", ".join(f"{o['tensor']} x{o['count']}" for o in scan["offenders"][:5]))
            syncs = rep.get("syncs")
            if on_gpu:
                if not syncs:
                    problems.append(f"{key}: no sync count ({rep.get('sync_counting_reason')})")
                else:
                    steps = syncs["steps"]
                    row["syncs_per_step"] = [{"step": st["step"], "in_step": st["in_step"],
                                              "after_step": st["after_step"]} for st in steps]
                    row["syncs_median_in_step_after_first"] = syncs["median_in_step_after_first"]
                    row["syncs_max_in_step"] = syncs["max_in_step"]
                    n = max(1, len(steps))
                    row["sites_per_step"] = {site: round(c / n, 2) for site, c in list(syncs["by_site"].items())[:15]}
                    row["first_step_sites"] = steps[0]["sites"] if steps else {}
                    if steps and any(st["in_step"] + st["after_step"] == 0 for st in steps):
                        problems.append(f"{key}: a step with no sync at all (its loss reaches the host every "
                                        f"step): the warning capture is broken")
            runs[key] = row
        result = {"runs": runs, "measured_in": "phase a_equivalence's device runs (scripts/gpu_check_entry.py)",
                  "sync_rule": "torch.cuda.set_sync_debug_mode('warn') from the first step on; each warning "
                               "counted by step and by call site (first frame outside torch); syncs of the "
                               "backward pass surface at its backward() call; no limit is asserted",
                  "tensor_rule": f"every tensor gc reaches, after step {self.sizes.scan_at}; offenders: CPU "
                                 "tensors that are parameters, require grad, or are floating point with >= 65536 "
                                 "elements and not pinned (scripts/gpu_check_entry.py OFFENDER_MIN_NUMEL)"}
        if problems:
            return {"status": "failed", "reason": "; ".join(problems[:6]), **result}
        if not on_gpu:
            return {"status": "skipped", **result,
                    "reason": "no CUDA: host syncs cannot be counted (torch.cuda.set_sync_debug_mode needs a GPU; "
                              "the CPU is always synchronous); the step wrapper and the tensor scan ran and passed"}
        return {"status": "passed", **result}

    # -- (c)

    def speed(self, deadline: float) -> dict:
        s = self.sizes
        m = s.speed_model
        tokens = s.speed_global_batch * m.seq
        jobs = {}
        order = []
        for path in ("static", "dcp"):
            log = os.path.join(self.work, f"c_{path}.jsonl")
            flags = self.run_flags(f"c {path}", m, s.speed_micro_batch, s.speed_global_batch, s.speed_iters, "bf16",
                                   path, log, planner="static" if path == "dcp" else None)
            flags += ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1",
                      "--context-parallel-size", "1"]
            job = Job(f"c {'megatron-core static path' if path == 'static' else '--dcp --dcp-planner static'}",
                      [sys.executable, os.path.join(REPO, "pretrain_gpt_dcp.py")] + flags, self.env(),
                      cores=self.cores, threads=len(self.cores))
            jobs[path] = (job, log)
            order.append(job)
        self.runner.run_lanes([order], deadline)  # one after the other: nothing else runs meanwhile
        rows, problems = {}, []
        for path, (job, log) in jobs.items():
            times = iteration_times(job.output)
            records = read_loss_log(log)
            per_iter = {r["iteration"]: (r.get("tokens") or tokens) for r in records}
            if job.rc != 0 or len(times) < s.speed_iters:
                problems.append(f"{path}: {'timed out' if job.timed_out else f'rc {job.rc}'}, {len(times)} of "
                                f"{s.speed_iters} iterations logged: {tail(job.output, 2)}")
            timed = [i for i in sorted(times) if i > s.speed_warmup]
            seconds = sum(times[i] for i in timed)
            timed_tokens = sum(per_iter.get(i, tokens) for i in timed)
            all_tokens = sum(per_iter.get(i, tokens) for i in sorted(times))
            rows[path] = {"rc": job.rc, "wall_s": round(job.wall_s or 0, 2), "iterations": len(times),
                          "timed_iterations": len(timed), "tokens_per_iteration": (
                              all_tokens / len(times) if times else None),
                          "steady_tokens_per_s": timed_tokens / seconds if seconds > 0 else None,
                          "wall_tokens_per_s": all_tokens / job.wall_s if job.wall_s and times else None,
                          "median_iteration_s": sorted(times[i] for i in timed)[len(timed) // 2] if timed else None}
        a, b = rows.get("static", {}), rows.get("dcp", {})
        ratio = lambda k: (b[k] / a[k]) if a.get(k) and b.get(k) else None  # noqa: E731
        result = {"model": m.describe(), "dtype": "bf16", "layout": "TP1 PP1 CP1, one device",
                  "iterations": s.speed_iters, "warmup_iterations_excluded": s.speed_warmup,
                  "static": rows.get("static"), "dcp_static_planner": rows.get("dcp"),
                  "ratio_dcp_over_static_steady": ratio("steady_tokens_per_s"),
                  "ratio_dcp_over_static_wall": ratio("wall_tokens_per_s"),
                  "same": f"the model, bf16, TP1 on one device, the data (the demo corpus), --dcp-cpu-attention "
                          f"flash (the same per-document SDPA call: the static path's --reset-attention-mask "
                          f"batches are packed THD as well), {tokens} tokens per iteration asked for",
                  "differs": [f"the static path trains --global-batch-size {s.speed_global_batch} x --seq-length "
                              f"{m.seq} = {tokens} tokens of documents concatenated and cut at {m.seq} "
                              f"(micro-batches of {s.speed_micro_batch}); --dcp takes whole documents (longer ones "
                              f"split at {m.seq}) until --dcp-global-batch-tokens {tokens} would be exceeded, so "
                              f"its iterations hold slightly fewer tokens (tokens/s counts each run's own)",
                              "--dcp packs micro-batches by its cost model's memory plan (fewer, larger ones) and "
                              "moves parameters and gradients between its fixed sharding and the layout; the "
                              "static path runs megatron-core's DDP and optimizer",
                              "steady tokens/s leave out the first warm-up iterations; wall tokens/s divide every "
                              "iteration's tokens by the whole command's wall clock (start-up included)"],
                  "rule": "no threshold: speed is reported, never asserted"}
        if problems:
            return {"status": "failed", "reason": "; ".join(problems), **result}
        return {"status": "passed", **result}

    # -- (d)

    def memory(self, deadline: float) -> dict:
        if self.mode != "gpu":
            return {"status": "skipped", "reason": "needs CUDA: peaks are torch.cuda.max_memory_allocated"}
        model = MEMORY_MODEL
        table = os.path.join(self.work, "d_memory.json")
        flags = model.flags() + ["--bf16", "--data-path", self.prefix, "--tokenizer-type", "ByteLevelTokenizer",
                                      "--split", "98,2,0", "--reset-position-ids", "--reset-attention-mask",
                                      "--micro-batch-size", "1", "--global-batch-size", "1", "--train-iters", "1",
                                      "--lr", "1e-3", "--dcp-cpu-attention", "flash", "--json", table]
        job = Job("d scripts/gpu_memory_check.py", [sys.executable, os.path.join(REPO, "scripts",
                                                                                   "gpu_memory_check.py")] + flags,
                  self.env(), cores=self.cores, threads=len(self.cores))
        self.runner.run_lanes([[job]], deadline)
        data = None
        if os.path.exists(table):
            with open(table) as f:
                data = json.load(f)
        result = {"model": model.describe(), "table": data, "rc": job.rc, "wall_s": round(job.wall_s or 0, 1),
                  "rule": "every prediction within the script's goal (relative error of the peak and of the "
                          "persistent bytes)"}
        if job.rc != 0 or not data or not data.get("passed"):
            why = "timed out" if job.timed_out else (f"worst error {data['worst_error']:.1%} over the goal"
                                                     if data and "worst_error" in data else
                                                     f"rc {job.rc}: {tail(job.output, 2)}")
            return {"status": "failed", "reason": why, **result}
        return {"status": "passed", **result}

    # -- (e)

    def gpu_tests(self, deadline: float) -> dict:
        """The suite's gpu-marked tests (skipped without CUDA there too)."""
        if self.mode != "gpu":
            return {"status": "skipped", "reason": "needs CUDA: the gpu-marked tests skip without it"}
        files = []
        for folder, _, names in sorted(os.walk(os.path.join(REPO, "tests"))):
            for name in sorted(names):
                if name.startswith("test_") and name.endswith(".py"):
                    with open(os.path.join(folder, name)) as f:
                        if "pytest.mark.gpu" in f.read():
                            files.append(os.path.relpath(os.path.join(folder, name), REPO))
        if not files:
            return {"status": "skipped", "reason": "no test file has a gpu mark"}
        job = Job("e pytest -m gpu", [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider"]
                  + files, self.env(), cores=self.cores, threads=len(self.cores))
        self.runner.run_lanes([[job]], deadline)
        counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected)", job.output)}
        result = {"files": files, "counts": counts, "rc": job.rc, "wall_s": round(job.wall_s or 0, 1),
                  "tail": tail(job.output, 4)}
        if job.rc == 5:
            return {"status": "skipped", "reason": "pytest collected no gpu-marked test", **result}
        if job.rc != 0:
            return {"status": "failed", "reason": "timed out" if job.timed_out else f"pytest exited {job.rc}",
                    **result}
        return {"status": "passed", **result}

    # -- all

    def run(self) -> int:
        say(f"mode {self.mode}; summary {self.summary_path}; log {self.log_path}; budget "
            f"{self.deadline - self.t0:.0f} s")
        setup = self.run_phase("setup", self.setup)
        if self.prefix is not None and setup["status"] != "skipped":
            self.run_phase("a_equivalence", self.equivalence)
            self.run_phase("b_device_and_syncs", self.device_and_syncs)
            self.run_phase("c_speed", self.speed)
            self.run_phase("d_memory", self.memory)
            self.run_phase("e_gpu_tests", self.gpu_tests)
        else:
            for p in PHASES[1:]:
                self.summary["phases"][p] = {"status": "skipped", "reason": "setup failed"}
        statuses = {p: r["status"] for p, r in self.summary["phases"].items()}
        self.summary["passed"] = "failed" not in statuses.values()
        self.write()
        if not self.opts.keep_work and not self.opts.work:
            shutil.rmtree(self.work, ignore_errors=True)
        say(" ".join(f"{p}={st}" for p, st in statuses.items()))
        say(f"{'PASS' if self.summary['passed'] else 'FAIL'} in {self.summary['elapsed_s']:.0f} s; "
            f"summary: {self.summary_path}")
        return 0 if self.summary["passed"] else 1


def _version_key(version: str) -> tuple:
    return tuple(int(p) if p.isdigit() else -1 for p in re.split(r"[.+-]", version))


def compare_losses(device: list[dict], cpu: list[dict], iterations: int, tol: dict) -> dict:
    """Per-iteration relative differences of 'lm loss' between two loss logs."""
    d = {r["iteration"]: r["lm loss"] for r in device}
    c = {r["iteration"]: r["lm loss"] for r in cpu}
    common = sorted(set(d) & set(c))
    rel = [abs(d[i] - c[i]) / max(abs(c[i]), 1e-12) for i in common
           if math.isfinite(d[i]) and math.isfinite(c[i])]
    complete = len(common) == iterations == len(rel)
    max_rel = max(rel) if rel else None
    mean_rel = sum(rel) / len(rel) if rel else None
    passed = bool(complete and max_rel is not None and max_rel <= tol["max_rel"] and mean_rel <= tol["mean_rel"])
    row = {"passed": passed, "iterations_compared": len(rel), "max_rel_diff": max_rel, "mean_rel_diff": mean_rel,
           "first_rel_diff": rel[0] if rel else None, "last_rel_diff": rel[-1] if rel else None,
           "device_losses": [d[i] for i in sorted(d)], "cpu_losses": [c[i] for i in sorted(c)]}
    if not complete:
        row["problems"] = [f"{len(d)} device and {len(c)} CPU iterations logged, {len(rel)} finite in common, "
                           f"{iterations} expected"]
    return row


def parse_cli(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="the same phases on the CPU at tiny sizes")
    ap.add_argument("--out", default=os.environ.get("OUT") or os.path.join(REPO, ".gpu_check", "out"),
                    help="where the summary JSON and the log go (default $OUT, else .gpu_check/out)")
    ap.add_argument("--wheels", default=None, help=f"carried wheels, relative to the repository (default "
                                                   f"{DEFAULT_WHEELS})")
    ap.add_argument("--work", default=None, help="scratch folder (default: a new temporary one, removed at the end)")
    ap.add_argument("--keep-work", action="store_true", help="keep the temporary scratch folder")
    ap.add_argument("--budget-s", type=float, default=None, help="the whole run's time limit")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    return Check(parse_cli(argv)).run()


if __name__ == "__main__":
    sys.exit(main())
