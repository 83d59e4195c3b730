"""Convert an upstream Megatron-LM checkpoint in its legacy format into a torch_dist checkpoint of its weights.

Why it exists: upstream's `--ckpt-format torch` (its default before torch_dist) writes one
torch.save file per model-parallel rank,

    {load}/latest_checkpointed_iteration.txt            -> "1000" (or "release")
    {load}/iter_0001000/mp_rank_TT[_PPP]/model_optim_rng.pt
        {"args": argparse.Namespace, "checkpoint_version": 3.0, "iteration": 1000,
         "model": the stage's state dict (its TP shard, its layers numbered from 0),
         "optimizer", "opt_param_scheduler", "rng_state", ...}

(`_PPP` only with pipeline parallelism; `model0`, `model1`, ... per virtual pipeline chunk).
This fork reads torch_dist checkpoints only, so users with such checkpoints convert them once:

    python tools/convert_legacy_checkpoint.py --load UPSTREAM_DIR [--iteration N] --save OUT [--force]

then train with `--load OUT --finetune` (iteration 0, fresh optimizer) or `--no-load-optim
--no-load-rng` (continue at N), on either path (static at any TP/PP, or `--dcp`).

How: each rank file is read as data only (`checkpoint_unpickler.load_legacy_file`:
weights_only, nothing in the file runs); the tensor-parallel shards of every parameter are
joined along the dimension the model's full shape says (SwiGLU's fc1 per shard as [gate;
up]: the gates then the ups), the pipeline stages' layers renumbered in order, transformer-
engine's names mapped to the local layers' (the layer norms fused into linear_qkv/linear_fc1)
and its `_extra_state` dropped; the result fills the TP1/PP1 GPTModel the static path builds
from the checkpoint's own model flags, saved through its `sharded_state_dict()` by
`checkpoint_protocol.save_sharded_atomic` (weights only: `args`, `iteration`,
`consumed_train_samples`, `model`). Its padded vocabulary is the checkpoint's.

Refused in one line: mixture-of-experts (expert ranks, --num-experts), multi-latent
attention, Megatron's pre-core GPT model (`language_model` keys: convert with upstream's
tools/checkpoint/convert.py to a core model first), a rank file missing or unreadable, one
that would run code, a `--save` that holds a checkpoint (unless `--force`, never rewinding
its tracker).
"""
from __future__ import annotations

import argparse
import os
import re
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

FORMAT = "megatron-weights-from-legacy/v1"
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_GATED = ("mlp.linear_fc1.weight", "mlp.linear_fc1.bias")


class ConversionError(RuntimeError):
    """A checkpoint or request this tool cannot convert; the message is one line."""


# ------------------------------------------------------------------------ the source
def parse_options(argv: list[str]) -> argparse.Namespace:
    from dcp_ext.cli.boundary import Parser

    p = Parser(prog="convert_legacy_checkpoint.py", allow_abbrev=False,
               description="Convert an upstream Megatron-LM legacy checkpoint (--ckpt-format torch, "
                           "mp_rank_*/model_optim_rng.pt) into a torch_dist checkpoint of its weights.")
    p.add_argument("--load", required=True, help="upstream's --save directory (holds the tracker file)")
    p.add_argument("--iteration", type=int, default=None, help="default: the one the tracker file names")
    p.add_argument("--save", required=True, help="output directory (torch_dist, Megatron layout)")
    p.add_argument("--force", action="store_true",
                   help="write into a --save directory that already holds a checkpoint (never to an older "
                        "iteration than its tracker names)")
    opts = p.parse_args(argv)
    if opts.iteration is not None and opts.iteration < 0:
        raise ConversionError(f"--iteration {opts.iteration} must be >= 0")
    save, load = os.path.realpath(opts.save), os.path.realpath(opts.load)
    if save == load or os.path.commonpath([save, load]) == load:
        raise ConversionError(f"--save {opts.save} is --load {opts.load} or inside it; choose a --save directory "
                              "outside the source checkpoint")
    return opts


