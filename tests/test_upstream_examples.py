"""Upstream Megatron-LM's 8 GPT-style example training scripts, as their users would swap us in.

`tests/data/upstream/*.args` hold the exact argument lists the scripts pass to
`pretrain_gpt.py` (upstream d98e8a6). Each line is shrunk the way tests/test_upstream_launch_lines.py
shrinks the Llama-3 lines (its `shrink`): only model and batch sizes, sample and iteration counts,
parallel sizes that 4 ranks can hold, and paths change (data, tokenizer files and checkpoints
point at this test's; nothing else is touched). Then each line is launched as it is:

- it is refused, if at all, in ONE message that names every refused flag (exit 2, one `error:`
  line, no traceback), and the flags it names are exactly the ones expected of that script:
  the mixture-of-experts scripts (mixtral, gpt-oss, deepseek-v3) name their MoE flags and
  everything else this fork lacks; the dense ones only what this CPU cannot run (fp8, Megatron
  FSDP and its checkpoint format) and flags of older Megatron-LM or of upstream's ModelOpt
  integration that upstream's own parser no longer has (checked in `test_refusals_...`);
- the dense scripts without exactly those flags train on 4 CPU ranks, static and with `--dcp`,
  and the loss falls (the two Llama-3 lines run in test_upstream_launch_lines.py; gpt3 175B,
  the sc21 paper line and the ModelOpt Qwen3 SFT line here): gpt3's word-split
  `--step-batch-size-schedule` is honoured (iteration batch sizes 2, 2, 4: the loss log's
  `batch-size`... the static log's global batch size), Qwen3's training-time `--sft` trains on
  SFT data (loss on the assistant's tokens only), `--no-position-embedding` with rope,
  `--rope-type rope` and `--expert-tensor-parallel-size 1` are accepted.
"""
from __future__ import annotations

import glob
import json
import os
import re

import numpy as np
import pytest

from tests.entry_runner import shared_runner
from tests.helpers import REPO, drop_flags, read_loss_log, run_ranks
from tests.test_bad_input import assert_one_line_error
from tests.test_upstream_launch_lines import PATHS, SIZES, read_line, shrink

UPSTREAM = os.path.join(REPO, "tests", "data", "upstream")
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
    from tests.test_tokenizers import make_gpt2_files

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
@pytest.mark.parametrize("name", ALL, ids=[n.split(".")[0] for n in ALL])
def test_refusals_are_one_message_naming_every_refused_flag(name, tmp_path, data):
    """As written (shrunk), through the entry point: one line, exit 2, exactly the expected
    flags; the same line without them is refused no more (one iteration on one process; the
    4-rank runs are below and in test_upstream_launch_lines.py)."""
    argv = line_for(name, str(tmp_path), None if name in MOE else data)
    proc = run_ranks(1, argv, timeout=300)
    want = EXPECTED_REFUSED[name]
    if not want:
        assert proc.returncode == 0 or "refused" not in proc.stderr, proc.stderr[-2000:]
        return
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert_one_line_error(proc, "error: ")
    named = refused_flags(proc.stderr)
    assert len(named) == len(set(named)), named  # each flag once
    assert set(named) == want, f"unexpected: {set(named) - want}; missing: {want - set(named)}"
    line = proc.stderr.strip()
    if name in MOE:
        assert MOE_FAMILY_NEEDLE in line and "train MoE models with upstream Megatron-LM" in line
    for old in {"--activations-checkpoint-method", "--DDP-impl"} & want:
        assert f"{old}: a flag of older Megatron-LM" in line
    for modelopt in {"--modelopt-enabled", "--export-te-mcore-model"} & want:
        assert f"{modelopt}: a flag of upstream's ModelOpt integration" in line
    if name in MOE:
        return
    rest = drop_flags(argv, *named)
    one = (drop_flags(rest, "--train-iters", "--train-samples", "--step-batch-size-schedule", "--global-batch-size")
           + ["--train-iters", "1", "--global-batch-size", "4", "--tensor-model-parallel-size", "1",
              "--pipeline-model-parallel-size", "1", "--eval-iters", "0"])
    proc = run_ranks(1, one, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


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
    else:
        assert not any(r["skipped"] for r in records) and losses[-1] < losses[0], records
    if name.startswith("gpt3") and not dcp:  # "0:2 512:4 1K:8" tokens at --seq-length 128: 2, 2, then 4 samples
        assert [r["consumed samples"] for r in records] == [2, 4, 8], records
    if name.startswith("gpt3") and dcp:  # token budgets of 2, 2, 4 samples x 128 (documents fill them up to one short)
        tokens = [r["tokens"] for r in records]
        assert max(tokens[:2]) <= 256 < tokens[2] <= 512, records
    if name.startswith("qwen3"):
        assert "--sft: loss on the assistant's tokens only" in proc.stdout
        accepted = _accepted(proc.stdout)
        assert "--expert-tensor-parallel-size (" in accepted, accepted
