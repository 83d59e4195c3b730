"""Export an adaptive-runtime (`--dcp`) checkpoint as a plain Megatron checkpoint of the weights.

Why this exists: a `--dcp` checkpoint stores the model layout-free, one tensor per
canonical parameter (`adaptive.param.<name>`, the full TP1/PP1 GPTModel's names) plus Adam
moments. Upstream Megatron tooling (and this fork's static path) expect Megatron's own
layout instead: `latest_checkpointed_iteration.txt`, `iter_XXXXXXX/`, torch_dist shards
keyed by the GPTModel's `sharded_state_dict()`. This tool writes exactly that, at any
TP/PP the model allows:

    python tools/convert_dcp_checkpoint.py --load DCP_DIR [--iteration N] --save OUT \
        --tensor-model-parallel-size T --pipeline-model-parallel-size P [model flags | --yaml-cfg F]

How: T*P gloo ranks on the CPU, GPUs hidden (spawned by this script, or the ranks of a
`torchrun --nproc_per_node T*P` launch) initialise megatron-core's parallel state at
(T, P), build their GPTModel stage with `pretrain_gpt_dcp.model_provider` (the static
path's model), map every local parameter into the canonical space with
`dcp_ext.runtime.params.param_map.map_stage` (the same map the adaptive runtime pulls with), fill
it from the checkpoint's canonical tensors, and save with
`megatron.training.checkpoint.protocol.save_sharded_atomic` (the tracker only ever names a
complete export).

What is written: the model only (`args`, `checkpoint_version`, `iteration`,
`consumed_train_samples`, `model`), no optimizer, scheduler or RNG state. Load it with
`--finetune` (iteration and samples restart at 0) or `--no-load-optim --no-load-rng`
(continues at the source iteration with a fresh optimizer).

Model flags default to the ones stored in the checkpoint (`args`); flags or `--yaml-cfg`
given here override them and must still describe the checkpoint's shapes. The padded
vocabulary is the checkpoint's (the adaptive run pads to a multiple of divisible_by x lcm
of its candidate TPs); when the static path at TP T would pad differently, the export
records, and the tool prints, the `--make-vocab-size-divisible-by` that reproduces it.

`--save` must not hold a checkpoint already (a tracker file or `iter_*` folders): the export
is refused unless `--force`, and even with `--force` it never moves the tracker back to an
older iteration than it names (that would hide the newer checkpoint from every loader). The
source is never written: `--save` may not be `--load`, a link to it, or inside it.

Every failure (no checkpoint, not a `--dcp` checkpoint, a TP/PP the model cannot take,
flags that do not match the checkpoint, an unwritable `--save`, Ctrl-C) ends with one
`error:` line and a non-zero exit (dcp_ext.cli.boundary: the console tools' one boundary).
"""
from __future__ import annotations

import argparse
import bisect
import json
import os
import re
import socket
import sys
import tempfile
import traceback

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

EXPORT_FORMAT = "megatron-weights-from-adaptive/v1"
class ConversionError(RuntimeError):
    """A checkpoint or request this tool cannot convert; the message is one line."""


