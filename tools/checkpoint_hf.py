"""Hugging Face models (Llama, Mistral, Qwen2, Qwen3, Phi-3) in and out of this fork's checkpoints.

Why this exists: most jobs start from a published model and hand the result back to the
Hugging Face ecosystem. This tool is that bridge, on the CPU, in one process:

    python tools/checkpoint_hf.py import --hf HF_DIR --save CKPT [--dcp]
    python tools/checkpoint_hf.py export --load CKPT --hf OUT_DIR [--dtype float32|bfloat16|float16]

`import` reads config.json and the safetensors weights (one file, or shards with their
index) of a Llama (biases on every linear too), Mistral, Qwen2, Qwen3 (--qk-layernorm) or
Phi-3 (fused projections split, partial rotary as --rotary-percent) model and writes a
static checkpoint (megatron-core dist-checkpointing, the layout the static path saves:
iteration 0, weights only) that both paths load: `--load CKPT --finetune`, with or without
`--dcp` (the adaptive runtime reads static checkpoints' weights,
`checkpointing_adaptive.read_static`). It prints the Megatron flags the model needs and
writes them to CKPT/hf_model_args.txt; the tokenizer files and the model's config
(CKPT/hf_config.json) are copied next to the checkpoint. `--dcp` adds the flags of an
adaptive run to what it prints.

`export` reads a checkpoint of either kind (static, or `--dcp`'s canonical tensors) and
writes config.json + model.safetensors (+ the tokenizer files it finds next to the
checkpoint or at the run's --tokenizer-model) that `transformers` loads: the imported
model's family where it holds the checkpoint's flags, else the one they need (qwen3 for
--qk-layernorm, qwen2 for --add-qkv-bias, phi3 for --rotary-percent, llama otherwise). The
vocabulary is cut back to the Hugging Face size (hf_config.json's, else the tokenizer's).

Each family's facts (flags, tensor names, layouts) are in tools/hf_families.py. RMSNorm
weights sit in `input_layernorm` / `pre_mlp_layernorm` (saved under transformer-engine's
names `linear_qkv.layer_norm_weight` / `linear_fc1.layer_norm_weight`).

What GPTModel here cannot express is refused in one `error:` line naming it, through the
console tools' error boundary: Gemma and Gemma2 (an embedding scale, a GELU-gated MLP,
softcapping, norms after attention and MLP), an unknown model_type or an activation other
than SiLU, active sliding-window attention, RoPE scaling other than Llama 3.1's with its
built-in constants (megatron-core's --use-rope-scaling), partial rotary outside Phi-3, a
bias Megatron cannot place (Llama's attention_bias without mlp_bias, or the reverse).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from tools.hf_families import (  # noqa: E402,F401  (the families' facts; re-exported for callers)
    FAMILIES, SUPPORTED, HFError, Shape, canonical_shapes, canonical_to_hf, fits, fuse_qkv, hf_config, hf_to_canonical,
    megatron_flags, shape_from_args, shape_from_config, split_qkv)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "generation_config.json")
ARGS_FILE = "hf_model_args.txt"
CONFIG_FILE = "hf_config.json"
IMPORT_FORMAT = "megatron-weights-from-hf/v1"
DTYPES = ("float32", "bfloat16", "float16")


# --------------------------------------------------------------------- files
def read_config(folder: str, flag: str) -> dict:
    path = os.path.join(folder, "config.json")
    if not os.path.isdir(folder):
        raise HFError(f"{flag} {folder}: no such directory")
    if not os.path.isfile(path):
        raise HFError(f"{flag} {folder}: no config.json (a Hugging Face model directory holds config.json and "
                      "*.safetensors)")
    try:
        with open(path) as f:
            cfg = json.load(f)
    except ValueError as e:
        raise HFError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise HFError(f"{path}: not a model configuration (a JSON object)")
    return cfg


def read_hf_tensors(folder: str) -> dict:
    """Every tensor of the model's safetensors files (one file, or the shards its index names)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            with open(index) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        except (ValueError, KeyError, TypeError):
            raise HFError(f"{index}: not a safetensors index (no weight_map)") from None
    else:
        files = sorted(n for n in os.listdir(folder) if n.endswith(".safetensors"))
    if not files:
        bins = [n for n in os.listdir(folder) if n.endswith(".bin") or n.endswith(".pth")]
        hint = " (it holds PyTorch .bin files: re-save it with save_pretrained(..., safe_serialization=True))" \
            if bins else ""
        raise HFError(f"--hf {folder}: no *.safetensors weights{hint}")
    tensors = {}
    for name in files:
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            raise HFError(f"{path}: missing (named by the safetensors index)")
        try:
            tensors.update(load_file(path))
        except (SafetensorError, OSError, ValueError) as e:
            raise HFError(f"{path}: cannot read it ({str(e).splitlines()[0] if str(e) else type(e).__name__})") \
                from None
    return tensors


