"""Bad inputs, as a table: each ends with one clear `error:` line and a non-zero exit, and
loses nothing.

Why a table: every row is one way a user or a machine can get a run wrong (flags, layouts,
YAML, data files, --dcp limits, checkpoints, NaN/inf loss, a rank that dies), with the
substring its error line must carry. The contract per row (`assert_one_line_error`,
tests/support/helpers.py): exit code != 0 (or the exact one named), no traceback, exactly one
non-empty stderr line, starting with `error:`. Four cases at the end run by hand on real ranks. Rows that touch a checkpoint also check
that its files are byte-identical afterwards, and the last test resumes from both
checkpoints. Rows that show a real bug are `xfail(strict=True)` with the reason, so they
flip to failures once the bug is fixed and the mark can go.

Speed: the rows run the real entry point (`pretrain_gpt_dcp.py`'s `main()`, argv, exit
code, stderr) in processes forked from one server that has already imported torch and
megatron-core (tests/support/entry_runner.py), so a row costs its own work, not 5 s of imports
(2 shared cores). `BAD_INPUTS_FRESH=1` runs every row in a fresh `python pretrain_gpt_dcp.py`
instead.
Layout rows that need several ranks set WORLD_SIZE as torchrun would (the checks run
before any process group); one row per multi-rank path runs real torchrun ranks.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import time
import dataclasses
from dataclasses import dataclass, field

import pytest

from tests.support import checkpoint_payloads as payloads
from tests.conftest import TINY_MODEL
from tests.support.entry_runner import make_runner, run_case
from tests.support.helpers import ENTRY, drop_flags, kill_tree, rank_processes, read_loss_log, run_ranks, start_ranks
from tests.support.helpers import assert_one_line_error, read_only_dir

pytestmark = pytest.mark.dist


# ------------------------------------------------------------------------------ table
@dataclass
class Case:
    id: str
    flags: list[str]  # {corpus}, {bad}, {static_ckpt}, {dcp_ckpt}, {tmp} are filled in
    needle: str  # substring of the one error line
    code: int | None = None  # exact exit code, when it is part of the contract
    env: dict = field(default_factory=dict)
    keeps: tuple[str, ...] = ()  # fixture checkpoints whose files must not change
    bug: str | None = None  # a real bug: xfail(strict) with this reason
    timeout: int = 180
    base: str = "static"  # static | dcp | none
    tool: str | None = None  # "plan" | "simulate": the row runs dcp-plan / dcp-simulate (TOOLS), not training
    absent: tuple[str, ...] = ()  # paths that must not exist afterwards (a payload's marker: nothing ran)


B_STATIC = ["--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "1",
            "--data-path", "{corpus}", "--data-cache-path", "{tmp}/cache"]
B_DCP = ["--dcp", "--dcp-global-batch-tokens", "512", "--train-iters", "1",
         "--data-path", "{corpus}", "--data-cache-path", "{tmp}/cache"]
SHAPE = ["--hidden-size", "32", "--ffn-hidden-size", "64"]
NAN = ["--lr", "1e30", "--lr-warmup-iters", "0", "--train-iters", "6", "--max-nan-iterations", "2"]
# what torchrun --nproc_per_node=2 sets (a rank of a 2-rank world); layout checks precede any group
W2 = {"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}

CASES = [
    # flags
    Case("unknown-flag", ["--no-such-flag"], "unknown flag --no-such-flag", code=2),
    Case("bad-int", ["--num-layers", "four"], "invalid int value: 'four'", code=2),
    Case("bad-float", ["--lr", "fast"], "invalid float value: 'fast'", code=2),
    Case("bad-choice", ["--normalization", "BatchNorm"], "invalid choice: 'BatchNorm'", code=2),
    Case("missing-value", ["--train-iters"], "expected one argument", code=2),
    Case("conflicting-precision", ["--bf16", "--fp16"], "--bf16 and --fp16 are mutually exclusive", code=2),
    Case("missing-required-lr", ["--drop", "--lr"], "--lr is required", code=2),
    Case("ckpt-format-not-written", ["--ckpt-format", "torch"], "this fork writes and reads torch_dist", code=2),
    Case("no-data-path", ["--drop", "--data-path"], "--data-path is required", code=2),
    # every refused flag of a line at once (upstream's scripts: older Megatron-LM's flags, FSDP, MoE)
    Case("refused-flags-said-at-once", ["--use-megatron-fsdp", "--DDP-impl", "torch", "--num-experts", "8",
                                        "--no-such-flag"],
         "4 flags are refused here (--DDP-impl, --no-such-flag, --use-megatron-fsdp, --num-experts)", code=2),
    Case("batch-schedule-vs-global-batch", ["--step-batch-size-schedule", "0:2", "512:8"],
         "--global-batch-size 4 differs from --step-batch-size-schedule's final size 8", code=2),
    Case("sft-without-loss-mask", ["--sft"], "has no SFT loss mask", code=2),
    # layouts
    Case("world-not-divisible", ["--tensor-model-parallel-size", "2"], "world size 1 is not divisible by tp*pp*cp",
         code=2),
    Case("heads-vs-tp", ["--num-attention-heads", "3", "--tensor-model-parallel-size", "2"],
         "--num-attention-heads 3 is not divisible by --tensor-model-parallel-size 2", code=2, env=W2),
    Case("groups-vs-tp", ["--num-query-groups", "1", "--tensor-model-parallel-size", "2"],
         "--num-query-groups 1 is not divisible by --tensor-model-parallel-size 2", code=2, env=W2),
    Case("layers-vs-pp", ["--num-layers", "3", "--pipeline-model-parallel-size", "2"],
         "--num-layers 3 is not divisible by --pipeline-model-parallel-size 2", code=2, env=W2),
    Case("seq-vs-2cp", ["--context-parallel-size", "2", "--seq-length", "126"],
         "--seq-length 126 must be a multiple of 2*context-parallel-size = 4", code=2, env=W2),
    Case("positions-below-seq", ["--position-embedding-type", "learned_absolute", "--max-position-embeddings", "64"],
         "--max-position-embeddings 64 is smaller than --seq-length 128", code=2),
    # YAML
    Case("yaml-unknown-key", ["--yaml-cfg", "{bad}/unknown_key.yaml"], "unknown key 'num-layerz'", code=2),
    Case("yaml-malformed", ["--yaml-cfg", "{bad}/malformed.yaml"], "not valid YAML", code=2),
    Case("yaml-missing-file", ["--yaml-cfg", "{bad}/nope.yaml"], "nope.yaml: no such file", code=2),
    Case("yaml-bad-value", ["--yaml-cfg", "{bad}/bad_value.yaml", "--drop", "--hidden-size"],
         "invalid int value: 'sixty'", code=2),
    Case("yaml-list-for-int", ["--yaml-cfg", "{bad}/list_value.yaml", "--drop", "--num-layers"], "num-layers", code=2),
    # data files
    Case("data-missing-prefix", ["--data-path", "{bad}/nope_text_document"], "no dataset at"),
    Case("data-missing-bin", ["--data-path", "{bad}/only_idx_text_document"], "only_idx_text_document.bin not found"),
    Case("data-truncated-bin", ["--data-path", "{bad}/trunc_text_document"], "trunc_text_document.bin is truncated"),
    Case("data-corrupt-idx", ["--data-path", "{bad}/garbled_text_document"],
         "garbled_text_document.idx is not a Megatron index file"),
    Case("data-empty", ["--data-path", "{bad}/empty_text_document"], "empty_text_document is empty"),
    Case("data-vocab-mismatch", ["--vocab-size", "100"], "vocabulary mismatch"),
    Case("data-vocab-mismatch-dcp", ["--vocab-size", "100"], "vocabulary mismatch", base="dcp"),
    Case("data-empty-dcp", ["--data-path", "{bad}/empty_text_document"], "empty_text_document is empty", base="dcp"),
    Case("data-split-without-documents", ["--split", "969,30,1", "--eval-iters", "1", "--eval-interval", "1"],
         "split", timeout=40),
    Case("data-split-without-documents-dcp", ["--split", "969,30,1", "--eval-iters", "1", "--eval-interval", "1"],
         "gets 0 documents of its", timeout=40, base="dcp"),
    # --dcp
    Case("dcp-zero-batch-tokens", ["--dcp", "--train-iters", "1", "--dcp-global-batch-tokens", "0"],
         "--dcp-global-batch-tokens 0 must be >= 1", code=2),
    Case("dcp-max-seq-above-batch", ["--dcp-max-seq-len", "1024", "--dcp-global-batch-tokens", "512"],
         "--dcp-max-seq-len 1024 exceeds --dcp-global-batch-tokens 512", code=2, base="dcp"),
    Case("dcp-bad-memory-margin", ["--dcp-memory-margin", "1.5"], "--dcp-memory-margin must be in [0, 1)", code=2,
         base="dcp"),
    Case("dcp-layer-strategies-static-planner", ["--dcp-planner", "static", "--dcp-layer-strategies", "on"],
         "--dcp-layer-strategies on is a choice of the adaptive planner", code=2, base="dcp"),
    Case("dcp-uneven-stages-without-dcp", ["--dcp-uneven-stages", "on"],
         "--dcp-uneven-stages on is a choice of the adaptive planner", code=2),
    Case("dcp-sequence-fits-nowhere", ["--dcp-max-seq-len", "4000000", "--dcp-global-batch-tokens", "4000000"],
         "fits no layout", base="dcp"),
    # checkpoints
    Case("ckpt-tracker-names-missing-iteration", ["--load", "{tmp}/tracker7"], "iter_0000007"),
    Case("ckpt-garbage-tracker", ["--load", "{tmp}/garbage"], "expected an iteration number, found 'latest'"),
    Case("ckpt-garbage-tracker-dcp", ["--load", "{tmp}/garbage"], "expected an iteration number", base="dcp"),
    Case("ckpt-exit-on-missing", ["--load", "{tmp}/empty_ckpt", "--exit-on-missing-checkpoint"],
         "no latest_checkpointed_iteration.txt found"),
    Case("ckpt-static-loaded-with-dcp", ["--load", "{static_ckpt}", "--train-iters", "2"],
         "not an adaptive-runtime checkpoint", keeps=("static_ckpt",), base="dcp"),
    Case("ckpt-dcp-loaded-without-dcp", ["--load", "{dcp_ckpt}", "--train-iters", "2"], "--dcp",
         keeps=("dcp_ckpt",)),
    Case("ckpt-dcp-other-model-shape", ["--load", "{dcp_ckpt}", "--train-iters", "2"] + SHAPE,
         "holds another model: --hidden-size is 32 here and 64 in the checkpoint", keeps=("dcp_ckpt",), base="dcp"),
    Case("ckpt-static-other-model-shape", ["--load", "{static_ckpt}", "--train-iters", "2"] + SHAPE,
         "holds another model: --hidden-size is 32 here and 64 in the checkpoint", keeps=("static_ckpt",)),
    # resume honours the flags or refuses (issue 24, class B): a model with the same tensor
    # shapes (8 heads of 8, 4 query groups = 4 heads of 16, 2 groups) used to load, scrambled
    *[Case(f"resume-{name}{'-dcp' if base == 'dcp' else ''}", ["--load", "{%s_ckpt}" % base, "--train-iters", "3"]
           + flags, needle, keeps=(f"{base}_ckpt",), base=base)
      for base in ("static", "dcp") for name, flags, needle in (
          ("same-shapes-other-heads", ["--num-attention-heads", "8", "--num-query-groups", "4", "--kv-channels", "8"],
           "holds another model: --num-attention-heads is 8 here and 4 in the checkpoint"),
          ("other-ffn", ["--ffn-hidden-size", "256"], "--ffn-hidden-size is 256 here and 128 in the checkpoint"),
          ("other-normalization", ["--normalization", "LayerNorm"],
           "--normalization is LayerNorm here and RMSNorm in the checkpoint"),
          ("without-swiglu", ["--drop", "--swiglu"], "--swiglu is off here and on in the checkpoint"),
          ("other-positions", ["--position-embedding-type", "learned_absolute"],
           "--position-embedding-type is learned_absolute here and rope in the checkpoint"),
          ("other-lr", ["--lr", "5e-4"],
           "the LR schedule differs from the flags: learning rate is 0.0005 from --lr and 0.001 in the checkpoint"),
          ("other-min-lr", ["--min-lr", "5e-5"], "minimum learning rate is 5e-05 from --min-lr and 0.0001"),
          ("other-lr-decay-iters", ["--lr-decay-iters", "100"], "decay steps is 100 from --lr-decay-iters"),
          ("other-decay-style", ["--lr-decay-style", "linear"], "decay style is linear from --lr-decay-style"),
          ("other-warmup", ["--lr-warmup-iters", "0"], "warmup steps is 0 from --lr-warmup-iters"),
      )],
    Case("resume-both-schedule-flags", ["--override-opt_param-scheduler", "--use-checkpoint-opt_param-scheduler"],
         "--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler exclude each other", code=2),
    Case("train-iters-zero-with-warmup", ["--drop", "--lr-decay-iters", "--train-iters", "0"],
         "--train-iters 0 trains nothing, and --lr-decay-iters (which defaults to it) leaves no room for "
         "--lr-warmup-iters 1", code=2),
    Case("train-iters-zero-with-warmup-dcp", ["--drop", "--lr-decay-iters", "--train-iters", "0"],
         "--train-iters 0 trains nothing", code=2, base="dcp"),
    # upstream's divisibility rule: --hidden-size over heads, unless --kv-channels says each head's size
    Case("hidden-not-divisible-by-heads-rope", ["--hidden-size", "60", "--num-attention-heads", "8",
                                                "--num-query-groups", "4"],
         "--hidden-size 60 is not divisible by --num-attention-heads 8", code=2),
    Case("hidden-not-divisible-by-heads-learned", ["--hidden-size", "60", "--num-attention-heads", "8",
                                                   "--num-query-groups", "4", "--position-embedding-type",
                                                   "learned_absolute"],
         "give each head's size with --kv-channels", code=2),
    Case("hidden-not-divisible-by-heads-dcp", ["--hidden-size", "60", "--num-attention-heads", "8",
                                               "--num-query-groups", "4"],
         "--hidden-size 60 is not divisible by --num-attention-heads 8", code=2, base="dcp"),
    Case("ckpt-static-other-vocab-padding", ["--load", "{static_ckpt}", "--train-iters", "2",
                                             "--make-vocab-size-divisible-by", "192"],
         "vocab", keeps=("static_ckpt",)),
    # pretrained weights across the two paths (issue 28): --finetune reads the other kind's weights
    Case("ckpt-dcp-finetune-from-static-other-shape", ["--load", "{static_ckpt}", "--finetune"] + SHAPE,
         "holds another model: --hidden-size is 32 here and 64 in the checkpoint", keeps=("static_ckpt",), base="dcp"),
    Case("ckpt-static-finetune-from-dcp-other-shape", ["--load", "{dcp_ckpt}", "--finetune"] + SHAPE,
         "holds another model: --hidden-size is 32 here and 64 in the checkpoint", keeps=("dcp_ckpt",)),
    Case("ckpt-static-finetune-from-dcp-other-vocab-padding", ["--load", "{dcp_ckpt}", "--finetune",
                                                               "--make-vocab-size-divisible-by", "192"],
         "its vocabulary is padded to 256 rows", keeps=("dcp_ckpt",)),
    Case("ckpt-pretrained-checkpoint-empty", ["--pretrained-checkpoint", "{tmp}/empty_ckpt"],
         "--pretrained-checkpoint {tmp}/empty_ckpt: no checkpoint there", code=2),
    # NaN / inf loss
    Case("nan-loss-static", NAN, "NaN/inf iterations in a row"),
    Case("nan-loss-dcp", NAN, "NaN/inf iterations in a row", base="dcp"),
]

# No lost work: every path the run writes is checked before training
# starts (megatron/training/startup/preflight.py), and the loader never takes a save's leftovers for a
# checkpoint. {out}: a file `afile`, a read-only dir `ro`, a full file system `full`, and
# checkpoint directories a crashed save could leave (make_output_fixtures, below).
_RO = "permission denied (cannot create"
CASES += [
    Case("out-save-is-a-file", ["--save", "{out}/afile"], "afile: is a file, not a directory", code=1),
    Case("out-save-under-a-file", ["--save", "{out}/afile/ckpt"], "afile is a file, not a directory", code=1),
    Case("out-save-read-only-dir", ["--save", "{out}/ro"], "ro: " + _RO, code=1),
    Case("out-save-read-only-parent", ["--save", "{out}/ro/run1/ckpt"], "ckpt: " + _RO, code=1),
    Case("out-save-no-space", ["--save", "{out}/full/ckpt"], "no space left on the device", code=1),
    Case("out-save-is-a-file-dcp", ["--save", "{out}/afile"], "afile: is a file, not a directory", code=1,
         base="dcp"),
    Case("out-save-read-only-dir-dcp", ["--save", "{out}/ro"], "ro: " + _RO, code=1, base="dcp"),
    Case("out-save-no-space-dcp", ["--save", "{out}/full/ckpt"], "no space left on the device", code=1, base="dcp"),
    Case("out-save-read-only-keeps-load", ["--load", "{static_ckpt}", "--save", "{out}/ro", "--train-iters", "3"],
         "ro: " + _RO, code=1, keeps=("static_ckpt",)),
    Case("out-save-read-only-keeps-load-dcp", ["--load", "{dcp_ckpt}", "--save", "{out}/ro", "--train-iters", "3"],
         "ro: " + _RO, code=1, keeps=("dcp_ckpt",), base="dcp"),
    Case("out-loss-log-missing-folder", ["--loss-log", "{out}/nope/loss.jsonl"], "nope does not exist: create it",
         code=1),
    Case("out-loss-log-missing-folder-dcp", ["--loss-log", "{out}/nope/loss.jsonl"],
         "nope does not exist: create it", code=1, base="dcp"),
    Case("out-loss-log-is-a-dir", ["--loss-log", "{out}/ro"], "is a directory, not a file", code=1),
    Case("out-loss-log-under-a-file", ["--loss-log", "{out}/afile/loss.jsonl"], "afile is a file, not a folder",
         code=1),
    Case("out-loss-log-read-only", ["--loss-log", "{out}/ro/loss.jsonl"], "loss.jsonl: " + _RO, code=1),
    Case("out-loss-log-no-space", ["--loss-log", "{out}/full/loss.jsonl"], "no space left on the device", code=1),
    Case("out-plan-log-missing-folder", ["--dcp-log-plan", "{out}/nope/plans.jsonl"], "nope does not exist",
         code=1, base="dcp"),
    Case("out-plan-log-is-a-dir", ["--dcp-log-plan", "{out}/ro"], "is a directory, not a file", code=1, base="dcp"),
    Case("out-tensorboard-is-a-file", ["--tensorboard-dir", "{out}/afile"], "afile: is a file, not a directory",
         code=1),
    Case("out-tensorboard-read-only", ["--tensorboard-dir", "{out}/ro/tb"], "tb: " + _RO, code=1),
    Case("out-data-cache-is-a-file", ["--data-cache-path", "{out}/afile"], "afile: is a file, not a directory",
         code=1),
    Case("out-data-cache-read-only-empty", ["--data-cache-path", "{out}/ro"], "ro: " + _RO, code=1),
    Case("ckpt-stale-staging-is-not-loaded", ["--load", "{out}/staged"], "iter_0000003 is missing or incomplete",
         code=1),
    Case("ckpt-half-written-aside-is-not-loaded", ["--load", "{out}/half_aside"],
         "iter_0000003 is missing or incomplete", code=1, base="dcp"),
]


def make_output_fixtures(root: str, static_ckpt: str, on_teardown) -> tuple[str, dict]:
    """{out} for the rows above; returns (root, {what: why it cannot be made here}).

    The read-only dir: mode 555, or (root ignores modes) the immutable attribute; the full
    file system: a 64 KiB tmpfs, filled (needs root). Rows that need what cannot be made
    on this machine are skipped with the reason."""
    import shutil

    os.makedirs(root)
    with open(os.path.join(root, "afile"), "w") as f:
        f.write("not a directory\n")
    # what a crashed save can leave: a complete staging that never committed, a half-deleted aside
    for name, leftover in (("staged", "iter_0000003.incomplete"), ("half_aside", "iter_0000003.old")):
        os.makedirs(os.path.join(root, name))
        with open(os.path.join(root, name, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write("3")
        shutil.copytree(os.path.join(static_ckpt, "iter_0000002"), os.path.join(root, name, leftover))
    os.remove(os.path.join(root, "half_aside", "iter_0000003.old", "metadata.json"))
    unavailable = {}
    ro = read_only_dir(root, on_teardown, unavailable)
    if "ro" not in unavailable:
        try:
            open(os.path.join(ro, "probe"), "w").close()
            os.remove(os.path.join(ro, "probe"))
            unavailable["ro"] = "this file system ignores read-only modes and attributes"
        except OSError:
            pass
    full = os.path.join(root, "full")
    os.makedirs(full)
    mounted = os.geteuid() == 0 and subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", full],
                                                   capture_output=True).returncode == 0
    if mounted:
        on_teardown(lambda: subprocess.run(["umount", "-l", full], capture_output=True))
        try:
            with open(os.path.join(full, "filler"), "wb") as f:
                while True:
                    f.write(b"\0" * 4096)
                    f.flush()
        except OSError:
            pass
    else:
        unavailable["full"] = "needs root to mount a 64 KiB tmpfs (a full disk)"
    return root, unavailable

# Validation: the whole configuration is checked in one place
# (argument_checks.validate_args: ranges, relations, YAML types, input-file syntax), token ids where
# each micro-batch is built, checkpoints by an inspector that names the missing or damaged
# file, OS errors said as such; and the planning tools (tool="plan"/"simulate": dcp-plan and
# dcp-simulate run instead of training). {val}: files made by make_validation_fixtures, below.
W4 = {"WORLD_SIZE": "4"}
LENS = ["--model", "demo", "--cluster", "cpu-gloox4", "--global-batch-tokens", "8192", "--max-seq-len", "2048",
        "--iterations", "2", "--quiet"]
PLAN = ["--lengths", "{val}/lengths.txt"] + LENS + ["--out", "{val}/plan.json"]
SIM = ["--lengths", "{val}/lengths.txt"] + LENS + ["--planners", "static"]
_DAMAGED = "restore it from a copy, or resume from an earlier checkpoint"
CASES += [
    # ranges of numbers: each flag names its range (argparse took "-1e-3" for a flag)
    Case("lr-negative", ["--lr", "-1e-3"], "--lr -0.001 must be >= 0", code=2),
    Case("lr-negative-equals-form", ["--lr=-3e-4"], "--lr -0.0003 must be >= 0", code=2),
    Case("lr-nan", ["--lr", "nan"], "--lr nan is not a finite number", code=2),
    Case("lr-minus-inf", ["--lr", "-inf"], "--lr -inf is not a finite number", code=2),
    Case("min-lr-above-lr", ["--min-lr", "1e-2"], "--min-lr 0.01 is above --lr 0.001", code=2),
    Case("adam-beta1-one", ["--adam-beta1", "1.0"], "--adam-beta1 1 must be in [0, 1)", code=2),
    Case("adam-beta2-negative", ["--adam-beta2", "-0.5"], "--adam-beta2 -0.5 must be in [0, 1)", code=2),
    Case("adam-eps-zero", ["--adam-eps", "0"], "--adam-eps 0 must be > 0", code=2),
    Case("weight-decay-negative", ["--weight-decay", "-0.1"], "--weight-decay -0.1 must be >= 0", code=2),
    Case("clip-grad-negative", ["--clip-grad", "-1"], "--clip-grad -1 must be >= 0", code=2),
    Case("dropout-above-one", ["--hidden-dropout", "1.5"], "--hidden-dropout 1.5 must be in [0, 1)", code=2),
    Case("warmup-fraction-above-one", ["--lr-warmup-fraction", "2"], "--lr-warmup-fraction 2 must be in [0, 1]",
         code=2),
    Case("micro-batch-zero", ["--micro-batch-size", "0"], "--micro-batch-size 0 must be >= 1", code=2),
    Case("global-batch-zero", ["--global-batch-size", "0"], "--global-batch-size 0 must be >= 1", code=2),
    Case("heads-zero", ["--num-attention-heads", "0"], "--num-attention-heads 0 must be >= 1", code=2),
    Case("query-groups-zero", ["--num-query-groups", "0"], "--num-query-groups 0 must be >= 1", code=2),
    Case("layers-negative", ["--num-layers", "-2"], "--num-layers -2 must be >= 1", code=2),
    Case("seed-negative", ["--seed", "-1"], "--seed -1 must be >= 0", code=2),
    Case("exit-interval-zero", ["--exit-interval", "0"], "--exit-interval 0 must be >= 1", code=2),
    Case("vocab-size-zero", ["--vocab-size", "0"], "--vocab-size 0 must be >= 1", code=2),
    Case("max-nan-iterations-zero", ["--max-nan-iterations", "0"], "--max-nan-iterations 0 must be >= 1", code=2),
    Case("dcp-max-seq-len-zero", ["--dcp-max-seq-len", "0"], "--dcp-max-seq-len 0 must be >= 1", code=2,
         base="dcp"),
    Case("dcp-candidates-zero", ["--dcp-candidates", "0"], "--dcp-candidates 0 must be >= 1", code=2, base="dcp"),
    # relations between flags
    Case("recompute-full-without-layers", ["--recompute-granularity", "full", "--recompute-method", "uniform"],
         "--recompute-granularity full needs --recompute-num-layers (1 to 4", code=2),
    Case("recompute-full-without-method", ["--recompute-granularity", "full", "--recompute-num-layers", "1"],
         "--recompute-granularity full needs --recompute-method uniform|block", code=2),
    Case("recompute-selective-with-layers", ["--recompute-granularity", "selective", "--recompute-num-layers", "2"],
         "--recompute-num-layers applies to --recompute-granularity full", code=2),
    Case("wsd-without-decay-iters", ["--lr-decay-style", "WSD"], "--lr-decay-style WSD needs --lr-wsd-decay-iters",
         code=2),
    Case("ffn-vs-tp", ["--tensor-model-parallel-size", "2", "--ffn-hidden-size", "129"],
         "--ffn-hidden-size 129 is not divisible by --tensor-model-parallel-size 2", code=2, env=W2),
    Case("global-batch-vs-micro-batch", ["--global-batch-size", "5"],
         "--global-batch-size 5 is not divisible by micro-batch-size x data-parallel-size = 2 x 1", code=2),
    Case("dcp-max-seq-beyond-positions", ["--position-embedding-type", "learned_absolute", "--dcp-max-seq-len", "256"],
         "--dcp-max-seq-len 256 exceeds --max-position-embeddings 128 (learned absolute positions)", code=2,
         base="dcp"),
    # --data-path blends and --split: their syntax before anything starts
    Case("blend-nan-weight-dcp", ["--data-path", "nan", "{corpus}", "1", "{corpus}"],
         "--data-path weights must be finite numbers > 0: nan 1", code=2, base="dcp"),
    Case("blend-nan-weight", ["--data-path", "nan", "{corpus}", "1", "{corpus}"],
         "--data-path weights must be finite numbers > 0: nan 1", code=2),
    Case("blend-inf-weight", ["--data-path", "inf", "{corpus}", "1", "{corpus}"],
         "--data-path weights must be finite numbers > 0: inf 1", code=2),
    Case("blend-zero-weight-dcp", ["--data-path", "0", "{corpus}", "1", "{corpus}"],
         "--data-path weights must be finite numbers > 0: 0 1", code=2, base="dcp"),
    Case("split-four-parts", ["--split", "1,2,3,4"], "bad --split '1,2,3,4'", code=2),
    # upstream's other data flags (dcp_ext/data/data_paths.py)
    # without --tokenizer-type, --vocab-file/--merge-file are upstream's pretrain_gpt.py default GPT2BPETokenizer's
    Case("tokenizer-files-without-type", ["--drop", "--tokenizer-type", "--drop", "--vocab-size", "--vocab-file",
                                          "{tmp}/gpt2-vocab.json", "--merge-file", "{tmp}/gpt2-merges.txt"],
         "--vocab-file not found: {tmp}/gpt2-vocab.json", code=1),
    Case("tokenizer-none-given", ["--drop", "--tokenizer-type", "--drop", "--vocab-size"],
         "no tokenizer: give --tokenizer-type", code=1, base="dcp"),
    Case("data-path-and-train-data-path", ["--train-data-path", "{corpus}"],
         "--data-path and --train-data-path exclude each other", code=2),
    Case("valid-data-path-without-train", ["--drop", "--data-path", "--valid-data-path", "{corpus}"],
         "--valid/test-data-path without a train dataset: give --train-data-path", code=2, base="dcp"),
    Case("data-args-path-missing", ["--drop", "--data-path", "--data-args-path", "{bad}/nope_args.txt"],
         "--data-args-path {bad}/nope_args.txt: no such file", code=2),
    Case("per-split-data-args-without-valid", ["--drop", "--data-path", "--per-split-data-args-path",
                                               "{bad}/per_split_train_only.json"], "has no 'valid', 'test'", code=2),
    # --dcp-cost-profile
    Case("cost-profile-missing", ["--dcp-cost-profile", "{val}/nope.json"],
         "--dcp-cost-profile {val}/nope.json: no such file", code=2, base="dcp"),
    Case("cost-profile-corrupt", ["--dcp-cost-profile", "{val}/profile_bad.json"], "profile_bad.json: not valid JSON",
         code=2, base="dcp"),
    Case("cost-profile-wrong-schema", ["--dcp-cost-profile", "{val}/profile_schema.json"],
         "profile_schema.json: not a dcp-profile file (profile schema is 'other'", code=2, base="dcp"),
    Case("cost-profile-is-a-directory", ["--dcp-cost-profile", "{val}"], "is a directory, not a profile file", code=2,
         base="dcp"),
    # YAML types and duplicate keys
    Case("yaml-yes-for-int", ["--yaml-cfg", "{val}/yes.yaml", "--drop", "--num-layers"],
         "key 'num-layers': expected an integer, got true", code=2),
    Case("yaml-on-for-float", ["--yaml-cfg", "{val}/on.yaml", "--drop", "--lr"], "key 'lr': expected a number, got true",
         code=2),
    Case("yaml-duplicate-key", ["--yaml-cfg", "{val}/dup.yaml", "--drop", "--num-layers"],
         "key 'num-layers' appears twice (lines 1 and 3)", code=2),
    Case("yaml-duplicate-underscore-key", ["--yaml-cfg", "{val}/dup_underscore.yaml", "--drop", "--num-layers"],
         "key 'num_layers' repeats 'num-layers'", code=2),
    Case("yaml-is-a-directory", ["--yaml-cfg", "{val}"], "is a directory, not a YAML file", code=2),
    # the launcher's environment
    Case("env-world-size-not-a-number", [], "WORLD_SIZE='two' is not an integer", code=2, env={"WORLD_SIZE": "two"}),
    Case("env-rank-beyond-world", [], "RANK=3 is not in [0, WORLD_SIZE=2)", code=2, env={"WORLD_SIZE": "2", "RANK": "3"}),
    Case("env-master-port-not-a-number", [], "MASTER_PORT='auto' is not an integer", code=2,
         env={"MASTER_PORT": "auto"}),
    Case("env-master-port-out-of-range", [], "MASTER_PORT=70000 is not a TCP port", code=2,
         env={"MASTER_PORT": "70000"}),
    Case("env-master-port-busy", [], "MASTER_PORT {busy_port} on 127.0.0.1 is already in use", code=1,
         env={"MASTER_PORT": "{busy_port}"}),
    Case("env-master-port-busy-dcp", [], "is already in use", code=1, env={"MASTER_PORT": "{busy_port}"}, base="dcp"),
    # a rank started without torchrun's rendezvous variables: one line, not a traceback (issue 24, class E)
    Case("env-world-without-master", [], "WORLD_SIZE=2 and RANK=0 are set but MASTER_ADDR and MASTER_PORT are not",
         code=2, env={"WORLD_SIZE": "2", "RANK": "0"}),
    Case("env-world-without-master-port-dcp", [], "WORLD_SIZE=2 and RANK=0 are set but MASTER_PORT is not",
         env={"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "127.0.0.1"}, base="dcp"),
    # data files a cluster user meets
    Case("data-prefix-with-bin-suffix", ["--data-path", "{corpus}.bin"], "takes the prefix without .bin/.idx", code=1),
    Case("data-idx-is-a-directory", ["--data-path", "{val}/dir_idx_text_document"],
         "dir_idx_text_document.idx is a directory, not a data file", code=1),
    Case("data-bin-broken-symlink", ["--data-path", "{val}/dangling_text_document"],
         "dangling_text_document.bin is a broken symbolic link", code=1),
    Case("data-bin-longer-than-idx", ["--data-path", "{val}/long_text_document"],
         "long_text_document.bin is corrupt", code=1),
    Case("data-token-past-vocab-late", ["--data-path", "{val}/latebad_text_document"],
         "has token id 300, outside the tokenizer's vocabulary of 256", code=1),
    Case("data-token-past-vocab-late-dcp", ["--data-path", "{val}/latebad_text_document"],
         "has token id 300, outside the tokenizer's vocabulary of 256", code=1, base="dcp"),
    Case("data-negative-token-id", ["--data-path", "{val}/negative_text_document"], "has token id -1", code=1),
    Case("data-negative-token-id-dcp", ["--data-path", "{val}/negative_text_document"], "has token id -1", code=1,
         base="dcp"),
    Case("data-tokenizer-mismatch", ["--data-path", "{val}/gpt2_text_document", "--tokenizer-type",
                                     "ByteLevelTokenizer"], "tokenizer mismatch", code=1),
    Case("data-tokenizer-mismatch-dcp", ["--data-path", "{val}/gpt2_text_document", "--tokenizer-type",
                                         "ByteLevelTokenizer"], "was preprocessed with GPT2BPETokenizer", code=1,
         base="dcp"),
    Case("data-damaged-hf-tokenizer", ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", "{val}/hf"],
         "tokenizer.json is not a valid tokenizer.json", code=1),
    Case("data-damaged-sentencepiece-model", ["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model",
                                              "{val}/garbage.model"], "garbage.model is not a SentencePiece model",
         code=1),
    Case("data-cache-cut-short", ["--data-cache-path", "{val}/cache_damaged"],
         "-sample_index.npy is damaged (cut short: another job may be writing the same --data-cache-path", code=1),
    # SFT: the loss mask on both paths
    Case("sft-no-trainable-token", ["--data-path", "{val}/sft0_text_document"], "has no trainable token", code=1),
    Case("sft-no-trainable-token-dcp", ["--data-path", "{val}/sft0_text_document"], "has no trainable token", code=1,
         base="dcp"),
    Case("sft-prompts-longer-than-max-seq-dcp", ["--data-path", "{val}/sft_text_document", "--dcp-max-seq-len", "8"],
         "iteration 1: the global batch's", code=1, base="dcp"),
    Case("sft-mixed-with-plain", ["--data-path", "{val}/sft_text_document", "{corpus}"], "mixes SFT datasets", code=1),
    Case("sft-mixed-with-plain-dcp", ["--data-path", "{val}/sft_text_document", "{corpus}"], "mixes SFT datasets",
         code=1, base="dcp"),
    Case("sft-loss-mask-truncated", ["--data-path", "{val}/sftcut_text_document"],
         "sftcut_text_document_loss_mask.bin is truncated", code=1),
    Case("sft-loss-mask-of-other-data", ["--data-path", "{val}/sftother_text_document"],
         "loss mask lengths differ from token lengths", code=1, base="dcp"),
    # checkpoints: the inspector names what is missing or damaged; --load itself
    Case("ckpt-load-is-a-file", ["--load", "{val}/lengths.txt"], "is a file, not a checkpoint directory", code=2),
    Case("ckpt-load-is-an-iteration-folder", ["--load", "{static_ckpt}/iter_0000002"],
         "is one checkpoint's folder: pass its parent", code=2, keeps=("static_ckpt",)),
    Case("ckpt-missing-common", ["--load", "{ck_no_common}", "--train-iters", "3"],
         "common.pt (iteration, arguments, scheduler) is missing; " + _DAMAGED, code=1, keeps=("ck_no_common",)),
    Case("ckpt-missing-common-dcp", ["--load", "{dk_no_common}", "--train-iters", "3"], "common.pt", code=1,
         keeps=("dk_no_common",), base="dcp"),
    Case("ckpt-missing-shard", ["--load", "{ck_no_shard}", "--train-iters", "3"], "shard file __0_1.distcp is missing",
         code=1, keeps=("ck_no_shard",)),
    Case("ckpt-missing-shard-dcp", ["--load", "{dk_no_shard}", "--train-iters", "3"],
         "shard file __0_0.distcp is missing", code=1, keeps=("dk_no_shard",), base="dcp"),
    Case("ckpt-truncated-shard", ["--load", "{ck_truncated}", "--train-iters", "3"], "__0_0.distcp is truncated (",
         code=1, keeps=("ck_truncated",)),
    Case("ckpt-truncated-shard-dcp", ["--load", "{dk_truncated}", "--train-iters", "3"], "__0_1.distcp is truncated (",
         code=1, keeps=("dk_truncated",), base="dcp"),
    # overwritten in a checkpoint without checksums (ours from before issue 37, upstream's): the read fails
    Case("ckpt-overwritten-shard", ["--load", "{ck_overwritten}", "--train-iters", "3"],
         "is damaged: a shard cannot be read", code=1, keeps=("ck_overwritten",)),
    Case("ckpt-overwritten-shard-dcp", ["--load", "{dk_overwritten}", "--train-iters", "3"],
         "is damaged: a shard cannot be read", code=1, keeps=("dk_overwritten",), base="dcp"),
    # issue 37, class B: 64 bytes flipped in a shard (size unchanged) decode, and were trained on
    Case("ckpt-flipped-shard", ["--load", "{ck_flipped}", "--train-iters", "3"],
         "__0_0.distcp is damaged: its sha256 differs from the one recorded when it was saved; restore it from a copy",
         code=1, keeps=("ck_flipped",)),
    Case("ckpt-flipped-shard-dcp", ["--load", "{dk_flipped}", "--train-iters", "3"],
         "__0_1.distcp is damaged: its sha256 differs from the one recorded when it was saved", code=1,
         keeps=("dk_flipped",), base="dcp"),
    Case("ckpt-flipped-common-dcp", ["--load", "{dk_flipped_common}", "--train-iters", "3"],
         "common.pt is damaged: its sha256 differs", code=1, keeps=("dk_flipped_common",), base="dcp"),
    Case("ckpt-garbage-checksums", ["--load", "{ck_bad_sums}", "--train-iters", "3"],
         "checksums.json is damaged", code=1, keeps=("ck_bad_sums",)),
    # issue 37, class A: a file that runs code when unpickled, then returns the real content
    # (tests/support/checkpoint_payloads.py; the checksums rewritten as an attacker would): refused, nothing runs
    Case("ckpt-index-runs-code", ["--load", "{ck_index_code}", "--train-iters", "3"],
         ".metadata: refused: reading it would run code (it names builtins.eval", code=1, keeps=("ck_index_code",),
         absent=("{val}/ran_ck_index_code",)),
    Case("ckpt-index-runs-code-dcp", ["--load", "{dk_index_code}", "--train-iters", "3"],
         ".metadata: refused: reading it would run code (it names builtins.eval", code=1, keeps=("dk_index_code",),
         absent=("{val}/ran_dk_index_code",), base="dcp"),
    Case("ckpt-stored-object-runs-code", ["--load", "{ck_object_code}", "--train-iters", "3"],
         ".distcp: rng_state/shard_0.0.0_1.1.1: refused: reading it would run code", code=1,
         keeps=("ck_object_code",),
         absent=("{val}/ran_ck_object_code",)),
    Case("ckpt-common-runs-code-dcp", ["--load", "{dk_common_code}", "--train-iters", "3"],
         "common.pt: refused: reading it would run code", code=1, keeps=("dk_common_code",),
         absent=("{val}/ran_dk_common_code",), env={"TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1"}, base="dcp"),
    Case("ckpt-missing-shard-index", ["--load", "{ck_no_index}", "--train-iters", "3"],
         ".metadata (the index of the shard files) is missing", code=1, keeps=("ck_no_index",)),
    Case("ckpt-garbage-shard-index", ["--load", "{ck_bad_index}", "--train-iters", "3"],
         ".metadata is damaged (cannot be read", code=1, keeps=("ck_bad_index",)),
    Case("ckpt-garbage-common", ["--load", "{ck_bad_common}", "--train-iters", "3"], "common.pt is damaged", code=1,
         keeps=("ck_bad_common",)),
    Case("ckpt-garbage-metadata-json", ["--load", "{ck_bad_json}", "--train-iters", "3"],
         "metadata.json is damaged (not valid JSON", code=1, keeps=("ck_bad_json",)),
    Case("ckpt-upstream-dp-reshardable-without-distributed-optimizer", ["--load", "{ck_upstream_dp}", "--train-iters",
         "3"], "format 'dp_reshardable' (upstream's default without --dist-ckpt-optim-fully-reshardable); resume with "
         "--use-distributed-optimizer", code=1, keeps=("ck_upstream_dp",)),
    # a disk that fills during the save (the start-of-run probe passed): said as a disk, nothing lost
    Case("disk-fills-during-save", ["--load", "{static_ckpt}", "--train-iters", "3", "--save", "{val}/small1/ckpt"],
         "no space left on the disk holding --save {val}/small1/ckpt", code=1, keeps=("static_ckpt",)),
    Case("disk-fills-during-save-dcp", ["--load", "{dcp_ckpt}", "--train-iters", "3", "--save", "{val}/small2/ckpt"],
         "no space left on the disk holding --save {val}/small2/ckpt", code=1, keeps=("dcp_ckpt",), base="dcp"),
    # dcp-plan / dcp-simulate: one line too
    Case("plan-unknown-model", PLAN + ["--model", "llama9"], "--model: model preset 'llama9'", code=2, base="none",
         tool="plan"),
    Case("plan-unknown-cluster", PLAN + ["--cluster", "tpu-v5x8"], "--cluster: cluster preset 'tpu-v5x8'", code=2,
         base="none", tool="plan"),
    Case("plan-cluster-of-zero", PLAN + ["--cluster", "h100x0"], "needs at least one device", code=2, base="none",
         tool="plan"),
    Case("plan-model-json-damaged", PLAN + ["--model", "{val}/profile_bad.json"], "not a ModelSpec JSON file", code=1,
         base="none", tool="plan"),
    Case("plan-length-not-an-integer", PLAN + ["--lengths", "{val}/lengths_text.txt"],
         "lengths_text.txt:3: '12.5' is not an integer length", code=1, base="none", tool="plan"),
    Case("plan-length-zero", PLAN + ["--lengths", "{val}/lengths_zero.txt"], "lengths_zero.txt:2: length 0 must be >= 1",
         code=1, base="none", tool="plan"),
    Case("plan-length-negative", PLAN + ["--lengths", "{val}/lengths_negative.txt"], "length -7 must be >= 1", code=1,
         base="none", tool="plan"),
    Case("plan-lengths-empty", PLAN + ["--lengths", "{val}/lengths_empty.txt"], "no lengths (the file is empty)",
         code=1, base="none", tool="plan"),
    Case("plan-lengths-missing", PLAN + ["--lengths", "{val}/nope.txt"], "--lengths {val}/nope.txt: no such file",
         code=1, base="none", tool="plan"),
    Case("plan-iterations-zero", PLAN + ["--iterations", "0"], "--iterations 0 must be >= 1", code=2, base="none",
         tool="plan"),
    Case("plan-batch-tokens-zero", PLAN + ["--global-batch-tokens", "0"], "--global-batch-tokens 0 must be >= 1",
         code=2, base="none", tool="plan"),
    Case("plan-start-past-the-end", PLAN + ["--start", "5000"], "--start 5000 is past the end", code=2, base="none",
         tool="plan"),
    Case("plan-bad-profile", PLAN + ["--profile", "{val}/profile_bad.json"], "--profile {val}/profile_bad.json: not valid JSON",
         code=1, base="none", tool="plan"),
    Case("plan-missing-out", ["--lengths", "{val}/lengths.txt"] + LENS, "the following arguments are required: --out",
         code=2, base="none", tool="plan"),
    Case("simulate-max-seq-above-batch", SIM + ["--max-seq-len", "16384"],
         "--max-seq-len 16384 exceeds --global-batch-tokens 8192", code=2, base="none", tool="simulate"),
    Case("simulate-unknown-planner", SIM + ["--planners", "static,magic"], "unknown planner 'magic'", code=2,
         base="none", tool="simulate"),
    Case("simulate-negative-length", SIM + ["--lengths", "{val}/lengths_negative.txt"], "length -7 must be >= 1",
         code=1, base="none", tool="simulate"),
    Case("simulate-unknown-model", SIM + ["--model", "gpt-5"], "--model: model preset 'gpt-5'", code=2, base="none",
         tool="simulate"),
]
TOOLS = {"plan": "dcp_ext/cli/plan.py", "simulate": "dcp_ext/cli/simulate.py"}


def make_validation_fixtures(root: str, p: dict, runner, on_teardown) -> dict:
    """{val} for the rows above; returns what to add to `paths` (damaged checkpoint copies with
    their digests, the busy port, what this machine cannot make)."""
    import shutil
    import socket

    import numpy as np

    from dcp_ext.data.indexed import write_documents

    os.makedirs(root)
    out = {"val": root}
    j = lambda *a: os.path.join(root, *a)  # noqa: E731
    corpus = p["corpus"]
    rng = np.random.default_rng(12)
    # YAML, profiles, lengths
    for name, text in (("yes.yaml", "num-layers: yes\n"), ("on.yaml", "lr: on\n"),
                       ("dup.yaml", "num-layers: 2\nhidden-size: 64\nnum-layers: 4\n"),
                       ("dup_underscore.yaml", "num-layers: 2\nnum_layers: 4\n"),
                       ("profile_bad.json", '{"schema": "dcp-profile/v1", '),
                       ("profile_schema.json", '{"schema": "other"}'),
                       ("lengths.txt", "\n".join(str(int(x)) for x in rng.integers(50, 3000, 200)) + "\n"),
                       ("lengths_text.txt", "100\n200\n12.5\n"), ("lengths_zero.txt", "100\n0\n"),
                       ("lengths_negative.txt", "100\n-7\n"), ("lengths_empty.txt", ""),
                       ("garbage.model", "not a sentencepiece model\n")):
        with open(j(name), "w") as f:
            f.write(text)
    os.makedirs(j("hf"))
    with open(j("hf", "tokenizer.json"), "w") as f:
        f.write("{not json")
    # data files
    os.makedirs(j("dir_idx_text_document.idx"))
    shutil.copy(corpus + ".bin", j("dir_idx_text_document.bin"))
    shutil.copy(corpus + ".idx", j("dangling_text_document.idx"))
    os.symlink("/nonexistent/volume/dangling_text_document.bin", j("dangling_text_document.bin"))
    shutil.copy(corpus + ".idx", j("long_text_document.idx"))
    with open(j("long_text_document.bin"), "wb") as f:
        f.write(open(corpus + ".bin", "rb").read() + b"\0" * 64)
    docs = [[int(x) for x in rng.integers(0, 254, int(rng.integers(20, 200)))] + [255] for _ in range(300)]
    late = [list(d) for d in docs]
    for d in late[64:]:  # past the first 64 documents the cheap up-front check reads
        d[len(d) // 2] = 300
    write_documents(j("latebad_text_document"), late, vocab_size=512)
    os.remove(j("latebad_text_document.meta.json"))
    neg = [list(d) for d in docs]
    for d in neg[64:]:
        d[1] = -1  # megatron.core's GPTDataset pad id: it would turn it into token 0 silently
    write_documents(j("negative_text_document"), neg, vocab_size=100_000)  # int32 ids
    os.remove(j("negative_text_document.meta.json"))
    write_documents(j("gpt2_text_document"), docs, vocab_size=256,
                    meta={"tokenizer": {"class": "GPT2BPETokenizer", "vocab_size": 50257, "eod": 50256}})
    prompts, masks = [], []
    for _ in range(120):
        n_p, n_r = int(rng.integers(20, 80)), int(rng.integers(3, 60))
        prompts.append([int(x) for x in rng.integers(0, 254, n_p + n_r)] + [255])
        masks.append([0] * n_p + [1] * (n_r + 1))
    write_documents(j("sft_text_document"), prompts, vocab_size=256, loss_masks=masks)
    write_documents(j("sft0_text_document"), prompts, vocab_size=256, loss_masks=[[0] * len(d) for d in prompts])
    for ext in (".bin", ".idx", "_loss_mask.idx"):
        shutil.copy(j("sft_text_document" + ext), j("sftcut_text_document" + ext))
    with open(j("sftcut_text_document_loss_mask.bin"), "wb") as f:
        f.write(open(j("sft_text_document_loss_mask.bin"), "rb").read()[:100])
    write_documents(j("other_text_document"), prompts[:50], vocab_size=256, loss_masks=masks[:50])
    for ext in (".bin", ".idx"):
        shutil.copy(j("sft_text_document" + ext), j("sftother_text_document" + ext))
        shutil.copy(j("other_text_document_loss_mask" + ext), j("sftother_text_document_loss_mask" + ext))
    # a data cache cut short: the base run's own cache files, one truncated
    argv = [a.format(**dict(p, tmp=root)) for a in TINY_MODEL + B_STATIC]
    argv[argv.index("--data-cache-path") + 1] = j("cache_damaged")
    r = run_case(runner, argv)
    assert r.returncode == 0, r.stderr[-3000:]
    index = [n for n in os.listdir(j("cache_damaged")) if n.endswith("-sample_index.npy")][0]
    with open(j("cache_damaged", index), "r+b") as f:
        f.truncate(100)
    # damaged copies of the two good checkpoints
    def damaged(name, src, how):
        dst = j(name)
        shutil.copytree(src, dst)
        how(os.path.join(dst, "iter_0000002"))
        out[name] = dst

    def cut(path, keep=None):
        size = os.path.getsize(path)
        with open(path, "r+b") as f:
            f.truncate(size // 2 if keep is None else keep)

    def overwrite(path):
        data = bytearray(open(path, "rb").read())
        data[64:len(data) // 2] = b"\x07" * (len(data) // 2 - 64)
        open(path, "wb").write(bytes(data))

    def garbage(path):
        with open(path, "w") as f:
            f.write("garbage\n")

    def as_upstream_dp_reshardable(path):  # common.pt as upstream writes it, its default optimizer format
        import torch

        common = torch.load(os.path.join(path, "common.pt"), weights_only=False)
        common["args"].consumed_train_samples = common.pop("consumed_train_samples")
        common.pop("layout")
        common["content_metadata"] = {"distrib_optim_sharding_type": "dp_reshardable"}
        torch.save(common, os.path.join(path, "common.pt"))
        unsealed(path)  # upstream writes no checksums

    def unsealed(path):
        if os.path.exists(os.path.join(path, "checksums.json")):
            os.remove(os.path.join(path, "checksums.json"))

    def poisoned(how, marker):
        def make(path):
            how(path, marker)
            payloads.reseal(path)
        return make

    s, d = p["static_ckpt"], p["dcp_ckpt"]
    damaged("ck_no_common", s, lambda it: os.remove(os.path.join(it, "common.pt")))
    damaged("dk_no_common", d, lambda it: os.remove(os.path.join(it, "common.pt")))
    damaged("ck_no_shard", s, lambda it: os.remove(os.path.join(it, "__0_1.distcp")))
    damaged("dk_no_shard", d, lambda it: os.remove(os.path.join(it, "__0_0.distcp")))
    damaged("ck_truncated", s, lambda it: cut(os.path.join(it, "__0_0.distcp")))
    damaged("dk_truncated", d, lambda it: cut(os.path.join(it, "__0_1.distcp"), 100))
    damaged("ck_overwritten", s, lambda it: (overwrite(os.path.join(it, "__0_0.distcp")), unsealed(it)))
    damaged("dk_overwritten", d, lambda it: (overwrite(os.path.join(it, "__0_0.distcp")), unsealed(it)))
    damaged("ck_flipped", s, lambda it: payloads.flip(os.path.join(it, "__0_0.distcp")))
    damaged("dk_flipped", d, lambda it: payloads.flip(os.path.join(it, "__0_1.distcp")))
    damaged("dk_flipped_common", d, lambda it: payloads.flip(os.path.join(it, "common.pt"), count=1, at=0.9))
    damaged("ck_bad_sums", s, lambda it: garbage(os.path.join(it, "checksums.json")))
    damaged("ck_index_code", s, poisoned(payloads.poison_index, j("ran_ck_index_code")))
    damaged("dk_index_code", d, poisoned(payloads.poison_index, j("ran_dk_index_code")))
    damaged("ck_object_code", s, poisoned(lambda it, marker: payloads.poison_stored_object(it, marker, "rng_state"),
                                          j("ran_ck_object_code")))
    damaged("dk_common_code", d, poisoned(payloads.poison_common, j("ran_dk_common_code")))
    damaged("ck_no_index", s, lambda it: os.remove(os.path.join(it, ".metadata")))
    damaged("ck_bad_index", s, lambda it: garbage(os.path.join(it, ".metadata")))
    damaged("ck_bad_common", s, lambda it: garbage(os.path.join(it, "common.pt")))
    damaged("ck_bad_json", s, lambda it: garbage(os.path.join(it, "metadata.json")))
    damaged("ck_upstream_dp", s, as_upstream_dp_reshardable)
    out["digests"] = dict(p["digests"], **{k: tree_digest(v) for k, v in out.items() if k[:3] in ("ck_", "dk_")})
    # a port another process listens on
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    on_teardown(sock.close)
    out["busy_port"] = str(sock.getsockname()[1])
    # disks that fill during a save: 1 MiB tmpfs (the start-of-run probe fits, a checkpoint does not)
    unavailable = {}
    for name in ("small1", "small2"):
        os.makedirs(j(name))
        mounted = os.geteuid() == 0 and subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", j(name)],
                                                       capture_output=True).returncode == 0
        if mounted:
            on_teardown(lambda path=j(name): subprocess.run(["umount", "-l", path], capture_output=True))
        else:
            unavailable["{val}/" + name] = "needs root to mount a 1 MiB tmpfs (a disk that fills during a save)"
    out["val_unavailable"] = unavailable
    return out


def argv_for(case: Case, paths: dict) -> list[str]:
    own, drop = [], []
    it = iter(case.flags)
    for f in it:
        if f == "--drop":
            drop.append(next(it))
        else:
            own.append(f)
    base = {"static": TINY_MODEL + B_STATIC, "dcp": TINY_MODEL + B_DCP, "none": []}[case.base]
    argv = drop_flags(base, *drop) + own
    return [a.format(**paths) for a in argv]


def tree_digest(root: str) -> str:
    h = hashlib.sha256()
    for d, _, files in sorted(os.walk(root)):
        for name in sorted(files):
            p = os.path.join(d, name)
            h.update(os.path.relpath(p, root).encode())
            with open(p, "rb") as f:
                h.update(f.read())
    return h.hexdigest()


# ---------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    work = tmp_path_factory.mktemp("runs")
    r = make_runner(str(work))
    yield r
    r.close()


@pytest.fixture(scope="module")
def paths(text_corpus, tmp_path_factory, runner, request):
    from dcp_ext.data.indexed import write_documents

    tmp = tmp_path_factory.mktemp("bad_inputs")
    bad = tmp / "bad"
    bad.mkdir()
    idx, bin_ = open(text_corpus + ".idx", "rb").read(), open(text_corpus + ".bin", "rb").read()
    (bad / "only_idx_text_document.idx").write_bytes(idx)
    (bad / "trunc_text_document.idx").write_bytes(idx)
    (bad / "trunc_text_document.bin").write_bytes(bin_[: len(bin_) // 2])
    (bad / "garbled_text_document.idx").write_bytes(b"garbage!" + idx[8:])
    (bad / "garbled_text_document.bin").write_bytes(bin_)
    write_documents(str(bad / "empty_text_document"), [], vocab_size=256)
    (bad / "unknown_key.yaml").write_text("num-layerz: 4\n")
    (bad / "malformed.yaml").write_text("num-layers: [4\nhidden-size: 64\n")
    (bad / "bad_value.yaml").write_text("hidden-size: sixty\n")
    (bad / "list_value.yaml").write_text("num-layers: [1, 2]\n")
    (bad / "per_split_train_only.json").write_text(json.dumps({"train": [text_corpus]}))
    (tmp / "tracker7").mkdir()
    (tmp / "tracker7" / "latest_checkpointed_iteration.txt").write_text("7")
    (tmp / "garbage").mkdir()
    (tmp / "garbage" / "latest_checkpointed_iteration.txt").write_text("latest\n")
    (tmp / "empty_ckpt").mkdir()
    p = {"corpus": text_corpus, "bad": str(bad), "tmp": str(tmp),
         "static_ckpt": str(tmp / "static_ckpt"), "dcp_ckpt": str(tmp / "dcp_ckpt")}
    # two good checkpoints (1 rank, 2 iterations) the checkpoint rows try to misuse
    for name, base in (("static_ckpt", B_STATIC), ("dcp_ckpt", B_DCP)):
        argv = [a.format(**p) for a in TINY_MODEL + base] + ["--train-iters", "2", "--save", p[name]]
        r = run_case(runner, argv)
        assert r.returncode == 0, r.stderr[-3000:]
    p["digests"] = {name: tree_digest(p[name]) for name in ("static_ckpt", "dcp_ckpt")}
    p["out"], p["unavailable"] = make_output_fixtures(str(tmp / "out"), p["static_ckpt"], request.addfinalizer)
    p.update(make_validation_fixtures(str(tmp / "val"), p, runner, request.addfinalizer))
    return p


def _param(case):
    marks = [pytest.mark.xfail(strict=True, reason=case.bug)] if case.bug else []
    return pytest.param(case, id=case.id, marks=marks)


def test_table_has_at_least_120_distinct_rows():
    assert len(CASES) >= 120 and len({c.id for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", [_param(c) for c in CASES])
def test_bad_input(case, runner, paths):
    for what, why in paths["unavailable"].items():  # {out}/ro, {out}/full where this machine cannot make them
        if "{out}/" + what in " ".join(case.flags):
            pytest.skip(why)
    for what, why in paths["val_unavailable"].items():  # {val}/small*: tmpfs disks this machine cannot mount
        if what in " ".join(case.flags):
            pytest.skip(why)
    env = {k: v.format(**paths) for k, v in case.env.items()}  # {busy_port}
    case = dataclasses.replace(case, needle=case.needle.format(**paths)) if "{" in case.needle else case
    r = run_case(runner, argv_for(case, paths), env=env, timeout=case.timeout, entry=TOOLS.get(case.tool))
    try:
        assert r.returncode != 124, f"no exit within {case.timeout} s (hang)"
        assert_one_line_error(r, case.needle)
        if case.code is not None:
            assert r.returncode == case.code, (r.returncode, r.stderr)
    finally:  # nothing lost, whatever the error looked like; nothing ran that a file smuggled in
        for name in case.keeps:
            assert tree_digest(paths[name]) == paths["digests"][name], f"{name} changed"
        for path in case.absent:
            assert not os.path.exists(path.format(**paths)), f"{path.format(**paths)} exists: the payload ran"


# -------------------------------------------------------------- several real ranks
def _worker_lines(stderr: str) -> list[str]:
    """stderr of the ranks: torchrun's own failure report (its log lines and
    ChildFailedError traceback) starts at its first `[WE]MMDD hh:mm:ss` line."""
    import re

    lines = []
    for line in stderr.splitlines():
        if re.match(r"^[WEI]\d{4} \d\d:\d\d:\d\d", line):
            break
        if line.strip():
            lines.append(line)
    return lines


def test_layout_error_on_real_ranks(paths):
    argv = argv_for(Case("x", ["--num-layers", "3", "--pipeline-model-parallel-size", "2"], ""), paths)
    r = run_ranks(2, argv, timeout=180, torchrun=True)
    assert r.returncode != 0
    lines = _worker_lines(r.stderr)
    assert lines == ["error: --num-layers 3 is not divisible by --pipeline-model-parallel-size 2"], r.stderr[-3000:]


@pytest.fixture(scope="module")
def killed_run(paths, tmp_path_factory):
    """2 ranks resume the dcp checkpoint and train; rank 1 is killed (SIGKILL) mid-run."""

    work = tmp_path_factory.mktemp("killed")
    log = str(work / "loss.jsonl")
    argv = argv_for(Case("x", ["--train-iters", "100000", "--load", "{dcp_ckpt}", "--save", str(work / "save"),
                               "--save-interval", "100000", "--loss-log", log], "", base="dcp"), paths)
    with open(work / "out", "w") as out, open(work / "err", "w") as err:
        proc = start_ranks(2, argv, out, err)
        try:
            deadline = time.time() + 300
            while time.time() < deadline and proc.poll() is None:
                if os.path.exists(log) and len(read_loss_log(log)) >= 2:
                    break
                time.sleep(0.1)
            assert proc.poll() is None, "the run ended before it could be killed"
            ranks = rank_processes(proc, ENTRY, rank="1")
            assert len(ranks) == 1
            ranks[0].send_signal(signal.SIGKILL)
            killed_at = time.time()
            try:
                code = proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                code = None
            waited = time.time() - killed_at
        finally:
            kill_tree(proc)
    return code, waited, open(work / "err").read(), read_loss_log(log)


def test_rank_killed_mid_run_exits_and_loses_nothing(killed_run, paths):
    code, waited, stderr, losses = killed_run
    assert code is not None, "the surviving rank hung after its peer died"
    assert code != 0
    assert losses and losses[0]["iteration"] == 3  # it did resume from the checkpoint and train
    assert tree_digest(paths["dcp_ckpt"]) == paths["digests"]["dcp_ckpt"]


def test_rank_killed_mid_run_reports_one_line(killed_run):
    """The survivor says why in one line: lost contact (a collective failed), or, when torchrun
    stopped it first (it was busy with its own work, e.g. choosing its next plan), the
    SIGTERM line, which comes after torchrun's report has begun."""
    _, _, stderr, _ = killed_run
    lines = _worker_lines(stderr)
    report = next((i for i, x in enumerate(stderr.splitlines()) if re.match(r"^[WEI]\d{4} \d\d:\d\d:\d\d", x)), None)
    if report is not None:
        lines += [x for x in stderr.splitlines()[report:] if x.startswith("error: stopped by SIGTERM")]
    assert "Traceback" not in "\n".join(lines), "\n".join(lines)[-3000:]
    assert len(lines) == 1 and "error:" in lines[0], lines