def resolve_source(load: str, iteration: int | None) -> tuple[str, int]:
    """(the legacy checkpoint's folder, its iteration; 0 for a release checkpoint)."""
    from megatron.training.checkpoint import protocol as ckpt

    if not os.path.isdir(load):
        raise ConversionError(f"--load {load}: no such directory")
    if ckpt.legacy_shards(load):
        raise ConversionError(f"--load {load} is one checkpoint's folder (it holds mp_rank_* folders): pass its "
                              f"parent, the folder that holds {ckpt.TRACKER}")
    if iteration is None:
        text = _tracker_text(os.path.join(load, ckpt.TRACKER))
        if text is None:
            raise ConversionError(f"--load {load}: no {ckpt.TRACKER} found; name the checkpoint with --iteration N")
        if text == ckpt.RELEASE:
            folder, iteration = os.path.join(load, ckpt.RELEASE), 0
        elif text.isdigit():
            iteration = int(text)
            folder = ckpt.checkpoint_dir(load, iteration)
        else:
            raise ConversionError(f"{os.path.join(load, ckpt.TRACKER)}: expected an iteration number or 'release', "
                                  f"found {text[:40]!r}")
    else:
        folder = ckpt.checkpoint_dir(load, iteration)
    if not os.path.isdir(folder):
        raise ConversionError(f"--load {load}: {folder} does not exist")
    if ckpt.is_complete(folder):
        raise ConversionError(f"--load {load}: {folder} is already a torch_dist checkpoint: load it as it is "
                              "(--load with --finetune), no conversion needed")
    return folder, iteration


def _tracker_text(path: str) -> str | None:
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return f.read().strip()


def rank_files(folder: str) -> tuple[dict[tuple[int, int], str], int, int]:
    """{(tp rank, pp rank): model_optim_rng.pt}, tp size, pp size; every rank of the grid present."""
    from megatron.training.checkpoint import protocol as ckpt

    shards = ckpt.legacy_shards(folder)
    if not shards:
        raise ConversionError(f"{folder}: no mp_rank_* folders: not a checkpoint in upstream's legacy format "
                              "(--ckpt-format torch)")
    if any(ep for _, _, ep in shards):
        raise ConversionError(f"{folder}: expert-parallel rank folders (mp_rank_TT_PPP_EEE): a mixture-of-experts "
                              "checkpoint; this fork trains dense GPT models")
    tp, pp = 1 + max(k[0] for k in shards), 1 + max(k[1] for k in shards)
    files = {}
    for t in range(tp):
        for p in range(pp):
            if (t, p, 0) not in shards:
                name = f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 else "")
                raise ConversionError(f"{folder}: {name} is missing (the checkpoint has tensor-parallel {tp}, "
                                      f"pipeline-parallel {pp}); copy the whole checkpoint folder")
            path = os.path.join(shards[(t, p, 0)], ckpt.LEGACY_FILE)
            if not os.path.isfile(path):
                raise ConversionError(f"{path} is missing; copy the whole checkpoint folder")
            files[(t, p)] = path
    return files, tp, pp


def read_rank_file(path: str) -> dict:
    """One rank's file as data (its optimizer and RNG state dropped at once)."""
    from dcp_ext.compat.checkpoint_unpickler import CodeRefused, load_legacy_file

    try:
        state = load_legacy_file(path)
    except CodeRefused as e:
        raise ConversionError(str(e)) from None
    except Exception as e:  # cut short, not a torch file
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
        raise ConversionError(f"{path}: cannot read it ({type(e).__name__}: {first}); copy it again from "
                              "the source") from None
    if not isinstance(state, dict):
        raise ConversionError(f"{path}: holds a {type(state).__name__}, not a Megatron checkpoint's state dict")
    for key in ("optimizer", "rng_state", "opt_param_scheduler", "rerun_state_machine"):
        state.pop(key, None)
    return state


def model_chunks(state: dict, path: str) -> list[dict]:
    """The file's model state dicts in layer order: `model`, or `model0`, `model1`, ... (virtual pipeline)."""
    if "model" in state:
        chunks = [state["model"]]
    else:
        keys = sorted((k for k in state if re.fullmatch(r"model\d+", str(k))), key=lambda k: int(k[5:]))
        if not keys:
            raise ConversionError(f"{path}: holds no model state (no 'model' key; keys: "
                                  f"{', '.join(map(str, list(state)[:6]))})")
        chunks = [state[k] for k in keys]
    for chunk in chunks:
        if not isinstance(chunk, dict):
            raise ConversionError(f"{path}: its model state is a {type(chunk).__name__}, not a state dict")
        if "language_model" in chunk:
            raise ConversionError(f"{path}: holds Megatron's pre-core GPT model (language_model.* keys); convert it "
                                  "to a megatron-core model with upstream's tools/checkpoint/convert.py (--saver core) "
                                  "first")
    return chunks


