"""`--dcp` adaptive against the best static layout, like with like, side by side in one run.

Why it exists: the project's claim is that the adaptive planner trains faster than any static
layout. A claim is only as good as its baseline, so every run here uses the same model (the CPU
demo's, examples/cpu_demo.yaml: 4 layers, hidden 128, 8 heads in 4 query groups, ffn 352, SwiGLU,
RMSNorm, RoPE, fp32), the same data, the same tokens per iteration, the same per-device budget
and the same attention kernel (`--dcp-cpu-attention`, one table per kernel: static runs pass it
too), on 4 gloo ranks. The best static layout is searched on both runtimes:

  megatron    megatron-core's static path (upstream's schedule): every (tp, cp, pp) of the ranks,
              with and without full recompute, every micro-batch size; pruned where the cost model
              puts the peak beyond twice the budget (it over-predicts this path), a recompute
              variant run only when its layout overflows the budget without it, then the fastest
              predicted first, at most --static-runs; a run over the budget by its own memory line
              does not count;
  dcp-static  `--dcp --dcp-planner static`: the adaptive runtime at one fixed layout, the least
              recompute that holds a --seq-length document (fixed for the run); every layout that
              holds one, the fastest predicted first, at most --static-runs.

Both train --seq-length documents at most (longer ones split: --dcp-split-long-documents; the
static path's --seq-length samples of concatenated documents with --reset-attention-mask
--reset-position-ids). Each run trains --iters iterations (default 30); tokens/s is over the last
--measure (default 20), from the log lines' elapsed time, so a planner that learns from its own
timings is judged after it has learnt and the static runs get the same window; the whole
command's wall clock (start-up, the adaptive run's startup calibration) is beside it.

Settings (--setting, several allowed; `all` = the acceptance set):
  long-tail  the default: most documents short, the longest several times what the fastest
             data-parallel layout holds under the budget without recompute (the table says
             which length file, which maximum and how many times); per kernel (`LONG_TAIL`);
  today      Reuters lengths, documents up to 2048 tokens, 8192-token iterations, 256 MB (the
             setting of earlier reports); with --data-path, that corpus instead;
  demo-data  `today` on a `.bin/.idx` corpus given as --data-path: the demo corpus (this
             Python's standard-library modules cut into top-level blocks);
  uniform    every document 768 tokens, 9,216-token iterations: no layout change can help, so
             adaptive must not lose (the no-regret control).
Data of the shipped length files is real lengths filled with the demo corpus's bytes
(benchmarks/long_tail_corpus.py, byte-level tokens).

Beside each ratio: the adaptive run's own closing line, the lower bound of its last batches with
its calibrated prices (dcp_ext/planning/bound.py): the tokens/s no plan of those batches could
beat by the cost model, so the headroom left is visible.

    python benchmarks/bench_real_win.py                          # long-tail, math and flash (~1 h on 2 cores)
    python benchmarks/bench_real_win.py --setting all            # the acceptance set (several hours)
    python benchmarks/bench_real_win.py --setting today --kernels flash --static-runs 3
    python benchmarks/bench_real_win.py --quick                  # 8 iterations, 2 static runs a runtime (a smoke run)
    python benchmarks/bench_real_win.py --setting today --data-path /data/my_text_document \\
        --tokenizer-type GPT2BPETokenizer --vocab-file gpt2-vocab.json --merge-file gpt2-merges.txt

Results: benchmarks/results/real_win.json and real_win.png (tokens/s per run, per table).
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
from dataclasses import asdict, dataclass, field, replace

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from machine import describe  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
DEMO = os.path.join(REPO, "examples", "cpu_demo.yaml")
RESULTS = os.path.join(REPO, "benchmarks", "results")
MiB = 2**20
# The cost model over-predicts the static path's memory (measured: tp1 cp4 234 MiB predicted,
# 146 MiB measured): prune only what it puts beyond twice the budget; the measured peak decides the rest.
PRUNE_SLACK = 2.0
TOKENIZER_FLAGS = ("--tokenizer-type", "--tokenizer-model", "--vocab-file", "--merge-file")
RECOMPUTE = ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
ITERATION = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?elapsed time per iteration \(ms\): ([\d.]+) \|"
                       r".*?lm loss: ([-+.\dEeinfa]+) \|(?:.*?layout: ([^|]+)\|)?(?:.*?\| tokens: (\d+) \|)?")
HEADROOM = re.compile(r"> planner over the last (\d+) iterations: measured ([\d.]+) s, planned ([\d.]+) s, "
                      r"lower bound ([\d.]+) s")
ERROR = re.compile(r"^(?:\[rank \d+\] )?error: .*$", re.M)
WORLD = 4


class BenchError(Exception):
    """Bad input or a missing flag: one line, exit 2."""


class OneLineParser(argparse.ArgumentParser):
    def error(self, message):
        raise BenchError(f"{message} (see {os.path.basename(sys.argv[0])} --help)")


def require_flags(flags: list[str], what: str) -> None:
    from megatron.training.arguments import build_parser

    known = build_parser()._option_string_actions
    missing = [f for f in flags if f not in known]
    if missing:
        raise BenchError(f"{', '.join(missing)} not on this branch's pretrain_gpt_dcp.py, which {what} needs: "
                         "merge the branch that adds it first")


# ----------------------------------------------------------------------------- settings
@dataclass(frozen=True)
class Setting:
    """What one table measures: the corpus, the longest document, tokens per iteration, budget."""

    name: str
    lengths: str | None  # a shipped length file, "uniform:N", or None with a --data-path corpus
    seq_length: int  # --seq-length = --dcp-max-seq-len: documents longer are split
    tokens: int  # tokens per iteration (a multiple of seq_length: the static path's samples)
    budget: str = "256MB"
    data_path: str | None = None  # a .bin/.idx prefix (then `lengths` is None)
    demo_data: bool = False  # the demo corpus as a --data-path corpus


# long-tail per kernel: the longest document several times what DP (tp1, no recompute) holds
# under 256 MB: math ~950 tokens (quadratic attention memory), so Reuters news up to 2560
# (2.7x; a 4-rank replica with full recompute holds ~2.9K, less what the runtime measures
# beyond the model); flash ~3.6K tokens (linear), so Azure conversation prompts up to their
# longest, 14,050 (3.9x; only tp2 and tp4 hold it).
LONG_TAIL = {"math": Setting("long-tail", "text_reuters21578_cl100k.txt", 2560, 4 * 2560),
             "flash": Setting("long-tail", "azure2023_conv_prompt_tokens.txt", 14080, 2 * 14080)}
TODAY = Setting("today", "text_reuters21578_cl100k.txt", 2048, 8192)
UNIFORM = Setting("uniform", "uniform:768", 768, 12 * 768)
ALL = ("long-tail", "today", "demo-data", "uniform")


def setting_for(name: str, kernel: str, args) -> Setting:
    if name == "long-tail":
        s = LONG_TAIL[kernel]
    elif name == "today":
        s = TODAY if args.data_path is None else replace(TODAY, lengths=None, data_path=args.data_path)
    elif name == "demo-data":
        s = replace(TODAY, name="demo-data", lengths=None, demo_data=True)
    else:
        s = UNIFORM
    if args.budget is not None:
        s = replace(s, budget=args.budget)
    return s


@dataclass
class Data:
    flags: list[str]
    line: str  # what the table says of the data
    vocab_size: int
    holds: dict = field(default_factory=dict)


def resolve_data(s: Setting, args) -> Data:
    """The corpus of a setting: its pretrain_gpt_dcp.py flags and a line describing it."""
    import numpy as np

    from dcp_ext.data.indexed import IndexedDocuments
    from dcp_ext.data.tokenizers import build_tokenizer

    if s.lengths is not None:
        from long_tail_corpus import ensure_long_tail_corpus

        try:
            prefix = ensure_long_tail_corpus(os.path.join(REPO, "cache"), s.lengths)
        except FileNotFoundError as e:
            raise BenchError(str(e)) from None
        flags = ["--data-path", prefix, "--tokenizer-type", "ByteLevelTokenizer"]
        what = (f"{s.lengths.split(':')[1]}-token documents" if s.lengths.startswith("uniform:") else
                f"the lengths of {s.lengths}") + " (the demo corpus's bytes, byte-level)"
        tokenizer = build_tokenizer("ByteLevelTokenizer")
    elif s.demo_data:
        from dcp_ext.data.demo_corpus import ensure_demo_corpus

        prefix = ensure_demo_corpus(os.path.join(REPO, "cache", "demo"))
        flags = ["--data-path", prefix, "--tokenizer-type", "ByteLevelTokenizer"]
        what = f"--data-path {os.path.relpath(prefix, REPO)} (the demo corpus: standard-library blocks)"
        tokenizer = build_tokenizer("ByteLevelTokenizer")
    else:
        prefix = s.data_path
        if not (os.path.isfile(prefix + ".bin") and os.path.isfile(prefix + ".idx")):
            raise BenchError(f"--data-path {prefix}: no {prefix}.bin/.idx (give the prefix, without the suffix)")
        kv = {f: getattr(args, f[2:].replace("-", "_")) for f in TOKENIZER_FLAGS}
        flags = ["--data-path", prefix] + [x for f, v in kv.items() if v for x in (f, v)]
        what = f"--data-path {prefix}"
        try:
            tokenizer = build_tokenizer(kv["--tokenizer-type"] or "ByteLevelTokenizer", kv["--vocab-file"],
                                        kv["--merge-file"], kv["--tokenizer-model"])
        except Exception as e:  # the tokenizer's own one-line error
            raise BenchError(f"tokenizer: {e}") from None
    lengths = np.asarray(IndexedDocuments(prefix).lengths, dtype=np.int64)
    q = np.percentile(lengths, [50, 99]) if len(lengths) else [0, 0]
    longest = int(lengths.max()) if len(lengths) else 0
    line = (f"{what}: {len(lengths):,} documents, median {q[0]:.0f} tokens, p99 {q[1]:.0f}, max {longest:,}; "
            f"split at {s.seq_length} tokens")
    return Data(flags, line, tokenizer.vocab_size)


def common_flags(s: Setting, data: Data, kernel: str, args) -> list[str]:
    return ["--yaml-cfg", DEMO, "--seq-length", str(s.seq_length), "--max-position-embeddings", str(s.seq_length),
            "--train-iters", str(args.iters), "--lr-decay-iters", str(max(60, args.iters)), "--log-interval", "1",
            "--eval-iters", "0", "--data-cache-path", os.path.join(REPO, "cache"), "--dcp-device-memory", s.budget,
            "--dcp-cpu-attention", kernel] + data.flags


# ----------------------------------------------------------------------------- static candidates
@dataclass(frozen=True)
class Config:
    """One static launch: runtime, layout, micro-batch size (megatron), full recompute or not (megatron)."""

    runtime: str  # "megatron" | "dcp-static"
    tp: int
    cp: int
    pp: int
    mbs: int = 1
    recompute: bool = False

    @property
    def dp(self) -> int:
        return WORLD // (self.tp * self.cp * self.pp)

    @property
    def label(self) -> str:
        if self.runtime == "dcp-static":
            return f"tp{self.tp} cp{self.cp} pp{self.pp} dp{self.dp}"
        return f"tp{self.tp} cp{self.cp} pp{self.pp} dp{self.dp} mbs{self.mbs}" + (" +recompute" if self.recompute else "")


def layouts_of(world: int) -> list[tuple[int, int, int]]:
    divisors = [d for d in range(1, world + 1) if world % d == 0]
    return [(tp, cp, pp) for tp, cp, pp in itertools.product(divisors, repeat=3) if world % (tp * cp * pp) == 0]


def megatron_configs(samples: int) -> list[Config]:
    """Every (tp, cp, pp), recompute or not, micro-batch sizes dividing the replica's batch."""
    out = []
    for tp, cp, pp in layouts_of(WORLD):
        dp = WORLD // (tp * cp * pp)
        if samples % dp:
            continue
        per_replica = samples // dp
        for mbs in (m for m in range(1, per_replica + 1) if per_replica % m == 0):
            for recompute in (False, True):
                out.append(Config("megatron", tp, cp, pp, mbs, recompute))
    return out