# ------------------------------------------------------------------------- options
def parse_options(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """The converter's own flags; everything else is passed on as Megatron model flags."""
    from megatron.training.arguments import ArgumentError, _Parser

    p = _Parser(prog="convert_dcp_checkpoint.py", allow_abbrev=False,
                description="Export a --dcp checkpoint as a Megatron TP/PP checkpoint of the weights.")
    p.add_argument("--load", required=True, help="the adaptive run's --save directory")
    p.add_argument("--iteration", type=int, default=None, help="default: the one the tracker file names")
    p.add_argument("--save", required=True, help="output directory (Megatron layout)")
    p.add_argument("--tensor-model-parallel-size", type=int, default=1)
    p.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    p.add_argument("--force", action="store_true",
                   help="write into a --save directory that already holds a checkpoint (never to an older "
                        "iteration than its tracker names)")
    opts, rest = p.parse_known_args(argv)
    if opts.tensor_model_parallel_size < 1 or opts.pipeline_model_parallel_size < 1:
        raise ArgumentError("--tensor-model-parallel-size and --pipeline-model-parallel-size must be >= 1")
    save, load = os.path.realpath(opts.save), os.path.realpath(opts.load)
    if save == load:
        raise ArgumentError("--save must differ from --load (the export would replace the source checkpoint)")
    if os.path.commonpath([save, load]) == load:
        raise ArgumentError(f"--save {opts.save} is inside --load {opts.load} (the export would write into the "
                            "source checkpoint); choose a --save directory outside it")
    return opts, rest


_CHECKPOINT_DIR = re.compile(r"^iter_\d{7}(\.old)?$")


def check_destination(save: str, iteration: int, force: bool) -> None:
    """Refuse an export that would damage what `save` holds: any checkpoint there without
    --force; with --force, one whose tracker names a newer iteration than `iteration`."""
    from dcp_ext.cli.boundary import check_output
    from megatron.training.checkpoint import protocol as ckpt
    from megatron.training.arguments import ArgumentError

    if os.path.lexists(save) and not os.path.isdir(save):
        raise ConversionError(f"--save {save}: is a file, not a directory; point --save to a directory")
    check_output("--save", os.path.join(save, ckpt.TRACKER), make_folder=True)
    if not os.path.isdir(save):
        return
    try:
        held = ckpt.read_tracker(save)
    except ckpt.CheckpointError as e:
        raise ConversionError(f"--save {save} holds an unreadable tracker ({e}); fix or remove it, or choose "
                              "another --save directory") from None
    folders = sorted(n for n in os.listdir(save) if _CHECKPOINT_DIR.match(n))
    if held is None and not folders:
        return
    if not force:
        what = f"its tracker names iteration {held}" if held is not None else folders[-1]
        raise ArgumentError(f"--save {save} already holds a checkpoint ({what}); refusing to write the export "
                            f"(iteration {iteration}) into it: choose an empty --save directory, or pass --force")
    if held is not None and held > iteration:
        raise ArgumentError(f"--save {save}: the export of iteration {iteration} would rewind its tracker from "
                            f"iteration {held} to {iteration}, hiding the newer checkpoint from every loader; "
                            "choose another --save directory")


def resolve_source(load: str, iteration: int | None) -> tuple[str, int]:
    from megatron.training.checkpoint import protocol as ckpt

    if not os.path.isdir(load):
        raise ConversionError(f"--load {load}: no such directory")
    if iteration is None:
        iteration = ckpt.read_tracker(load)
        if iteration is None:
            hint = (" (this looks like an iter_XXXXXXX directory: pass its parent)"
                    if os.path.isfile(os.path.join(load, "metadata.json")) else "")
            raise ConversionError(f"--load {load}: no {ckpt.TRACKER} found{hint}; or name one with --iteration N")
    # iter_N, or iter_N.old where a re-save was interrupted (checkpoint_protocol.find_checkpoint)
    path = ckpt.find_checkpoint(load, iteration) or ckpt.checkpoint_dir(load, iteration)
    if not os.path.isfile(os.path.join(path, "metadata.json")) or not os.path.isfile(os.path.join(path, "common.pt")):
        legacy = ckpt.legacy_description(path)
        if legacy:
            raise ConversionError(f"--load {load}: {path} is {legacy}, not a --dcp checkpoint; convert it with "
                                  f"python {ckpt.LEGACY_CONVERTER} --load {load} --save DIR")
        raise ConversionError(f"--load {load}: iteration {iteration}: {path} is missing or incomplete")
    return path, iteration


def load_common(path: str) -> dict:
    from megatron.core import dist_checkpointing

    from dcp_ext.compat.checkpoint_unpickler import CodeRefused
    from megatron.training.checkpoint.checkpointing_adaptive import is_adaptive

    try:
        common = dist_checkpointing.load_common_state_dict(path)
    except CodeRefused as e:
        raise ConversionError(str(e)) from None
    except Exception as e:  # unreadable/garbled common state
        raise ConversionError(f"{path}: cannot read the checkpoint's common state "
                              f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
    if not is_adaptive(common):
        raise ConversionError(f"{path}: not an adaptive-runtime (--dcp) checkpoint; a checkpoint saved without --dcp "
                              "is already in Megatron's layout and loads at any TP/PP as it is")
    if "canonical" not in common or not common["canonical"]:
        raise ConversionError(f"{path}: the checkpoint lists no canonical tensors")
    return common


def megatron_args(opts, rest: list[str], common: dict) -> argparse.Namespace:
    """Megatron flags for the static model at (T, P): checkpoint args < --yaml-cfg < command line."""
    from megatron.training.flags.argument_yaml import dest_names as _dest_names
    from megatron.training.arguments import ArgumentError, build_parser, fill_derived, parse_flags, validate_args

    parser = build_parser()
    dests = _dest_names(parser)
    saved = vars(common.get("args") or argparse.Namespace())
    from megatron.training.flags.upstream_flags import is_table_flag

    parser.set_defaults(**{k: v for k, v in saved.items()
                           if k in dests and k != "yaml_cfg" and not is_table_flag(dests[k])})
    args = parse_flags(parser, rest, "model flags as in pretrain_gpt_dcp.py --help")
    tp, pp = opts.tensor_model_parallel_size, opts.pipeline_model_parallel_size
    args.tensor_model_parallel_size, args.pipeline_model_parallel_size = tp, pp
    args.context_parallel_size = 1
    args.sequence_parallel = bool(args.sequence_parallel and tp > 1)
    args.world_size = tp * pp
    args.dcp = False
    args.transformer_impl = "local"  # built on the CPU; keys equal transformer-engine's (keys map)
    args.recompute_granularity = args.recompute_method = args.recompute_num_layers = None
    args.load, args.save = None, opts.save
    # Batch sizes do not matter for an export: keep the stored ones valid at data-parallel size 1.
    if args.global_batch_size is None or args.global_batch_size % args.micro_batch_size:
        args.global_batch_size = args.micro_batch_size
    fill_derived(args)
    validate_args(args)
    # The padded vocabulary is the checkpoint's, whatever this TP would pad to.
    shapes = {name: tuple(shape) for name, shape in common["canonical"]}
    emb = shapes.get("embedding.word_embeddings.weight")
    if emb is None:
        raise ConversionError("the checkpoint has no embedding.word_embeddings.weight")
    padded = emb[0]
    if padded % tp:
        raise ArgumentError(f"the checkpoint's padded vocabulary ({padded} rows) does not split over "
                            f"--tensor-model-parallel-size {tp}")
    if args.ffn_hidden_size % tp:
        raise ArgumentError(f"--ffn-hidden-size {args.ffn_hidden_size} is not divisible by "
                            f"--tensor-model-parallel-size {tp}")
    args.padded_vocab_size = padded
    args.trained_make_vocab_size_divisible_by = args.make_vocab_size_divisible_by
    args.make_vocab_size_divisible_by = divisible_by_for(padded, tp, args.make_vocab_size_divisible_by,
                                                         _vocab_size(args, saved))
    return args


def _vocab_size(args, saved: dict) -> int | None:
    """The tokenizer's vocabulary (unpadded) if it can be known without reading vocab files."""
    if args.tokenizer_type == "NullTokenizer" and args.vocab_size is not None:
        return int(args.vocab_size) + 1
    if args.tokenizer_type in (None, "ByteLevelTokenizer") and args.demo_corpus:
        return 257
    try:
        from megatron.training import global_vars

        return global_vars.build_tokenizer(argparse.Namespace(**vars(args))).vocab_size
    except Exception:
        return None


def divisible_by_for(padded: int, tp: int, trained: int, vocab: int | None) -> int:
    """A `--make-vocab-size-divisible-by` under which Megatron pads the vocabulary at `tp`
    to `padded` rows: the training value when it does, else padded // tp (always does,
    since the vocabulary is at most `padded`)."""
    from dcp_ext.data.tokenizers import padded_vocab_size

    if vocab is not None and padded_vocab_size(vocab, trained, tp) == padded:
        return trained
    return padded // tp


# -------------------------------------------------------------------------- ranks
def convert_on_this_rank(path: str, iteration: int, common: dict, args) -> None:
    """Collective over the T*P ranks: build this rank's stage, fill it, save the export."""
    import torch
    import torch.distributed as dist
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from dcp_ext.runtime.params.param_map import CanonicalSpace, map_stage
    from megatron.training.checkpoint import protocol as ckpt
    from megatron.training import global_vars
    from megatron.training.checkpoint.checkpointing_adaptive import ShapesOnly, local_name, tensor_key
    from megatron.training.flags.core_configs import transformer_config_from_args
    from pretrain_gpt_dcp import model_provider

    rank, tp, pp = dist.get_rank(), args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    saved_names = [name for name, _ in common["canonical"]]
    stored = {local_name(n): n for n in saved_names}  # a TE run's norm names, keyed by the local spec's
    error = None
    try:
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
        global_vars.set_args(args)
        # perform_initialization stays on: megatron-core sets the TP partition attributes map_stage reads there
        config = transformer_config_from_args(args, use_cpu_initialization=True)
        model = model_provider(config, pre_process=parallel_state.is_pipeline_first_stage(),
                               post_process=parallel_state.is_pipeline_last_stage())
        # canonical space in the names this (local-spec) model uses
        space = CanonicalSpace(ShapesOnly([(local_name(n), s) for n, s in common["canonical"]]))
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        try:
            local = map_stage(model, space, tp, tp_rank, bool(config.gated_linear_unit))
        except KeyError as e:
            raise ConversionError(f"the model flags do not describe the checkpoint's model: {e.args[0]}") from None
        except ValueError as e:
            raise ConversionError(f"the model flags do not describe the checkpoint's model at tp {tp}: {e}") from None
        starts = [t.offset for t in space.tensors.values()]
        tensors = list(space.tensors.values())
        plan = []  # (local param, canonical tensor, index into it)
        for lp in local:
            first = int(lp.index.reshape(-1)[0])
            t = tensors[bisect.bisect_right(starts, first) - 1]
            rel = lp.index - t.offset
            if int(rel.min()) < 0 or int(rel.max()) >= t.numel:
                raise ConversionError(f"{lp.name}: spans more than one canonical tensor")
            plan.append((lp, t, rel))
    except ConversionError as e:
        error = str(e)
    # every rank learns whether any failed before entering a collective load
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    failed = [e for e in errors if e]
    if failed:
        raise ConversionError(failed[0])
    # all canonical tensors are placed somewhere (a model with fewer layers would drop some)
    covered = [None] * dist.get_world_size()
    dist.all_gather_object(covered, sorted({t.name for _, t, _ in plan}))
    missing = [n for n in space.tensors if n not in set().union(*map(set, covered))]
    if missing:
        raise ConversionError(f"the model flags do not describe the checkpoint's model: {len(missing)} checkpoint "
                              f"tensors have no place in it (first: {missing[0]})")

    needed = sorted({t.name for _, t, _ in plan})
    request = {}
    for name in needed:
        key = tensor_key(common, "param", stored.get(name, name))
        request[key] = ShardedTensor.from_rank_offsets(key, torch.empty(space.tensors[name].shape), replica_id=rank)
    # each rank reads only the canonical tensors its stage needs (no rank is the main replica)
    state = dist_checkpointing.load(request, path, validate_access_integrity=False)
    with torch.no_grad():
        for lp, t, rel in plan:
            value = state[tensor_key(common, "param", stored.get(t.name, t.name))].reshape(-1)[rel]
            lp.param.data.copy_(value.to(lp.param.dtype))
    out = {
        "args": ckpt.common_args(args),
        "checkpoint_version": ckpt.CHECKPOINT_VERSION,
        "iteration": iteration,
        "consumed_train_samples": common.get("consumed_train_samples", 0),
        "exported_from": {"path": os.path.abspath(path), "format": common["format"], "export_format": EXPORT_FORMAT},
        "model": model.sharded_state_dict(),
    }
    ckpt.save_sharded_atomic(args.save, iteration, out)


def _quiet() -> None:
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.getLogger("megatron").setLevel(logging.ERROR)
    logging.getLogger("torch.distributed").setLevel(logging.ERROR)


def _init_gloo(rank: int, world: int, port: int | None) -> None:
    import datetime

    import torch.distributed as dist

    from dcp_ext.compat import cpu_compat, mcore_compat

    if port is not None:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                          LOCAL_RANK=str(rank))
    cpu_compat.install()
    mcore_compat.install()
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(minutes=10))


