"""dcp-profile: time real forward+backward micro-batches on this machine, fit the cost model.

Why it exists: the analytic cost model is a guess about the hardware; the planner is only
as good as its prices. This tool times what the runtime really does (megatron-core stage
models built by `dcp_ext.runtime.stages.model`, run by the runtime's `StageRunner` with the runtime's
process groups) over `dcp_ext.planning.profile.profile_grid`'s document lengths and layouts, then
fits and saves the profile that `--dcp-cost-profile` / `dcp-plan --profile` read.

    dcp-profile --yaml-cfg examples/cpu_demo.yaml --out cache/profile-demo.json          # full grid
    dcp-profile --quick --yaml-cfg examples/cpu_demo.yaml --out cache/profile-demo.json  # a first look
    dcp-profile --layouts tp1cp1pp1,tp2cp1pp1 --points 6 --repeats 5 <Megatron model flags>

The grid's defaults (`FULL`: 6 lengths x 3 packings x 2 recompute settings per layout, 1 warm-up
+ 5 timed runs each: 864 runs for the demo on 2 cores, 13 min on a busy machine) or, with
`--quick` (`QUICK`: 3 lengths x 2 packings, 1 timed run each after one warm-up run per layout:
52 runs, about a minute there), a rough profile for a first look; a flag given explicitly wins
over either. The first line says
how many runs are planned and what the analytic cost model expects them to take.

How it measures (CPU: gloo ranks, one thread each; CUDA: one rank per GPU, NCCL):
  * ranks are spawned for the largest layout only; layouts are timed one at a time on
    ranks 0..size-1 while the others wait in a barrier, so a record is one micro-batch
    alone on its replica (what `ProfileRecord.seconds` means);
  * per run: world barrier, then every replica rank times `StageRunner.run([mb])` (1F1B
    of one micro-batch = every stage's forward then backward); the run's time is the
    last rank's end minus the first rank's start (one monotonic clock per machine);
  * every layout's stage models are built up front (as the engine holds them); after
    `--warmup` untimed passes, each of the `--repeats` rounds times every point in a fresh
    random order across layouts, so a slow spell of a shared machine spreads over points
    and layouts instead of biasing one layout against another (what the planner compares);
    a record's seconds is the median of its rounds (`--statistic min`: the
    fastest, i.e. the machine without the other tenants of a shared box).
  * waiting ranks block in gloo without spinning, so they take no core from the timed ones.
The Megatron side (its argument parser and tokenizer, the TransformerConfig builder, the
cluster `--dcp` training assumes) is handed in as a `TrainingSide` by the entry point,
`megatron/training/adaptive/profiling.py` (the `dcp-profile` command): `dcp_ext` never imports
`megatron.training`.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import socket
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from dcp_ext.cli.boundary import Parser, check_output, run_tool, writing


@dataclass(frozen=True)
class TrainingSide:
    """What profiling needs from the Megatron training side (module-level functions, so a
    spawned rank gets them by reference)."""

    parse_args: Callable  # (argv, world_size) -> Megatron's args, unpadded_vocab_size set
    transformer_config: Callable  # (args, **overrides) -> TransformerConfig
    cluster_for: Callable  # (num_gpus, args) -> the ClusterSpec --dcp training would assume
    model_spec: Callable  # (args, name) -> the ModelSpec --dcp training would plan with
    argument_errors: tuple = ()  # what parse_args raises for a bad flag: one line, exit 2


@dataclass
class Job:
    """Everything a rank needs: picklable, identical on every rank."""

    args: argparse.Namespace  # parsed Megatron arguments (padded_vocab_size set)
    points: list[dict]  # tp, cp, pp, recompute_layers, lengths (profile_grid's dicts)
    repeats: int = 5
    warmup: int = 1
    seed: int = 1234
    cuda: bool = False
    threads: int = 1
    progress: bool = True
    desc: str = "dcp-profile"
    statistic: str = "median"  # of the repeats: "median", or "min" (the machine with no other load)
    transformer_config: Callable | None = None  # TrainingSide.transformer_config
    warmup_points: str = "all"  # what a warm-up pass runs: every point, or "one" per layout (its first)


@dataclass
class Timing:
    point: dict
    samples: list[float] = field(default_factory=list)  # seconds, one per repeat, in round order
    statistic: str = "median"

    @property
    def seconds(self) -> float:
        return self.value(self.statistic)

    def value(self, statistic: str) -> float:
        return float(np.min(self.samples) if statistic == "min" else np.median(self.samples))

    @property
    def spread(self) -> float:
        """Interquartile range / median of the repeats: the noise of this point."""
        if len(self.samples) < 2:
            return 0.0
        q1, q2, q3 = np.percentile(self.samples, [25, 50, 75])
        return float((q3 - q1) / q2)


# ----------------------------------------------------------------------------- layouts
def parse_layouts(text: str) -> list[tuple[int, int, int]]:
    """`tp1cp1pp1,tp2cp1pp1` (any of tp/cp/pp may be left out: `tp2` = tp2cp1pp1)."""
    import re

    out = []
    for item in (t.strip().lower() for t in text.split(",")):
        if not item:
            continue
        m = re.fullmatch(r"(?:tp(\d+))?(?:cp(\d+))?(?:pp(\d+))?", item)
        if not m or not any(m.groups()):
            raise SystemExit(f"--layouts: cannot read {item!r} (expected e.g. tp2cp1pp1)")
        out.append(tuple(int(g or 1) for g in m.groups()))
    return out


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def default_layouts(cost_model, ranks: int) -> list[tuple[int, int, int]]:
    """Every valid layout that fits the ranks without oversubscribing the CPU cores (or
    the GPUs): larger ones would time the machine's contention, not the layout."""
    return [tuple(l) for l in cost_model.all_layouts() if l.size <= ranks]