# ------------------------------------------------------------- and nothing lost
def test_checkpoints_still_resume(paths, runner, tmp_path):
    """After every row above, both checkpoints resume (iteration 3 follows 2)."""
    for name, base in (("static_ckpt", B_STATIC), ("dcp_ckpt", B_DCP)):
        log = str(tmp_path / f"{name}.jsonl")
        argv = [a.format(**paths) for a in TINY_MODEL + base] + ["--train-iters", "3", "--load", paths[name],
                                                                "--loss-log", log]
        r = run_case(runner, argv)
        assert r.returncode == 0, r.stderr[-3000:]
        assert [x["iteration"] for x in read_loss_log(log)] == [3]


# ------------------------------------------------- ranks given different flags (issue 37, class D)
# Each node's launcher passes its own command line: rank 1 gets the row's flags on top of the
# base that rank 0 gets. Two plain `python pretrain_gpt_dcp.py` ranks (rank 0 holds the store,
# as a launch without torchrun), so each can have its own argv. The check runs right after the
# process group, before either path's work: rank 0 says it once, both exit 2.
@dataclass
class RankCase:
    id: str
    rank1: list[str]  # {tmp} is filled in
    needle: str
    base: str = "static"


RANK_CASES = [
    RankCase("ranks-differ-lr", ["--lr", "2e-3"], "--lr is 0.001 on rank 0 and 0.002 on rank 1"),
    RankCase("ranks-differ-dcp", ["--dcp", "--dcp-global-batch-tokens", "512"],
             "--dcp is not given on rank 0 and given on rank 1"),
    RankCase("ranks-differ-save", ["--save", "{tmp}/rank1_ckpt"],
             "--save is not given on rank 0 and {tmp}/rank1_ckpt on rank 1"),
    RankCase("ranks-differ-model-dcp", ["--hidden-size", "32", "--ffn-hidden-size", "64"],
             "--ffn-hidden-size is 128 on rank 0 and 64 on rank 1; also --hidden-size", base="dcp"),
]


