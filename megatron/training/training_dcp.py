"""The `--dcp` training loop: per-iteration plans on the adaptive engine.

Glue only: documents from the variable-length data path, global batches by tokens
(DESIGN.md), a plan per iteration from `dcp_ext.planning.planner` (the next one computed in a
background thread while this one trains), `dcp_ext.runtime.AdaptiveEngine` for the step,
Megatron's LR schedule, log line and checkpoint layout.
"""
from __future__ import annotations

import copy
import json
import math
import os
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist

from megatron.training import checkpointing_adaptive as checkpointing_dcp
from megatron.training.initialize import print_rank_0, set_random_seed_without_parallel_state
from megatron.training.log import TrainingLogger
from megatron.training.loop_features import LoopFeatures


def cluster_for(world_size: int, args=None):
    """The cluster this job runs on: on a GPU, its memory from torch's device properties and
    its peak from the table of known kinds (dcp_ext/planning/gpu_table.py) or --dcp-device-tflops /
    --dcp-device-memory-gb; an unknown GPU without them is one error line, never the CPU
    preset. Without CUDA, this CPU (the flags override its numbers too)."""
    from dcp_ext.planning.gpu_table import UnknownDevice, gpu_kind_for_device
    from dcp_ext.planning.specs import GiB, ClusterSpec

    tflops = getattr(args, "dcp_device_tflops", None)
    memory_gb = getattr(args, "dcp_device_memory_gb", None)
    if not torch.cuda.is_available():
        spec = ClusterSpec.cpu_gloo(world_size)
        if tflops is not None:
            spec = spec.with_(peak_flops=tflops * 1e12)
        if memory_gb is not None:
            spec = spec.with_(memory_bytes=memory_gb * GiB)
        return spec
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    try:
        gpu = gpu_kind_for_device(props.name, props.total_memory, tflops=tflops, memory_gb=memory_gb)
    except UnknownDevice as e:
        from megatron.training.arguments import ArgumentError

        raise ArgumentError(str(e)) from None
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", torch.cuda.device_count()))
    return ClusterSpec(name=f"{gpu.name}x{world_size}", num_gpus=world_size,
                       gpus_per_node=max(1, min(per_node, world_size)), gpu=gpu)


def layout_summary(it) -> str:
    """`layout: tp2·pp2 + 2×tp1 | mb 3/5/5 | recompute 0/12`."""

    labels = Counter(r.replica_type.label() for r in it.replicas)
    layout = " + ".join(f"{n}×{lab}" if n > 1 else lab for lab, n in labels.items())
    mbs = "/".join(str(len(r.micro_batches)) for r in it.replicas)
    all_mbs = [mb for r in it.replicas for mb in r.micro_batches]
    recomputed = sum(1 for mb in all_mbs if mb.recompute_layers > 0)
    return f"layout: {layout} | mb {mbs} | recompute {recomputed}/{len(all_mbs)}"


def vocab_padding_for(args, vocab_size: int, cluster) -> int:
    """One padded vocabulary for every layout the planner may choose on `cluster`: a
    multiple of divisible_by x lcm(every candidate tp). Fixed before planning, so the
    planner's cost model and the runtime see the same model."""
    from dcp_ext.planning.cost_model import CostModel
    from dcp_ext.data.tokenizers import padded_vocab_size
    from dcp_ext.planning.specs import ModelSpec

    spec = ModelSpec.from_megatron_args(args).with_(vocab_size=vocab_size)
    lcm_tp = 1
    for layout in CostModel(spec, cluster).all_layouts():
        lcm_tp = math.lcm(lcm_tp, layout.tp)
    return padded_vocab_size(vocab_size, args.make_vocab_size_divisible_by, lcm_tp)


def grad_scaler_for(args):
    """--fp16: megatron-core's loss scaler (dynamic unless --loss-scale), else none."""
    if not args.fp16:
        return None
    from megatron.core.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler

    if args.loss_scale is not None:
        return ConstantGradScaler(args.loss_scale)
    return DynamicGradScaler(initial_scale=args.initial_loss_scale, min_scale=args.min_loss_scale, growth_factor=2.0,
                             backoff_factor=0.5, growth_interval=int(args.loss_scale_window),
                             hysteresis=args.hysteresis)


def static_layout_of(args) -> tuple[int, int, int]:
    """(tp, cp, pp) of the launch line: the static baseline's layout."""
    return (args.tensor_model_parallel_size, args.context_parallel_size, args.pipeline_model_parallel_size)