# ----------------------------------------------------------------------------- one rank
def _rank_main(rank: int, world: int, port: int, job: Job, result_dir: str) -> None:
    import warnings

    # megatron-core warns at import about missing TE/apex, once per rank: noise in a long job
    warnings.filterwarnings("ignore", category=UserWarning)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(job.threads)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    if job.cuda:
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    else:
        from dcp_ext.compat import cpu_compat

        cpu_compat.install()
        dist.init_process_group("gloo", rank=rank, world_size=world)
    spans = _measure(rank, world, job)
    with open(os.path.join(result_dir, f"{rank}.json"), "w") as f:
        json.dump(spans, f)
    dist.barrier()
    dist.destroy_process_group()


def _stage(rank: int, rep, registry, job: Job, idx: list[int], device):
    """This rank's stage model of replica `rep` (the runtime's builder and runner) and its
    share of every micro-batch in `idx`: {point index: (LocalMicroBatch, loss scale)}."""
    from dcp_ext.data.thd import build_micro_batch
    from dcp_ext.runtime.stages.model import build_gpt_model
    from dcp_ext.runtime.params.initial_values import seed_rng_tracker
    from dcp_ext.runtime.schedule.executor import StageRunner, localize

    args = job.args
    tp, cp, pp = rep.tp, rep.cp, rep.pp
    sp = bool(args.sequence_parallel) and tp > 1
    # as under --dcp: the fused loss takes the replica's TP group (the unfused one reads a global one)
    config = job.transformer_config(args, tensor_model_parallel_size=tp, context_parallel_size=cp,
                                          pipeline_model_parallel_size=pp, sequence_parallel=sp,
                                          cross_entropy_loss_fusion=True)
    tp_rank, cp_rank, pp_rank = rep.coords(rank)
    seed_rng_tracker(job.seed, 0, tp_rank)  # before the build: GPU init draws from it
    model = build_gpt_model(config, args.padded_vocab_size, args.max_position_embeddings, pp_rank == 0,
                            pp_rank == pp - 1, pg_collection=registry.collection(rep),
                            position_embedding_type=args.position_embedding_type,
                            share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                            rotary_base=args.rotary_base, rotary_percent=args.rotary_percent)
    if device is not None:
        model = model.to(device)  # dcp_ext.runtime.stages.model's torch norms are built on the CPU even with CUDA (no TE)
    runner = StageRunner(model, config, rep, rank, config.num_layers)
    vocab = min(args.padded_vocab_size, 256)
    mbs = {}
    for i in idx:
        p = job.points[i]
        gen = np.random.default_rng([job.seed, i])  # every rank of the replica draws the same tokens
        docs = [gen.integers(0, vocab, size=int(n)) for n in p["lengths"]]
        batch = build_micro_batch(docs, pad_each_to=2 * cp if cp > 1 else 1, pad_total_to=tp * cp if sp else 1)
        mbs[i] = (localize(batch, cp, cp_rank, tp, sp, config.hidden_size, p["recompute_layers"], device),
                  1.0 / max(batch.num_loss_tokens, 1))
    return runner, mbs