def run_two_ranks(argv0: list[str], argv1: list[str], tmp_path, timeout: int = 180):
    """Ranks 0 and 1 of one job, each with its own argv: [(code, stdout, stderr)] by rank."""
    from tests.support.helpers import REPO, free_port, rank_env

    env = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    procs = []
    for rank, argv in enumerate((argv0, argv1)):
        out, err = open(tmp_path / f"out{rank}", "w"), open(tmp_path / f"err{rank}", "w")
        procs.append((subprocess.Popen([os.sys.executable, ENTRY] + argv, cwd=REPO, stdout=out, stderr=err,
                                       env=rank_env(dict(env, RANK=str(rank), LOCAL_RANK=str(rank))),
                                       start_new_session=True), out, err))
    results = []
    try:
        for rank, (p, out, err) in enumerate(procs):
            try:
                code = p.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                code = 124
            out.close()
            err.close()
            results.append((code, open(tmp_path / f"out{rank}").read(), open(tmp_path / f"err{rank}").read()))
    finally:
        for p, _, _ in procs:
            kill_tree(p)
    return results


@pytest.mark.parametrize("case", RANK_CASES, ids=[c.id for c in RANK_CASES])
def test_ranks_given_different_flags_are_refused_in_one_line(case, paths, tmp_path):
    base = argv_for(Case("x", [], "", base=case.base), paths)
    rank1 = [a.format(tmp=str(tmp_path)) for a in case.rank1]
    (code0, _, err0), (code1, _, err1) = run_two_ranks(base, base + rank1, tmp_path)
    lines = [line for line in err0.splitlines() if line.strip()]
    assert code0 == 2 and code1 == 2, (code0, code1, err0[-2000:], err1[-2000:])
    assert len(lines) == 1 and lines[0].startswith("error: the ranks were given different flags (every node's "
                                                   "launcher must pass the same ones): "), lines
    assert case.needle.format(tmp=str(tmp_path)) in lines[0], lines[0]
    assert err1.strip() == "", err1[-2000:]  # said once, by rank 0
    assert not os.path.exists(tmp_path / "rank1_ckpt")


