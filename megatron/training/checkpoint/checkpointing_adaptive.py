"""Checkpoints of the adaptive runtime: the fixed optimizer sharding, in model space.

Same Megatron layout and atomic protocol as the static loop's `checkpointing` (tracker
file, `iter_XXXXXXX/`, torch_dist: `checkpoint_protocol`). What is stored is layout-free:
for every canonical tensor (the full model's parameter names) its fp32 master value and
Adam moments, written once by the rank that owns the tensor's first element (gathered
tensor by tensor, so no rank holds the whole model). Loading reads the tensors in groups
and keeps, on every rank, the pieces of its shard, so a checkpoint saved on W ranks
resumes on any W'.

Pretrained weights cross between the two kinds without a conversion step: `--dcp
--finetune` (or `--no-load-optim`) reads a static checkpoint (one saved without --dcp, or
written by tools/checkpoint_hf.py import) tensor by tensor through `read_static`, and the
static path's `--finetune` reads a --dcp checkpoint through `load_dcp_weights`. Only the
weights cross; optimizer state, schedule and RNG start afresh.
"""
from __future__ import annotations

import re

import torch
import torch.distributed as dist

from dcp_ext.runtime.params.server import STATE_KINDS
from megatron.training.checkpoint import protocol as ckpt
from megatron.training.checkpoint.inspector import check_saved_parts, load_or_explain, open_checkpoint
from megatron.training.initialize import print_rank_0
from megatron.training.checkpoint.resume_checks import check_model_args, reconcile_lr_schedule

# Our format and tensor keys. Checkpoints saved before the rename (December 2026) say
# "dcp-fixed-sharding/v1" with "dcp.<kind>.<name>" keys, a name beside PyTorch's own DCP
# (torch.distributed.checkpoint); they still load: each format names its keys' prefix.
FORMAT = "adaptive-canonical/v1"
KEY_PREFIX = {FORMAT: "adaptive", "dcp-fixed-sharding/v1": "dcp"}
KINDS = STATE_KINDS  # what a checkpoint holds per canonical tensor: weights, Adam's moments


def is_adaptive(common) -> bool:
    """Whether a checkpoint's common state is one of ours (under either name)."""
    return isinstance(common, dict) and common.get("format") in KEY_PREFIX


def tensor_key(common: dict | None, kind: str, name: str) -> str:
    """The key of canonical tensor `name`'s `kind` (param, exp_avg, exp_avg_sq) in the
    checkpoint whose common state is `common` (None: the one being written)."""
    return f"{KEY_PREFIX[FORMAT if common is None else common['format']]}.{kind}.{name}"


LOAD_GROUP = 1 << 26  # elements of canonical tensors read per dist_checkpointing.load call


def _sharded(key: str, tensor: torch.Tensor, replica_id: int):
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    return ShardedTensor.from_rank_offsets(key, tensor, replica_id=replica_id)


def save(config, iteration: int, consumed_samples: int, engine, scheduler, planner_state: dict) -> None:
    """Write iteration `iteration` to `config.save` (a CheckpointConfig). Collective."""
    from megatron.training.checkpoint.finite_weights import refuse_nonfinite

    refuse_nonfinite([engine.optimizer.master()], iteration, config.save)
    kinds = KINDS if config.save_optim else ("param",)  # weights only
    state = {}
    for name, kind, value in engine.server.canonical_state(kinds):  # each whole on one rank
        if value is not None:
            key = tensor_key(None, kind, name)
            state[key] = _sharded(key, value.cpu(), replica_id=0)
    state.update({
        "args": config.stored_args(),
        "checkpoint_version": ckpt.CHECKPOINT_VERSION,
        "format": FORMAT,
        "iteration": iteration,
        "consumed_train_samples": consumed_samples,
        "adam_step": engine.optimizer.step_count(),
        "planner_state": planner_state,
        "canonical": [(name, list(shape)) for name, shape in engine.server.canonical_shapes()],
    })
    if kinds == KINDS:
        state["opt_param_scheduler"] = scheduler.state_dict()
    ckpt.save_sharded_atomic(config.save, iteration, state)


