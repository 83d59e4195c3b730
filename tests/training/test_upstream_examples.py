"""Upstream Megatron-LM's 8 GPT-style example training scripts, as their users would swap us in.

`tests/fixtures/upstream/*.args` hold the exact argument lists the scripts pass to
`pretrain_gpt.py` (upstream d98e8a6). Each line is shrunk the way tests/training/test_upstream_launch_lines.py
shrinks the Llama-3 lines (its `shrink`): only model and batch sizes, sample and iteration counts,
parallel sizes that 4 ranks can hold, and paths change (data, tokenizer files and checkpoints
point at this test's; nothing else is touched). Then each line is launched as it is:

- it is refused, if at all, in ONE message that names every refused flag (exit 2, one `error:`
  line, no traceback), and the flags it names are exactly the ones expected of that script:
  the mixture-of-experts scripts (mixtral, gpt-oss, deepseek-v3) name their MoE flags and
  everything else this fork lacks; the dense ones only what this CPU cannot run (fp8, Megatron
  FSDP and its checkpoint format) and flags of older Megatron-LM or of upstream's ModelOpt
  integration that upstream's own parser no longer has (checked in `test_refusals_...`);
- the dense scripts without exactly those flags train 3 iterations on 4 CPU ranks, static and
  with `--dcp`, every update applied (the two Llama-3 lines run in test_upstream_launch_lines.py;
  gpt3 175B, the sc21 paper line and the ModelOpt Qwen3 SFT line here). gpt3's
  `--step-batch-size-schedule`, word-split by its script, is honoured: 2, 2, then 4 samples
  (static), token budgets of those sizes (`--dcp`); its fp16 without `--loss-scale` skips its
  first iterations as upstream's dynamic scaler does. Qwen3's training-time `--sft` trains on
  data preprocessed with tools/preprocess_data.py --sft (its tokenizer given as SFTTokenizer),
  and its `--expert-tensor-parallel-size 1` is accepted without effect.

Time (2 cores): the data fixture ~13 s, each refused line ~0.2 s (deepseek's ~15 s: the first
fork), each 4-rank run 3-20 s.
"""
from __future__ import annotations

import glob
import json
import os
import re

import numpy as np
import pytest

from tests.support.entry_runner import shared_runner
from tests.support.helpers import REPO, drop_flags, read_loss_log, run_ranks
from tests.support.helpers import assert_one_line_error
from tests.training.test_upstream_launch_lines import PATHS, SIZES, read_line, shrink

UPSTREAM = os.path.join(REPO, "tests", "fixtures", "upstream")
MOE = ["mixtral_8x7b_distributed.args", "gptoss_02_train.args", "deepseek_v3_fsdp.args"]
DENSE_HERE = ["gpt3_175b_distributed.args", "sc21_run_table_1.args", "qwen3_8b_modelopt_train.args"]
DENSE_THERE = ["llama3_8b_h100_fp8.args", "llama3_8b_fsdp_h100_fp8.args"]  # run in test_upstream_launch_lines.py