def _spawned_rank(rank: int, world: int, port: int, result_dir: str, path: str, iteration: int, args) -> None:
    import torch

    _quiet()
    torch.set_num_threads(1)
    status = {"ok": True}
    try:
        from megatron.core import dist_checkpointing

        _init_gloo(rank, world, port)
        common = dist_checkpointing.load_common_state_dict(path)
        convert_on_this_rank(path, iteration, common, args)
    except ConversionError as e:
        status = {"ok": False, "error": str(e)}
    except BaseException as e:  # anything else: one line here, the traceback in the result file
        status = {"ok": False, "error": f"rank {rank}: {type(e).__name__}: {_first_line(e)}",
                  "traceback": traceback.format_exc()}
    with open(os.path.join(result_dir, f"{rank}.json"), "w") as f:
        json.dump(status, f)
    try:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:
        pass


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else ""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tracker_or_none(root: str):
    from megatron.training.checkpoint import protocol as ckpt

    try:
        return ckpt.read_tracker(root)
    except ckpt.CheckpointError:
        return "unreadable"


def save_state(save: str, before, iteration: int) -> str:
    """What `save` holds after an export that died, given its tracker `before` (the save
    protocol leaves the tracker naming a complete checkpoint at every step)."""
    now = _tracker_or_none(save)
    if now is None or now == "unreadable":
        return f"{save} holds no checkpoint ({'no' if now is None else 'an unreadable'} tracker)"
    if now == iteration and before != iteration:
        return f"{save}: its tracker names the new export, iteration {iteration}"
    if now == before and now != iteration:
        return f"{save}: its tracker still names iteration {now}"
    return f"{save}: its tracker names iteration {now} (a complete copy)"