# ------------------------------------------------------------------------ model flags
# (attribute of upstream's args, flag, kind): what shapes the model, as upstream's
# --use-checkpoint-args reads it
_MODEL_FLAGS = (
    ("num_layers", "--num-layers", int), ("hidden_size", "--hidden-size", int),
    ("ffn_hidden_size", "--ffn-hidden-size", int), ("num_attention_heads", "--num-attention-heads", int),
    ("kv_channels", "--kv-channels", int), ("max_position_embeddings", "--max-position-embeddings", int),
    ("seq_length", "--seq-length", int), ("position_embedding_type", "--position-embedding-type", str),
    ("rotary_base", "--rotary-base", int), ("rotary_percent", "--rotary-percent", float),
    ("rotary_interleaved", "--rotary-interleaved", bool), ("use_rope_scaling", "--use-rope-scaling", bool),
    ("rope_scaling_factor", "--rope-scaling-factor", float), ("normalization", "--normalization", str),
    ("norm_epsilon", "--norm-epsilon", float), ("apply_layernorm_1p", "--apply-layernorm-1p", bool),
    ("qk_layernorm", "--qk-layernorm", bool), ("swiglu", "--swiglu", bool), ("squared_relu", "--squared-relu", bool),
    ("add_qkv_bias", "--add-qkv-bias", bool),
    ("untie_embeddings_and_output_weights", "--untie-embeddings-and-output-weights", bool),
    ("hidden_dropout", "--hidden-dropout", float), ("attention_dropout", "--attention-dropout", float),
)
# kept in the converted checkpoint's args as they were (the tokenizer is not needed to convert)
_TOKENIZER_ATTRS = ("tokenizer_type", "vocab_size", "vocab_file", "merge_file", "tokenizer_model",
                    "make_vocab_size_divisible_by")


def model_flags(saved) -> list[str]:
    """The model flags the checkpoint's args describe (what `--load OUT` needs)."""
    out = []
    if getattr(saved, "group_query_attention", False) and getattr(saved, "num_query_groups", None):
        out += ["--group-query-attention", "--num-query-groups", str(saved.num_query_groups)]
    if getattr(saved, "add_bias_linear", True) is False or getattr(saved, "disable_bias_linear", False):
        out.append("--disable-bias-linear")  # upstream's args: add_bias_linear False; ours: disable_bias_linear
    for name, flag, kind in _MODEL_FLAGS:
        value = getattr(saved, name, None)
        if value is None or (kind is bool and not value):
            continue
        if kind is bool:
            out.append(flag)
        elif name == "rope_scaling_factor" and not getattr(saved, "use_rope_scaling", False):
            continue
        else:
            out += [flag, f"{value:g}" if kind is float else str(value)]
    return out


def check_model(saved, path: str) -> None:
    """What a dense GPT here cannot be: one line naming it."""
    if saved is None:
        raise ConversionError(f"{path}: records no 'args' (the run's flags): the model cannot be rebuilt from it")
    for name in ("num_layers", "hidden_size", "num_attention_heads"):
        if not isinstance(getattr(saved, name, None), int):
            raise ConversionError(f"{path}: its args lack {name}: the model cannot be rebuilt from it")
    if getattr(saved, "num_experts", None):
        raise ConversionError(f"{path}: a mixture-of-experts model (--num-experts {saved.num_experts}); this fork "
                              "trains dense GPT models")
    if getattr(saved, "multi_latent_attention", False):
        raise ConversionError(f"{path}: multi-latent attention (--multi-latent-attention); this fork trains GPT "
                              "models with standard attention")


