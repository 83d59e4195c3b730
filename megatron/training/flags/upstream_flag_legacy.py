"""Flags upstream's launch scripts still pass that upstream's `pretrain_gpt.py` parser (d98e8a6)
does not define, each with what it was and what replaced it.

Why a module of its own: `upstream_flag_table` holds the 838 options upstream's parser has.
Upstream's own example scripts also pass flags of older Megatron-LM versions (the sc21 paper
scripts) and of upstream's ModelOpt integration, which `pretrain_gpt.py` parses only when
nvidia-modelopt is installed (the post-training scripts). "unknown flag" would leave such a user
guessing; `explain(flag)` says what the flag was and what to use instead. Facts (names, when
they went) are upstream's; the texts are this fork's. `flag_refusals` reads this table.
"""
from __future__ import annotations

import difflib
from typing import Iterable, Optional

# flag -> "<what it was>; <what to use instead>" (older Megatron-LM, removed from its parser)
OLDER_MEGATRON = {
    "--activations-checkpoint-method": (
        "a flag of older Megatron-LM (renamed in 2022, now --recompute-method); use --recompute-granularity full "
        "--recompute-method uniform --recompute-num-layers 1 (its old default), or drop it"),
    "--activations-checkpoint-num-layers": (
        "a flag of older Megatron-LM (renamed in 2022); use --recompute-num-layers with --recompute-granularity full"),
    "--distribute-checkpointed-activations": (
        "a flag of older Megatron-LM (renamed in 2022 to --distribute-saved-activations, which only spreads "
        "recomputed activations over tensor-parallel ranks to save memory); drop it"),
    "--DDP-impl": (
        "a flag of older Megatron-LM (removed in 2023: data parallelism is always megatron-core's DDP since, "
        "local or torch alike); drop it (--use-distributed-optimizer and --overlap-grad-reduce tune it)"),
}

# upstream's ModelOpt integration (megatron/post_training/arguments.py): parsed by pretrain_gpt.py only
# with nvidia-modelopt installed
MODELOPT_FLAGS = (
    "--export-model-type", "--export-legacy-megatron", "--export-te-mcore-model", "--export-default-te-spec",
    "--export-force-local-attention", "--export-kv-cache-quant", "--export-real-quant-cfg", "--export-quant-cfg",
    "--export-kd-teacher-load", "--export-kd-teacher-model-config", "--export-kd-teacher-ckpt-format",
    "--export-kd-cfg", "--finetune-hf-dataset", "--finetune-data-split", "--finetune-data-files",
    "--qad-train-target", "--freeze-base-for-mtp", "--export-qk-l2-norm", "--export-moe-apply-probs-on-input",
    "--export-offline-model", "--modelopt-enabled", "--enable-gpt-oss",
)
MODELOPT_TEXT = ("a flag of upstream's ModelOpt integration (pretrain_gpt.py parses it only with nvidia-modelopt "
                 "installed: quantization, distillation, export and ModelOpt checkpoints), none of which is in this "
                 "fork; drop it (a dense model trains and checkpoints here without it)")
MODELOPT_SPECIFIC = {
    "--modelopt-enabled": (
        "a flag of upstream's ModelOpt integration (pretrain_gpt.py parses it only with nvidia-modelopt installed; "
        "upstream sets it itself when it loads a ModelOpt checkpoint), which is not in this fork; drop it "
        "(--load reads this fork's megatron-core checkpoints; tools/checkpoint_hf.py imports Hugging Face ones)"),
    "--export-te-mcore-model": (
        "a flag of upstream's ModelOpt integration (pretrain_gpt.py parses it only with nvidia-modelopt installed: "
        "it remaps transformer-engine layer names for ModelOpt export), which is not in this fork; drop it "
        "(checkpoints here load whatever the layer implementation)"),
    "--finetune-hf-dataset": (
        "a flag of upstream's ModelOpt fine-tuning (a Hugging Face dataset fetched at start), which is not in this "
        "fork; preprocess the dataset with tools/preprocess_data.py --sft and train with --sft --data-path"),
}


def explain(flag: str) -> Optional[str]:
    """What `flag` was and what to use instead, or None for a flag no Megatron version had here."""
    if flag in OLDER_MEGATRON:
        return OLDER_MEGATRON[flag]
    if flag in MODELOPT_SPECIFIC:
        return MODELOPT_SPECIFIC[flag]
    if flag in MODELOPT_FLAGS:
        return MODELOPT_TEXT
    return None


def closest(flag: str, known: Iterable[str]) -> Optional[str]:
    """The defined flag `flag` is most likely a typo of, or None."""
    found = difflib.get_close_matches(flag, [k for k in known if k.startswith("--")], n=1, cutoff=0.8)
    return found[0] if found else None