def planner_options(args) -> dict:
    """What each planner takes from the line: the adaptive ones (adaptive, hydraulis) keep the
    static layout in a pool of at most --dcp-candidates; `static` runs the static layout
    itself; dynamic-cp and dcp search their own (tp, pp) and size CP per sequence."""
    if args.dcp_planner in ("adaptive", "hydraulis"):
        return {"static_layout": static_layout_of(args), "max_layouts": args.dcp_candidates}
    if args.dcp_planner == "static":
        return {"layout": static_layout_of(args)}
    return {}


def static_layout_line(args, planner) -> str:
    """The one line said at start: where the line's static layout is in the planner."""
    tp, cp, pp = static_layout_of(args)
    what = f"static layout tp={tp} pp={pp} cp={cp}"
    pool = getattr(planner, "pool", None)
    entry = getattr(planner, "static_entry", None)
    if pool is not None:
        n = len(pool.layouts)
        where = "is in" if entry is not None and entry in pool.layouts else "is not in"
        why = "" if where == "is in" else (" (hydraulis has no context parallelism)" if cp > 1 and
                                           args.dcp_planner == "hydraulis" else " (it does not fit beside the pool)")
        return f"dcp: {what} {where} the candidate pool{why} ({n} candidate{'s' if n != 1 else ''}, --dcp-candidates {args.dcp_candidates})"
    if args.dcp_planner == "static":
        return f"dcp: {what} is the static planner's layout ({planner.describe()})"
    return (f"dcp: {what} is not used by planner {args.dcp_planner}, which picks its own tp/pp and sizes CP per "
            f"sequence ({planner.describe()})")


def optimizer_options_for(args):
    """Every optimizer flag for the fixed sharding's optimizer (--decoupled-lr/--decoupled-min-lr
    read by getattr: older parsers do not have them)."""
    from dcp_ext.runtime.sharded_optimizer import OptimizerOptions

    return OptimizerOptions(optimizer=args.optimizer, lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay,
                            betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_eps,
                            sgd_momentum=args.sgd_momentum, clip_grad=args.clip_grad,
                            decoupled_lr=getattr(args, "decoupled_lr", None),
                            decoupled_min_lr=getattr(args, "decoupled_min_lr", None))


def build_planner(args, train_ds, cluster=None):
    from dcp_ext.planning.planner import make_planner
    from dcp_ext.planning.planners.common import PlanningError
    from dcp_ext.planning.specs import ModelSpec

    sample = train_ds.lengths if len(train_ds.lengths) <= 200_000 else train_ds.lengths[:200_000]
    try:
        planner = make_planner(
            args.dcp_planner,
            ModelSpec.from_megatron_args(args),
            cluster if cluster is not None else cluster_for(args.world_size, args),
            max_seq_len=args.dcp_max_seq_len,
            global_batch_tokens=args.dcp_global_batch_tokens,
            length_sample=[int(x) for x in sample],
            profile=args.dcp_cost_profile,
            memory_margin=args.dcp_memory_margin,
            seed=args.seed,
            **planner_options(args),
        )
    except PlanningError as e:
        if args.dcp_planner != "static" or "cannot hold" not in str(e):
            raise
        tp, cp, pp = static_layout_of(args)
        raise PlanningError(f"--dcp-planner static runs the line's layout tp={tp} pp={pp} cp={cp}, which cannot hold "
                            f"a pack of --dcp-max-seq-len {args.dcp_max_seq_len} tokens on {cluster_for(args.world_size, args).name}: "
                            "raise --tensor-model-parallel-size / --pipeline-model-parallel-size / "
                            "--context-parallel-size or lower --dcp-max-seq-len") from None
    print_rank_0(static_layout_line(args, planner))
    return planner


def check_memory(planner, it, batch) -> None:
    """The planner promises every micro-batch fits (device memory less --dcp-memory-margin);
    check the promise before running it, so a planning bug is an error, not an OOM."""
    from dcp_ext.planning.simulator import simulate_iteration

    result = simulate_iteration(planner.cm, it, dict(zip(batch.sample_ids, batch.lengths)))
    if not result.memory_ok:
        from megatron.training.training import TrainingError

        raise TrainingError(f"iteration {it.index}: the plan needs {result.peak_memory_fraction:.0%} of device memory, "
                            "over the budget: raise --dcp-memory-margin headroom or report this planner bug")


