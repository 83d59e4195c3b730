"""Scale check without GPUs: one rank's engine state at 7B-70B, next to the cost model.

For one rank of a 64-rank world (default: the worst one, the rank whose replica types
hold the largest stage), this builds the AdaptiveEngine exactly as `--dcp` training does
(Megatron flags -> `transformer_config_from_args` + `pretrain_gpt_dcp.model_provider`, the
adaptive planner's real pool of replica types) with every tensor on the meta device and
torch's `fake` process-group backend, so a 70B stage costs no memory and no GPU. It prints
that rank's persistent bytes by kind (`AdaptiveEngine.persistent_bytes()`) beside the cost
model's figure (`CostModel.state_bytes` of the layouts the rank plays; after the pool is
chosen every layout is charged the pool's largest stage), the relative difference, the
largest activation peak of the rank's replicas over a few planned real batches
(`simulate_iteration`, peak minus state) and the planning capacity, with a verdict:
OK when engine bytes + peak activations fit the capacity, OVER otherwise.

- worst rank: the largest `ModelSpec.local_stage_params(tp, pp)` over the replica types the
  rank belongs to (ties: the rank whose own pipeline stage there is heaviest, then the lowest);
- data: global batches by docs/contracts.md's rule from the shipped length file (default
  data/lengths/code_python_cl100k.txt, the same file as /work/shared/data/lengths/);
- capacity: `CostModel.capacity_bytes` (device memory less --dcp-memory-margin and the GPU
  kind's reserved bytes): the budget the planner packs to and the planner's post-condition (`PlannerBase.plan`)
  enforces; the device's own memory is printed beside it;
- vocabulary: a Llama-2 tokenizer's 32000 ids; the planner's ModelSpec sees them padded as
  pretrain() pads them (x --tensor-model-parallel-size), the engine as AdaptiveRun pads
  them (x lcm of the pool's tp sizes), as in a real `--dcp` run.

    .venv/bin/python scripts/scale_check.py                       # llama2-7b, -13b, -70b on h200x64
    .venv/bin/python scripts/scale_check.py --model llama2-70b --rank 5
    .venv/bin/python scripts/scale_check.py --small               # 2 layers, hidden 256, 8 ranks (tests)
    .venv/bin/python scripts/scale_check.py --json out.json
    .venv/bin/python scripts/scale_check.py --communicators       # the communicator bound, h200x64 and h200x1024

Progress goes to stderr, the table to stdout. Exit status 0 when every engine/cost-model
difference is within --tolerance and every verdict is OK, 1 otherwise.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

GB = 1e9

# Megatron shapes (the ModelSpec presets' numbers): layers, hidden, heads, query groups, ffn, vocab
SHAPES = {
    "llama2-7b": (32, 4096, 32, 32, 11008, 32000),
    "llama2-13b": (40, 5120, 40, 40, 13824, 32000),
    "llama2-70b": (80, 8192, 64, 8, 28672, 32000),
    # --small: GQA like 70B, every tp up to 4 valid, vocabulary a multiple of 128*8 (no padding)
    "small": (2, 256, 8, 4, 704, 1024),
}
SMALL_WORLD = 8
LENGTHS_FILE = "code_python_cl100k.txt"  # shipped: data/lengths/ (= /work/shared/data/lengths/)
KINDS = ("parameters", "main_grads", "master", "grad_shard", "adam", "exchange")


def log(msg: str) -> None:
    print(f"[scale_check {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- setup
def megatron_argv(name: str, max_seq_len: int, global_batch_tokens: int, seed: int) -> list[str]:
    layers, hidden, heads, groups, ffn, vocab = SHAPES[name]
    seq = 4096 if name != "small" else 1024
    return [
        "--num-layers", str(layers), "--hidden-size", str(hidden), "--num-attention-heads", str(heads),
        "--num-query-groups", str(groups), "--ffn-hidden-size", str(ffn), "--vocab-size", str(vocab),
        "--seq-length", str(seq), "--max-position-embeddings", str(seq),
        "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--norm-epsilon", "1e-5",
        "--swiglu", "--untie-embeddings-and-output-weights", "--disable-bias-linear",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--init-method-std", "0.02",
        "--make-vocab-size-divisible-by", "128", "--bf16",
        # as examples/train_llama2_7b.sh launches it (the static tp flag only validates SP)
        "--tensor-model-parallel-size", "2", "--sequence-parallel",
        "--lr", "3e-4", "--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.95",
        "--adam-eps", "1e-5", "--clip-grad", "1.0", "--train-iters", "1", "--seed", str(seed),
        "--tokenizer-type", "NullTokenizer", "--data-path", "unused",
        "--dcp", "--dcp-planner", "adaptive", "--dcp-global-batch-tokens", str(global_batch_tokens),
        "--dcp-max-seq-len", str(max_seq_len),
    ]


def load_lengths(path: str):
    import numpy as np

    with open(path) as f:
        return np.asarray([int(x) for x in f.read().split()], dtype=np.int64)


def build_planner(args, cluster_name: str, lengths, sample_count: int, layouts: str | None = None):
    """The planner `--dcp` training builds (training_adaptive.build_planner), on a named cluster,
    with its reserve of layouts for re-choosing the pool (`--dcp-recalibration on`, the
    default); `layouts`: a fixed pool ("1xtp2cp1pp2+1xtp4cp1pp1") instead of the pool search."""
    from dcp_ext.planning.planner import make_planner
    from dcp_ext.planning.specs import ClusterSpec
    from megatron.training.adaptive.run_config import model_spec_for

    model = model_spec_for(args, name=args.model_name)
    cluster = ClusterSpec.from_preset(cluster_name)
    sample = [int(x) for x in (lengths if len(lengths) <= 200_000 else lengths[:200_000])]
    planner = make_planner(args.dcp_planner, model, cluster, max_seq_len=args.dcp_max_seq_len,
                           global_batch_tokens=args.dcp_global_batch_tokens, length_sample=sample,
                           memory_margin=args.dcp_memory_margin, seed=args.seed, sample_count=sample_count,
                           **({"layouts": [layouts]} if layouts else {"rechoose_pool": True}))
    return planner


def spec_differences(spec, preset_name: str) -> dict:
    """Fields where run_config.model_spec_for differs from the preset (name, seq_length aside)."""
    from dcp_ext.planning.specs import MODEL_PRESETS

    if preset_name not in MODEL_PRESETS:
        return {}
    preset = MODEL_PRESETS[preset_name]
    out = {}
    for f in dataclasses.fields(spec):
        if f.name in ("name", "seq_length"):
            continue
        a, b = getattr(spec, f.name), getattr(preset, f.name)
        if a != b:
            out[f.name] = (a, b)
    return out


def rank_stage_params(spec, tp: int, pp: int, pp_rank: int) -> float:
    """Parameters one rank holds for stage `pp_rank` of (tp, pp) (ModelSpec.local_stage_params
    is the heaviest stage; this one tells the first, middle and last stages apart)."""
    h = spec.hidden_size
    layer = (spec.layer_params - 2 * h) / tp + 2 * h
    emb = spec.embedding_params / tp
    out = spec.num_layers // pp * layer
    if pp_rank == 0:
        out += emb
    if pp_rank == pp - 1:
        out += h + (emb if (spec.untie_embeddings_and_output_weights or pp > 1) else 0.0)
    return out


def worst_rank(planner) -> int:
    """The rank whose replica types hold the largest stage: ModelSpec.local_stage_params of its
    largest (tp, pp); ties go to the rank whose own stage there is heaviest, then the lowest."""
    spec = planner.model
    best = None
    for r in range(planner.cluster.num_gpus):
        heaviest, own = 0.0, 0.0
        for tp, cp, pp, ranks in ((t.tp, t.cp, t.pp, t.ranks) for t in planner.replica_types()):
            if r not in ranks:
                continue
            local = spec.local_stage_params(tp, pp)
            pp_rank = ranks.index(r) // (tp * cp)
            heaviest = max(heaviest, local)
            own = max(own, rank_stage_params(spec, tp, pp, pp_rank))
        key = (heaviest, own, -r)
        if best is None or key > best[0]:
            best = (key, r)
    return best[1]


def init_fake_world(rank: int, world: int) -> None:
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())


def build_engine(args, planner):
    """AdaptiveEngine on the meta device, as training_adaptive.AdaptiveRun builds it."""
    import pretrain_gpt_dcp as entry
    from dcp_ext.runtime.engine import AdaptiveEngine
    from megatron.training import global_vars
    from megatron.training.adaptive.run_config import AdaptiveRunConfig
    from megatron.training.flags.core_configs import transformer_config_from_args

    types = planner.replica_types()
    global_vars.set_args(args)  # args.padded_vocab_size: set before planning, as training does

    def make_config(tp, cp, pp, sp):
        return transformer_config_from_args(args, tensor_model_parallel_size=tp, context_parallel_size=cp,
                                            pipeline_model_parallel_size=pp, sequence_parallel=sp)

    def build_model(config, pre, post, pg):
        return entry.model_provider(config, pre_process=pre, post_process=post, pg_collection=pg)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # as on the GPUs it stands for: overlap as the flags ask
        engine = AdaptiveEngine(types, make_config, build_model,
                                AdaptiveRunConfig.from_args(args, on_cpu=False, device="meta").engine)
    return engine


def cost_model_bytes(cm, layout) -> dict[str, float]:
    """CostModel.state_bytes(layout), split into the engine's kinds (the same terms) and the
    communicators' buffers beyond the GPU kind's reserve (NCCL's, not the engine's)."""
    m = cm.model
    buffer = cm.buffer_params_for(layout)
    opt = m.num_params * m.optimizer_bytes_per_param / cm.cluster.num_gpus
    out = {"parameters": buffer * m.param_bytes, "main_grads": buffer * m.grad_bytes,
           "master": opt * 4 / 16, "grad_shard": opt * 4 / 16, "adam": opt * 8 / 16, "exchange": cm.exchange_bytes,
           "communicators": cm.communicator_bytes}
    total = cm.state_bytes(layout)
    assert math.isclose(sum(out.values()), total, rel_tol=1e-9), (out, total)
    return out


def activation_peaks(planner, rank: int, lengths, iterations: int) -> dict:
    """Plan the first `iterations` global batches (docs/contracts.md's rule) and take, for the replica
    holding `rank`, simulate_iteration's peak minus the layout's state."""
    import numpy as np

    from dcp_ext.planning.batching import global_batches
    from dcp_ext.planning.cost_model import Layout
    from dcp_ext.planning.simulator import simulate_iteration

    cm = planner.cm
    truncated = np.minimum(lengths, planner.max_seq_len)
    batches = global_batches(truncated.tolist(), planner.global_batch_tokens, planner.max_seq_len, count=iterations)
    best = {"activation_bytes": 0.0, "iteration": None, "layout": None, "planned": []}
    for i, ids in enumerate(batches):
        t0 = time.perf_counter()
        it = planner.plan_iteration(i, ids, truncated[ids].tolist())
        res = simulate_iteration(cm, it, dict(zip(ids, truncated[ids].tolist())))
        for rep, rr in zip(it.replicas, res.replicas):
            if rank in rep.ranks:
                lay = Layout(rep.tp, rep.cp, rep.pp)
                act = rr.peak_bytes - cm.state_bytes(lay)
                best["planned"].append({"iteration": i, "layout": str(lay), "activation_bytes": act,
                                        "micro_batches": len(rep.micro_batches),
                                        "recomputed": sum(1 for mb in rep.micro_batches if mb.recompute_layers)})
                if act >= best["activation_bytes"]:
                    best.update(activation_bytes=act, iteration=i, layout=str(lay))
        log(f"  iteration {i}: {len(ids)} documents, {sum(truncated[ids].tolist())} tokens, "
            f"{len(it.replicas)} replicas, planned in {time.perf_counter() - t0:.1f} s")
    return best


# ----------------------------------------------------------------------------- one model
def check_model(name: str, cluster: str, rank: int | None, iterations: int, max_seq_len: int,
                global_batch_tokens: int, sample_count: int, lengths_path: str, seed: int = 1234,
                fixed_pool: str | None = None) -> dict:
    import numpy as np
    import torch.distributed as dist

    from dcp_ext.planning.layout import communicators_per_rank
    from dcp_ext.planning.cost_model import Layout
    from megatron.training.arguments import parse_args

    t_start = time.perf_counter()
    from dcp_ext.planning.specs import ClusterSpec

    world = ClusterSpec.from_preset(cluster).num_gpus
    args = parse_args(megatron_argv(name, max_seq_len, global_batch_tokens, seed), world_size=world)
    args.model_name = name
    # a Llama-2 tokenizer: 32000 ids (NullTokenizer's EOD would add one), padded as training
    # pads it before planning: for every tp the planner may choose on this cluster
    from megatron.training.adaptive.run_config import vocab_padding_for

    args.tokenizer_vocab = SHAPES[name][5]
    args.padded_vocab_size = vocab_padding_for(args, args.tokenizer_vocab, ClusterSpec.from_preset(cluster))
    lengths = load_lengths(lengths_path)
    pool = f"fixed pool {fixed_pool}" if fixed_pool else f"sample_count {sample_count}"
    log(f"{name}: planning the pool (adaptive planner, {cluster}, {os.path.basename(lengths_path)}, "
        f"max-seq-len {max_seq_len}, {global_batch_tokens} tokens per batch, {pool})")
    t0 = time.perf_counter()
    planner = build_planner(args, cluster, np.minimum(lengths, max_seq_len), sample_count, fixed_pool)
    plan_build_s = time.perf_counter() - t0
    cm = planner.cm
    log(f"{name}: {planner.describe()} ({plan_build_s:.0f} s)")
    diffs = spec_differences(planner.model, name)
    if diffs:
        log(f"{name}: run_config.model_spec_for differs from the preset: {diffs}")
    chosen = worst_rank(planner) if rank is None else rank
    if not 0 <= chosen < world:
        raise SystemExit(f"--rank {chosen}: the world has {world} ranks")
    mine = [(tp, cp, pp, ranks) for tp, cp, pp, ranks in ((t.tp, t.cp, t.pp, t.ranks) for t in planner.replica_types()) if chosen in ranks]
    layouts = sorted({Layout(tp, cp, pp) for tp, cp, pp, _ in mine})
    labels = []
    for tp, cp, pp, ranks in sorted(mine):
        stage = ranks.index(chosen) // (tp * cp)
        labels.append(f"{Layout(tp, cp, pp)}" + (f"[s{stage}]" if pp > 1 else ""))

    log(f"{name}: building rank {chosen}'s engine on meta/fake ({len(planner.replica_types())} replica types, "
        f"{len(mine)} on this rank: {', '.join(labels)})")
    t0 = time.perf_counter()
    init_fake_world(chosen, world)
    engine = build_engine(args, planner)
    engine_build_s = time.perf_counter() - t0
    held = engine.persistent_bytes()
    stage_numel = {f"{s.rep.label()}[s{s.rep.coords(chosen)[2]}]@{s.rep.ranks[0]}-{s.rep.ranks[-1]}": s.numel
                   for s in engine.bank.stages.values()}
    log(f"{name}: engine built in {engine_build_s:.1f} s: {engine.space.numel:,} parameters, "
        f"{engine.registry.num_groups} process groups, {engine.sharding.num_buckets} buckets, "
        f"stages {stage_numel}")

    # communicators: the planner's count (every registered type's groups) and the engine's own
    mine_comms = communicators_per_rank(planner.replica_types(), world)
    engine_comms = sum(1 for ranks in engine.registry.rank_sets() if len(ranks) > 1 and chosen in ranks)
    per_layout = {str(l): cost_model_bytes(cm, l) for l in layouts}
    worst_layout = max(layouts, key=lambda l: cm.state_bytes(l))
    cm_kinds = per_layout[str(worst_layout)]
    comm_bytes = cm_kinds.pop("communicators")  # NCCL's buffers: beside the engine's kinds, in the need
    cm_total = cm.state_bytes(worst_layout) - comm_bytes
    engine_total = float(sum(held.values()))
    rel = (engine_total - cm_total) / cm_total
    kind_diff = {k: (held.get(k, 0) - cm_kinds.get(k, 0.0)) for k in sorted(set(held) | set(cm_kinds))}

    log(f"{name}: planning {iterations} iterations for the activation peak")
    act = activation_peaks(planner, chosen, lengths, iterations)
    capacity = cm.capacity_bytes
    need = engine_total + comm_bytes + act["activation_bytes"]
    verdict = "OK" if need <= capacity * (1 + 1e-9) else "OVER"
    dist.destroy_process_group()
    return {
        "model": name, "cluster": cluster, "world": world, "rank": chosen, "lengths": lengths_path,
        "max_seq_len": max_seq_len, "global_batch_tokens": global_batch_tokens, "sample_count": sample_count,
        "pool": planner.describe(), "replica_types": labels, "layouts": [str(l) for l in layouts],
        "engine_bytes": {k: int(v) for k, v in held.items()}, "engine_total_bytes": engine_total,
        "cost_model_bytes": cm_kinds, "cost_model_total_bytes": cm_total, "cost_model_layout": str(worst_layout),
        "cost_model_per_layout_total": {k: sum(v.values()) for k, v in per_layout.items()},
        "kind_diff_bytes": kind_diff, "rel_diff": rel,
        "engine_params": {"canonical": engine.space.numel, "buffer": engine.bank.params.numel(),
                          "shard": engine.sharding.shard_numel(chosen), "stages": stage_numel,
                          "bucket_numel": engine.sharding.bucket_numel, "max_bucket_numel": engine.sharding.max_bucket_numel,
                          "padded_vocab_size": args.padded_vocab_size},
        "cost_model_params": {"num_params": cm.model.num_params, "buffer": max(cm.buffer_params, max(
            cm.model.local_stage_params(l.tp, l.pp) for l in layouts)), "vocab_size": cm.model.vocab_size},
        "spec_vs_preset": {k: list(v) for k, v in diffs.items()},
        "activation_bytes": act["activation_bytes"], "activation_iteration": act["iteration"],
        "activation_layout": act["layout"], "planned": act["planned"],
        "capacity_bytes": capacity, "device_bytes": cm.cluster.gpu.memory_bytes,
        "need_bytes": need, "verdict": verdict,
        "communicators": {"rank": mine_comms[chosen], "engine_rank": engine_comms, "most": max(mine_comms),
                          "charged": cm.communicators, "reserved": cm.cluster.gpu.reserved_communicators,
                          "bytes_each": cm.cluster.gpu.communicator_bytes, "charged_bytes": comm_bytes},
        "plan_build_s": plan_build_s, "engine_build_s": engine_build_s, "wall_s": time.perf_counter() - t_start,
    }


# ----------------------------------------------------------------------------- communicators at any scale
def communicator_bound(name: str, cluster_name: str, reserve: int = 16) -> dict:
    """Communicators per rank (process groups of 2+ ranks) the adaptive planner's registered
    types can make on `cluster_name`, without planning: with every layout of `name` valid
    there registered on every aligned block (what no pool exceeds), and the most any reserve
    of `reserve` layouts (--dcp-candidates) can make (the sum of the `reserve` largest
    per-layout counts: a union of groups is no larger than the sum).
    Each figure is the busiest rank's, with what it would be charged."""
    from dcp_ext.planning.cost_model import CostModel
    from dcp_ext.planning.layout import ReplicaType, communicators_per_rank
    from dcp_ext.planning.specs import MODEL_PRESETS, ClusterSpec

    cluster = ClusterSpec.from_preset(cluster_name)
    cm = CostModel(MODEL_PRESETS[name], cluster)
    layouts = cm.all_layouts()
    n = cluster.num_gpus

    def aligned(l):
        return [ReplicaType(l.tp, l.cp, l.pp, tuple(range(s, s + l.size))) for s in range(0, n, l.size)]

    def charged(count):
        cm.communicators = count
        return cm.communicator_bytes

    every = max(communicators_per_rank([t for l in layouts for t in aligned(l)], n))
    per_layout = sorted((max(communicators_per_rank(aligned(l), n)) for l in layouts), reverse=True)
    bounded = min(every, sum(per_layout[:reserve]))
    return {"model": name, "cluster": cluster_name, "layouts": len(layouts), "every_layout": every,
            "every_layout_bytes": charged(every), "reserve": reserve, "reserve_bound": bounded,
            "reserve_bound_bytes": charged(bounded)}


def format_bounds(bounds: list[dict]) -> str:
    out = ["communicators per rank (the busiest rank; charged beyond the 8 of the GPU kind's reserve, 0.25 GiB each):"]
    for b in bounds:
        out.append(f"  {b['model']} on {b['cluster']}: every one of its {b['layouts']} layouts registered: "
                   f"{b['every_layout']} ({b['every_layout_bytes'] / GB:.2f} GB); a reserve of {b['reserve']} layouts: "
                   f"at most {b['reserve_bound']} ({b['reserve_bound_bytes'] / GB:.2f} GB)")
    return "\n".join(out)


# ----------------------------------------------------------------------------- output
def format_table(results: list[dict]) -> str:
    cols = ["model", "rank", "replica types on it"] + [f"{k} GB" for k in KINDS] + \
           ["engine GB", "cost model GB", "diff %", "comms", "comms GB", "peak act GB", "need GB", "capacity GB",
            "device GB", "verdict"]
    rows = []
    for r in results:
        e = r["engine_bytes"]
        rows.append([r["model"], str(r["rank"]), " ".join(r["replica_types"])]
                    + [f"{e.get(k, 0) / GB:.3f}" for k in KINDS]
                    + [f"{r['engine_total_bytes'] / GB:.3f}", f"{r['cost_model_total_bytes'] / GB:.3f}",
                       f"{100 * r['rel_diff']:+.2f}", f"{r['communicators']['rank']}/{r['communicators']['most']}",
                       f"{r['communicators']['charged_bytes'] / GB:.2f}",
                       f"{r['activation_bytes'] / GB:.2f}", f"{r['need_bytes'] / GB:.2f}",
                       f"{r['capacity_bytes'] / GB:.2f}", f"{r['device_bytes'] / GB:.0f}", r["verdict"]])
    w = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(cols)]
    line = lambda xs: "| " + " | ".join(x.ljust(w[i]) for i, x in enumerate(xs)) + " |"  # noqa: E731
    return "\n".join([line(cols), "|" + "|".join("-" * (x + 2) for x in w) + "|"] + [line(r) for r in rows])


