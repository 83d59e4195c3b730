"""The `--dcp` run's configuration, derived once from the validated flags.

Why it exists: the planner's cost model and the engine must agree on what the engine will
do (whether pull/push overlap compute, how large an exchange bucket is, which optimizer
runs), or the planner prices memory and time the run does not have. Each of those rules
is derived here, once, into frozen records: `EngineOptions` for the engine, a `ModelSpec`
for the planner and the cost model with the same exchange slots, bucket size and kernels
(TE or local layers, the fusions: what its activation memory depends on). Nothing
writes the flags after this point.

It is the door's part for `--dcp` (nothing below reads the flags): the cluster the job runs
on (`cluster_for`), the vocabulary padded for every layout the planner could choose
(`vocab_padding_for`, which `global_vars.build_tokenizer` applies: the one place it is padded),
and `configure`, which `pretrain()` hands the run to call once its data
is read: every record of `AdaptiveRunConfig`, the iterations' `StepOptions` and the
per-layout TransformerConfig builder among them.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch

from dcp_ext.planning.layout import bucket_numel_for
from dcp_ext.planning.specs import ModelSpec
from dcp_ext.runtime.options import EngineOptions
from dcp_ext.runtime.params.sharded_optimizer import OptimizerOptions
from megatron.training.adaptive.training_adaptive import LossScaling, StepOptions
from megatron.training.checkpoint.config import CheckpointConfig
from megatron.training.flags.core_configs import transformer_config_from_args
from megatron.training.flags.records import batch_sizes_for, checkpoint_config_for
from megatron.training.flags.model_flags import Machine, config_fields, uses_transformer_engine

OVERLAP_OFF_ON_CPU = ("note: --overlap-param-gather/--overlap-grad-reduce are off for --dcp on CPU ranks: gloo's "
                      "transfer threads share the cores with the compute, so overlapping made the exposed "
                      "communication worse here (benchmarks/bench_overlap.py); they take effect on GPUs")


def overlap_asked(args) -> bool:
    return bool(args.overlap_param_gather or args.overlap_grad_reduce)


def overlap_for(args, on_cpu: bool) -> tuple[bool, str | None]:
    """Whether the adaptive runtime overlaps its pull/push with compute, and the note to say:
    as the overlap flags ask, except on CPU ranks, where it costs more than it hides.
    DCP_OVERLAP_ON_CPU=1 keeps it on there (benchmarks/bench_overlap.py measures both)."""
    asked = overlap_asked(args)
    if asked and on_cpu and os.environ.get("DCP_OVERLAP_ON_CPU") != "1":
        return False, OVERLAP_OFF_ON_CPU
    return asked, None


def optimizer_options_for(args) -> OptimizerOptions:
    """Every optimizer flag, as the fixed sharding's optimizer takes them."""
    return OptimizerOptions(optimizer=args.optimizer, lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay,
                            betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_eps,
                            sgd_momentum=args.sgd_momentum, clip_grad=args.clip_grad,
                            decoupled_lr=args.decoupled_lr, decoupled_min_lr=args.decoupled_min_lr)


def kernels_for(args, machine: Machine | None = None) -> dict:
    """The ModelSpec's kernel fields (layer_kernels, fused_swiglu, fused_rope): the layers
    and fusions the engine builds on `machine` (None: this one), by the rules that build
    them (pretrain_gpt_dcp's layer spec, transformer_config_from_args' fusions)."""
    machine = machine or Machine.here()
    fields = config_fields(args, machine)
    return dict(layer_kernels="te" if uses_transformer_engine(args, machine) else "local",
                fused_swiglu=bool(fields["bias_activation_fusion"]) if args.swiglu else None,
                fused_rope=bool(fields["apply_rope_fusion"]))


def model_spec_for(args, name: str | None = None, overlap: bool | None = None, vocab_size: int | None = None) -> ModelSpec:
    """The planner's and the cost model's view of the model the flags describe (the only
    place flags become a ModelSpec). `overlap`: whether the runtime overlaps its exchange
    (two exchange slots), None: as the flags ask (`AdaptiveRunConfig` passes what it decided).
    The vocabulary: `vocab_size` when given, else the padded one once `padded_vocab_size` is
    set, else the flag's."""
    heads = int(args.num_attention_heads)
    groups = args.num_query_groups if args.num_query_groups is not None and args.group_query_attention else heads
    hidden = int(args.hidden_size)
    ffn = args.ffn_hidden_size
    if ffn is None:
        ffn = 4 * hidden if not args.swiglu else int(4 * hidden * 2 / 3 / 64) * 64
    vocab = vocab_size or getattr(args, "padded_vocab_size", None) or args.vocab_size
    if vocab is None:
        raise ValueError("the flags carry neither a padded vocabulary nor --vocab-size")
    half = bool(args.bf16 or args.fp16)
    dropout = float(args.hidden_dropout or 0.0) > 0 or float(args.attention_dropout or 0.0) > 0
    if overlap is None:
        overlap = overlap_asked(args)
    return ModelSpec(
        name=name or "megatron-args",
        num_layers=int(args.num_layers),
        hidden_size=hidden,
        num_attention_heads=heads,
        num_query_groups=int(groups),
        ffn_hidden_size=int(ffn),
        vocab_size=int(vocab),
        seq_length=int(args.seq_length or args.max_position_embeddings or 0),
        swiglu=bool(args.swiglu),
        untie_embeddings_and_output_weights=bool(args.untie_embeddings_and_output_weights),
        param_bytes=2 if half else 4,
        grad_bytes=4,
        optimizer_bytes_per_param=16,
        activation_bytes=2 if half else 4,
        grad_reduce_bytes=2 if (args.bf16 and args.grad_reduce_in_bf16) else 4,
        bucket_numel=int(args.ddp_bucket_size or 0),
        exchange_slots=2 if overlap else 1,
        sequence_parallel=bool(args.sequence_parallel),
        hidden_dropout=dropout,
        cpu_attention=str(args.dcp_cpu_attention or "math"),
    )