def load(config, engine, scheduler, planner) -> tuple[int, int]:
    """Resume from `config.load` (a CheckpointConfig): (iteration, consumed samples)."""
    found = ckpt.resolve_load_dir(config.load, config.exit_on_missing)
    if found is None:
        return 0, 0
    path = found.path
    if found.release:
        config = config.as_finetune()
    common = open_checkpoint(path, skip_verify=not config.verify)  # inspected and checksums verified
    if not is_adaptive(common):
        if config.loads_optimizer():
            raise ckpt.CheckpointError(f"{path}: not an adaptive-runtime checkpoint (saved without --dcp, or "
                                       "imported): start --dcp from its weights with --finetune (or "
                                       "--no-load-optim), or resume it without --dcp")
        return _load_static_weights(config, engine, path, common)
    check_model_args(common.get("args"), config.model_flags, path)
    saved_rows = getattr(common.get("args"), "padded_vocab_size", None)
    if saved_rows is not None and saved_rows != config.padded_vocab_size:
        raise ckpt.CheckpointError(
            f"{path}: its vocabulary is padded to {saved_rows} rows, this run's to {config.padded_vocab_size} "
            f"(--make-vocab-size-divisible-by {config.vocab_divisor}, vocabulary "
            f"{config.vocab_size or '?'}): resume with the flags it was trained with")
    saved = {name: tuple(shape) for name, shape in common["canonical"]}
    ours = dict(engine.server.canonical_shapes())
    if saved != ours:
        diff = sorted(set(saved.items()) ^ set(ours.items()))[:1]
        raise ckpt.CheckpointError(f"{path}: model shape differs from the checkpoint's (first difference: {diff})")
    check_saved_parts(config, common, path)
    schedule = None
    if config.loads_optimizer() and "opt_param_scheduler" in common:
        schedule = reconcile_lr_schedule(config, scheduler, common["opt_param_scheduler"], path)
        print_rank_0("> " + schedule.line)
    kinds = KINDS if config.loads_optimizer() else ("param",)

    def read(group) -> dict:
        # the same groups on every rank: each load is collective; no rank is "the" main replica
        keys = {(t.name, kind): tensor_key(common, kind, t.name) for t in group for kind in kinds}
        shapes = {t.name: t.shape for t in group}
        request = {key: _sharded(key, torch.empty(shapes[name]), replica_id=engine.rank)
                   for (name, _), key in keys.items()}
        state = load_or_explain(request, path, validate_access_integrity=False)
        return {nk: state[key] for nk, key in keys.items()}

    engine.server.load_canonical_state(read, kinds, adam_step=common.get("adam_step"), group_numel=LOAD_GROUP)
    if "exp_avg" in kinds:
        scheduler.load_state_dict(common["opt_param_scheduler"])
        if schedule is not None:
            schedule.apply()
    dist.barrier()
    if config.finetune:
        return 0, 0
    planner.load_planning_state(common.get("planner_state") or {})  # with the calibration's windows
    print_rank_0(f"  loaded adaptive checkpoint from {path} at iteration {common['iteration']}")
    return common["iteration"], common["consumed_train_samples"]


# ------------------------------------------------------ weights across the two kinds
# A static checkpoint stores each layer's tensors stacked ([num_layers, ...]) under one key,
# and megatron-core's local spec saves its norms under transformer-engine's names.
_STATIC_NORMS = (("input_layernorm.", "self_attention.linear_qkv.layer_norm_"),
                 ("pre_mlp_layernorm.", "mlp.linear_fc1.layer_norm_"))
_LAYER = re.compile(r"^(decoder\.layers\.)(\d+)\.(.+)$")
VOCAB_ROWS = ("embedding.word_embeddings.weight", "output_layer.weight")


def static_key(name: str) -> tuple[str, int | None]:
    """(key, layer index or None) of canonical tensor `name` in a static checkpoint."""
    m = _LAYER.match(name)
    if m is None:
        return name, None
    rest = m.group(3)
    for local, stored in _STATIC_NORMS:
        if rest.startswith(local):
            rest = stored + rest[len(local):]
    return m.group(1) + rest, int(m.group(2))


def _fit_rows(name: str, value: torch.Tensor, shape: tuple) -> torch.Tensor:
    """A vocabulary tensor padded to another row count: the common rows, zeros beyond."""
    out = torch.zeros(shape, dtype=value.dtype)
    rows = min(shape[0], value.shape[0])
    out[:rows] = value[:rows]
    return out