def _measure(rank: int, world: int, job: Job) -> list[list]:
    """Time every point on this rank. Returns [point index, round, t_start, t_end] per timed
    run this rank took part in (warm-up rounds are not returned)."""
    import torch
    import torch.distributed as dist

    from dcp_ext.compat import mcore_compat
    from dcp_ext.data.progress import Progress
    from dcp_ext.planning.layout import ReplicaType
    from dcp_ext.runtime.stages.groups import GroupRegistry

    device = torch.device("cuda", rank) if job.cuda else None
    sync = torch.cuda.synchronize if job.cuda else (lambda: None)
    mcore_compat.ensure_global_memory_buffer()
    layout_of = [(p["tp"], p["cp"], p["pp"]) for p in job.points]
    reps = {lay: ReplicaType(*lay, tuple(range(lay[0] * lay[1] * lay[2]))) for lay in dict.fromkeys(layout_of)}
    registry = GroupRegistry(list(reps.values()))  # collective: same order on every rank
    # every layout's stage at once (as the engine holds them), so rounds can mix layouts
    stages = {}
    for lay, rep in reps.items():
        if rank in rep.ranks:
            stages[lay] = _stage(rank, rep, registry, job, [i for i, l in enumerate(layout_of) if l == lay], device)
    n = len(job.points)
    order_rng = np.random.default_rng(job.seed)
    rounds = [(-1 - w, warmup_order(job)) for w in range(job.warmup)]
    rounds += [(r, order_rng.permutation(n).tolist()) for r in range(job.repeats)]
    spans: list[list] = []
    with Progress(job.desc, total=sum(len(order) for _, order in rounds), unit="run",
                  enabled=job.progress and rank == 0) as bar:
        for r, order in rounds:
            for i in order:
                stage = stages.get(layout_of[i])
                if stage is not None:
                    for prm in stage[0].model.parameters():
                        prm.grad = None
                dist.barrier()
                if stage is not None:
                    runner, (mb, scale) = stage[0], stage[1][i]
                    sync()
                    t0 = time.perf_counter()
                    runner.run([mb], scale)
                    sync()
                    t1 = time.perf_counter()
                    if r >= 0:
                        spans.append([i, r, t0, t1])
                bar.update(1, extra="warm-up" if r < 0 else f"round {r + 1}/{job.repeats}")
    return spans


def warmup_order(job: Job) -> list[int]:
    """The points a warm-up pass runs: all of them, or the first of each layout (what a layout
    pays once: its first collectives, lazy initialisation)."""
    if job.warmup_points == "all":
        return list(range(len(job.points)))
    first = {}
    for i, p in enumerate(job.points):
        first.setdefault((p["tp"], p["cp"], p["pp"]), i)
    return sorted(first.values())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def time_points(job: Job) -> list[Timing]:
    """Spawn the ranks, time `job.points`, return one Timing per point (same order)."""
    import torch.multiprocessing as mp

    if not job.points:
        return []
    world = max(p["tp"] * p["cp"] * p["pp"] for p in job.points)
    with tempfile.TemporaryDirectory() as d:
        mp.start_processes(_rank_main, args=(world, _free_port(), job, d), nprocs=world, start_method="spawn", join=True)
        spans = []
        for r in range(world):
            with open(os.path.join(d, f"{r}.json")) as f:
                spans += json.load(f)
    per_run: dict[tuple[int, int], list[float]] = {}
    for i, r, t0, t1 in spans:
        got = per_run.setdefault((i, r), [math.inf, -math.inf])
        got[0], got[1] = min(got[0], t0), max(got[1], t1)
    out = [Timing(p, statistic=job.statistic) for p in job.points]
    for (i, _), (t0, t1) in sorted(per_run.items()):
        out[i].samples.append(t1 - t0)
    return out