def test_an_output_of_one_rank_may_differ_per_node_and_is_said_where_it_goes(paths, tmp_path):
    """--loss-log given to each rank with its own path (a node's local disk): not refused; the
    last rank writes its own, and rank 0 says which and where in one line at start. (Given to
    rank 0 only, the line says nothing will be written: tests/training/test_launcher_gone.py.)"""
    base = argv_for(Case("x", [], ""), paths)
    mine, last = str(tmp_path / "rank0_loss.jsonl"), str(tmp_path / "rank1_loss.jsonl")
    (code0, out0, err0), (code1, out1, err1) = run_two_ranks(base + ["--loss-log", mine], base + ["--loss-log", last],
                                                             tmp_path)
    assert code0 == 0 and code1 == 0, (err0[-2000:], err1[-2000:])
    said = [line for line in out0.splitlines() + out1.splitlines() if "--loss-log" in line]
    assert said == [f"> --loss-log {last} is written by rank 1 (the last rank) on {os.uname().nodename}"], said
    assert os.path.exists(last) and not os.path.exists(mine)


# ------------------------------------------------------------------------------ by hand, on real ranks
BATCH = ["--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "1"]


def test_missing_data_path(tmp_path):
    r = run_ranks(1, TINY_MODEL + BATCH + ["--data-path", str(tmp_path / "nope_text_document")])
    assert_one_line_error(r, "nope_text_document")


def test_corrupt_index_file(text_corpus, tmp_path):
    prefix = str(tmp_path / "bad_text_document")
    os.symlink(text_corpus + ".bin", prefix + ".bin")
    with open(text_corpus + ".idx", "rb") as f:
        data = f.read()
    with open(prefix + ".idx", "wb") as f:
        f.write(b"garbage!" + data[8:])
    r = run_ranks(1, TINY_MODEL + BATCH + ["--data-path", prefix])
    assert_one_line_error(r, "bad_text_document.idx")


def test_invalid_layout(text_corpus):
    r = run_ranks(1, TINY_MODEL + BATCH + ["--data-path", text_corpus, "--tensor-model-parallel-size", "2"])
    assert_one_line_error(r, "world size 1 is not divisible by tp*pp*cp")
    assert r.returncode == 2


def test_tracker_naming_a_missing_checkpoint(text_corpus, tmp_path):
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("7")
    r = run_ranks(1, TINY_MODEL + BATCH + ["--data-path", text_corpus, "--load", str(tmp_path)])
    assert_one_line_error(r, "iter_0000007")