def build_args(saved, rows: int):
    """Our parsed arguments for the checkpoint's model at TP1/PP1 on one rank, its vocabulary
    padded to `rows` (as it was saved)."""
    from megatron.training.arguments import ArgumentError, parse_args

    flags = model_flags(saved) + ["--tokenizer-type", "NullTokenizer", "--vocab-size", str(rows - 1),
                                  "--make-vocab-size-divisible-by", "1", "--micro-batch-size", "1",
                                  "--global-batch-size", "1", "--train-iters", "1", "--lr", "0", "--mock-data"]
    try:
        args = parse_args(flags, world_size=1)
    except ArgumentError as e:
        raise ConversionError(f"the checkpoint's model is refused here: {e}") from None
    args.padded_vocab_size = rows
    for name in _TOKENIZER_ATTRS:  # the run's own tokenizer, for --use-checkpoint-args
        if hasattr(saved, name):
            setattr(args, name, getattr(saved, name))
    args.consumed_train_samples = getattr(saved, "consumed_train_samples", 0) or 0
    args.no_save_optim = args.no_save_rng = True  # a weights-only checkpoint
    return args


# ------------------------------------------------------------------------ the merge
def local_names(state: dict) -> dict:
    """A stage's state in the local layers' names: transformer-engine's fused layer norms
    (linear_qkv.layer_norm_*, linear_fc1.layer_norm_*) under input/pre_mlp_layernorm, no
    `_extra_state` (fp8 metadata; nothing the weights need)."""
    from megatron.training.checkpoint.checkpointing_adaptive import local_name

    return {local_name(k): v for k, v in state.items() if not k.endswith("_extra_state")}


def renumber(stages: list[dict]) -> dict[str, list]:
    """{name: [tensor per tp rank]} of the whole model from its stages in layer order, each
    stage a list of tp shards (state dicts) whose layers count from 0."""
    out: dict[str, list] = {}
    offset = 0
    for shards in stages:
        layers = set()
        for t, shard in enumerate(shards):
            for name, value in shard.items():
                m = _LAYER.match(name)
                if m:
                    layers.add(int(m.group(1)))
                    name = f"decoder.layers.{offset + int(m.group(1))}.{m.group(2)}"
                out.setdefault(name, []).append(value)
        offset += len(layers)
    return out


def join_shards(name: str, shards: list, shape: tuple, gated: bool):
    """One parameter of the TP1 model from its tensor-parallel shards (rank order)."""
    import torch

    first = shards[0]
    if not isinstance(first, torch.Tensor):
        raise ConversionError(f"{name}: stored as a {type(first).__name__}, not a tensor")
    if tuple(first.shape) == shape:
        return first  # replicated over tensor-parallel ranks (norms, row-parallel biases)
    tp = len(shards)
    if gated and name.endswith(_GATED):  # each rank holds [gate_r; up_r]
        halves = [torch.chunk(s, 2, dim=0) for s in shards]
        joined = torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    else:
        dims = [d for d in range(first.dim()) if first.shape[d] * tp == shape[d]
                and all(first.shape[e] == shape[e] for e in range(first.dim()) if e != d)]
        if len(first.shape) != len(shape) or not dims:
            raise ConversionError(f"{name}: {tp} shards of shape {tuple(first.shape)} do not make the model's "
                                  f"{shape}; the checkpoint's args do not describe its tensors")
        joined = torch.cat(shards, dim=dims[0])
    if tuple(joined.shape) != shape:
        raise ConversionError(f"{name}: its shards make {tuple(joined.shape)}, the model has {shape}")
    return joined


def full_model_state(by_name: dict[str, list], shapes: dict[str, tuple], gated: bool) -> dict:
    """{parameter name: full tensor} for the TP1 model whose parameter shapes are `shapes`."""
    out = {}
    for name, shards in by_name.items():
        if name not in shapes:
            if name == "output_layer.weight" and "embedding.word_embeddings.weight" in shapes:
                continue  # tied embeddings under pipeline parallelism: the last stage's copy
            raise ConversionError(f"the checkpoint holds {name}, which the model its args describe does not have")
        out[name] = join_shards(name, shards, shapes[name], gated)
    missing = sorted(set(shapes) - set(out))
    if missing:
        raise ConversionError(f"the checkpoint lacks {len(missing)} of the model's tensors (first: {missing[0]})")
    return out


# ------------------------------------------------------------------------ the save
def _one_rank_group() -> None:
    import datetime
    import socket

    import torch.distributed as dist

    from dcp_ext.compat import cpu_compat, mcore_compat

    cpu_compat.install()
    mcore_compat.install()
    if dist.is_initialized():
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                            timeout=datetime.timedelta(minutes=30))