def static_flags(c: Config, s: Setting, data: Data, kernel: str, args) -> list[str]:
    """megatron-core's static path at config `c`."""
    return common_flags(s, data, kernel, args) + [
        "--tensor-model-parallel-size", str(c.tp), "--context-parallel-size", str(c.cp),
        "--pipeline-model-parallel-size", str(c.pp), "--micro-batch-size", str(c.mbs),
        "--global-batch-size", str(s.tokens // s.seq_length)] + (
        ["--sequence-parallel"] if c.tp > 1 else []) + (RECOMPUTE if c.recompute else [])


def dcp_flags(s: Setting, data: Data, kernel: str, args, planner: str = "adaptive",
              layout: tuple[int, int, int] | None = None) -> list[str]:
    flags = common_flags(s, data, kernel, args) + [
        "--dcp", "--dcp-planner", planner, "--dcp-max-seq-len", str(s.seq_length), "--dcp-global-batch-tokens",
        str(s.tokens), "--dcp-split-long-documents"]
    if layout is not None:
        tp, cp, pp = layout
        flags += ["--tensor-model-parallel-size", str(tp), "--context-parallel-size", str(cp),
                  "--pipeline-model-parallel-size", str(pp)] + (["--sequence-parallel"] if tp > 1 else [])
    return flags


def parsed(flags: list[str]):
    from megatron.training.arguments import parse_args

    return parse_args(flags, world_size=WORLD)


def cost_model(a, vocab_size: int, budget_bytes: float, tp_for_vocab: int):
    from dcp_ext.data.tokenizers import padded_vocab_size
    from dcp_ext.planning.cost_model import CostModel
    from dcp_ext.planning.specs import ClusterSpec
    from megatron.training.adaptive.run_config import AdaptiveRunConfig

    a.padded_vocab_size = padded_vocab_size(vocab_size, a.make_vocab_size_divisible_by, tp_for_vocab)
    cluster = ClusterSpec.cpu_gloo(WORLD).with_(memory_bytes=float(budget_bytes), reserved_bytes=0.0)
    return CostModel(AdaptiveRunConfig.from_args(a, on_cpu=True).model, cluster, memory_margin=0.0)


@dataclass
class Candidate:
    config: Config
    predicted_peak: float | None = None
    predicted_s: float | None = None
    verdict: str = ""  # why it did not run, or "ran"
    worst_peak_mib: int | None = None  # megatron: the peak on --seq-length documents (`holds_longest`)


def plan_megatron(s: Setting, data: Data, kernel: str, args) -> list[Candidate]:
    """Every megatron config with the cost model's verdict: runnable first, fastest predicted first."""
    from dcp_ext.planning.layout import Layout
    from megatron.training.arguments import ArgumentError, memory_size

    budget = memory_size(s.budget)
    cands = []
    for c in megatron_configs(s.tokens // s.seq_length):
        cand = Candidate(c)
        cands.append(cand)
        try:
            a = parsed(static_flags(c, s, data, kernel, args))
        except ArgumentError as e:
            cand.verdict = f"invalid launch line: {e}"
            continue
        cm = cost_model(a, data.vocab_size, budget, c.tp)
        lay = Layout(c.tp, c.cp, c.pp)
        if not cm.layout_valid(lay):
            cand.verdict = "the model does not split this way (heads, query groups or layers)"
            continue
        k = s.tokens // s.seq_length // c.dp // c.mbs
        rs = cm.layers_per_stage(lay) if c.recompute else 0
        docs = [s.seq_length] * c.mbs
        cand.predicted_peak = cm.replica_peak_bytes(lay, [float(sum(docs))] * k, [rs] * k, [docs] * k)
        cand.predicted_s = (k + c.pp - 1) * cm.mb_stage_time(docs, lay, rs)
        if cand.predicted_peak > PRUNE_SLACK * budget:
            cand.verdict = f"cost model: peak {cand.predicted_peak / MiB:.0f} MiB > {PRUNE_SLACK:g}x the budget"
    fits = {(c.config.tp, c.config.cp, c.config.pp, c.config.mbs) for c in cands
            if not c.verdict and not c.config.recompute}
    for cand in cands:
        c = cand.config
        if not cand.verdict and c.recompute and (c.tp, c.cp, c.pp, c.mbs) in fits:
            cand.verdict = "held back: fits without recompute"
    return sorted(cands, key=lambda x: (bool(x.verdict), x.predicted_s if x.predicted_s is not None else 1e9))


def plan_dcp_static(s: Setting, data: Data, kernel: str, args) -> list[Candidate]:
    """Every layout `--dcp-planner static` can run (it holds a --seq-length document), fastest
    predicted first (the static planner's own estimate on the corpus's batches)."""
    import numpy as np

    from dcp_ext.data.indexed import IndexedDocuments
    from dcp_ext.planning.planner import make_planner
    from dcp_ext.planning.batching import sample_batches
    from dcp_ext.planning.planners.errors import PlanningError
    from dcp_ext.planning.specs import ClusterSpec
    from megatron.training.arguments import ArgumentError, memory_size
    from megatron.training.adaptive.run_config import AdaptiveRunConfig
    from megatron.training.adaptive.run_config import vocab_padding_for

    budget = memory_size(s.budget)
    prefix = data.flags[data.flags.index("--data-path") + 1]
    lengths = np.minimum(np.asarray(IndexedDocuments(prefix).lengths[:20000], dtype=np.int64), s.seq_length)
    cands = []
    for tp, cp, pp in layouts_of(WORLD):
        cand = Candidate(Config("dcp-static", tp, cp, pp))
        cands.append(cand)
        try:
            a = parsed(dcp_flags(s, data, kernel, args, "static", (tp, cp, pp)))
        except ArgumentError as e:
            cand.verdict = f"invalid launch line: {e}"
            continue
        cluster = ClusterSpec.cpu_gloo(WORLD).with_(memory_bytes=float(budget), reserved_bytes=0.0)
        a.vocab_size = data.vocab_size
        a.padded_vocab_size = vocab_padding_for(a, data.vocab_size, cluster)
        try:
            planner = make_planner("static", AdaptiveRunConfig.from_args(a, on_cpu=True).model, cluster,
                                   max_seq_len=s.seq_length, global_batch_tokens=s.tokens,
                                   length_sample=[int(x) for x in lengths], memory_margin=a.dcp_memory_margin,
                                   seed=a.seed, layout=(tp, cp, pp), balance=True)
        except (PlanningError, ValueError) as e:
            cand.verdict = f"cannot hold a {s.seq_length}-token document ({str(e)[:80]})"
            continue
        times = [planner.plan(i, list(range(len(b))), [int(x) for x in b]).predicted_time_s
                 for i, b in enumerate(sample_batches(lengths, s.tokens, s.seq_length, 8, 0))]
        cand.predicted_s = float(np.mean(times)) if times else None
    return sorted(cands, key=lambda x: (bool(x.verdict), x.predicted_s if x.predicted_s is not None else 1e9))


# ----------------------------------------------------------------------------- running
@dataclass
class Run:
    name: str
    flags: list[str]
    rc: int = 0
    wall_s: float = 0.0
    iterations: list[dict] = field(default_factory=list)
    memory: dict | None = None  # the report line, parsed
    vmhwm_gb: dict = field(default_factory=dict)  # rank -> GB, read from outside
    headroom: dict | None = None  # the --dcp run's closing line: measured, planned, lower bound
    error: str | None = None
    text: str = ""  # the run's stdout and stderr


def launch(name: str, flags: list[str], nproc: int, work: str, timeout: float, note: str = "") -> Run:
    """One torchrun of pretrain_gpt_dcp.py: its log lines, memory line, per-rank VmHWM (outside), wall clock."""
    from bench_memory import descendants, worker_rank
    from dcp_ext.runtime.device_memory import peak_rss_bytes
    from megatron.training.loop.memory_report import parse_memory_line

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
                if now - last_note > 30:
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
    m = HEADROOM.search(text)
    if m:
        run.headroom = {"iterations": int(m.group(1)), "measured_s": float(m.group(2)), "planned_s": float(m.group(3)),
                        "bound_s": float(m.group(4))}
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


def throughput(run: Run, measure: int, tokens_per_static_iteration: int) -> dict:
    """tokens/s over the last `measure` iterations (log lines' elapsed time) and over the wall clock."""
    its = run.iterations
    tok = [it["tokens"] if it["tokens"] is not None else tokens_per_static_iteration for it in its]
    window = list(zip(its, tok))[-measure:] if measure else []
    seconds = sum(it["elapsed_s"] for it, _ in window)
    return {"tokens_per_s": sum(t for _, t in window) / seconds if window and seconds > 0 else None,
            "wall_tokens_per_s": sum(tok) / run.wall_s if its and run.wall_s > 0 else None,
            "measured_iterations": len(window), "window_tokens": sum(t for _, t in window), "window_s": seconds,
            "tokens_per_iteration": sum(tok) / len(tok) if tok else None}


def within(run: Run) -> bool | None:
    return None if run.memory is None or run.memory["within"] is None else run.memory["within"]


def layouts_used(run: Run, last: int) -> str:
    counts: dict[str, int] = {}
    for it in run.iterations[-last:]:
        lay = (it["layout"] or "").split(" | ")[0].replace("layout: ", "") if it["layout"] else "?"
        counts[lay] = counts.get(lay, 0) + 1
    return ", ".join(f"{k} x{v}" for k, v in sorted(counts.items(), key=lambda kv: -kv[1])) or "-"


def report(run: Run, args, tokens: int) -> None:
    t = throughput(run, args.measure, tokens)
    mem = run.memory
    peak = f"peak {max(mem['peaks_mib'])} MiB ({'within' if mem['within'] else 'over budget'})" if mem else "no memory line"
    speed = f"{t['tokens_per_s']:.0f} tokens/s" if t["tokens_per_s"] else "no measured iterations"
    state = f"failed: {run.error}" if run.error else f"{speed}, {peak}"
    print(f"    done in {run.wall_s:.0f} s: {state}", file=sys.stderr, flush=True)


def run_static(cands: list[Candidate], s: Setting, data: Data, kernel: str, args, work: str) -> list[tuple[Candidate, Run]]:
    """Runnable candidates in order, at most --static-runs; a megatron run over the budget lets its
    recompute variant in next."""
    queue = [c for c in cands if not c.verdict]
    waiting = {c.config: c for c in cands if c.verdict.startswith("held back")}
    done: list[tuple[Candidate, Run]] = []
    while queue and len(done) < args.static_runs:
        cand = queue.pop(0)
        c = cand.config
        if c.runtime == "megatron" and not holds_longest(cand, s, kernel, args, work):
            alt = waiting.pop(replace(c, recompute=True), None) if not c.recompute else None
            if alt is not None:
                alt.verdict = ""
                queue.insert(0, alt)
            continue
        flags = (static_flags(c, s, data, kernel, args) if c.runtime == "megatron" else
                 dcp_flags(s, data, kernel, args, "static", (c.tp, c.cp, c.pp)))
        run = launch(f"{s.name} {kernel} {c.runtime} {c.label}", flags, WORLD, work, args.run_timeout,
                     note=f"[{c.runtime} {len(done) + 1}/{min(args.static_runs, len(done) + 1 + len(queue))}] ")
        cand.verdict = "ran"
        done.append((cand, run))
        report(run, args, s.tokens)
        if within(run) is False and c.runtime == "megatron" and not c.recompute:
            alt = waiting.pop(replace(c, recompute=True), None)
            if alt is not None:
                alt.verdict = ""
                queue.insert(0, alt)
    for cand in queue:
        cand.verdict = f"--static-runs {args.static_runs} reached (predicted slower)"
    return done


def holds_longest(cand: Candidate, s: Setting, kernel: str, args, work: str) -> bool:
    """Whether megatron-core's path at this config stays within the budget on its worst case,
    samples that are one --seq-length document each (3 iterations on a corpus of such
    documents): a static layout must hold the longest document the run may meet, which the
    measured iterations of a long-tailed corpus may not contain. `cand.verdict` says why not."""
    worst = resolve_data(replace(s, lengths=f"uniform:{s.seq_length}", data_path=None, demo_data=False), args)
    quick = argparse.Namespace(**{**vars(args), "iters": 3})
    run = launch(f"{s.name} {kernel} megatron {cand.config.label} worst case", static_flags(
        cand.config, s, worst, kernel, quick), WORLD, work, args.run_timeout, note="[worst case] ")
    if run.error or within(run) is not True:
        peak = f"{max(run.memory['peaks_mib'])} MiB" if run.memory else "no memory line"
        cand.verdict = (f"over the budget on {s.seq_length}-token documents ({peak})" if not run.error
                        else f"failed on {s.seq_length}-token documents: {run.error[:120]}")
        print(f"    not run: {cand.verdict}", file=sys.stderr, flush=True)
        return False
    cand.worst_peak_mib = max(run.memory["peaks_mib"])
    return True


def row(runtime: str, layout: str, run: Run, args, s: Setting, cand: Candidate | None = None) -> dict:
    t = throughput(run, args.measure, s.tokens)
    predicted_peak = cand.predicted_peak if cand is not None else None
    return {"runtime": runtime, "layout": layout, **t, "wall_s": run.wall_s,
            "predicted_peak_mib": None if predicted_peak is None else predicted_peak / MiB,
            "worst_case_peak_mib": cand.worst_peak_mib if cand is not None else None,
            "peaks_mib": run.memory["peaks_mib"] if run.memory else None, "what": run.memory["what"] if run.memory else None,
            "vmhwm_gb": [run.vmhwm_gb[r] for r in sorted(run.vmhwm_gb)], "within_budget": within(run),
            "headroom": run.headroom, "last_loss": run.iterations[-1]["loss"] if run.iterations else None,
            "error": run.error, "iterations": run.iterations}


def counts(r: dict, args) -> bool:
    """A run that may be the best static: finished, within the budget by its own line, measured."""
    return bool(r["within_budget"] and not r["error"] and r["tokens_per_s"]
                and r["measured_iterations"] >= min(args.measure, args.iters))


def fmt(x, spec):
    width = re.match(r"\d*", spec).group(0)
    return "-".rjust(int(width) if width else 0) if x is None else format(x, spec)


# ----------------------------------------------------------------------------- one table
def measure_table(setting_name: str, kernel: str, args, work: str) -> dict:
    from megatron.training.arguments import memory_size

    s = setting_for(setting_name, kernel, args)
    data = resolve_data(s, args)
    megatron = plan_megatron(s, data, kernel, args) if "megatron" in args.runtimes else []
    dcp_static = plan_dcp_static(s, data, kernel, args) if "dcp-static" in args.runtimes else []
    print(f"[{s.name}, {kernel}] {data.line}", file=sys.stderr, flush=True)
    runs = run_static(megatron, s, data, kernel, args, work) + run_static(dcp_static, s, data, kernel, args, work)
    adaptive = launch(f"{s.name} {kernel} dcp adaptive", dcp_flags(s, data, kernel, args), WORLD, work,
                      args.run_timeout, note="[adaptive] ")
    report(adaptive, args, s.tokens)
    rows = [row(c.config.runtime, c.config.label, r, args, s, c) for c, r in runs]
    ad = row("dcp adaptive", layouts_used(adaptive, args.measure), adaptive, args, s)
    best = {}
    for rt in ("megatron", "dcp-static"):
        ok = [r for r in rows if r["runtime"] == rt and counts(r, args)]
        best[rt] = max(ok, key=lambda r: r["tokens_per_s"]) if ok else None
    both = [r for r in best.values() if r is not None]
    best["both"] = max(both, key=lambda r: r["tokens_per_s"]) if both else None
    ratios = {}
    for key, b in best.items():
        if b is not None and ad["tokens_per_s"]:
            ratios[key] = {"tokens_per_s": ad["tokens_per_s"] / b["tokens_per_s"],
                           "wall": (ad["wall_tokens_per_s"] / b["wall_tokens_per_s"]) if b["wall_tokens_per_s"] else None}
    bound = None
    if ad["headroom"] and ad["headroom"]["bound_s"] > 0 and ad["headroom"]["iterations"] == ad["measured_iterations"]:
        bound = ad["window_tokens"] / ad["headroom"]["bound_s"]  # the same iterations' tokens
    return {"setting": asdict(s), "kernel": kernel, "data": data.line, "budget_mib": memory_size(s.budget) / MiB,
            "rows": rows, "adaptive": ad, "best": {k: (v["runtime"] + " " + v["layout"]) if v else None
                                                     for k, v in best.items()},
            "ratios": ratios, "bound_tokens_per_s": bound,
            "bound_ratio": (bound / best["both"]["tokens_per_s"]) if bound and best["both"] else None,
            "not_run": not_run(megatron + dcp_static)}


def not_run(cands: list[Candidate]) -> dict[str, list[str]]:
    groups: dict[str, list[str]] = {}
    for cand in cands:
        if cand.verdict == "ran":
            continue
        reason = cand.verdict.split(" (")[0] if cand.verdict.startswith(("cannot hold", "over the budget on")) \
            else cand.verdict
        reason = "cost model: peak over twice the budget" if reason.startswith("cost model") else reason
        groups.setdefault(f"{cand.config.runtime}: {reason}", []).append(cand.config.label)
    return groups


def print_table(t: dict, args) -> None:
    s = t["setting"]
    print(f"\n=== {s['name']}, {t['kernel']} attention on every run: {t['data']}; {s['tokens']} tokens an "
          f"iteration, budget {s['budget']} ({t['budget_mib']:.0f} MiB) per rank")
    print(f"{'runtime':13s} {'layout':36s} {'tok/s':>7s} {'tok/s wall':>10s} {'wall s':>7s} {'peak MiB per rank':>18s} "
          f"{'within budget':>13s}")
    for r in t["rows"] + [t["adaptive"]]:
        peaks = " ".join(map(str, r["peaks_mib"])) if r["peaks_mib"] else "-"
        ok = {True: "yes", False: "no", None: "?"}[r["within_budget"]]
        if r.get("worst_case_peak_mib"):
            ok += f" (worst case {r['worst_case_peak_mib']})"
        name = f"{r['runtime']} {r['layout']}"
        marks = [k for k, v in t["best"].items() if v == name and k != "both"]
        mark = "  <- best " + marks[0] if marks else ""
        if r["error"]:
            print(f"{r['runtime']:13s} {r['layout'][:36]:36s} failed: {r['error']}")
            continue
        print(f"{r['runtime']:13s} {r['layout'][:36]:36s} {fmt(r['tokens_per_s'], '7.0f')} "
              f"{fmt(r['wall_tokens_per_s'], '10.0f')} {r['wall_s']:7.0f} {peaks:>18s} {ok:>7s}{mark}")
    if len(t["adaptive"]["layout"]) > 36:
        print(f"  adaptive's layouts over the measured iterations: {t['adaptive']['layout']}")
    for reason, labels in t["not_run"].items():
        print(f"  not run, {reason}: " + "; ".join(labels))
    names = {"megatron": "megatron-core's best static", "dcp-static": "dcp-static's best", "both": "the best static of both"}
    for key in ("megatron", "dcp-static", "both"):
        r = t["ratios"].get(key)
        if r:
            print(f"  adaptive / {names[key]} ({t['best'][key]}): {r['tokens_per_s']:.2f}x tokens/s over the last "
                  f"{args.measure} iterations, {fmt(r['wall'], '.2f')}x over the whole command")
        else:
            print(f"  adaptive / {names[key]}: n/a (no such run finished within the budget)")
    if t["bound_tokens_per_s"]:
        print(f"  lower bound of adaptive's measured batches with its calibrated prices: {t['bound_tokens_per_s']:.0f} "
              f"tokens/s" + (f", {t['bound_ratio']:.2f}x the best static" if t["bound_ratio"] else ""))


def plot(tables: list[dict], path: str) -> None:
    """One panel per table: tokens/s per run (adaptive orange), hatched where over the budget."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [t for t in tables if any(r["tokens_per_s"] for r in t["rows"] + [t["adaptive"]])]
    if not shown:
        return
    fig, axes = plt.subplots(len(shown), 1, figsize=(10, sum(0.42 * (len(t["rows"]) + 1) + 1.2 for t in shown)),
                             squeeze=False)
    for ax, t in zip(axes[:, 0], shown):
        rs = [r for r in t["rows"] + [t["adaptive"]] if r["tokens_per_s"]]
        names = [f"{r['runtime']} {r['layout'][:40]}" for r in rs]
        speeds = [r["tokens_per_s"] for r in rs]
        colors = ["tab:orange" if r["runtime"] == "dcp adaptive" else
                  ("tab:blue" if r["runtime"] == "megatron" else "tab:green") for r in rs]
        bars = ax.barh(names, speeds, color=colors, edgecolor="black")
        for bar, r in zip(bars, rs):
            if r["within_budget"] is False:
                bar.set_hatch("//")
        for i, v in enumerate(speeds):
            ax.text(v, i, f" {v:.0f}", va="center", fontsize=8)
        if t["bound_tokens_per_s"]:
            ax.axvline(t["bound_tokens_per_s"], color="red", linestyle="--", label="lower bound (adaptive's batches)")
            ax.legend(loc="lower right", fontsize=8)
        ax.invert_yaxis()
        ax.set_xlim(0, max(speeds + [t["bound_tokens_per_s"] or 0]) * 1.25)
        s = t["setting"]
        ax.set_title(f"{s['name']}, {t['kernel']} attention, max {s['seq_length']} tokens, {s['budget']}", fontsize=10)
    axes[-1, 0].set_xlabel("tokens/s over the last iterations (blue: megatron-core static, green: --dcp-planner "
                           "static, orange: --dcp adaptive; hatched: over the budget)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------- main
def parse_cli(argv):
    from megatron.training.arguments import memory_size

    ap = OneLineParser(description=__doc__.splitlines()[0])
    ap.add_argument("--setting", nargs="+", choices=ALL + ("all",), default=["long-tail"])
    ap.add_argument("--kernels", nargs="+", choices=["math", "flash"], default=["math", "flash"],
                    help="--dcp-cpu-attention of every run, one table per kernel")
    ap.add_argument("--runtimes", nargs="+", choices=["megatron", "dcp-static"], default=["megatron", "dcp-static"],
                    help="where the best static layout is searched")
    ap.add_argument("--budget", default=None, help="per-device memory budget for every setting (default: the setting's)")
    ap.add_argument("--iters", type=int, default=None, help="iterations per run (default 30, --quick 8)")
    ap.add_argument("--measure", type=int, default=None, help="last iterations in tokens/s (default 20, --quick 5)")
    ap.add_argument("--static-runs", type=int, default=None, help="static runs at most per runtime (default 6, --quick 2)")
    ap.add_argument("--quick", action="store_true", help="fewer static runs and iterations (a smoke run)")
    ap.add_argument("--run-timeout", type=float, default=1500.0, help="seconds before a run is killed")
    ap.add_argument("--data-path", default=None, help="a .bin/.idx prefix for the `today` setting")
    for flag in TOKENIZER_FLAGS:
        ap.add_argument(flag, default=None, help="with --data-path: as pretrain_gpt_dcp.py")
    ap.add_argument("--json", default=os.path.join(RESULTS, "real_win.json"))
    ap.add_argument("--plot", default=os.path.join(RESULTS, "real_win.png"))
    args = ap.parse_args(argv)
    if "all" in args.setting:
        args.setting = list(ALL)
    if args.data_path is None and any(getattr(args, f[2:].replace("-", "_")) for f in TOKENIZER_FLAGS):
        raise BenchError("the tokenizer flags go with --data-path (the shipped corpora are byte-level)")
    if args.data_path is not None and "today" not in args.setting:
        raise BenchError("--data-path is the `today` setting's corpus: add --setting today")
    if args.budget is not None:
        try:
            memory_size(args.budget)
        except argparse.ArgumentTypeError as e:
            raise BenchError(f"--budget: {e}") from None
    args.iters = args.iters if args.iters is not None else (8 if args.quick else 30)
    args.measure = args.measure if args.measure is not None else (5 if args.quick else 20)
    args.static_runs = args.static_runs if args.static_runs is not None else (2 if args.quick else 6)
    if not 1 <= args.measure <= args.iters:
        raise BenchError(f"--measure {args.measure} must be between 1 and --iters {args.iters}")
    if args.static_runs < 1:
        raise BenchError("--static-runs must be >= 1")
    return args


def main(argv=None) -> int:
    try:
        args = parse_cli(argv)
        require_flags(["--dcp-device-memory", "--dcp-split-long-documents", "--dcp-calibrate-at-start"],
                      "this benchmark")
    except BenchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    t_start = time.perf_counter()
    tables = []
    with tempfile.TemporaryDirectory() as work:
        for name in args.setting:
            for kernel in args.kernels:
                try:
                    tables.append(measure_table(name, kernel, args, work))
                except BenchError as e:
                    print(f"error: {e}", file=sys.stderr)
                    return 2
    print(f"Adaptive (--dcp) vs the best static layout of megatron-core's path and of --dcp-planner static, "
          f"the same kernel on both sides: CPU demo model (4 layers, hidden 128, 8 heads / 4 query groups, SwiGLU, "
          f"RMSNorm, RoPE, byte-level, fp32), {WORLD} gloo ranks, {args.iters} iterations a run, tokens/s over "
          f"the last {args.measure}")
    print(f"machine: {describe()}")
    print("peak MiB per rank: each run's own memory line; worst case: megatron-core's peak on samples of one "
          "--seq-length document each, before its run (a static layout must hold the longest document); tok/s wall: "
          "every token over the whole command (start-up and the adaptive run's startup calibration included)")
    for t in tables:
        print_table(t, args)
    total = time.perf_counter() - t_start
    print(f"\nbenchmark took {total / 60:.1f} min")
    result = {"machine": describe(), "iters": args.iters, "measure": args.measure, "static_runs": args.static_runs,
              "quick": args.quick, "prune_slack": PRUNE_SLACK, "minutes": total / 60, "tables": tables}
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
    plot(tables, args.plot)
    print(f"results: {args.json}, plot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