def run_spawned(path: str, iteration: int, args) -> None:
    import torch.multiprocessing as mp

    world = args.world_size
    before = _tracker_or_none(args.save)
    with tempfile.TemporaryDirectory() as d:
        try:
            mp.start_processes(_spawned_rank, args=(world, _free_port(), d, path, iteration, args), nprocs=world,
                               start_method="spawn", join=True)
        except mp.ProcessExitedException as e:
            raise ConversionError(f"rank {e.error_index} died (exit code {e.exit_code}) during the export; "
                                  f"{save_state(args.save, before, iteration)}") from None
        for r in range(world):
            file = os.path.join(d, f"{r}.json")
            if not os.path.isfile(file):
                raise ConversionError(f"rank {r} ended without a result; {save_state(args.save, before, iteration)}")
            with open(file) as f:
                status = json.load(f)
            if not status["ok"]:
                if os.environ.get("DCP_CONVERT_DEBUG") and status.get("traceback"):
                    print(status["traceback"], file=sys.stderr)
                raise ConversionError(status["error"])


# --------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    # An export is a CPU job on gloo ranks, on any machine: hide GPUs before torch loads, so
    # megatron-core takes the same (CPU-redirected) path it is tested on here.
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    _quiet()
    os.environ.setdefault("PYTHONWARNINGS", "ignore")  # spawned ranks start quiet too
    from dcp_ext.cli.boundary import run_tool
    from megatron.training.arguments import ArgumentError
    from megatron.training.checkpoint.protocol import CheckpointError

    argv = list(sys.argv[1:] if argv is None else argv)
    under_torchrun = "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)
    rank = int(os.environ.get("RANK", "0")) if under_torchrun else 0
    return run_tool(lambda: _main(argv, under_torchrun, rank),
                    errors={ArgumentError: 2, ConversionError: 1, CheckpointError: 1}, quiet=rank != 0,
                    interrupted="interrupted (Ctrl-C); the tracker of --save still names a complete checkpoint")