# what 4 CPU ranks can hold, per script, on top of the common sizes (counts of iterations and
# samples are 3 iterations' worth; parallel sizes fit 4 ranks)
EXTRA_SIZES = {
    "gpt3_175b_distributed.args": {"--global-batch-size": "8", "--step-batch-size-schedule": ["0:2", "512:4", "1K:8"],
                                   "--train-iters": "3", "--lr-decay-iters": "10", "--tensor-model-parallel-size": "2",
                                   "--pipeline-model-parallel-size": "2"},
    "sc21_run_table_1.args": {"--micro-batch-size": "1", "--global-batch-size": "8", "--train-iters": "3",
                              "--lr-decay-iters": "10"},
    "qwen3_8b_modelopt_train.args": {"--train-samples": "12", "--lr-decay-samples": "12"},  # 3 x (1 x 4 ranks)
}
# Flags each script may have refused, and must: what this CPU cannot run (fp8: transformer-engine
# on an FP8 GPU; Megatron FSDP and its fsdp_dtensor format) and what upstream's own parser has
# not had for years or only with nvidia-modelopt (older Megatron-LM's, ModelOpt's).
EXPECTED_REFUSED = {
    "gpt3_175b_distributed.args": set(),
    "sc21_run_table_1.args": {"--activations-checkpoint-method", "--DDP-impl"},
    "qwen3_8b_modelopt_train.args": {"--modelopt-enabled", "--export-te-mcore-model"},
    "llama3_8b_h100_fp8.args": {"--fp8-format", "--fp8-amax-history-len", "--fp8-amax-compute-algo",
                                "--fp8-param-gather"},
    "llama3_8b_fsdp_h100_fp8.args": {"--fp8-format", "--fp8-amax-history-len", "--fp8-amax-compute-algo",
                                     "--fp8-param-gather", "--use-megatron-fsdp", "--fsdp-double-buffer",
                                     "--fsdp-manual-registration", "--ckpt-format"},
    "mixtral_8x7b_distributed.args": {"--num-experts", "--moe-aux-loss-coeff", "--moe-grouped-gemm",
                                      "--moe-token-dispatcher-type", "--expert-model-parallel-size"},
    "gptoss_02_train.args": {
        "--export-force-local-attention", "--softmax-type", "--window-attn-skip-freq", "--activation-func-clamp-value",
        "--window-size", "--enable-gpt-oss", "--quick-geglu", "--glu-linear-offset", "--num-experts",
        "--moe-aux-loss-coeff", "--moe-grouped-gemm", "--moe-token-dispatcher-type", "--moe-ffn-hidden-size",
        "--moe-router-dtype", "--moe-z-loss-coeff", "--moe-permute-fusion", "--moe-per-layer-logging",
        "--fp8-format", "--fp8-param-gather", "--fp8-amax-compute-algo", "--fp8-amax-history-len"},
    "deepseek_v3_fsdp.args": None,  # filled in below: its MoE, MLA and MTP flags, FSDP, ...
}
MOE_FAMILY_NEEDLE = "mixture of experts is not built in this fork"


def refused_flags(stderr: str) -> list[str]:
    """The flags one refusal line names: `error: --flag: ...`, `error: unknown flag --x ...`, or
    `error: N flags are refused here (--a, --b, ...); ...`."""
    line = stderr.strip().splitlines()[-1]
    many = re.match(r"error: (\d+) flags? (?:is|are) refused here \(([^)]*)\)", line)
    if many:
        flags = many.group(2).split(", ")
        assert len(flags) == int(many.group(1)), line
        return flags
    return [next(t for t in line.split() if t.startswith("--")).rstrip(":")]


# ------------------------------------------------------------------------------ data
def _corpus(root) -> str:
    """Byte documents (ids 0..254, EOD 255) from the standard library's sources: enough documents
    (4000) that every share of upstream's --split values (969,30,1 ...) holds some."""
    from dcp_ext.data.indexed import write_documents

    files = sorted(glob.glob(os.path.join(os.path.dirname(json.__file__), "*.py")))
    data = b"".join(open(p, "rb").read() for p in files)
    rng = np.random.default_rng(0)
    docs = []
    for _ in range(4000):
        n = int(rng.integers(20, 120))
        start = int(rng.integers(0, len(data) - n))
        docs.append([min(b, 254) for b in data[start:start + n]] + [255])
    return write_documents(os.path.join(root, "corpus_text_document"), docs, vocab_size=256)


def _gpt2_files(root) -> tuple[str, str]:
    from tests.data.test_tokenizers import make_gpt2_files

    vocab, merges, _ = make_gpt2_files(root)  # 256 byte symbols + merges + <|endoftext|>: the corpus' ids fit
    return vocab, merges


