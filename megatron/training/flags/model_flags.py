"""Upstream Megatron's model, attention, fusion and precision flags, in one place.

Why a module of its own: these flags mean different things on a GPU with
transformer-engine and on this fork's CPU path (our document-masked attention, torch
norms, no fused kernels), and differently again under `--dcp` (no global parallel state,
the runtime's own fp32 main grads). Each flag is therefore resolved here once, against the
machine: honoured, turned off with one line saying why, or refused with one line naming
the fix. `transformer_config_from_args` reads `config_fields`; `validate_args` calls
`check_model_flags`; `pretrain` prints `startup_notes`.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from megatron.training.flags.argument_errors import ArgumentError
ATTENTION_BACKENDS = ("flash", "fused", "unfused", "local", "auto")
FP8_RECIPES = ("tensorwise", "delayed", "mxfp8", "blockwise")
FP8_MIN_CAPABILITY = (8, 9)  # Ada / Hopper: TE's FP8 GEMMs
MXFP8_MIN_CAPABILITY = (10, 0)  # Blackwell


def add_model_flags(parser) -> None:
    """Upstream's flags of this kind, with upstream's names, dests and defaults."""
    g = parser.add_argument_group("model kernels and precision (upstream Megatron)")
    g.add_argument("--use-mcore-models", action="store_true", help="no-op: models are always megatron-core's")
    g.add_argument("--attention-backend", choices=ATTENTION_BACKENDS, default="auto",
                   help="transformer-engine's attention kind on GPUs; CPUs run our document-masked attention")
    g.add_argument("--use-flash-attn", action="store_true", help="as --attention-backend flash")
    g.add_argument("--cross-entropy-loss-fusion", action="store_true")
    g.add_argument("--cross-entropy-fusion-impl", choices=["native", "te"], default="native")
    g.add_argument("--calculate-per-token-loss", action="store_true",
                   help="the loss rule of this fork in any case: per token over the global batch")
    g.add_argument("--apply-layernorm-1p", action="store_true", help="zero-centred norm weights (1 + gamma)")
    g.add_argument("--rotary-percent", type=float, default=1.0, help="fraction of each head's dims rotated by RoPE")
    g.add_argument("--qk-layernorm", action="store_true", help="normalise queries and keys per head")
    g.add_argument("--use-rope-scaling", action="store_true",
                   help="Llama 3.1's RoPE frequency scaling (low/high frequency factors 1 and 4, 8192 original "
                        "positions), by --rope-scaling-factor")
    g.add_argument("--rope-scaling-factor", type=float, default=8.0)
    g.add_argument("--add-qkv-bias", action="store_true",
                   help="a bias on the query/key/value projection only (Qwen2), with --disable-bias-linear")
    g.add_argument("--no-gradient-accumulation-fusion", action="store_false", dest="gradient_accumulation_fusion")
    g.add_argument("--no-masked-softmax-fusion", action="store_false", dest="masked_softmax_fusion")
    g.add_argument("--no-bias-gelu-fusion", action="store_false", dest="bias_gelu_fusion")
    g.add_argument("--no-bias-swiglu-fusion", action="store_false", dest="bias_swiglu_fusion")
    g.add_argument("--no-bias-dropout-fusion", action="store_false", dest="bias_dropout_fusion")
    g.add_argument("--no-rope-fusion", action="store_false", dest="apply_rope_fusion")
    g.add_argument("--init-model-with-meta-device", action="store_true")
    g.add_argument("--use-cpu-initialization", action="store_true",
                   help="draw the initial weights on the CPU, as upstream (a GPU run then starts from the same "
                        "weights as a CPU run of the same flags); always on without CUDA")
    g.add_argument("--no-check-for-nan-in-loss-and-grad", action="store_false", dest="check_for_nan_in_loss_and_grad")
    g.add_argument("--fp8-format", choices=["e4m3", "hybrid"], default=None)
    g.add_argument("--fp8-recipe", choices=FP8_RECIPES, default=FP8_DEFAULTS["fp8_recipe"])
    g.add_argument("--fp8-margin", type=int, default=FP8_DEFAULTS["fp8_margin"])
    g.add_argument("--fp8-interval", type=int, default=FP8_DEFAULTS["fp8_interval"])
    g.add_argument("--fp8-amax-history-len", type=int, default=FP8_DEFAULTS["fp8_amax_history_len"])
    g.add_argument("--fp8-amax-compute-algo", choices=["most_recent", "max"],
                   default=FP8_DEFAULTS["fp8_amax_compute_algo"])
    g.add_argument("--no-fp8-wgrad", "--disable-fp8-wgrad", action="store_false", dest="fp8_wgrad")
    g.add_argument("--fp8-param-gather", action="store_true")


# the fp8 flags besides --fp8-format, at their defaults (a value other than these was given)
FP8_DEFAULTS = {"fp8_recipe": "delayed", "fp8_margin": 0, "fp8_interval": 1, "fp8_amax_history_len": 1,
                "fp8_amax_compute_algo": "most_recent", "fp8_wgrad": True, "fp8_param_gather": False}


@dataclass(frozen=True)
class Machine:
    """What the kernels can use here (a test builds other machines)."""
    cuda: bool
    te: bool  # transformer-engine imports
    capability: Optional[tuple] = None  # (major, minor) of GPU 0
    flash_attn: bool = False

    @classmethod
    def here(cls) -> "Machine":
        import torch

        if not torch.cuda.is_available():
            return cls(cuda=False, te=False)
        return cls(cuda=True, te=_imports("transformer_engine"), capability=tuple(torch.cuda.get_device_capability()),
                   flash_attn=_imports("flash_attn"))


def _imports(name: str) -> bool:
    try:
        __import__(name)
    except Exception:
        return False
    return True


def _requested_backend(args) -> str:
    if args.use_flash_attn and args.attention_backend == "auto":
        return "flash"
    return args.attention_backend


def uses_transformer_engine(args, machine: Machine) -> bool:
    """TE layers when asked for, or by default when it imports on a GPU; never for --attention-backend local."""
    if args.transformer_impl is not None:
        return args.transformer_impl == "transformer_engine"
    return machine.cuda and machine.te and _requested_backend(args) != "local"


def attention_note(args, machine: Machine) -> Optional[str]:
    """One line when the attention asked for is not the one that runs (None when it is)."""
    wanted = _requested_backend(args)
    te = uses_transformer_engine(args, machine)
    ours = "our document-masked attention (torch SDPA)"
    if wanted == "local":
        return ("attention: --attention-backend local runs " + ours + " in the local layer spec (megatron-core's "
                "local DotProductAttention takes neither packed sequences nor context parallelism)")
    if wanted == "auto" or te:
        return None
    why = "transformer-engine on a GPU" if not (machine.cuda and machine.te) else "--transformer-impl transformer_engine"
    return f"attention: --attention-backend {wanted} needs {why}; running {ours} instead"


def check_model_flags(args) -> None:
    """Refusals (one line naming the fix) and upstream's silent corrections (one warning line)."""
    machine = Machine.here()
    if not 0.0 < args.rotary_percent <= 1.0:
        raise ArgumentError(f"--rotary-percent {args.rotary_percent:g} must be in (0, 1]")
    for name in ("fp8_interval", "fp8_amax_history_len"):
        if getattr(args, name) < 1:
            raise ArgumentError(f"--{name.replace('_', '-')} {getattr(args, name)} must be >= 1")
    if args.fp8_margin < 0:
        raise ArgumentError(f"--fp8-margin {args.fp8_margin} must be >= 0")
    if args.qk_layernorm and args.kv_channels and args.kv_channels < 1:
        raise ArgumentError("--kv-channels must be >= 1")
    for _, line in refusals(args, machine):  # said with the line's other refused flags (flag_refusals) first
        raise ArgumentError(line)
    if args.sequence_parallel and args.tensor_model_parallel_size == 1:
        # upstream: warn and turn it off, so that TP1 numerics do not change
        if os.environ.get("RANK", "0") == "0":
            print("WARNING: disabling --sequence-parallel because --tensor-model-parallel-size is 1 "
                  "(as upstream Megatron does)", flush=True)
        args.sequence_parallel = False


