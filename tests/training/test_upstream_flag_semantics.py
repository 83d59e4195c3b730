"""Upstream flags honoured here with upstream's meaning, in-process (no ranks):

- `--step-batch-size-schedule`: upstream's rule (megatron.core's step calculator: thresholds in
  tokens // --seq-length, K/M/B/T suffixes, the size of the last threshold reached by the samples
  consumed) against a brute-force replay of that rule; its bad forms, one line each;
  `--global-batch-size` only as the schedule's final size; the LR schedule then counts samples;
- training-time `--sft`: this fork's SFT data (a loss mask) or one line with the command that
  makes it, conversations kept apart on the static path, `--tokenizer-type SFTTokenizer` as the
  Hugging Face tokenizer of `--tokenizer-model`;
- `--vocab-file`/`--merge-file` without `--tokenizer-type`: upstream pretrain_gpt.py's default,
  GPT2BPETokenizer.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

from megatron.training.arguments import ArgumentError, parse_args
from megatron.training.loop.batch_schedule import BatchSchedule, ScheduleError, parse

BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "128",
        "--lr", "1e-3", "--mock-data", "--micro-batch-size", "1"]
GPT3 = "0:16 2.4B:320 4.8B:624 7.2B:928 9.6B:1232 12B:1536"  # upstream's GPT-3 175B schedule


def replay(entries, iterations):
    """Upstream's rule, literally: each iteration trains the size of the last entry whose
    threshold the consumed samples reached."""
    consumed, sizes = 0, []
    for _ in range(iterations):
        size = [b for t, b in entries if consumed >= t][-1]
        sizes.append(size)
        consumed += size
    return sizes


@pytest.mark.parametrize("text,seq,iterations", [(GPT3, 2048, 90_000), ("0:3 1k:5, 2K:2 5K:7", 100, 400),
                                                 ("10:4 0:1", 1, 50)])
def test_schedule_follows_upstreams_rule(text, seq, iterations):
    entries = parse(text, seq)
    schedule = BatchSchedule(entries)
    sizes = replay(entries, iterations)
    before = np.concatenate([[0], np.cumsum(sizes)])  # samples consumed before iteration k
    assert [schedule.size_of_iteration(k) for k in range(iterations)] == sizes
    assert [schedule.samples_before(k) for k in range(0, iterations, 97)] == list(before[:iterations:97])
    for total in (1, sizes[0], sizes[0] + 1, int(before[iterations // 2]), int(before[-1]) - 1):
        assert schedule.iterations_for(total) == int(np.searchsorted(before, total)), total


@pytest.mark.parametrize("text,needle", [
    ("500:16 1000:32", "must start at 0"),
    ("0:16 0:32", "strictly increase"),
    ("0:16 2.4B", "is not THRESHOLD:SIZE"),
    ("0:16 x:32", "threshold 'x' is not a number"),
    ("0:0", "batch size 0 must be >= 1"),
])
def test_bad_schedules_are_one_line(text, needle):
    with pytest.raises(ScheduleError, match=needle):
        parse(text, 128)
    with pytest.raises(ArgumentError) as e:
        parse_args(BASE + ["--train-iters", "3", "--step-batch-size-schedule", text], world_size=1)
    assert str(e.value).startswith("--step-batch-size-schedule ") and needle in str(e.value)


def test_schedule_sets_the_batch_and_the_lr_schedule_counts_samples():
    args = parse_args(BASE + ["--train-iters", "10", "--lr-decay-iters", "8", "--lr-warmup-iters", "2",
                              "--step-batch-size-schedule", "0:2", "512:4"], world_size=2)  # word-split, as gpt3's
    assert args.global_batch_size == 4 and args.lr_schedule_in_samples
    from megatron.training.flags.loop_flags import scheduler_steps

    steps = scheduler_steps(args)  # upstream: iterations x --global-batch-size samples
    assert (steps["lr_warmup_steps"], steps["lr_decay_steps"]) == (8, 32)
    args = parse_args(BASE + ["--train-samples", "20", "--step-batch-size-schedule", "0:2 512:4"], world_size=2)
    assert args.train_iters == 6  # 2, 2, then 4 x 4 = 20 samples
    args = parse_args(BASE + ["--train-iters", "3", "--global-batch-size", "4", "--step-batch-size-schedule",
                              "0:2 512:4"], world_size=2)  # the final size, given too: accepted
    assert args.global_batch_size == 4


@pytest.mark.parametrize("extra,needle", [
    (["--global-batch-size", "8"], "--global-batch-size 8 differs from --step-batch-size-schedule's final size 4: "
                                   "drop --global-batch-size"),
    (["--micro-batch-size", "2"], "size 2 is not divisible by micro-batch-size x data-parallel-size = 2 x 2"),
    (["--dcp", "--dcp-global-batch-tokens", "1024"], "--dcp-global-batch-tokens and --step-batch-size-schedule both"),
    (["--dcp", "--dcp-max-seq-len", "512", "--position-embedding-type", "rope"], "size 2 x --seq-length 128 tokens is below "
                                                                   "--dcp-max-seq-len 512"),
])
def test_schedule_conflicts_are_one_line(extra, needle):
    with pytest.raises(ArgumentError) as e:
        parse_args(BASE + ["--train-iters", "3", "--step-batch-size-schedule", "0:2 512:4"] + extra, world_size=2)
    assert needle in str(e.value), str(e.value)


# ------------------------------------------------------------------------------ --sft
@pytest.fixture(scope="module")
def sft_data(tmp_path_factory):
    from dcp_ext.data.indexed import write_documents

    root = tmp_path_factory.mktemp("sft_semantics")
    docs = [[int(x) for x in np.arange(5) + i] + [255] for i in range(40)]
    plain = write_documents(str(root / "plain_text_document"), docs, vocab_size=256)
    sft = write_documents(str(root / "chat_sft_document"), docs, vocab_size=256,
                          loss_masks=[[0, 0, 1, 1, 1, 1] for _ in docs])
    jsonl = root / "chat.jsonl"
    jsonl.write_text(json.dumps({"messages": [{"role": "user", "content": "a"},
                                              {"role": "assistant", "content": "b"}]}) + "\n")
    return {"plain": plain, "sft": sft, "jsonl": str(jsonl)}


SFT = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32", "--lr", "1e-3",
       "--train-iters", "2", "--global-batch-size", "2", "--tokenizer-type", "NullTokenizer", "--vocab-size", "256",
       "--split", "100,0,0"]


def test_sft_trains_on_sft_data_with_conversations_apart(sft_data):
    args = parse_args(SFT + ["--sft", "--data-path", sft_data["sft"]], world_size=1)
    assert args.reset_position_ids and args.reset_attention_mask  # one conversation, one document
    from megatron.training.flags.sft_flags import note

    assert note(args).startswith("--sft: loss on the assistant's tokens only")


@pytest.mark.parametrize("which,needle", [
    ("jsonl", "as upstream's --sft reads chat JSONL at training time; here the conversations are tokenized once "
              "with their loss mask: run tools/preprocess_data.py --input {path} --sft"),
    ("plain", "has no SFT loss mask"),
])
def test_sft_on_other_data_is_one_line_with_the_command(sft_data, which, needle):
    with pytest.raises(ArgumentError) as e:
        parse_args(SFT + ["--sft", "--data-path", sft_data[which]], world_size=1)
    assert str(e.value).startswith("--sft: ") and needle.format(path=sft_data[which]) in str(e.value), str(e.value)
    assert "_sft_document" in str(e.value)  # where the preprocessed data will be


def test_sft_tokenizer_is_the_hugging_face_tokenizer_under_sft(sft_data):
    argv = SFT + ["--data-path", sft_data["sft"], "--tokenizer-type", "SFTTokenizer", "--tokenizer-model", "/tok"]
    args = parse_args(argv + ["--sft"], world_size=1)
    assert args.tokenizer_type == "HuggingFaceTokenizer" and args.tokenizer_model == "/tok"
    with pytest.raises(ArgumentError, match="SFTTokenizer is upstream's tokenizer for --sft: add --sft"):
        parse_args(argv, world_size=1)


def test_vocab_and_merge_files_default_to_gpt2_bpe_as_upstream():
    args = parse_args(BASE + ["--train-iters", "1", "--vocab-file", "v.json", "--merge-file", "m.txt"], world_size=1)
    assert args.tokenizer_type == "GPT2BPETokenizer"
    args = parse_args(BASE + ["--train-iters", "1", "--tokenizer-type", "NullTokenizer", "--vocab-size", "9"],
                      world_size=1)
    assert args.tokenizer_type == "NullTokenizer"