# ----------------------------------------------------------------------------- the CLI
def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="dcp-profile", allow_abbrev=False,
        description="Time forward+backward micro-batches of a Megatron model over a grid of lengths and layouts, "
                    "fit the cost model, save the profile. Other flags are Megatron's (or --yaml-cfg FILE).")
    p.add_argument("--nproc", type=int, default=None,
                   help="ranks available (CPU: gloo ranks, default 4; CUDA: GPUs, default all); also the cluster size "
                        "the profile is for")
    p.add_argument("--max-seq-len", type=int, default=None, help="longest micro-batch in the grid (default --dcp-max-seq-len)")
    p.add_argument("--min-seq-len", type=int, default=32)
    p.add_argument("--quick", action="store_true",
                   help="a rough profile in about a minute on the demo (2 cores): --points 3 --docs-per-pack 1,4 "
                        "--repeats 1 --warmup-points one; flags given explicitly win")
    p.add_argument("--points", type=int, default=None,
                   help="micro-batch lengths per layout, geometric from --min-seq-len (default 6; --quick 3)")
    p.add_argument("--docs-per-pack", default=None,
                   help="documents packed per micro-batch (equal lengths; default 1,2,4; --quick 1,4)")
    p.add_argument("--recompute", default="none,full", help="none, full or both (comma separated)")
    p.add_argument("--repeats", type=int, default=None, help="timed runs per point (default 5; --quick 1)")
    p.add_argument("--statistic", choices=["median", "min"], default="median",
                   help="what a record keeps of its repeats: the median (default), or the fastest (what the machine "
                        "does without other load, for a shared machine)")
    p.add_argument("--warmup", type=int, default=1, help="untimed passes over each layout's points first")
    p.add_argument("--warmup-points", choices=["all", "one"], default=None,
                   help="what a warm-up pass runs: every point (default) or one per layout (--quick)")
    p.add_argument("--layouts", default=None,
                   help="e.g. tp1cp1pp1,tp2cp1pp1,tp1cp2pp1,tp1cp1pp2 (default: every valid layout of at most "
                        "min(nproc, cores) ranks)")
    p.add_argument("--profile-layers", type=int, default=None,
                   help="time a model with this many layers and extrapolate (DCP-style); default: all layers")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank on the CPU")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--out", default="profile.json")
    p.add_argument("--quiet", action="store_true", help="no progress bar, no header line")
    return p


# The grid's size: the full default, and --quick's (a first look on a laptop)
FULL = {"points": 6, "docs_per_pack": "1,2,4", "repeats": 5, "warmup_points": "all"}
QUICK = {"points": 3, "docs_per_pack": "1,4", "repeats": 1, "warmup_points": "one"}


def fill_grid_defaults(ours) -> None:
    """--quick's or the full grid's values for the grid flags not given explicitly."""
    for dest, value in (QUICK if ours.quick else FULL).items():
        if getattr(ours, dest) is None:
            setattr(ours, dest, value)


# Bad flags end in SystemExit(message), as parse_layouts always did: the tool's boundary
# (dcp_ext.cli.boundary.run_tool) says the message in one `error:` line, exit 2.
_AT_LEAST = (("--nproc", "nproc", 1), ("--points", "points", 1), ("--repeats", "repeats", 1),
             ("--warmup", "warmup", 0), ("--threads", "threads", 1), ("--min-seq-len", "min_seq_len", 1),
             ("--max-seq-len", "max_seq_len", 1), ("--profile-layers", "profile_layers", 1))


def check_flags(ours) -> None:
    """Our own flags' ranges and spellings, before anything is parsed, built or started."""
    fill_grid_defaults(ours)
    for flag, dest, low in _AT_LEAST:
        value = getattr(ours, dest)
        if value is not None and value < low:
            raise SystemExit(f"{flag} {value} must be >= {low}")
    if ours.max_seq_len is not None and ours.max_seq_len < ours.min_seq_len:
        raise SystemExit(f"--max-seq-len {ours.max_seq_len} is below --min-seq-len {ours.min_seq_len}")
    recompute_options(ours)
    docs_per_pack(ours)
    if ours.layouts:
        parse_layouts(ours.layouts)


def recompute_options(ours) -> tuple[str, ...]:
    rc = tuple(r.strip() for r in ours.recompute.split(",") if r.strip())
    if not rc or set(rc) - {"none", "full"}:
        raise SystemExit(f"--recompute {ours.recompute!r}: expected none, full or none,full")
    return rc


def docs_per_pack(ours) -> tuple[int, ...]:
    items = [k.strip() for k in ours.docs_per_pack.split(",")]
    if not items or not all(k.isdigit() and int(k) >= 1 for k in items):
        raise SystemExit(f"--docs-per-pack {ours.docs_per_pack!r}: expected positive integers, comma separated "
                         "(e.g. 1,2,4)")
    return tuple(int(k) for k in items)


def pad_vocab(args, tps: Sequence[int]) -> None:
    """One padded vocabulary for every profiled TP size (as the --dcp training loop pads it)."""
    from dcp_ext.data.tokenizers import padded_vocab_size

    args.padded_vocab_size = padded_vocab_size(args.unpadded_vocab_size, args.make_vocab_size_divisible_by,
                                               math.lcm(*tps))


