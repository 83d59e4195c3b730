"""What a resume must agree on with the checkpoint, checked before any tensor is read.

Why it exists: a resume used to train silently on other settings than the flags said. The
model-shaping flags were not compared (another --num-attention-heads with the same tensor
shapes loaded and scrambled the query/key/value layout), and the LR schedule came from
the checkpoint whatever --lr, --min-lr or --lr-decay-iters said. Both checkpoint kinds
(static, --dcp) call these two functions on the checkpoint's common state:

- `check_model_args`: every flag that shapes the model must equal the checkpoint's, or the
  resume stops in one line naming the flag (`--use-checkpoint-args` takes them from it);
- `reconcile_lr_schedule`: upstream's two flags and upstream's rule. Neither flag: the
  flags' schedule must equal the checkpoint's, or one line names the first that differs
  and both ways out; `--override-opt_param-scheduler`: the flags' schedule;
  `--use-checkpoint-opt_param-scheduler`: the checkpoint's. It returns the choice: the line
  that says, at start, which schedule the run follows, and what makes every parameter
  group follow it once loaded.
"""
from __future__ import annotations

from megatron.training.checkpoint.protocol import CheckpointError

# (args attribute, the flag a user writes); compared when both sides have the attribute
MODEL_FLAGS = (
    ("num_layers", "--num-layers"),
    ("hidden_size", "--hidden-size"),
    ("ffn_hidden_size", "--ffn-hidden-size"),
    ("num_attention_heads", "--num-attention-heads"),
    ("num_query_groups", "--num-query-groups"),
    ("kv_channels", "--kv-channels"),
    ("normalization", "--normalization"),
    ("position_embedding_type", "--position-embedding-type"),
    ("swiglu", "--swiglu"),
    ("squared_relu", "--squared-relu"),
    ("untie_embeddings_and_output_weights", "--untie-embeddings-and-output-weights"),
    ("disable_bias_linear", "--disable-bias-linear"),
    ("add_qkv_bias", "--add-qkv-bias"),
    ("qk_layernorm", "--qk-layernorm"),
    ("apply_layernorm_1p", "--apply-layernorm-1p"),
    ("rotary_percent", "--rotary-percent"),
    ("rotary_interleaved", "--rotary-interleaved"),
    ("use_rope_scaling", "--use-rope-scaling"),
    ("rope_scaling_factor", "--rope-scaling-factor"),
)
# learned position embeddings are a tensor of --max-position-embeddings rows
LEARNED_POSITIONS = ("max_position_embeddings", "--max-position-embeddings")

_MISSING = object()


def _show(value) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    return f"{value:g}" if isinstance(value, float) else str(value)


def compared_flags(position_embedding_type: str | None) -> list[str]:
    """The attributes of the flags a resume compares with the checkpoint's."""
    pairs = list(MODEL_FLAGS) + ([LEARNED_POSITIONS] if position_embedding_type == "learned_absolute" else [])
    return [name for name, _ in pairs]


def check_model_args(saved, ours, path: str) -> None:
    """Raise CheckpointError naming the first model-shaping flag that differs from `saved`
    (the checkpoint's arguments); a checkpoint without arguments is not checked. `ours`:
    this run's values of `compared_flags` ((name, value) pairs, `CheckpointConfig.model_flags`)."""
    if saved is None:
        return
    flag_of = dict(MODEL_FLAGS + (LEARNED_POSITIONS,))
    for name, value in ours:
        theirs = getattr(saved, name, _MISSING)
        if theirs is _MISSING or theirs == value:
            continue
        raise CheckpointError(f"{path} holds another model: {flag_of[name]} is {_show(value)} here and "
                              f"{_show(theirs)} in the checkpoint; pass the value it was trained with "
                              "(--use-checkpoint-args takes every model flag from the checkpoint)")


# the scheduler's state keys, the flag(s) that set each, and a short name
SCHEDULE = (
    ("max_lr", "--lr", "learning rate"),
    ("min_lr", "--min-lr", "minimum learning rate"),
    ("lr_warmup_steps", "--lr-warmup-iters (or -samples/-fraction)", "warmup steps"),
    ("lr_decay_steps", "--lr-decay-iters (default --train-iters; or --lr-decay-samples)", "decay steps"),
    ("lr_decay_style", "--lr-decay-style", "decay style"),
    ("start_wd", "--weight-decay", "weight decay"),
    ("end_wd", "--weight-decay", "weight decay"),
    ("wd_incr_style", "--weight-decay-incr-style", "weight-decay increment style"),
    ("wd_incr_steps", "--train-iters (or --train-samples)", "weight-decay increment steps"),
)


