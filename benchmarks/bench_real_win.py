"""Megatron-core's best static layout vs `--dcp` adaptive on this machine, side by side in one run.

Same model (the CPU demo's, examples/cpu_demo.yaml: 4 layers, hidden 128, 8 heads in 4 query
groups, ffn 352, SwiGLU, RMSNorm, RoPE, fp32), same data, same tokens (8192 per iteration: the static path's 4 samples of --seq-length
2048, documents concatenated with --reset-attention-mask --reset-position-ids; --dcp's
8192-token global batches of documents up to 2048 tokens, longer ones split by
--dcp-split-long-documents, so both paths train every token) and the same per-device budget
(--dcp-device-memory 256MB unless --budget), on 4 gloo ranks.

Data: by default a long-tailed corpus the way real ones are (benchmarks/long_tail_corpus.py:
the document lengths of ../shared/data/lengths/text_reuters21578_cl100k.txt, news, median 154
tokens, p99 993, max 5,651, filled with the demo corpus's bytes, byte-level tokens; --lengths
names another shipped file); or any `.bin/.idx` with `--data-path PREFIX` and the tokenizer's
flags (`--tokenizer-type`, `--tokenizer-model`, `--vocab-file`, `--merge-file`).

Best static is searched over every layout of the ranks (tp, cp, pp with tp*cp*pp dividing
them, DP the rest; --sequence-parallel with tp > 1, --use-distributed-optimizer as the demo),
with and without full recompute (--recompute-granularity full --recompute-method uniform
--recompute-num-layers 1) and every micro-batch size that divides the replica's batch:
  1. pruned where the cost model puts the peak beyond twice the budget (CostModel.replica_peak_bytes,
     every sample holding one 2048-token document: the most a sample can hold; it over-predicts
     the static path, whose masked attention at cp 1 runs torch's flash kernel, so the measured
     peak decides the rest);
  2. a recompute variant waits while the same layout and micro-batch size fits without
     recompute (recompute only costs time); it runs when that one's measured peak exceeds
     the budget;
  3. the rest run in the order of the cost model's iteration time, at most --static-runs;
  4. a run whose measured peak (its `> peak device memory per rank` line) exceeds the budget
     is dropped; the fastest survivor is best static.
Then `--dcp` (the adaptive planner) with the same budget, once per `--dcp-cpu-attention` kernel
(default both: math, the demo's, whose probabilities make a long document need CP, TP or
recompute under the budget; flash, torch's CPU flash kernel, linear memory, the kernel
megatron-core's masked attention runs at cp 1).

Table: each run's layout, tokens/s over the iterations after the first --warmup (from the log
lines' elapsed time) and over the whole command's wall clock, peak memory per rank (the report
line, and each worker's VmHWM read from outside), within budget, and dcp / best static.
Results: benchmarks/results/real_win.json and real_win.png (tokens/s and peaks per run).

    python benchmarks/bench_real_win.py             # 10 static runs (fallbacks included) + dcp, 6 iterations,
                                                    # then the fixed-layout pairs (bench_fixed_layout.py)
    python benchmarks/bench_real_win.py --quick     # 3 static runs + dcp, 5 iterations, no fixed-layout pairs
    python benchmarks/bench_real_win.py --data-path /data/my_text_document --tokenizer-type GPT2BPETokenizer \
        --vocab-file gpt2-vocab.json --merge-file gpt2-merges.txt

A run takes 55-90 s on 2 shared cores (~25-40 s to start 4 ranks, 4-15 s an iteration);
times on a loaded machine move with the load, memory does not.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_fixed_layout as fixed_layout  # noqa: E402
from bench_fixed_layout import Busy  # noqa: E402
from machine import describe  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
DEMO = os.path.join(REPO, "examples", "cpu_demo.yaml")
RESULTS = os.path.join(REPO, "benchmarks", "results")
MiB = 2**20
# The cost model over-predicts the static path (measured: tp1 cp4 234 MiB predicted, 146 MiB
# measured; at cp 1 megatron-core's masked attention runs torch's flash kernel with a float
# mask where the model charges our math kernel's probabilities): prune only what it puts
# beyond twice the budget, and let the measured peak decide the rest.
PRUNE_SLACK = 2.0
TOKENIZER_FLAGS = ("--tokenizer-type", "--tokenizer-model", "--vocab-file", "--merge-file")
RECOMPUTE = ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
ITERATION = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?elapsed time per iteration \(ms\): ([\d.]+) \|"
                       r".*?lm loss: ([-+.\dEeinfa]+) \|(?:.*?layout: ([^|]+)\|)?(?:.*?\| tokens: (\d+) \|)?")
ERROR = re.compile(r"^(?:\[rank \d+\] )?error: .*$", re.M)


class BenchError(Exception):
    """Bad input or a missing flag: one line, exit 2."""


class OneLineParser(argparse.ArgumentParser):
    def error(self, message):
        raise BenchError(f"{message} (see {os.path.basename(sys.argv[0])} --help)")


def missing_flags(flags: list[str]) -> list[str]:
    """The flags of `flags` this branch's pretrain_gpt_dcp.py does not define."""
    from megatron.training.arguments import build_parser

    known = build_parser()._option_string_actions
    return [f for f in flags if f not in known]