def read_static(path: str, named_shapes, replica_id: int = 0) -> dict:
    """Full fp32 tensors {canonical name: tensor} read from the static checkpoint at `path`
    (one layer's slice of each stacked key, never the whole stack). Vocabulary tensors of
    another padding keep their common rows (zeros beyond); any other difference is one line."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    stored = dist_checkpointing.load_tensors_metadata(path)
    request, rows = {}, {}
    for name, shape in named_shapes:
        key, layer = static_key(name)
        if key not in stored:
            raise ckpt.CheckpointError(f"{path}: has no tensor {key} (for {name}): it holds another model; pass the "
                                       "model flags it was saved with")
        full = tuple(stored[key].global_shape)
        one = full if layer is None else full[1:]
        if layer is not None and layer >= full[0]:
            raise ckpt.CheckpointError(f"{path}: holds {full[0]} layers, this model has more (--num-layers)")
        if one != tuple(shape) and not (name in VOCAB_ROWS and one[1:] == tuple(shape)[1:]):
            raise ckpt.CheckpointError(f"{path}: {name} is {list(one)} there and {list(shape)} here: it holds "
                                       "another model; pass the model flags it was saved with")
        offsets = () if layer is None else ((0, layer, full[0]),)
        request[name] = ShardedTensor.from_rank_offsets(key, torch.empty(one, dtype=stored[key].dtype), *offsets,
                                                        replica_id=replica_id,
                                                        prepend_axis_num=0 if layer is None else 1)
        rows[name] = tuple(shape)
    state = load_or_explain(request, path, validate_access_integrity=False)
    out = {}
    for name, shape in rows.items():
        value = state[name].float()
        out[name] = value if tuple(value.shape) == shape else _fit_rows(name, value, shape)
    return out


def _say_rows(path: str, common: dict, rows: int) -> None:
    saved = getattr(common.get("args"), "padded_vocab_size", None)
    if saved is not None and saved != rows:
        print_rank_0(f"  note: {path} pads the vocabulary to {saved} rows, this run to {rows}: the common rows "
                     "are loaded, any others start at zero (rows past the tokenizer's vocabulary are padding)")


def _load_static_weights(config, engine, path: str, common: dict) -> tuple[int, int]:
    """`--dcp --finetune` from a static or imported checkpoint: its weights into the fixed
    sharding (fresh Adam moments and schedule), group by group as `load` reads."""
    check_model_args(common.get("args"), config.model_flags, path)
    _say_rows(path, common, config.padded_vocab_size)

    def read(group) -> dict:
        values = read_static(path, [(t.name, t.shape) for t in group], replica_id=engine.rank)
        return {(t.name, "param"): values[t.name] for t in group}

    engine.server.load_canonical_state(read, ("param",), group_numel=LOAD_GROUP)
    dist.barrier()
    print_rank_0(f"  loaded the weights of {path} (a checkpoint saved without --dcp) at iteration "
                 f"{common.get('iteration', 0)}; optimizer and schedule start afresh")
    if config.finetune:
        return 0, 0
    return common.get("iteration", 0), common.get("consumed_train_samples", 0)


def local_name(name: str) -> str:
    """A --dcp checkpoint saved with transformer-engine layers names the norms TE's way."""
    m = _LAYER.match(name)
    if m is None:
        return name
    rest = m.group(3)
    for local, stored in _STATIC_NORMS:
        if rest.startswith(stored):
            rest = local + rest[len(stored):]
    return m.group(1) + m.group(2) + "." + rest


class ShapesOnly(torch.nn.Module):
    """Names and shapes only (meta tensors): the canonical space of a --dcp checkpoint, as the
    full model `param_map.CanonicalSpace` reads."""

    def __init__(self, named_shapes):
        super().__init__()
        self._named = [(n, torch.nn.Parameter(torch.empty(s, device="meta"))) for n, s in named_shapes]

    def named_parameters(self, *unused, **unused_kw):
        return iter(self._named)


def load_dcp_weights(config, model, path: str, common: dict) -> None:
    """The static path's `--finetune` (or `--no-load-optim`) from a --dcp checkpoint: every
    parameter of this rank's stage filled from the checkpoint's canonical tensors, mapped
    as the adaptive runtime maps a layout (`param_map.map_stage`). Collective (each rank
    reads the canonical tensors its stage needs)."""
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from dcp_ext.runtime.params.param_map import CanonicalSpace, map_stage

    check_model_args(common.get("args"), config.model_flags, path)
    stored = {local_name(n): n for n, _ in common["canonical"]}
    space = CanonicalSpace(ShapesOnly([(local_name(n), s) for n, s in common["canonical"]]))
    tp, tp_rank = config.tensor_parallel, parallel_state.get_tensor_model_parallel_rank()
    rows = space.tensors.get("embedding.word_embeddings.weight")
    if rows is not None and rows.shape[0] != config.padded_vocab_size:
        raise ckpt.CheckpointError(f"{path}: its vocabulary is padded to {rows.shape[0]} rows, this run's to "
                                   f"{config.padded_vocab_size}: pass --make-vocab-size-divisible-by "
                                   f"{rows.shape[0] // tp} (at --tensor-model-parallel-size {tp})")
    try:
        local = map_stage(model, space, tp, tp_rank, config.swiglu)
    except (KeyError, ValueError) as e:
        raise ckpt.CheckpointError(f"{path}: the model flags do not describe its model ({str(e).strip()})") from None
    needed = sorted({lp.canonical for lp in local})
    request = {n: ShardedTensor.from_rank_offsets(tensor_key(common, "param", stored[n]),
                                                  torch.empty(space.tensors[n].shape), replica_id=dist.get_rank())
               for n in needed}
    state = load_or_explain(request, path, validate_access_integrity=False)
    with torch.no_grad():
        for lp in local:
            t = space.tensors[lp.canonical]
            lp.param.data.copy_(state[lp.canonical].reshape(-1)[lp.index - t.offset].to(lp.param.dtype))
    del state
    print_rank_0(f"  loaded the weights of {path} (a --dcp checkpoint) at iteration {common.get('iteration', 0)}; "
                 "optimizer and schedule start afresh")