def copy_tokenizer(src: str, dst: str) -> list[str]:
    copied = []
    for name in TOKENIZER_FILES:
        path = os.path.join(src, name)
        if os.path.isfile(path):
            shutil.copyfile(path, os.path.join(dst, name))
            copied.append(name)
    return copied


def tokenizer_size(folder: str) -> int | None:
    """The vocabulary the run's HuggingFaceTokenizer will report, if it loads."""
    try:
        from dcp_ext.data.tokenizers import build_tokenizer

        return int(build_tokenizer("HuggingFaceTokenizer", tokenizer_model=folder).vocab_size)
    except Exception:  # no tokenizer, or one the run would refuse (it says so then)
        return None


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def vocabulary(shape: Shape, source: str, save: str) -> tuple[int, int, list[str]]:
    """(padded rows, --make-vocab-size-divisible-by, tokenizer flags): Megatron pads the
    tokenizer's vocabulary (the one in `source`, copied to `save`); the rows must also hold
    every row of the HF embedding."""
    has_tokenizer = any(os.path.isfile(os.path.join(source, n))
                        for n in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))
    size = None
    if has_tokenizer:  # loaded as the run will load it: the copied files alone, without config.json
        import tempfile

        with tempfile.TemporaryDirectory() as alone:
            copy_tokenizer(source, alone)
            size = tokenizer_size(alone)
    if size is not None:
        flags = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", os.path.abspath(save)]
    else:  # no tokenizer that loads here: NullTokenizer, ids 0..vocab-1, the last one its EOD
        if has_tokenizer:
            print(f"note: the tokenizer files of {source} do not load here; the flags name NullTokenizer "
                  "(give --tokenizer-type/--tokenizer-model yourself)")
        flags = ["--tokenizer-type", "NullTokenizer", "--vocab-size", str(shape.vocab - 1)]
    size = size or shape.vocab
    rows = round_up(max(size, shape.vocab), 128)
    divisible_by = 128 if round_up(size, 128) == rows else rows
    return rows, divisible_by, flags + (["--make-vocab-size-divisible-by", str(divisible_by)]
                                        if divisible_by != 128 else [])


# ---------------------------------------------------------------- the process group
def _one_rank_group() -> None:
    """dist-checkpointing saves and loads through torch.distributed: one gloo rank."""
    import datetime

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


# -------------------------------------------------------------------- import
def build_args(flags: list[str], shape: Shape, rows: int, dcp: bool) -> argparse.Namespace:
    """The run's arguments for these model flags (parsed as pretrain_gpt_dcp.py parses them),
    at TP1/PP1 on one rank, the vocabulary padded to `rows`. With `dcp` the flags are first
    checked as a --dcp run checks them. A refusal is one line naming the flag."""
    from megatron.training.arguments import ArgumentError, parse_args

    extra = ["--seq-length", str(min(shape.max_positions, 4096)), "--micro-batch-size", "1",
             "--global-batch-size", "1", "--train-iters", "1", "--lr", "0", "--mock-data"]
    try:
        if dcp:
            parse_args(flags + extra + ["--dcp"], world_size=1)
        args = parse_args(flags + extra, world_size=1)
    except ArgumentError as e:
        raise HFError(f"this model's flags are refused{' under --dcp' if dcp else ''}: {e}") from None
    args.padded_vocab_size = rows
    args.no_save_optim = args.no_save_rng = True  # what a load without --finetune is told to skip
    return args


def write_static(save: str, tensors: dict, args: argparse.Namespace, source: dict) -> None:
    """Our tensors as the static path's checkpoint at iteration 0: the TP1/PP1 GPTModel the
    static path builds, filled, saved through its own `sharded_state_dict()` (the layout
    `checkpointing.save_checkpoint` writes, weights only)."""
    import torch
    from megatron.core import parallel_state

    from megatron.training.checkpoint import protocol as ckpt
    from megatron.training import global_vars
    from megatron.training.flags.core_configs import transformer_config_from_args
    from pretrain_gpt_dcp import model_provider

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    global_vars.set_args(args)
    config = transformer_config_from_args(args, use_cpu_initialization=True, perform_initialization=False)
    model = model_provider(config, pre_process=True, post_process=True)
    names = {n for n, _ in model.named_parameters()}
    if names != set(tensors):
        odd = sorted(names ^ set(tensors))[:3]
        raise HFError(f"the converted tensors do not match the model the flags build (first differences: {odd})")
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(tensors[name].to(p.dtype))
    state = {"args": ckpt.common_args(args), "checkpoint_version": ckpt.CHECKPOINT_VERSION, "iteration": 0,
             "consumed_train_samples": 0, "imported_from": source, "model": model.sharded_state_dict()}
    ckpt.save_sharded_atomic(save, 0, state)