def evaluate(args, engine, planner, valid_ds) -> float:
    """Per-token loss over the first --eval-iters global batches of the validation split."""
    from dcp_ext.data.batches import GlobalBatchStream
    from dcp_ext.data.thd import materialize

    stream = GlobalBatchStream(valid_ds, args.dcp_global_batch_tokens, args.dcp_max_seq_len, limit=len(valid_ds))
    total, tokens = 0.0, 0.0
    for i in range(args.eval_iters):
        try:
            batch = stream.next()
        except StopIteration:
            break
        it = planner.plan_iteration(i, batch.sample_ids, batch.lengths)
        rep = engine.my_replica(it)
        each, pad_total = engine.padding_for(rep.replica_type)
        batches = [materialize(valid_ds, mb.sample_ids, pad_each_to=each, pad_total_to=pad_total,
                               eod_mask_loss=args.eod_mask_loss, eod=args.eod_token) for mb in rep.micro_batches]
        loss_sum, n = engine.evaluate(it, batches)
        total, tokens = total + loss_sum, tokens + n
    return total / max(tokens, 1.0)


def no_loss_tokens_message(args, iteration: int, dataset, batch) -> str:
    """A global batch with no token to train on would train at loss 0: say why, naming a sample."""
    prefix, doc, _ = dataset.source(batch.sample_ids[0])
    if getattr(dataset, "has_loss_mask", False):
        why = (f"their SFT loss mask is 0 on every token kept (prompts longer than --dcp-max-seq-len "
               f"{args.dcp_max_seq_len}?)")
    else:
        why = "every sample is one token long" + (" or all EOD (--eod-mask-loss)" if args.eod_mask_loss else "")
    return (f"iteration {iteration}: the global batch's {len(batch.sample_ids)} samples have no token to train on: "
            f"{why}; first sample: {prefix} document {doc}")