def require_flags(flags: list[str], what: str) -> None:
    missing = missing_flags(flags)
    if missing:
        raise BenchError(f"{', '.join(missing)} not on this branch's pretrain_gpt_dcp.py, which {what} needs: "
                         "merge the branch that adds it first")


@dataclass(frozen=True)
class Config:
    """One static launch: layout, micro-batch size, full recompute or not."""

    tp: int
    cp: int
    pp: int
    mbs: int
    recompute: bool
    world: int = 4

    @property
    def dp(self) -> int:
        return self.world // (self.tp * self.cp * self.pp)

    @property
    def label(self) -> str:
        return f"tp{self.tp} cp{self.cp} pp{self.pp} dp{self.dp} mbs{self.mbs}" + (" +recompute" if self.recompute else "")


def static_configs(world: int, samples: int) -> list[Config]:
    """Every (tp, cp, pp) with tp*cp*pp | world, recompute or not, micro-batch sizes dividing the replica's batch."""
    divisors = [d for d in range(1, world + 1) if world % d == 0]
    out = []
    for tp, cp, pp in itertools.product(divisors, repeat=3):
        if world % (tp * cp * pp):
            continue
        dp = world // (tp * cp * pp)
        if samples % dp:
            continue
        per_replica = samples // dp
        for mbs in (m for m in range(1, per_replica + 1) if per_replica % m == 0):
            for recompute in (False, True):
                out.append(Config(tp, cp, pp, mbs, recompute, world))
    return out


def resolve_data(args) -> None:
    """args.data_flags (for every run), args.vocab_size and args.data_line (what the table says)."""
    import numpy as np

    from dcp_ext.data.indexed import IndexedDocuments
    from dcp_ext.data.tokenizers import build_tokenizer

    if args.data_path is None:
        from long_tail_corpus import DEFAULT_LENGTHS, ensure_long_tail_corpus

        name = args.lengths or DEFAULT_LENGTHS
        try:
            prefix = ensure_long_tail_corpus(os.path.join(REPO, "cache"), name)
        except FileNotFoundError as e:
            raise BenchError(str(e)) from None
        args.data_flags = ["--data-path", prefix, "--tokenizer-type", "ByteLevelTokenizer"]
        what = f"the long-tailed corpus (lengths of {os.path.basename(name)}, the demo corpus's bytes, byte-level)"
        tokenizer = build_tokenizer("ByteLevelTokenizer")
    else:
        prefix = args.data_path
        if not (os.path.isfile(prefix + ".bin") and os.path.isfile(prefix + ".idx")):
            raise BenchError(f"--data-path {prefix}: no {prefix}.bin/.idx (give the prefix, without the suffix)")
        kv = {f: getattr(args, f[2:].replace("-", "_")) for f in TOKENIZER_FLAGS}
        args.data_flags = ["--data-path", prefix] + [x for f, v in kv.items() if v for x in (f, v)]
        what = f"--data-path {prefix}"
        try:
            tokenizer = build_tokenizer(kv["--tokenizer-type"] or "ByteLevelTokenizer", kv["--vocab-file"],
                                        kv["--merge-file"], kv["--tokenizer-model"])
        except Exception as e:  # the tokenizer's own one-line error
            raise BenchError(f"tokenizer: {e}") from None
    args.vocab_size = tokenizer.vocab_size
    lengths = np.asarray(IndexedDocuments(prefix).lengths, dtype=np.int64)
    q = np.percentile(lengths, [50, 99]) if len(lengths) else [0, 0]
    args.data_line = (f"data: {what}: {len(lengths):,} documents, median {q[0]:.0f} tokens, p99 {q[1]:.0f}, "
                      f"max {lengths.max() if len(lengths) else 0:,}; documents split at {args.seq_length} tokens")