def model_name(argv: Sequence[str]) -> str:
    argv = list(argv)
    if "--yaml-cfg" in argv:
        return os.path.splitext(os.path.basename(argv[argv.index("--yaml-cfg") + 1]))[0]
    return "megatron-args"


@dataclass
class Setup:
    ours: argparse.Namespace
    side: TrainingSide
    args: argparse.Namespace  # Megatron's, for the model that is timed
    spec: "object"  # ModelSpec of the model the profile is for (all layers)
    timed: "object"  # CostModel of the timed model (fewer layers with --profile-layers)
    cluster: "object"
    layouts: list
    cuda: bool


def setup(argv: Sequence[str] | None, side: TrainingSide) -> Setup:
    """Parse our flags and Megatron's (the rest), choose the layouts, pad the vocabulary."""
    import torch

    from dcp_ext.planning.cost_model import CostModel, Layout
    from dcp_ext.planning.specs import ClusterSpec

    ours, rest = build_parser().parse_known_args(argv)
    check_flags(ours)
    cuda = torch.cuda.is_available()
    nproc = ours.nproc if ours.nproc is not None else (torch.cuda.device_count() if cuda else 4)
    args = side.parse_args(rest, nproc)
    check_output("--out", ours.out, make_folder=True)  # before the timing (minutes), not after
    pad_vocab(args, [1])
    if cuda:
        cluster = side.cluster_for(nproc, args)
    else:
        cluster = ClusterSpec.cpu_gloo(nproc)
    cm = CostModel(side.model_spec(args, model_name(rest)), cluster)
    if ours.layouts:
        layouts = parse_layouts(ours.layouts)
        for lay in layouts:
            if not cm.layout_valid(Layout(*lay)) or lay[0] * lay[1] * lay[2] > nproc:
                raise SystemExit(f"--layouts: tp{lay[0]}cp{lay[1]}pp{lay[2]} is not valid for this model on {nproc} "
                                 "ranks (heads and groups divisible by tp, layers by pp, tp*cp*pp <= --nproc)")
    else:
        ranks = nproc if cuda else min(nproc, usable_cores())
        layouts = default_layouts(cm, ranks)
        skipped = [lay for lay in default_layouts(cm, nproc) if lay not in layouts]
        if skipped and not ours.quiet:  # a shortfall of what --nproc asks: said, not silent
            print(f"dcp-profile: layouts of more than {ranks} ranks are not timed ("
                  f"{', '.join(f'tp{a}cp{b}pp{c}' for a, b, c in skipped)}): this machine has {ranks} cores for "
                  f"--nproc {nproc}, and timing them would measure the cores' contention; the cost model prices "
                  "them by the timed layouts' ratios to its analytic prices", file=sys.stderr)
    pad_vocab(args, [lay[0] for lay in layouts])
    spec = side.model_spec(args, model_name(rest))
    if ours.profile_layers:
        if any(ours.profile_layers % lay[2] for lay in layouts):
            raise SystemExit(f"--profile-layers {ours.profile_layers} is not divisible by every layout's pp")
        args.num_layers = ours.profile_layers
    timed = CostModel(side.model_spec(args, spec.name), cluster)
    return Setup(ours, side, args, spec, timed, cluster, layouts, cuda)


def grid(ours, cm, layouts, max_len: int) -> list[dict]:
    from dcp_ext.planning.profile import profile_grid

    if max_len < ours.min_seq_len:
        raise SystemExit(f"the longest micro-batch, {max_len} tokens (--max-seq-len, else the model's "
                         f"--dcp-max-seq-len or --seq-length), is below --min-seq-len {ours.min_seq_len}")
    return profile_grid(cm, max_len, layouts=layouts, recompute=recompute_options(ours), points=ours.points,
                        docs_per_pack=docs_per_pack(ours), min_len=ours.min_seq_len)


def summarize(profile, timings: list[Timing], out=None) -> None:
    from dcp_ext.planning.profile import evaluate_profile, fit_profile, split_holdout

    out = out or sys.stdout  # the stream of the call, not of the import

    spreads = [t.spread for t in timings]
    print(f"{len(profile.records)} records, {len(profile.fits)} strategies; repeat spread (IQR/median): "
          f"median {100 * float(np.median(spreads)):.1f}%, worst {100 * max(spreads):.1f}%", file=out)
    for key, f in sorted(profile.fits.items()):
        print(f"  tp{key[0]}cp{key[1]}pp{key[2]} recompute {key[3]}: c0 {1e3 * f.c0:7.2f} ms  "
              f"b {1e6 * f.b:7.2f} us/token  a {1e9 * f.a:7.3f} ns/token^2  c {1e3 * f.c:6.2f} ms/doc  "
              f"fit rms {100 * f.rms_rel_err:4.1f}% on {f.n}", file=out)
    fit, held = split_holdout(profile.records)
    if held:
        err = evaluate_profile(fit_profile(fit), held)
        print(f"held-out lengths (refit without them): mean absolute error {err:.1f}% on {len(held)} records", file=out)