def train_adaptive(args, document_datasets_provider, model_provider, make_config, build_scheduler):
    from dcp_ext.data.batches import GlobalBatchStream
    from dcp_ext.data.thd import materialize, num_loss_tokens
    from dcp_ext.planning.flops import training_flops
    from dcp_ext.planning.plan import iteration_to_json, validate_iteration
    from dcp_ext.runtime.engine import AdaptiveEngine

    set_random_seed_without_parallel_state(args.seed)
    cluster = cluster_for(args.world_size, args)  # an unknown GPU stops here, before any data is read
    train_ds, valid_ds, _ = document_datasets_provider(args)
    from megatron.training.global_vars import get_tokenizer

    args.padded_vocab_size = vocab_padding_for(args, get_tokenizer().vocab_size, cluster)
    planner = build_planner(args, train_ds, cluster)
    eval_planner = copy.deepcopy(planner)  # evaluation must not disturb the training plan sequence
    types = planner.replica_types()
    engine = AdaptiveEngine(
        types,
        lambda tp, cp, pp, sp: make_config(tensor_model_parallel_size=tp, context_parallel_size=cp,
                                           pipeline_model_parallel_size=pp, sequence_parallel=sp),
        lambda config, pre, post, pg: model_provider(config, pre_process=pre, post_process=post, pg_collection=pg),
        sequence_parallel=args.sequence_parallel,
        lr=args.lr, weight_decay=args.weight_decay, optimizer_options=optimizer_options_for(args),
        init_seed=args.seed, init_std=args.init_method_std,
        exchange=args.dcp_exchange, overlap=bool(getattr(args, "overlap_param_gather", False) or getattr(args, "overlap_grad_reduce", False)),
        grad_reduce_in_bf16=bool(getattr(args, "grad_reduce_in_bf16", False) and args.bf16),
        bucket_numel=getattr(args, "ddp_bucket_size", None), grad_scaler=grad_scaler_for(args),
    )
    held = engine.persistent_bytes()
    print_rank_0(f"> adaptive runtime: planner {args.dcp_planner}, {len(types)} replica types, "
                 f"{engine.registry.num_groups} process groups, {engine.space.numel:,} parameters "
                 f"sharded over {args.world_size} ranks in {engine.sharding.num_buckets} buckets; rank 0 holds "
                 + ", ".join(f"{k} {v / 2**20:.0f} MiB" for k, v in held.items()))
    scheduler = build_scheduler(args, engine.optimizer)
    iteration, consumed = 0, 0
    if args.load:
        iteration, consumed = checkpointing_dcp.load(args, engine, scheduler, planner)
    stream = GlobalBatchStream(train_ds, args.dcp_global_batch_tokens, args.dcp_max_seq_len, consumed_samples=consumed)
    logger = TrainingLogger(args)
    eod = args.eod_token
    history = []
    nan_streak = 0
    planning = ThreadPoolExecutor(max_workers=1)

    def plan(index, batch):
        t0 = time.perf_counter()
        it = planner.plan_iteration(index, batch.sample_ids, batch.lengths)
        return it, time.perf_counter() - t0

    upcoming = None
    window_layouts = Counter()
    start_iteration, planner_state = iteration, planner.state_dict()
    features = LoopFeatures(args, adaptive=True)
    while iteration < args.train_iters:
        features.begin_iteration(iteration)
        start = time.perf_counter()
        batch = stream.next()
        it, plan_s = upcoming.result() if upcoming is not None else plan(iteration, batch)
        if list(it.sample_ids) != list(batch.sample_ids):
            raise RuntimeError(f"iteration {iteration}: prefetched plan does not match the batch")
        planner_state = planner.state_dict()  # as of this iteration's plan, before the next is made
        ahead = stream.peek(1)
        upcoming = planning.submit(plan, iteration + 1, ahead[0]) if ahead and iteration + 1 < args.train_iters else None
        validate_iteration(it, args.world_size, args.num_layers, args.num_attention_heads, args.num_query_groups)
        check_memory(planner, it, batch)
        rep = engine.my_replica(it)
        each, total = engine.padding_for(rep.replica_type)
        batches = [materialize(train_ds, mb.sample_ids, pad_each_to=each, pad_total_to=total,
                               eod_mask_loss=args.eod_mask_loss, eod=eod) for mb in rep.micro_batches]
        loss_tokens = num_loss_tokens(train_ds, batch.sample_ids, args.eod_mask_loss, eod)
        if loss_tokens == 0:
            from megatron.training.training import TrainingError

            raise TrainingError(no_loss_tokens_message(args, iteration + 1, train_ds, batch))
        with features.timer("adaptive-step"):
            result = engine.step(it, batches, loss_tokens)
        ok = result.update_successful and math.isfinite(result.loss)
        if ok:
            scheduler.step(increment=args.lr_step_increment)  # 1, or --global-batch-size under --train-samples
        overflow = args.fp16 and not result.update_successful and math.isfinite(result.loss)  # loss scaler's skip
        nan_streak = 0 if (ok or overflow) else nan_streak + 1
        if nan_streak >= args.max_nan_iterations:
            from megatron.training.training import TrainingError

            raise TrainingError(f"{nan_streak} NaN/inf iterations in a row at iteration {iteration + 1}: lower --lr, "
                                "check the data, or raise --max-nan-iterations")
        iteration += 1
        elapsed = time.perf_counter() - start
        flops = training_flops(batch.lengths, **logger.model_shape())
        summary = layout_summary(it)
        window_layouts[summary.split(" | ")[0][len("layout: "):]] += 1
        extra = (f" {summary} | predicted/measured (ms): {1000 * it.predicted_time_s:.1f}/"
                 f"{1000 * elapsed:.1f} | plan (ms): {1000 * plan_s:.1f} | exposed comm (ms): "
                 f"{1000 * result.exposed_comm_s:.1f} | tokens: {sum(batch.lengths)} |")
        if iteration % args.log_interval == 0:
            if args.log_interval > 1:
                extra += " layouts since last log: " + ", ".join(f"{k} x{v}" for k, v in window_layouts.items()) + " |"
            window_layouts.clear()
        logger.log_iteration(iteration, stream.consumed_samples, elapsed, {"lm loss": result.loss}, scheduler,
                             engine.optimizer, result.grad_norm, ok, flops, len(batch.sample_ids), extra=extra,
                             record={"tokens": sum(batch.lengths), "elapsed_s": elapsed,
                                     "bytes_moved": result.bytes_moved, "exposed_comm_s": result.exposed_comm_s,
                                     "layout": summary})
        history.append((iteration, result.loss))
        features.end_iteration(iteration)
        if valid_ds is not None and args.eval_iters > 0 and iteration % args.eval_interval == 0:
            features.eval_boundary()
            loss = evaluate(args, engine, eval_planner, valid_ds)
            logger.log_validation(iteration, loss)
            features.eval_boundary()
        if args.dcp_log_plan and dist.get_rank() == 0:
            with open(args.dcp_log_plan, "a") as f:
                f.write(json.dumps(iteration_to_json(it)) + "\n")
        if args.save and args.save_interval and iteration % args.save_interval == 0:
            checkpointing_dcp.save(args, iteration, stream.consumed_samples, engine, scheduler, planner_state)
        if args.exit_interval and iteration % args.exit_interval == 0:
            break
        if features.should_exit(iteration):  # exit signal or duration: the save below, then exit 0
            break
    features.finish()
    planning.shutdown(wait=True)
    just_saved = args.save_interval and iteration % args.save_interval == 0
    if args.save and iteration > start_iteration and not just_saved:
        checkpointing_dcp.save(args, iteration, stream.consumed_samples, engine, scheduler, planner_state)
    logger.close()
    dist.barrier()
    return history