def refusals(args, machine: Optional[Machine] = None) -> list:
    """[(flags, line)] for the flags of this kind that cannot run on this machine or build."""
    machine = machine or Machine.here()
    out = []
    problem = fp8_problem(args, machine)
    if problem:
        given = [f"--{name.replace('_', '-')}" for name, default in FP8_DEFAULTS.items()
                 if getattr(args, name) != default]
        given = [f if f != "--fp8-wgrad" else "--no-fp8-wgrad" for f in given]
        flags = ["--fp8-format"] + given if args.fp8_format is not None else ["--fp8-param-gather"]
        if args.fp8_format is not None and given:
            problem += f" ({', '.join(flags)})"
        out.append((flags, problem))
    wanted = _requested_backend(args)
    if args.transformer_impl == "transformer_engine" and not (machine.cuda and machine.te):
        out.append((["--transformer-impl"], "--transformer-impl transformer_engine needs transformer-engine on a GPU; "
                    "this machine has none: drop it (without it the local layers run here, and TE's where it imports "
                    "on a GPU)"))
    elif wanted == "flash" and uses_transformer_engine(args, machine) and not machine.flash_attn:
        flag = "--attention-backend" if args.attention_backend == "flash" else "--use-flash-attn"
        out.append(([flag], f"{flag}{' flash' if flag == '--attention-backend' else ''} needs the flash-attn package "
                    "next to transformer-engine (pip install flash-attn): install it, or use --attention-backend auto"))
    if args.cross_entropy_loss_fusion and args.cross_entropy_fusion_impl == "te" and not (machine.cuda and machine.te):
        out.append((["--cross-entropy-fusion-impl"], "--cross-entropy-fusion-impl te needs transformer-engine on a "
                    "GPU; this machine has none: use --cross-entropy-fusion-impl native"))
    return out