def _sft_data(root) -> tuple[str, str]:
    """A tiny Hugging Face tokenizer and chat conversations preprocessed with it by
    tools/preprocess_data.py --sft (-> the dataset prefix, with its loss mask)."""
    import pathlib

    tk = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    from dcp_ext.data.preprocess import build_parser, run

    root = pathlib.Path(root)
    files = sorted(glob.glob(os.path.join(os.path.dirname(json.__file__), "*.py")))
    text = [open(p).read() for p in files]
    tok = tk.Tokenizer(tk.models.BPE())
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tk.decoders.ByteLevel()
    tok.train_from_iterator(text, tk.trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"],
                                                         initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet()))
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(
        str(root / "tok"))
    rng = np.random.default_rng(1)
    lines = []
    for i in range(300):
        source = text[i % len(text)]
        a, b = (int(x) for x in rng.integers(0, len(source) - 400, 2))
        lines.append(json.dumps({"messages": [
            {"role": "system", "content": "You complete Python code."},
            {"role": "user", "content": source[a:a + int(rng.integers(40, 160))]},
            {"role": "assistant", "content": source[b:b + int(rng.integers(40, 200))]}]}))
    (root / "chat.jsonl").write_text("\n".join(lines) + "\n")
    args = build_parser().parse_args(["--input", str(root / "chat.jsonl"), "--output-prefix", str(root / "chat"),
                                      "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
                                      str(root / "tok"), "--sft", "--no-progress"])
    return str(root / "tok"), run(args)["sft"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("upstream_examples_data"))
    vocab, merges = _gpt2_files(tmp_path_factory.mktemp("gpt2"))
    tok, sft = _sft_data(tmp_path_factory.mktemp("sft"))
    blend = os.path.join(root, "sft_blend.json")
    with open(blend, "w") as f:
        json.dump({"train": [sft], "valid": [sft], "test": [sft]}, f)
    return {"--data-path": _corpus(root), "--vocab-file": vocab, "--merge-file": merges, "--tokenizer-model": tok,
            "--per-split-data-args-path": blend, "sft": sft}


def line_for(name: str, tmp: str, data: dict | None) -> list[str]:
    """The script's line, shrunk: sizes, counts, parallel sizes and paths only."""
    sizes = {**SIZES, **EXTRA_SIZES.get(name, {})}
    if data is not None:
        sizes.update({k: v for k, v in data.items() if k.startswith("--")})
    return shrink(read_line(name), tmp, sizes=sizes, paths=PATHS)


EXPECTED_REFUSED["deepseek_v3_fsdp.args"] = {
    "--expert-model-parallel-size", "--num-experts", "--moe-layer-freq", "--moe-ffn-hidden-size",
    "--moe-shared-expert-intermediate-size", "--moe-router-load-balancing-type", "--moe-router-topk",
    "--moe-token-dispatcher-type", "--moe-flex-dispatcher-backend", "--moe-router-pre-softmax", "--moe-grouped-gemm",
    "--moe-aux-loss-coeff", "--moe-router-group-topk", "--moe-router-num-groups", "--moe-router-topk-scaling-factor",
    "--moe-router-score-function", "--moe-router-enable-expert-bias", "--moe-router-dtype", "--moe-permute-fusion",
    "--moe-router-force-load-balancing", "--recompute-modules", "--multi-latent-attention", "--q-lora-rank",
    "--kv-lora-rank", "--rotary-scaling-factor", "--mscale-all-dim", "--lr-warmup-init", "--mtp-num-layers",
    "--dist-ckpt-strictness", "--use-megatron-fsdp", "--fsdp-double-buffer", "--megatron-fsdp-grad-comm-dtype",
    "--megatron-fsdp-main-grads-dtype", "--transformer-impl", "--ckpt-format"}
EXPECTED_REFUSED["gptoss_02_train.args"] |= {"--attention-softmax-in-fp32", "--disable-bf16-reduced-precision-matmul",
                                             "--recompute-activations", "--transformer-impl"}
ALL = sorted(EXPECTED_REFUSED)


def test_the_eight_scripts_are_here():
    assert sorted(os.path.basename(p) for p in glob.glob(os.path.join(UPSTREAM, "*.args"))) == ALL
    assert set(ALL) == set(MOE + DENSE_HERE + DENSE_THERE)


@pytest.mark.dist
@pytest.mark.parametrize("name", [n for n in ALL if EXPECTED_REFUSED[n]],
                         ids=[n.split(".")[0] for n in ALL if EXPECTED_REFUSED[n]])