def _schedule_differences(ours: dict, theirs: dict) -> list[tuple[str, str, str, object, object]]:
    out = []
    for key, flag, name in SCHEDULE:
        if key not in theirs or key not in ours:
            continue
        if key == "wd_incr_steps" and ours.get("wd_incr_style") == theirs.get("wd_incr_style") == "constant" \
                and ours.get("start_wd") == ours.get("end_wd"):
            continue  # a constant weight decay has no increments: the count changes nothing
        if ours[key] != theirs[key]:
            out.append((key, flag, name, ours[key], theirs[key]))
    return out


class ScheduleChoice:
    """The schedule a resume follows: `line` says which; `apply()`, called right after the
    optimizer and the scheduler have loaded, makes every parameter group follow it.
    megatron-core's scheduler reads each group's own 'max_lr'/'min_lr' before its own values,
    and a loaded optimizer state may bring the checkpoint's: the flags' values (as the
    optimizer was built) go back under --override-opt_param-scheduler, the checkpoint's (the
    scheduler's, once loaded) under --use-checkpoint-opt_param-scheduler."""

    def __init__(self, line: str, scheduler, mode: str):
        self.line, self.scheduler, self.mode = line, scheduler, mode
        groups = scheduler.optimizer.param_groups
        self.flags_values = [{k: g[k] for k in ("max_lr", "min_lr") if k in g} for g in groups]

    def apply(self) -> None:
        s = self.scheduler
        groups = s.optimizer.param_groups
        if self.mode == "flags":
            for group, values in zip(groups, self.flags_values):
                group.update(values)
        elif self.mode == "checkpoint":
            for group in groups:
                if group.get("is_decoupled_lr") or group.get("default_config") is False:
                    continue  # --decoupled-lr groups keep what was loaded for them
                if "max_lr" in group:
                    group["max_lr"], group["min_lr"] = s.max_lr, s.min_lr
        else:
            return
        s.step(increment=0)  # every group's lr and weight decay at the resumed step, from these values


def reconcile_lr_schedule(config, scheduler, saved_state: dict, path: str) -> ScheduleChoice:
    """Set `scheduler` up to load `saved_state` by upstream's rule (module docstring); call
    before the optimizer loads. Raises CheckpointError where upstream would refuse.
    `config`: the run's CheckpointConfig (its two schedule flags)."""
    override = bool(config.override_scheduler)
    keep = bool(config.use_checkpoint_scheduler)
    scheduler.override_opt_param_scheduler = override
    scheduler.use_checkpoint_opt_param_scheduler = keep
    diffs = _schedule_differences(scheduler.state_dict(), saved_state)
    if not diffs:
        # megatron-core would also compare what changes nothing (the increment count of a
        # constant weight decay): equal where it matters, so take the checkpoint's values
        scheduler.use_checkpoint_opt_param_scheduler = not override
        return ScheduleChoice("LR schedule: the flags and the checkpoint agree", scheduler, "agree")
    shown = "; ".join(f"{name} {_show(mine)} (flags) vs {_show(theirs)} (checkpoint)"
                      for _, _, name, mine, theirs in diffs)
    if override:
        return ScheduleChoice(f"LR schedule: the flags' (--override-opt_param-scheduler): {shown}", scheduler, "flags")
    if keep:
        return ScheduleChoice(f"LR schedule: the checkpoint's (--use-checkpoint-opt_param-scheduler): {shown}",
                              scheduler, "checkpoint")
    _, flag, name, mine, theirs = diffs[0]
    raise CheckpointError(f"{path}: the LR schedule differs from the flags: {name} is {_show(mine)} from {flag} and "
                          f"{_show(theirs)} in the checkpoint; pass --override-opt_param-scheduler to train with the "
                          "flags' schedule, or --use-checkpoint-opt_param-scheduler to keep the checkpoint's")