def fp8_problem(args, machine: Machine) -> Optional[str]:
    """Why the fp8 flags cannot run here, or None (also None when they are not given)."""
    if args.fp8_format is None:
        if args.fp8_param_gather:
            return "--fp8-param-gather needs --fp8-format e4m3|hybrid (fp8 parameters need fp8 compute)"
        return None
    flag = f"--fp8-format {args.fp8_format}"
    need = MXFP8_MIN_CAPABILITY if args.fp8_recipe == "mxfp8" else FP8_MIN_CAPABILITY
    cc = ".".join(map(str, need))
    if not machine.cuda:
        return (f"{flag} needs transformer-engine on a GPU with FP8 (compute capability {cc}+); this machine has "
                "none: drop the fp8 flags")
    if machine.capability is None or tuple(machine.capability) < need:
        got = ".".join(map(str, machine.capability or ("?",)))
        return (f"{flag} (recipe {args.fp8_recipe}) needs a GPU of compute capability {cc}+; this one is {got}: "
                "drop the fp8 flags")
    if not machine.te or args.transformer_impl == "local":
        return f"{flag} needs transformer-engine layers: pip install transformer-engine, and no --transformer-impl local"
    if args.dcp:
        return (f"{flag} is not supported under --dcp (fp8 scaling state is kept per static layout): drop --dcp "
                "or the fp8 flags")
    if args.fp8_param_gather and not args.use_distributed_optimizer:
        return "--fp8-param-gather needs --use-distributed-optimizer (as upstream)"
    return None