def format_details(r: dict, tolerance: float) -> str:
    out = [f"{r['model']} on {r['cluster']} (rank {r['rank']} of {r['world']}): pool {r['pool']}"]
    out.append(f"  engine: {r['engine_params']['canonical']:,} canonical parameters, buffer {r['engine_params']['buffer']:,}"
               f" (stages {r['engine_params']['stages']}), shard {r['engine_params']['shard']:,}, "
               f"bucket {r['engine_params']['bucket_numel']:,}, padded vocab {r['engine_params']['padded_vocab_size']}")
    out.append(f"  cost model: {r['cost_model_params']['num_params']:,} parameters, buffer "
               f"{r['cost_model_params']['buffer']:,.0f}, vocab {r['cost_model_params']['vocab_size']}; "
               f"state_bytes per layout (GB): " + ", ".join(f"{k} {v / GB:.3f}" for k, v in r["cost_model_per_layout_total"].items()))
    out.append("  by kind, engine - cost model (GB): " + ", ".join(
        f"{k} {r['engine_bytes'].get(k, 0) / GB:.3f} - {r['cost_model_bytes'].get(k, 0) / GB:.3f} = {d / GB:+.4f}"
        for k, d in r["kind_diff_bytes"].items()))
    if r["spec_vs_preset"]:
        out.append(f"  run_config.model_spec_for vs preset (args, preset): {r['spec_vs_preset']}")
    out.append(f"  activations: peak {r['activation_bytes'] / GB:.2f} GB at iteration {r['activation_iteration']} "
               f"({r['activation_layout']}); per planned iteration: " + ", ".join(
                   f"{p['iteration']}:{p['layout']} {p['activation_bytes'] / GB:.2f} GB ({p['micro_batches']} mb, "
                   f"{p['recomputed']} recomputed)" for p in r["planned"]))
    c = r["communicators"]
    out.append(f"  communicators (process groups of 2+ ranks): {c['rank']} on this rank (the engine created "
               f"{c['engine_rank']}), {c['most']} on the busiest rank; charged {c['charged']} - {c['reserved']} in the "
               f"reserve = {max(0, c['charged'] - c['reserved'])} x {c['bytes_each'] / 2**30:.2f} GiB = {c['charged_bytes'] / GB:.2f} GB")
    flag = "within" if abs(r["rel_diff"]) <= tolerance else "BEYOND"
    out.append(f"  engine vs cost model {100 * r['rel_diff']:+.2f}% ({flag} {100 * tolerance:.0f}%); "
               f"engine + communicators + activations {r['need_bytes'] / GB:.2f} GB vs capacity {r['capacity_bytes'] / GB:.2f} GB "
               f"(device {r['device_bytes'] / GB:.0f} GB): {r['verdict']}; "
               f"planner {r['plan_build_s']:.0f} s, engine {r['engine_build_s']:.1f} s")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    from dcp_ext.data.lengths import DATA_DIR

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="all", choices=["llama2-7b", "llama2-13b", "llama2-70b", "all"])
    p.add_argument("--cluster", default=None, help="cluster preset (default h200x64; h200x8 with --small)")
    p.add_argument("--rank", type=int, default=None, help="default: the rank with the largest stage")
    p.add_argument("--small", action="store_true", help="a 2-layer hidden-256 model on 8 ranks (tests)")
    p.add_argument("--iterations", type=int, default=None, help="planned batches for the activation peak (default 4, 2 with --small)")
    p.add_argument("--max-seq-len", type=int, default=None, help="default 131072 (planner tests, launch scripts); 8192 with --small")
    p.add_argument("--global-batch-tokens", type=int, default=None, help="default 4194304; 65536 with --small")
    p.add_argument("--sample-count", type=int, default=4, help="planner's pool-search batches (the planner tests use 4)")
    p.add_argument("--layouts", default=None, help="a fixed pool instead of the planner's search, e.g. 1xtp2cp1pp2+1xtp4cp1pp1")
    p.add_argument("--lengths", default=os.path.join(DATA_DIR, LENGTHS_FILE))
    p.add_argument("--tolerance", type=float, default=0.05)
    p.add_argument("--json", default=None, help="write every number here")
    p.add_argument("--communicators", nargs="*", default=None, metavar="CLUSTER",
                   help="only the communicator bound per rank on these clusters (default h200x64 h200x1024), in seconds")
    a = p.parse_args(argv)
    if a.communicators is not None:
        models = ["llama2-7b", "llama2-13b", "llama2-70b"] if a.model == "all" else [a.model]
        bounds = [communicator_bound(m, c) for c in (a.communicators or ["h200x64", "h200x1024"]) for m in models]
        print(format_bounds(bounds))
        if a.json:
            with open(a.json, "w") as f:
                json.dump(bounds, f, indent=1)
        return 0
    if a.small:
        models = ["small"]
        cluster = a.cluster or f"h200x{SMALL_WORLD}"
        iters, msl, gbt = a.iterations or 2, a.max_seq_len or 8192, a.global_batch_tokens or 65536
    else:
        models = ["llama2-7b", "llama2-13b", "llama2-70b"] if a.model == "all" else [a.model]
        cluster = a.cluster or "h200x64"
        iters, msl, gbt = a.iterations or 4, a.max_seq_len or 131072, a.global_batch_tokens or 4194304
    results = []
    for name in models:
        results.append(check_model(name, cluster, a.rank, iters, msl, gbt, a.sample_count, a.lengths,
                                   fixed_pool=a.layouts))
        log(f"{name}: done in {results[-1]['wall_s']:.0f} s")
    print(f"scale check: {cluster}, lengths {a.lengths}, max-seq-len {msl}, {gbt} tokens per batch, "
          f"{iters} planned iterations; engine on meta + fake process groups")
    print()
    print(format_table(results))
    print()
    for r in results:
        print(format_details(r, a.tolerance))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1, default=str)
    ok = all(abs(r["rel_diff"]) <= a.tolerance and r["verdict"] == "OK" for r in results)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