def test_refusals_are_one_message_naming_every_refused_flag(name, tmp_path):
    """As written (shrunk), through the entry point on one process: one line, exit 2, and
    exactly the expected flags, each once (that the line without them trains is checked by
    the 4-rank runs below and in test_upstream_launch_lines.py)."""
    proc = run_ranks(1, line_for(name, str(tmp_path), None), timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert_one_line_error(proc, "error: ")
    named = refused_flags(proc.stderr)
    assert len(named) == len(set(named)), named
    want = EXPECTED_REFUSED[name]
    assert set(named) == want, f"unexpected: {set(named) - want}; missing: {want - set(named)}"
    line = proc.stderr.strip()
    if name in MOE:
        assert MOE_FAMILY_NEEDLE in line and "train MoE models with upstream Megatron-LM" in line
    for old in {"--activations-checkpoint-method", "--DDP-impl"} & want:
        assert f"{old}: a flag of older Megatron-LM" in line
    for modelopt in {"--modelopt-enabled", "--export-te-mcore-model"} & want:
        assert f"{modelopt}: a flag of upstream's ModelOpt integration" in line


def test_gpt3_line_is_accepted_as_written(tmp_path):
    """Its word-split schedule and --global-batch-size equal to the schedule's final size (which
    upstream itself refuses together) parse; nothing is refused."""
    from megatron.training.arguments import parse_args

    args = parse_args(line_for("gpt3_175b_distributed.args", str(tmp_path), None), world_size=4)
    assert args.step_batch_size_schedule == "0:2 512:4 1K:8" and args.global_batch_size == 8
    assert args.batch_schedule.entries == [(0, 2), (4, 4), (7, 8)]  # tokens // --seq-length 128 (K: 1000)


def _accepted(stdout: str) -> str:
    return next((ln for ln in stdout.splitlines() if ln.startswith("accepted without effect here:")), "")


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("dcp", [False, True], ids=["static", "dcp"])
@pytest.mark.parametrize("name", DENSE_HERE, ids=[n.split(".")[0] for n in DENSE_HERE])
def test_dense_script_trains_on_four_cpu_ranks(name, dcp, tmp_path, data):
    argv = drop_flags(line_for(name, str(tmp_path), data), *EXPECTED_REFUSED[name])
    log = str(tmp_path / "loss.jsonl")
    argv += ["--loss-log", log] + (["--dcp"] if dcp else [])
    proc = run_ranks(4, argv, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = read_loss_log(log)
    losses = [r["lm loss"] for r in records]
    assert len(losses) == 3 and all(np.isfinite(losses)), records
    assert "error" not in proc.stderr.lower(), proc.stderr[-2000:]
    if "--fp16" in argv and "--loss-scale" not in argv:
        # upstream's dynamic loss scale starts at 2**32 and halves on each overflow: its first
        # iterations are skipped, as upstream's are (3 iterations train nothing yet)
        scales = [r["loss scale"] for r in records]
        assert all(r["skipped"] for r in records) and scales == sorted(scales, reverse=True), records
    else:  # every update applied with a finite, non-zero gradient (3 iterations at upstream's small learning
        # rates move the loss less than the batches' own spread: a falling loss is not asked here)
        assert not any(r["skipped"] for r in records), records
        assert all(np.isfinite(r["grad norm"]) and r["grad norm"] > 0 and r["lr"] > 0 for r in records), records
    if name.startswith("gpt3") and not dcp:  # "0:2 512:4 1K:8" tokens at --seq-length 128: 2, 2, then 4 samples
        assert [r["consumed samples"] for r in records] == [2, 4, 8], records
    if name.startswith("gpt3") and dcp:  # token budgets of 2, 2, 4 samples x 128 (documents fill them up to one short)
        tokens = [r["tokens"] for r in records]
        assert max(tokens[:2]) <= 256 < tokens[2] <= 512, records
    if name.startswith("qwen3"):
        assert "--sft: loss on the assistant's tokens only" in proc.stdout
        accepted = _accepted(proc.stdout)
        assert "--expert-tensor-parallel-size (" in accepted, accepted