def config_fields(args, machine: Optional[Machine] = None) -> dict:
    """TransformerConfig fields of these flags, for the machine the run is on."""
    from megatron.core.transformer.enums import AttnBackend

    machine = machine or Machine.here()
    te = uses_transformer_engine(args, machine)
    fused = machine.cuda  # the jit-fused bias/activation/dropout kernels are compiled on GPUs only here
    activation_fusion = args.bias_swiglu_fusion if args.swiglu else (args.bias_gelu_fusion and not args.disable_bias_linear)
    fields = dict(
        layernorm_zero_centered_gamma=args.apply_layernorm_1p,
        qk_layernorm=args.qk_layernorm,
        add_qkv_bias=args.add_qkv_bias,
        attention_backend=AttnBackend[_requested_backend(args)] if te else AttnBackend.auto,
        # the unfused loss reads the global TP group, which --dcp never sets: its replicas use the fused one
        cross_entropy_loss_fusion=bool(args.cross_entropy_loss_fusion or args.dcp),
        cross_entropy_fusion_impl=args.cross_entropy_fusion_impl if args.cross_entropy_loss_fusion else "native",
        calculate_per_token_loss=True,  # docs/contracts.md: per token over the global batch, always
        masked_softmax_fusion=bool(args.masked_softmax_fusion and fused and not te),
        bias_activation_fusion=bool(activation_fusion and fused),
        bias_dropout_fusion=bool(args.bias_dropout_fusion and fused),
        apply_rope_fusion=bool(args.apply_rope_fusion and te and args.position_embedding_type == "rope"),
        # TE's linears add weight gradients into DDP's main_grad; the --dcp runtime keeps its own
        gradient_accumulation_fusion=bool(args.gradient_accumulation_fusion and te and not args.dcp),
    )
    if args.fp8_format is not None:
        fields.update(fp8=args.fp8_format, fp8_recipe=args.fp8_recipe, fp8_margin=args.fp8_margin,
                      fp8_interval=args.fp8_interval, fp8_amax_history_len=args.fp8_amax_history_len,
                      fp8_amax_compute_algo=args.fp8_amax_compute_algo, fp8_wgrad=args.fp8_wgrad,
                      fp8_param=args.fp8_param_gather)
    return fields


def startup_notes(args, machine: Optional[Machine] = None) -> list[str]:
    """The lines rank 0 prints at start about what these flags do on this machine."""
    machine = machine or Machine.here()
    notes = []
    line = attention_note(args, machine)
    if line:
        notes.append(line)
    if not args.calculate_per_token_loss:
        notes.append("loss: per token over the global batch (upstream's --calculate-per-token-loss rule, always "
                     "used here); upstream without the flag would average per micro-batch")
    if args.dcp and not args.cross_entropy_loss_fusion:
        notes.append("loss: --dcp computes the cross entropy with megatron-core's fused native kernel (the same "
                     "values; the unfused one reads a global TP group)")
    if not machine.cuda:
        notes.append("kernels: no fused kernels on the CPU (bias/activation/dropout/softmax/rope fusions and "
                     "gradient-accumulation fusion off)" + (", zero-centred norms (--apply-layernorm-1p) by torch"
                                                             if args.apply_layernorm_1p else ""))
    if args.init_model_with_meta_device:
        notes.append("--init-model-with-meta-device: the model is built directly where it trains and initialised "
                     "there (no Megatron FSDP here to materialise a meta model)")
    if getattr(args, "tokenizer_type_defaulted", False):
        notes.append("tokenizer: --vocab-file/--merge-file without --tokenizer-type: GPT2BPETokenizer, upstream's "
                     "pretrain_gpt.py default")
    if getattr(args, "dcp_planner_renamed", False):
        notes.append("--dcp-planner dcp is now named cp-buckets (context parallelism per length bucket, NUS DCP's "
                     "scheme); the old name still works")
    from megatron.training.flags.sft_flags import note as sft_note

    if sft_note(args):
        notes.append(sft_note(args))
    if not args.check_for_nan_in_loss_and_grad:
        notes.append("--no-check-for-nan-in-loss-and-grad: NaN/inf iterations are still skipped and stop the run "
                     "after --max-nan-iterations in a row (their update would poison the weights)")
    return notes