def check_save(save: str) -> None:
    from dcp_ext.cli.boundary import check_output
    from megatron.training.checkpoint import protocol as ckpt

    if os.path.lexists(save) and not os.path.isdir(save):
        raise HFError(f"--save {save}: is a file, not a directory; point --save to a directory")
    check_output("--save", os.path.join(save, ckpt.TRACKER), make_folder=True)
    if os.path.isdir(save) and (os.path.exists(os.path.join(save, ckpt.TRACKER))
                                or any(n.startswith("iter_") for n in os.listdir(save))):
        raise HFError(f"--save {save} already holds a checkpoint; choose an empty --save directory")


def do_import(opts) -> int:
    cfg = read_config(opts.hf, "--hf")
    shape = shape_from_config(cfg, os.path.join(opts.hf, "config.json"))
    check_save(opts.save)
    rows, _, tokenizer = vocabulary(shape, opts.hf, opts.save)
    flags = megatron_flags(shape) + tokenizer
    _one_rank_group()
    args = build_args(flags, shape, rows, opts.dcp)  # refused flags: before anything is written
    ours = hf_to_canonical(read_hf_tensors(opts.hf), shape, rows)
    os.makedirs(opts.save, exist_ok=True)
    copied = copy_tokenizer(opts.hf, opts.save)
    with open(os.path.join(opts.save, CONFIG_FILE), "w") as f:
        json.dump(cfg, f, indent=2)
    write_static(opts.save, ours, args, {"format": IMPORT_FORMAT, "hf": os.path.abspath(opts.hf),
                                         "model_type": shape.model_type, "vocab_size": shape.vocab})
    load = ["--load", os.path.abspath(opts.save), "--finetune"] + (["--dcp"] if opts.dcp else [])
    line = " ".join(flags + load)
    with open(os.path.join(opts.save, ARGS_FILE), "w") as f:
        f.write(line + "\n")
    print(f"imported {shape.model_type} from {opts.hf} to {opts.save}: {shape.layers} layers, hidden {shape.hidden}, "
          f"{shape.vocab} vocabulary ids in {rows} rows; tokenizer files: {', '.join(copied) or 'none'}")
    print(f"train from it with these flags (also in {os.path.join(opts.save, ARGS_FILE)}):")
    print(line, flush=True)
    return 0


# -------------------------------------------------------------------- export
def find_base(load: str, saved) -> str | None:
    """Where the model's Hugging Face config and tokenizer were left: next to the checkpoint
    (an import), or at the run's --tokenizer-model (a run started from an import)."""
    candidates = [load]
    model = getattr(saved, "tokenizer_model", None)
    if model:
        candidates.append(model if os.path.isdir(model) else os.path.dirname(model))
    for folder in candidates:
        if os.path.isfile(os.path.join(folder, CONFIG_FILE)) or any(
                os.path.isfile(os.path.join(folder, n)) for n in TOKENIZER_FILES[:3]):
            return folder
    return None


def read_checkpoint(load: str) -> tuple[dict, argparse.Namespace, str]:
    """({our name: fp32 tensor}, stored args, checkpoint folder) of a static or --dcp checkpoint."""
    from megatron.training.checkpoint import protocol as ckpt
    from megatron.training.checkpoint.inspector import open_checkpoint

    if not os.path.isdir(load):
        raise HFError(f"--load {load}: no such directory")
    tracker = os.path.join(load, ckpt.TRACKER)
    if os.path.isfile(tracker) and open(tracker).read().strip() == ckpt.RELEASE:
        path = os.path.join(load, ckpt.RELEASE)
    else:
        iteration = ckpt.read_tracker(load)
        if iteration is None:
            raise HFError(f"--load {load}: no {ckpt.TRACKER} found (pass the folder that holds it)")
        path = ckpt.find_checkpoint(load, iteration)
        if path is None:
            raise HFError(f"--load {load}: its tracker names iteration {iteration}, which is missing or incomplete")
    _one_rank_group()
    common = open_checkpoint(path)  # inspected, every file against its checksum, code refused
    saved = common.get("args")
    if saved is None:
        raise HFError(f"{path}: the checkpoint stores no model flags (args); cannot tell its shape")
    shape = shape_from_args(saved, path)
    from megatron.training.checkpoint.checkpointing_adaptive import is_adaptive

    if is_adaptive(common):
        return _read_dcp(path, common), saved, path
    from megatron.core import dist_checkpointing

    from megatron.training.checkpoint.checkpointing_adaptive import read_static

    rows = tuple(dist_checkpointing.load_tensors_metadata(path)["embedding.word_embeddings.weight"].global_shape)[0]
    return read_static(path, canonical_shapes(shape, rows)), saved, path