@dataclass(frozen=True)
class PlannerConfig:
    """What the planner is built from, read from the flags once."""

    name: str  # --dcp-planner
    max_seq_len: int  # --dcp-max-seq-len
    global_batch_tokens: int  # --dcp-global-batch-tokens
    static_layout: tuple[int, int, int]  # (tp, cp, pp) of the launch line: the static baseline's layout
    candidates: int  # --dcp-candidates: the pool's size
    rechoose_pool: bool  # --dcp-recalibration on
    calibrate_at_start: bool  # --dcp-calibrate-at-start on: measure the probe layouts before training
    layer_strategies: bool  # --dcp-layer-strategies on
    uneven_stages: bool  # --dcp-uneven-stages on
    cost_profile: str | None  # --dcp-cost-profile
    memory_margin: float  # --dcp-memory-margin
    seed: int

    @classmethod
    def from_args(cls, args) -> "PlannerConfig":
        return cls(name=args.dcp_planner, max_seq_len=args.dcp_max_seq_len,
                   global_batch_tokens=args.dcp_global_batch_tokens,
                   static_layout=(args.tensor_model_parallel_size, args.context_parallel_size,
                                  args.pipeline_model_parallel_size),
                   candidates=args.dcp_candidates, rechoose_pool=args.dcp_recalibration == "on",
                   calibrate_at_start=args.dcp_calibrate_at_start == "on",
                   layer_strategies=args.dcp_layer_strategies == "on", uneven_stages=args.dcp_uneven_stages == "on",
                   cost_profile=args.dcp_cost_profile, memory_margin=args.dcp_memory_margin, seed=args.seed)

    def options(self) -> dict:
        """What each planner takes from the line: the adaptive ones (adaptive, hydraulis) keep
        the static layout in a pool of at most --dcp-candidates; `static` runs the static layout
        itself; dynamic-cp and cp-buckets search their own (tp, pp) and size CP per sequence."""
        if self.name == "adaptive":
            return {"static_layout": self.static_layout, "max_layouts": self.candidates,
                    "rechoose_pool": self.rechoose_pool,
                    **{k: "on" for k in ("layer_strategies", "uneven_stages") if getattr(self, k)}}
        if self.name == "hydraulis":
            return {"static_layout": self.static_layout, "max_layouts": self.candidates}
        if self.name == "static":
            return {"layout": self.static_layout, "balance": True}
        return {}


def step_options_for(args) -> StepOptions:
    """What the iterations need (`training_adaptive.AdaptiveSteps`); after the tokenizer."""
    return StepOptions(global_batch_tokens=args.dcp_global_batch_tokens, max_seq_len=args.dcp_max_seq_len,
                       seq_length=args.seq_length, batch_sizes=batch_sizes_for(args), train_iters=args.train_iters,
                       lr_step_increment=args.lr_step_increment, eval_iters=args.eval_iters,
                       eval_interval=args.eval_interval, split=args.split, eod_mask_loss=bool(args.eod_mask_loss),
                       eod=getattr(args, "eod_token", None), fp16=bool(args.fp16), log_interval=args.log_interval,
                       log_plan=args.dcp_log_plan)


def loss_scaling_for(args) -> LossScaling | None:
    """--fp16's loss scaler settings; None without --fp16."""
    if not args.fp16:
        return None
    return LossScaling(loss_scale=args.loss_scale, initial=args.initial_loss_scale, minimum=args.min_loss_scale,
                       window=args.loss_scale_window, hysteresis=args.hysteresis)


def layer_config_for(args, tp: int, cp: int, pp: int, sp: bool):
    """megatron-core's TransformerConfig of one replica layout (the engine builds one per type)."""
    return transformer_config_from_args(args, tensor_model_parallel_size=tp, context_parallel_size=cp,
                                        pipeline_model_parallel_size=pp, sequence_parallel=sp)