def build_model(args):
    from megatron.core import parallel_state

    from megatron.training import global_vars
    from megatron.training.flags.core_configs import transformer_config_from_args
    from pretrain_gpt_dcp import model_provider

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    global_vars.set_args(args)
    config = transformer_config_from_args(args, use_cpu_initialization=True, perform_initialization=False)
    return model_provider(config, pre_process=True, post_process=True)


def convert(opts) -> tuple[argparse.Namespace, int, int, int, int]:
    """Read, join, save; returns (the checkpoint's args, iteration, tp, pp, vocabulary rows)."""
    import torch

    from megatron.training.checkpoint import protocol as ckpt
    from tools.convert_dcp_checkpoint import check_destination

    folder, iteration = resolve_source(opts.load, opts.iteration)
    files, tp, pp = rank_files(folder)
    check_destination(opts.save, iteration, opts.force)
    _one_rank_group()  # installs the data-only readers and megatron-core's safe types first
    first = read_rank_file(files[(0, 0)])
    saved = first.get("args")
    check_model(saved, files[(0, 0)])
    version = first.get("checkpoint_version", 0)
    if not isinstance(version, (int, float)) or version < 3.0:
        raise ConversionError(f"{files[(0, 0)]}: checkpoint_version {version} (Megatron before megatron-core's "
                              "models); convert it with upstream's tools/checkpoint/convert.py first")
    # stages in layer order: virtual-pipeline chunk v of every stage, then chunk v+1
    per_stage = {}
    for p in range(pp):
        ranks = []
        for t in range(tp):
            state = first if (t, p) == (0, 0) else read_rank_file(files[(t, p)])
            ranks.append([local_names(c) for c in model_chunks(state, files[(t, p)])])
        per_stage[p] = ranks
    chunks = len(per_stage[0][0])
    stages = [[per_stage[p][t][v] for t in range(tp)] for v in range(chunks) for p in range(pp)]
    by_name = renumber(stages)
    emb = by_name.get("embedding.word_embeddings.weight")
    if not emb:
        raise ConversionError(f"{folder}: no embedding.word_embeddings.weight in any rank file")
    rows = sum(int(s.shape[0]) for s in emb)
    args = build_args(saved, rows)
    model = build_model(args)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    full = full_model_state(by_name, shapes, bool(args.swiglu))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(full[name].to(p.dtype))
    state = {"args": ckpt.common_args(args), "checkpoint_version": ckpt.CHECKPOINT_VERSION, "iteration": iteration,
             "consumed_train_samples": args.consumed_train_samples,
             "converted_from": {"path": os.path.abspath(folder), "format": "megatron-legacy-torch",
                                "tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp,
                                "export_format": FORMAT},
             "model": model.sharded_state_dict()}
    ckpt.save_sharded_atomic(opts.save, iteration, state)
    return saved, iteration, tp, pp, rows


def main(argv: list[str] | None = None) -> int:
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # a CPU job on any machine
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.getLogger("megatron").setLevel(logging.ERROR)
    from dcp_ext.cli.boundary import run_tool
    from megatron.training.arguments import ArgumentError
    from megatron.training.checkpoint.protocol import CheckpointError

    argv = list(sys.argv[1:] if argv is None else argv)
    return run_tool(lambda: _main(argv), errors={ArgumentError: 2, ConversionError: 1, CheckpointError: 1},
                    interrupted="interrupted (Ctrl-C); the tracker of --save still names a complete checkpoint")


def _main(argv: list[str]) -> int:
    opts = parse_options(argv)
    saved, iteration, tp, pp, rows = convert(opts)
    flags = " ".join(model_flags(saved))
    print(f"converted iteration {iteration} of {opts.load} (upstream legacy format, tensor-parallel {tp}, "
          f"pipeline-parallel {pp}) to {opts.save}: a torch_dist checkpoint of the weights ({rows} vocabulary rows)")
    print(f"its model flags: {flags}")
    print(f"load it with: --load {opts.save} --finetune (or --no-load-optim --no-load-rng to continue at iteration "
          f"{iteration}), on the static path at any TP/PP or with --dcp", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