def job_for(st: Setup, points: list[dict], desc: str = "dcp-profile", seed_offset: int = 0) -> Job:
    o = st.ours
    return Job(st.args, points, o.repeats, o.warmup, o.seed + seed_offset, st.cuda, o.threads, not o.quiet, desc,
               o.statistic, st.side.transformer_config, warmup_points=o.warmup_points)


def records(timings: list[Timing], num_layers: int, statistic: str | None = None) -> list:
    """ProfileRecords of timed grid points (each timing's own statistic unless one is named)."""
    from dcp_ext.planning.profile import ProfileRecord

    return [ProfileRecord(t.point["tp"], t.point["cp"], t.point["pp"], t.point["recompute_layers"],
                          [int(n) for n in t.point["lengths"]], t.value(statistic or t.statistic), num_layers=num_layers)
            for t in timings]


def planned_runs(job: Job) -> int:
    return len(job.points) * job.repeats + len(warmup_order(job)) * job.warmup


def estimate_s(st: Setup, job: Job) -> float:
    """Seconds the analytic cost model gives the planned runs (one micro-batch alone on its
    replica, per warm-up and timed round that runs it)."""
    from dcp_ext.planning.cost_model import Layout

    def price(p):
        lay = Layout(p["tp"], p["cp"], p["pp"])
        return st.timed.mb_replica_time(p["lengths"], lay, st.timed.stage_recompute(lay, p["recompute_layers"]))

    return (job.repeats * sum(price(p) for p in job.points)
            + job.warmup * sum(price(job.points[i]) for i in warmup_order(job)))


def run_profile(st: Setup):
    """Time the grid, fit, save. Returns (Profile, Timings)."""
    from dcp_ext.planning.profile import fit_profile

    ours, args = st.ours, st.args
    max_len = ours.max_seq_len or args.dcp_max_seq_len or args.seq_length
    points = grid(ours, st.timed, st.layouts, max_len)
    if not points:
        raise SystemExit("the grid is empty: no micro-batch of --min-seq-len..--max-seq-len fits the layouts' "
                         "context parallelism; raise --min-seq-len or choose other --layouts")
    job = job_for(st, points)
    if not ours.quiet:
        warm = len(warmup_order(job))
        print(f"dcp-profile: model {st.spec.name} ({args.num_layers} of {st.spec.num_layers} layers timed, hidden "
              f"{st.spec.hidden_size}), {st.cluster.name}, layouts "
              f"{', '.join(f'tp{a}cp{b}pp{c}' for a, b, c in st.layouts)}; {len(points)} micro-batches x "
              f"{ours.repeats} timed + {ours.warmup} warm-up pass{'es' if ours.warmup != 1 else ''} of "
              f"{'every one' if warm == len(points) else f'{warm} (one per layout)'} = {planned_runs(job)} runs"
              f"{' (--quick: a rough profile)' if ours.quick else ''}", file=sys.stderr)
        print(f"dcp-profile: the analytic cost model expects about {estimate_s(st, job):.0f} s of runs after the "
              "ranks start; a busy machine takes longer (the progress line's eta follows the measured rate)",
              file=sys.stderr, flush=True)
    timings = time_points(job)
    profile = fit_profile(records(timings, args.num_layers), model=st.spec.to_json(), cluster=st.cluster.to_json())
    with writing("--out", ours.out, "the profile"):
        os.makedirs(os.path.dirname(os.path.abspath(ours.out)), exist_ok=True)
        profile.save(ours.out)
    return profile, timings


def main(argv: Sequence[str] | None, side: TrainingSide) -> int:
    return run_tool(lambda: _main(argv, side), errors={kind: 2 for kind in side.argument_errors})


def _main(argv: Sequence[str] | None, side: TrainingSide) -> int:
    t0 = time.perf_counter()
    st = setup(argv, side)
    profile, timings = run_profile(st)
    summarize(profile, timings)
    print(f"wrote {st.ours.out} ({time.perf_counter() - t0:.0f} s); use it with --dcp-cost-profile or dcp-plan --profile")
    return 0