@dataclass(frozen=True)
class AdaptiveRunConfig:
    engine: EngineOptions
    model: ModelSpec  # the planner's and the cost model's view of the model the engine builds
    planner: PlannerConfig
    checkpoint: CheckpointConfig  # what saving and loading need (built after the vocabulary is padded)
    steps: StepOptions  # what the iterations need
    layer_config: Callable  # (tp, cp, pp, sp) -> megatron-core's TransformerConfig of that layout
    loss_scaling: LossScaling | None = None  # --fp16's loss scaler
    overlap_note: str | None = None  # said once at start when the overlap flags are set aside

    @classmethod
    def from_args(cls, args, on_cpu: bool, device: str | None = None, machine: Machine | None = None):
        """device: the engine's (None: this process's CUDA device, else the CPU; 'meta').
        machine: what the kernels can use (None: this one, `Machine.here()`)."""
        overlap, note = overlap_for(args, on_cpu)
        spec = model_spec_for(args, overlap=overlap)
        # one bucket size for both: the flag's, else the sharding's rule on the model's size
        bucket = bucket_numel_for(spec.num_params, args.ddp_bucket_size or 0)
        spec = spec.with_(bucket_numel=bucket, **kernels_for(args, machine))
        engine = EngineOptions(
            optimizer=optimizer_options_for(args), sequence_parallel=args.sequence_parallel,
            exchange=args.dcp_exchange, overlap=overlap, bucket_numel=bucket,
            grad_reduce_in_bf16=bool(args.grad_reduce_in_bf16 and args.bf16), init_seed=args.seed,
            init_std=args.init_method_std, layer_strategies=args.dcp_layer_strategies == "on", device=device)
        return cls(engine, spec, PlannerConfig.from_args(args), checkpoint_config_for(args), step_options_for(args),
                   partial(layer_config_for, args), loss_scaling_for(args), note)


def configure(args) -> AdaptiveRunConfig:
    """The `--dcp` run's records once its data is read, every one from the flags (the
    vocabulary was padded for every layout on the cluster when the tokenizer was built:
    `global_vars.build_tokenizer`, `vocab_padding_for`)."""
    from dcp_ext.runtime.options import default_device

    return AdaptiveRunConfig.from_args(args, on_cpu=default_device().type == "cpu")


def cluster_for(world_size: int, args):
    """The cluster this job runs on: on a GPU, its memory from torch's device properties and
    its peak from the table of known kinds (dcp_ext/planning/gpu_table.py) or --dcp-device-tflops /
    --dcp-device-memory(-gb); an unknown GPU without them is one error line, never the CPU
    preset. Without CUDA, this CPU (the flags override its numbers too; --dcp-device-memory
    there is a budget for tensors alone)."""
    from dcp_ext.planning.gpu_table import UnknownDevice, gpu_kind_for_device
    from dcp_ext.planning.specs import GiB, ClusterSpec

    tflops, memory_gb, budget = args.dcp_device_tflops, args.dcp_device_memory_gb, args.dcp_device_memory
    if budget is not None:
        memory_gb = budget / GiB
    if not torch.cuda.is_available():
        spec = ClusterSpec.cpu_gloo(world_size)
        if tflops is not None:
            spec = spec.with_(peak_flops=tflops * 1e12)
        if budget is not None:
            # a budget for tensors: the process's code and libraries (host memory on a GPU
            # machine, the preset's reserve here) are not in it
            spec = spec.with_(memory_bytes=float(budget), reserved_bytes=0.0)
        elif memory_gb is not None:
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


# Tensor-parallel sizes a planner may use on any machine of up to this many devices per
# node; the vocabulary is padded for all of them (see vocab_padding_for).
TP_CEILING = 8


def vocab_padding_for(args, vocab_size: int, cluster) -> int:
    """One padded vocabulary for every layout the planner could choose, on this world size
    or any other: a multiple of divisible_by x lcm(every power-of-two tp up to TP_CEILING that
    divides the heads and the query groups, and every tp of this cluster's pool). It depends
    on the model and the flags alone (on nodes of up to TP_CEILING devices), so a checkpoint
    saved on W ranks resumes on any W' whatever the vocabulary; and it is fixed before
    planning, so the planner's cost model and the runtime see the same model."""
    from dcp_ext.planning.cost_model import CostModel
    from dcp_ext.data.tokenizers import padded_vocab_size

    spec = model_spec_for(args, vocab_size=vocab_size)
    lcm_tp = 1
    tp = 1
    while tp <= TP_CEILING:
        if spec.valid_tp(tp):
            lcm_tp = math.lcm(lcm_tp, tp)
        tp *= 2
    for layout in CostModel(spec, cluster).all_layouts():
        lcm_tp = math.lcm(lcm_tp, layout.tp)
    return padded_vocab_size(vocab_size, args.make_vocab_size_divisible_by, lcm_tp)