def _main(argv: list[str], under_torchrun: bool, rank: int) -> int:
    from megatron.training.arguments import ArgumentError

    from megatron.training.checkpoint.inspector import inspect_checkpoint, verify_checkpoint

    opts, rest = parse_options(argv)
    path, iteration = resolve_source(opts.load, opts.iteration)
    check_destination(opts.save, iteration, opts.force)
    inspect_checkpoint(path)  # before anything is read: files missing or cut short, an index that would run code
    verify_checkpoint(path)  # every file against its checksum (each rank under torchrun: no group yet)
    common = load_common(path)
    args = megatron_args(opts, rest, common)
    if under_torchrun:
        world = int(os.environ["WORLD_SIZE"])
        if world != args.world_size:
            raise ArgumentError(f"launched on {world} ranks; this export needs tp*pp = {args.world_size} "
                                "(or run it with plain python, which starts the ranks itself)")
        _init_gloo(rank, world, None)
        convert_on_this_rank(path, iteration, common, args)
    else:
        run_spawned(path, iteration, args)
    if rank == 0:
        trained = args.trained_make_vocab_size_divisible_by
        vocab_flag = ("" if args.make_vocab_size_divisible_by == trained else
                      f" --make-vocab-size-divisible-by {args.make_vocab_size_divisible_by}")
        print(f"exported iteration {iteration} of {opts.load} to {opts.save} at tensor-model-parallel-size "
              f"{args.tensor_model_parallel_size}, pipeline-model-parallel-size {args.pipeline_model_parallel_size} "
              f"(model only, {args.padded_vocab_size} vocabulary rows)")
        print(f"load it with: --load {opts.save} --tensor-model-parallel-size {args.tensor_model_parallel_size} "
              f"--pipeline-model-parallel-size {args.pipeline_model_parallel_size}{vocab_flag} "
              "--finetune (or --no-load-optim --no-load-rng)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