def _read_dcp(path: str, common: dict) -> dict:
    import torch
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from megatron.training.checkpoint.inspector import load_or_explain
    from megatron.training.checkpoint.checkpointing_adaptive import local_name, tensor_key

    request = {n: ShardedTensor.from_rank_offsets(tensor_key(common, "param", n), torch.empty(s), replica_id=0)
               for n, s in common["canonical"]}
    state = load_or_explain(request, path, validate_access_integrity=False)
    return {local_name(n): state[n].float() for n, _ in common["canonical"]}


def do_export(opts) -> int:
    import torch
    from safetensors.torch import save_file

    if os.path.realpath(opts.hf) == os.path.realpath(opts.load):
        raise HFError("--hf must differ from --load (the export would write into the checkpoint)")
    if os.path.lexists(opts.hf) and not os.path.isdir(opts.hf):
        raise HFError(f"--hf {opts.hf}: is a file, not a directory")
    from dcp_ext.cli.boundary import check_output

    check_output("--hf", os.path.join(opts.hf, "config.json"), make_folder=True)
    ours, saved, path = read_checkpoint(opts.load)
    shape = shape_from_args(saved, path)
    base_dir = find_base(opts.load, saved)
    base = None
    if base_dir and os.path.isfile(os.path.join(base_dir, CONFIG_FILE)):
        with open(os.path.join(base_dir, CONFIG_FILE)) as f:
            base = json.load(f)
    rows = ours["embedding.word_embeddings.weight"].shape[0]
    shape.vocab = int(opts.vocab_size or (base or {}).get("vocab_size") or
                      (tokenizer_size(base_dir) if base_dir else None) or _null_vocab(saved) or rows)
    if shape.vocab > rows:
        raise HFError(f"--vocab-size {shape.vocab} exceeds the checkpoint's {rows} vocabulary rows")
    if base is not None and fits(base.get("model_type"), shape):
        shape.model_type = base["model_type"]  # the imported model's family (mistral for a plain llama shape)
    dtype = opts.dtype or (base or {}).get("dtype") or (base or {}).get("torch_dtype") or "float32"
    if dtype not in DTYPES:
        dtype = "float32"
    tensors = {k: v.to(getattr(torch, dtype)) for k, v in canonical_to_hf(ours, shape).items()}
    os.makedirs(opts.hf, exist_ok=True)
    save_file(tensors, os.path.join(opts.hf, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(opts.hf, "config.json"), "w") as f:
        json.dump(hf_config(shape, base, dtype), f, indent=2)
    copied = copy_tokenizer(base_dir, opts.hf) if base_dir else []
    print(f"exported {path} to {opts.hf} ({shape.model_type}, {shape.layers} layers, {shape.vocab} vocabulary ids, "
          f"{dtype}); tokenizer files: {', '.join(copied) or 'none'}", flush=True)
    return 0


def _null_vocab(saved) -> int | None:
    if getattr(saved, "tokenizer_type", None) == "NullTokenizer" and getattr(saved, "vocab_size", None):
        return int(saved.vocab_size) + 1
    return None


# ---------------------------------------------------------------------- main
def parse(argv: list[str]):
    from dcp_ext.cli.boundary import Parser

    p = Parser(prog="checkpoint_hf.py", description="Hugging Face models (Llama, Mistral, Qwen2, Qwen3, Phi-3) in and "
                                                   "out of this fork's checkpoints.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=Parser)
    imp = sub.add_parser("import", help="a Hugging Face model directory -> a checkpoint --load reads")
    imp.add_argument("--hf", required=True, help="the model directory (config.json, *.safetensors, tokenizer files)")
    imp.add_argument("--save", required=True, help="the checkpoint directory to write")
    imp.add_argument("--dcp", action="store_true", help="print the flags of an adaptive (--dcp) run")
    exp = sub.add_parser("export", help="a checkpoint (static or --dcp) -> a Hugging Face model directory")
    exp.add_argument("--load", required=True, help="the checkpoint directory (the folder with the tracker file)")
    exp.add_argument("--hf", required=True, help="the model directory to write")
    exp.add_argument("--dtype", choices=DTYPES, default=None, help="default: the imported model's, else float32")
    exp.add_argument("--vocab-size", type=int, default=None,
                     help="the Hugging Face vocabulary (default: the imported model's, else the tokenizer's)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.getLogger("megatron").setLevel(logging.ERROR)
    from dcp_ext.cli.boundary import run_tool

    argv = list(sys.argv[1:] if argv is None else argv)

    def body() -> int:
        from megatron.training.checkpoint.protocol import CheckpointError

        try:
            opts = parse(argv)
            return do_import(opts) if opts.command == "import" else do_export(opts)
        except CheckpointError as e:
            raise HFError(str(e)) from None

    code = run_tool(body, errors={HFError: 1})
    try:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:
        pass
    return code


if __name__ == "__main__":
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # a CPU job, the path it is tested on
    sys.exit(main())