def common_flags(args) -> list[str]:
    return ["--yaml-cfg", DEMO, "--seq-length", str(args.seq_length), "--max-position-embeddings",
            str(args.seq_length), "--train-iters", str(args.iters), "--lr-decay-iters", "60", "--log-interval", "1",
            "--eval-iters", "0", "--data-cache-path", os.path.join(REPO, "cache"), "--dcp-device-memory",
            str(args.budget)] + list(args.data_flags)


def static_flags(c: Config, args) -> list[str]:
    return common_flags(args) + [
        "--tensor-model-parallel-size", str(c.tp), "--context-parallel-size", str(c.cp),
        "--pipeline-model-parallel-size", str(c.pp), "--micro-batch-size", str(c.mbs),
        "--global-batch-size", str(args.tokens // args.seq_length)] + (
        ["--sequence-parallel"] if c.tp > 1 else []) + (RECOMPUTE if c.recompute else [])


def dcp_flags(args) -> list[str]:
    return common_flags(args) + ["--dcp", "--dcp-max-seq-len", str(args.seq_length), "--dcp-global-batch-tokens",
                                 str(args.tokens), "--dcp-split-long-documents"]


def predict(c: Config, args) -> tuple[float, float] | str:
    """(peak bytes, iteration seconds) by the cost model, every sample one seq-length document;
    a line saying why when the launch line itself is invalid."""
    from dcp_ext.data.tokenizers import padded_vocab_size
    from dcp_ext.planning.cost_model import CostModel
    from dcp_ext.planning.layout import Layout
    from dcp_ext.planning.specs import ClusterSpec, ModelSpec
    from megatron.training.arguments import ArgumentError, parse_args

    try:
        a = parse_args(static_flags(c, args), world_size=c.world)
    except ArgumentError as e:
        return f"invalid launch line: {e}"
    a.padded_vocab_size = padded_vocab_size(args.vocab_size, a.make_vocab_size_divisible_by, c.tp)
    cluster = ClusterSpec.cpu_gloo(c.world).with_(memory_bytes=float(args.budget_bytes), reserved_bytes=0.0)
    cm = CostModel(ModelSpec.from_megatron_args(a), cluster, memory_margin=0.0)
    lay = Layout(c.tp, c.cp, c.pp)
    if not cm.layout_valid(lay):
        return "the model does not split this way (heads, query groups or layers)"
    k = args.tokens // args.seq_length // c.dp // c.mbs
    rs = cm.layers_per_stage(lay) if c.recompute else 0
    docs = [args.seq_length] * c.mbs
    peak = cm.replica_peak_bytes(lay, [float(sum(docs))] * k, [rs] * k, [docs] * k)
    return peak, (k + c.pp - 1) * cm.mb_stage_time(docs, lay, rs)


@dataclass
class Candidate:
    config: Config
    predicted_peak: float | None = None
    predicted_s: float | None = None
    verdict: str = ""  # why it did not run, or "ran"


def plan_static(args) -> list[Candidate]:
    """Every static config with the cost model's verdict; the runnable ones first, fastest predicted first."""
    cands = []
    for c in static_configs(args.nproc, args.tokens // args.seq_length):
        got = predict(c, args)
        cand = Candidate(c)
        if isinstance(got, str):
            cand.verdict = got
        else:
            cand.predicted_peak, cand.predicted_s = got
            if cand.predicted_peak > PRUNE_SLACK * args.budget_bytes:
                cand.verdict = f"cost model: peak {cand.predicted_peak / MiB:.0f} MiB > {PRUNE_SLACK:g}x the budget"
        cands.append(cand)
    fits = {(c.config.tp, c.config.cp, c.config.pp, c.config.mbs) for c in cands
            if not c.verdict and not c.config.recompute}
    for cand in cands:
        c = cand.config
        if not cand.verdict and c.recompute and (c.tp, c.cp, c.pp, c.mbs) in fits:
            cand.verdict = "held back: fits without recompute"
    return sorted(cands, key=lambda x: (bool(x.verdict), x.predicted_s if x.predicted_s is not None else 1e9))


@dataclass
class Run:
    name: str
    flags: list[str]
    rc: int = 0
    wall_s: float = 0.0
    iterations: list[dict] = field(default_factory=list)
    memory: dict | None = None  # the report line, parsed
    vmhwm_gb: dict = field(default_factory=dict)  # rank -> GB, read from outside
    error: str | None = None
    text: str = ""  # the run's stdout and stderr


def launch(name: str, flags: list[str], nproc: int, work: str, timeout: float, note: str = "") -> Run:
    """One torchrun of pretrain_gpt_dcp.py: its log lines, memory line, per-rank VmHWM (outside), wall clock."""
    from bench_memory import descendants, worker_rank
    from dcp_ext.runtime.device_memory import peak_rss_bytes
    from megatron.training.memory_report import parse_memory_line

    run = Run(name, flags)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           os.path.join(REPO, "pretrain_gpt_dcp.py")] + flags
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", PYTHONPATH=REPO)
    print(f"  {note}{name}: running ...", file=sys.stderr, flush=True)
    out_path = os.path.join(work, re.sub(r"\W+", "_", name) + ".out")
    t0 = last_note = time.perf_counter()
    with open(out_path, "w+") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            while proc.poll() is None:
                for pid in descendants(proc.pid):
                    rank = worker_rank(pid)
                    peak = peak_rss_bytes(pid) if rank is not None else None
                    if peak is not None:
                        run.vmhwm_gb[rank] = max(run.vmhwm_gb.get(rank, 0.0), peak / 1e9)
                now = time.perf_counter()
                if now - t0 > timeout:
                    run.error = f"still running after {timeout:.0f} s (killed; raise --run-timeout)"
                    break
                if now - last_note > 20:
                    last_note = now
                    out.flush()
                    seen = parse_iterations(open(out_path).read())
                    at = f"iteration {seen[-1]['iteration']}" if seen else "starting"
                    print(f"    {now - t0:4.0f} s, {at}", file=sys.stderr, flush=True)
                time.sleep(0.25)
        finally:
            stop(proc)
        run.wall_s = time.perf_counter() - t0
        out.seek(0)
        text = out.read()
    run.rc = proc.returncode if proc.returncode is not None else -9
    run.text = text
    run.iterations = parse_iterations(text)
    run.memory = parse_memory_line(text)
    if run.error is None and run.rc != 0:
        errors = ERROR.findall(text)
        run.error = errors[0][:300] if errors else f"exit {run.rc}: {text.strip().splitlines()[-1][:300] if text.strip() else ''}"
    return run


def stop(proc: subprocess.Popen) -> None:
    """SIGKILL what this launch started, by pid (torchrun puts its workers in sessions of their own)."""
    import signal

    from bench_memory import descendants

    for pid in descendants(proc.pid) if proc.poll() is None else []:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def parse_iterations(text: str) -> list[dict]:
    """Megatron's iteration lines (--log-interval 1): iteration, elapsed s, loss, and under --dcp layout and tokens."""
    out = []
    for m in ITERATION.finditer(text):
        out.append({"iteration": int(m.group(1)), "elapsed_s": float(m.group(2)) / 1000.0,
                    "loss": float(m.group(3)), "layout": (m.group(4) or "").strip() or None,
                    "tokens": int(m.group(5)) if m.group(5) else None})
    return out


def throughput(run: Run, warmup: int, tokens_per_static_iteration: int) -> dict:
    """tokens/s after the first `warmup` iterations (log lines' elapsed time) and over the wall clock."""
    its = run.iterations
    tok = [it["tokens"] if it["tokens"] is not None else tokens_per_static_iteration for it in its]
    steady = list(zip(its, tok))[warmup:]
    seconds = sum(it["elapsed_s"] for it, _ in steady)
    return {"steady_tokens_per_s": sum(t for _, t in steady) / seconds if steady and seconds > 0 else None,
            "wall_tokens_per_s": sum(tok) / run.wall_s if its and run.wall_s > 0 else None,
            "timed_iterations": len(steady), "tokens": sum(tok),
            "tokens_per_iteration": sum(tok) / len(tok) if tok else None}


def within(run: Run) -> bool | None:
    return None if run.memory is None or run.memory["within"] is None else run.memory["within"]


def dcp_layouts(run: Run) -> str:
    counts: dict[str, int] = {}
    for it in run.iterations:
        lay = (it["layout"] or "").split(" | ")[0].replace("layout: ", "") if it["layout"] else "?"
        counts[lay] = counts.get(lay, 0) + 1
    return ", ".join(f"{k} x{v}" for k, v in counts.items()) or "-"


def run_static(cands: list[Candidate], args, work: str) -> list[tuple[Candidate, Run]]:
    """Runnable candidates in order, at most --static-runs; an over-budget run lets its recompute variant in first."""
    queue = [c for c in cands if not c.verdict]
    waiting = {c.config: c for c in cands if c.verdict.startswith("held back")}
    done: list[tuple[Candidate, Run]] = []
    while queue and len(done) < args.static_runs:
        cand = queue.pop(0)
        c = cand.config
        run = launch(f"static {c.label}", static_flags(c, args), args.nproc, work, args.run_timeout,
                     note=f"[{len(done) + 1}/{min(args.static_runs, len(done) + 1 + len(queue))}] ")
        cand.verdict = "ran"
        done.append((cand, run))
        report(run, args)
        if within(run) is False:
            alt = waiting.pop(Config(c.tp, c.cp, c.pp, c.mbs, True, c.world), None) if not c.recompute else None
            if alt is not None:
                alt.verdict = ""
                queue.insert(0, alt)
    for cand in queue:
        cand.verdict = f"--static-runs {args.static_runs} reached (predicted slower, or a fallback queued last)"
    return done


def report(run: Run, args) -> None:
    t = throughput(run, args.warmup, args.tokens)
    mem = run.memory
    peak = f"peak {max(mem['peaks_mib'])} MiB ({'within' if mem['within'] else 'over budget'})" if mem else "no memory line"
    speed = f"{t['steady_tokens_per_s']:.0f} tokens/s" if t["steady_tokens_per_s"] else "no timed iterations"
    state = f"failed: {run.error}" if run.error else f"{speed}, {peak}"
    print(f"    done in {run.wall_s:.0f} s: {state}", file=sys.stderr, flush=True)


def row(name: str, layout: str, run: Run, args, predicted_peak: float | None = None) -> dict:
    t = throughput(run, args.warmup, args.tokens)
    return {"run": name, "layout": layout, **t, "wall_s": run.wall_s,
            "predicted_peak_mib": None if predicted_peak is None else predicted_peak / MiB,
            "peaks_mib": run.memory["peaks_mib"] if run.memory else None, "what": run.memory["what"] if run.memory else None,
            "vmhwm_gb": [run.vmhwm_gb[r] for r in sorted(run.vmhwm_gb)], "within_budget": within(run),
            "last_loss": run.iterations[-1]["loss"] if run.iterations else None, "error": run.error,
            "iterations": run.iterations}


def fmt(x, spec):
    """format(x, spec), or a dash as wide as the spec asks for."""
    width = re.match(r"\d*", spec).group(0)
    return "-".rjust(int(width) if width else 0) if x is None else format(x, spec)


def not_run(cands: list[Candidate]) -> dict[str, list[str]]:
    """The configs that did not run, grouped by why (the cost model's peak in MiB after each pruned one)."""
    groups: dict[str, list[str]] = {}
    for cand in cands:
        if cand.verdict == "ran":
            continue
        reason = cand.verdict.split(":")[0] if cand.verdict.startswith("cost model") else cand.verdict
        if reason == "cost model":
            reason = "cost model: peak over the budget (its MiB)"
        short = cand.config.label.replace(" pp", "pp").replace(" cp", "cp").replace(" +recompute", " +rc")
        extra = f" ({cand.predicted_peak / MiB:.0f})" if reason.startswith("cost model") else ""
        groups.setdefault(reason, []).append(short + extra)
    return groups


def print_table(rows: list[dict], best: dict | None, args) -> None:
    print(f"{'run':6s} {'layout':34s} {'tok/it':>6s} {'tok/s':>7s} {'tok/s wall':>10s} {'wall s':>7s} {'peak MiB per rank':>18s} "
          f"{'(cost model)':>12s} {'VmHWM GB per rank':>20s} {'within':>7s}")
    for r in rows:
        peaks = " ".join(map(str, r["peaks_mib"])) if r["peaks_mib"] else "-"
        hwm = " ".join(f"{v:.2f}" for v in r["vmhwm_gb"]) or "-"
        ok = {True: "yes", False: "no", None: "?"}[r["within_budget"]]
        mark = " <- best static" if best is not None and r is best else ""
        if r["error"]:
            print(f"{r['run']:6s} {r['layout']:34s} failed: {r['error']}")
            continue
        print(f"{r['run']:6s} {r['layout']:34s} {fmt(r['tokens_per_iteration'], '6.0f')} "
              f"{fmt(r['steady_tokens_per_s'], '7.0f')} {fmt(r['wall_tokens_per_s'], '10.0f')} "
              f"{r['wall_s']:7.0f} {peaks:>18s} {fmt(r['predicted_peak_mib'], '12.0f')} {hwm:>20s} {ok:>7s}  "
              f"{mark}")


def plot(rows: list[dict], best: dict | None, budget_mib: float, path: str) -> None:
    """Two panels per run: tokens/s after warm-up, and the largest rank's measured peak against the budget."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [r for r in rows if not r["error"] and r["steady_tokens_per_s"]]
    if not shown:
        return
    names = [("dcp adaptive\n" + r["layout"]) if r["run"] == "dcp" else r["layout"] for r in shown]
    colors = ["tab:orange" if r["run"] == "dcp" else "tab:blue" for r in shown]
    hatches = ["//" if r["within_budget"] is False else "" for r in shown]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 0.55 * len(shown) + 2), sharey=True)
    speeds = [r["steady_tokens_per_s"] for r in shown]
    peaks = [max(r["peaks_mib"]) if r["peaks_mib"] else 0 for r in shown]
    for ax, values in ((ax1, speeds), (ax2, peaks)):
        bars = ax.barh(names, values, color=colors, edgecolor="black")
        for bar, hatch in zip(bars, hatches):
            bar.set_hatch(hatch)
    for i, r in enumerate(shown):
        ax1.text(speeds[i], i, f" {speeds[i]:.0f}" + (" (best static)" if r is best else ""), va="center", fontsize=8)
    ax1.set_xlim(0, max(speeds) * 1.35)
    ax1.set_xlabel("tokens/s (after the warm-up iterations)")
    ax1.invert_yaxis()
    ax2.axvline(budget_mib, color="red", linestyle="--", label=f"budget {budget_mib:.0f} MiB")
    ax2.set_xlabel("largest rank's peak (MiB, the run's memory line)")
    ax2.legend(loc="upper center", bbox_to_anchor=(0.5, -0.25 if len(shown) < 6 else -0.12), frameon=False)
    fig.suptitle("megatron-core static layouts (blue) vs --dcp adaptive (orange); hatched: over the budget")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_cli(argv):
    from megatron.training.arguments import memory_size

    ap = OneLineParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget", default="256MB", help="per-device memory budget (--dcp-device-memory), e.g. 256MB")
    ap.add_argument("--iters", type=int, default=None, help="iterations per run (default 5, --quick 4)")
    ap.add_argument("--warmup", type=int, default=2, help="iterations left out of tokens/s")
    ap.add_argument("--static-runs", type=int, default=None, help="static runs at most (default 10, --quick 3)")
    ap.add_argument("--quick", action="store_true", help="fewer static runs and iterations (a smoke run)")
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--seq-length", type=int, default=2048)
    ap.add_argument("--tokens", type=int, default=8192, help="tokens per iteration (global batch)")
    ap.add_argument("--run-timeout", type=float, default=420.0, help="seconds before a run is killed")
    ap.add_argument("--data-path", default=None, help="a .bin/.idx prefix (default: the long-tailed corpus)")
    ap.add_argument("--lengths", default=None, help="the default corpus's length file (../shared/data/lengths/)")
    for flag in TOKENIZER_FLAGS:
        ap.add_argument(flag, default=None, help="with --data-path: as pretrain_gpt_dcp.py")
    ap.add_argument("--fixed-pairs", type=int, default=None,
                    help="A B pairs of the fixed-layout comparison per layout (default 1, --quick 0)")
    ap.add_argument("--dcp-cpu-attention", nargs="+", choices=["math", "flash"], default=["math", "flash"],
                    help="--dcp's document attention kernel(s), one adaptive run each (default both: math, the "
                         "demo's, whose probabilities make long documents need CP, TP or recompute under the budget; "
                         "flash, torch's CPU flash kernel, the one megatron-core's masked attention runs)")
    ap.add_argument("--busy", type=int, default=0, help="cores kept busy by competing processes (a straggler)")
    ap.add_argument("--json", default=os.path.join(RESULTS, "real_win.json"))
    ap.add_argument("--plot", default=os.path.join(RESULTS, "real_win.png"))
    args = ap.parse_args(argv)
    args.fixed_pairs = args.fixed_pairs if args.fixed_pairs is not None else (0 if args.quick else 1)
    if args.data_path is None and any(getattr(args, f[2:].replace("-", "_")) for f in TOKENIZER_FLAGS):
        raise BenchError("the tokenizer flags go with --data-path (the default corpus is byte-level)")
    if args.data_path is not None and args.lengths is not None:
        raise BenchError("--lengths shapes the default corpus: drop it with --data-path")
    try:
        args.budget_bytes = memory_size(args.budget)
    except argparse.ArgumentTypeError as e:
        raise BenchError(f"--budget: {e}") from None
    args.iters = args.iters if args.iters is not None else (5 if args.quick else 6)
    args.static_runs = args.static_runs if args.static_runs is not None else (3 if args.quick else 10)
    if args.iters <= args.warmup:
        raise BenchError(f"--iters {args.iters} leaves no timed iteration after --warmup {args.warmup}: raise --iters")
    if args.tokens % args.seq_length:
        raise BenchError(f"--tokens {args.tokens} is not a multiple of --seq-length {args.seq_length}")
    if args.static_runs < 1 or args.nproc < 1:
        raise BenchError("--static-runs and --nproc must be >= 1")
    return args


def main(argv=None) -> int:
    try:
        args = parse_cli(argv)
        require_flags(["--dcp-device-memory", "--dcp-split-long-documents"], "this benchmark")
        resolve_data(args)
    except BenchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    t_start = time.perf_counter()
    cands = plan_static(args)
    runnable = sum(1 for c in cands if not c.verdict)
    print(f"  {len(cands)} static configs; cost model prunes {sum(1 for c in cands if c.verdict.startswith('cost'))}, "
          f"holds back {sum(1 for c in cands if c.verdict.startswith('held'))} recompute variants; {runnable} to run, "
          f"at most {args.static_runs}", file=sys.stderr, flush=True)
    fixed = []
    with Busy(args.busy), tempfile.TemporaryDirectory() as work:
        static = run_static(cands, args, work)
        dcps = []
        for kernel in args.dcp_cpu_attention:
            dcps.append(launch(f"dcp adaptive {kernel}", dcp_flags(args) + ["--dcp-cpu-attention", kernel], args.nproc,
                               work, args.run_timeout, note="[dcp] "))
            report(dcps[-1], args)
        if args.fixed_pairs:
            fixed = fixed_layout.measure(argparse.Namespace(**{**vars(args), "layouts": list(fixed_layout.LAYOUTS),
                                                               "dcp_cpu_attention": "flash",
                                                               "repeats": args.fixed_pairs,
                                                               "budget": fixed_layout.SPEED_BUDGET}), work)
    rows = [row("static", c.config.label, r, args, c.predicted_peak) for c, r in static]
    survivors = [r for r in rows if r["within_budget"] and not r["error"] and r["steady_tokens_per_s"]]
    best = max(survivors, key=lambda r: r["steady_tokens_per_s"]) if survivors else None
    dcp_rows = [row("dcp", f"{kernel} attention: {dcp_layouts(run)}", run, args)
                for kernel, run in zip(args.dcp_cpu_attention, dcps)]
    rows.extend(dcp_rows)
    budget_mib = args.budget_bytes / MiB

    print(f"Best static layout vs --dcp adaptive: CPU demo model (4 layers, hidden 128, 8 heads / 4 query groups, "
          f"SwiGLU, RMSNorm, RoPE, byte-level, fp32), {args.nproc} gloo ranks, {args.tokens}-token iterations, "
          f"{args.iters} iterations a run ({args.warmup} warm-up left out of tok/s), budget {args.budget} "
          f"({budget_mib:.0f} MiB) per rank")
    print(f"machine: {describe()}")
    print(args.data_line + "; static: --seq-length samples with --reset-attention-mask "
          "--reset-position-ids; dcp: --dcp-split-long-documents")
    what = next((r["what"] for r in rows if r["what"]), "?")
    print(f"peak MiB per rank: each run's own line ({what}); VmHWM: each worker's peak RSS read from outside "
          "(code and libraries included); tok/it: tokens per iteration; tok/s wall: all tokens over the whole "
          "command (start-up included)")
    print_table(rows, best, args)
    print("static configs not run:")
    for reason, labels in not_run(cands).items():
        print(f"  {reason}: " + "; ".join(labels))
    if best is None:
        print("best static: none (no static run stayed within the budget by measurement)")
    else:
        print(f"best static: {best['layout']} ({best['steady_tokens_per_s']:.0f} tokens/s)")
    for kernel, dcp_row in zip(args.dcp_cpu_attention, dcp_rows):
        if best is not None and dcp_row["steady_tokens_per_s"]:
            ratio = dcp_row["steady_tokens_per_s"] / best["steady_tokens_per_s"]
            wall = (dcp_row["wall_tokens_per_s"] / best["wall_tokens_per_s"]) if best["wall_tokens_per_s"] else None
            dcp_ok = {True: "within the budget", False: "OVER the budget",
                      None: "budget unknown"}[dcp_row["within_budget"]]
            print(f"dcp ({kernel} attention) / best static (tokens/s): {ratio:.2f}x after warm-up, "
                  f"{fmt(wall, '.2f')}x over the wall clock (dcp {dcp_ok})")
        else:
            print(f"dcp ({kernel} attention) / best static: n/a" + (" (dcp failed)" if dcp_row["error"] else ""))
    if fixed:
        fixed_layout.print_rows(fixed, args.busy)
    total = time.perf_counter() - t_start
    print(f"benchmark took {total / 60:.1f} min")

    result = {"machine": describe(), "budget": args.budget, "budget_bytes": args.budget_bytes, "iters": args.iters,
              "warmup": args.warmup, "tokens": args.tokens, "seq_length": args.seq_length, "nproc": args.nproc,
              "data": args.data_line, "quick": args.quick, "runs": rows, "fixed_layout": fixed, "busy": args.busy,
              "dcp_cpu_attention": args.dcp_cpu_attention, "prune_slack": PRUNE_SLACK,
              "best_static": best["run"] if best else None, "minutes": total / 60,
              "static_configs": [{**asdict(c.config), "predicted_peak_mib": None if c.predicted_peak is None else
                                  c.predicted_peak / MiB, "predicted_s": c.predicted_s, "verdict": c.verdict}
                                 for c in cands]}
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
    plot(rows, best, budget_mib, args.plot)
    print(f"results: {args.json}, plot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
