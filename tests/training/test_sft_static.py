"""SFT without --dcp: the static (upstream Megatron) path trains on the responses only.

megatron.core's GPTDataset concatenates documents into --seq-length windows and knows no
loss mask; `CheckedSamples` cuts the stored mask into the very same windows. The corpus here
makes the contract checkable without re-implementing it: prompt tokens are ids 0..127,
response tokens 128..254 (and EOD 255, trained, as preprocessing marks it), so a position
must count exactly when its label is >= 128.
"""
import numpy as np
import pytest

from tests.conftest import TINY_MODEL
from tests.support.helpers import read_loss_log, run_ranks

SEQ = 64
EOD = 255


def sft_corpus(prefix: str, n_tokens: int, seed: int = 0, prompt_only_every: int = 3, variant: str = "base",
               prompt_only_end: int = EOD):
    """SFT documents (prompt ids < 128, response ids >= 128, EOD) and, every `prompt_only_every`-th,
    a document with no trainable token, ending with `prompt_only_end`. variant 'prompts': other
    tokens in those documents, same lengths; 'responses': other response tokens. Exactly
    `n_tokens` tokens in all."""
    from dcp_ext.data.indexed import write_documents

    rng = np.random.default_rng(seed)
    other = np.random.default_rng(seed + 1000)
    docs, masks, total, k = [], [], 0, 0
    while total < n_tokens:
        k += 1
        left = n_tokens - total
        if k % prompt_only_every == 0 or left < 3:
            n = min(int(rng.integers(10, 60)), left)
            toks = rng.integers(0, 128, max(n - 1, 0))
            if variant == "prompts":
                toks = other.integers(0, 128, toks.size)
            doc, mask = list(toks) + [prompt_only_end], [0] * n
        else:
            n_p, n_r = int(rng.integers(5, 40)), int(rng.integers(3, 40))
            if n_p + n_r + 1 > left:
                n_p = max(1, left // 2)
                n_r = left - n_p - 1
            resp = rng.integers(128, 255, n_r)
            if variant == "responses":
                resp = other.integers(128, 255, n_r)
            doc = list(rng.integers(0, 128, n_p)) + list(resp) + [EOD]
            mask = [0] * n_p + [1] * (n_r + 1)
        doc, mask = doc[: left], mask[: left]
        docs.append([int(x) for x in doc])
        masks.append(mask)
        total += len(doc)
    write_documents(prefix, docs, vocab_size=256, loss_masks=masks)
    return docs, masks


def test_static_samples_count_exactly_the_response_tokens(tmp_path):
    from dcp_ext.data.gpt_dataset import build_fixed_length_datasets
    from dcp_ext.data.tokenizers import build_tokenizer

    windows = 40
    prefix = str(tmp_path / "sft_text_document")
    docs, masks = sft_corpus(prefix, windows * SEQ + 1, prompt_only_end=7)  # one epoch: exactly `windows` samples
    tok = build_tokenizer("NullTokenizer", vocab_size=255)
    train, _, _ = build_fixed_length_datasets([prefix], "100,0,0", SEQ, 3, tok, (windows, None, None),
                                              str(tmp_path / "cache"))
    assert len(train) == windows
    counted = 0
    for i in range(windows):
        s = train[i]
        labels, mask = s["labels"].numpy(), s["loss_mask"].numpy()
        assert set(np.unique(mask)) <= {0.0, 1.0}
        np.testing.assert_array_equal(mask == 1, labels >= 128, err_msg=f"sample {i}")
        counted += int(mask.sum())
    # every document starts with a prompt token, so whichever comes first in the shuffled epoch,
    # every response token (and trained EOD) is a label exactly once
    assert counted == sum(sum(m) for m in masks)


@pytest.mark.dist
def test_static_sft_prompt_change_leaves_training_unchanged(tmp_path):
    """Two runs whose data differ only in tokens no trainable position depends on (documents
    with no response, isolated by --reset-attention-mask) train identically, though the
    windows they train on differ (checked on the datasets, so the comparison can fail)."""
    from dcp_ext.data.gpt_dataset import build_fixed_length_datasets
    from dcp_ext.data.tokenizers import build_tokenizer

    runs, windows = {}, {}
    tok = build_tokenizer("NullTokenizer", vocab_size=255)
    for variant in ("base", "prompts"):
        prefix = str(tmp_path / f"{variant}_text_document")
        sft_corpus(prefix, 12 * SEQ + 1, variant=variant)
        log = str(tmp_path / f"{variant}.jsonl")
        r = run_ranks(1, TINY_MODEL + ["--seq-length", str(SEQ), "--max-position-embeddings", str(SEQ),
                                       "--reset-attention-mask", "--micro-batch-size", "2", "--global-batch-size", "4",
                                       "--train-iters", "2", "--data-path", prefix,
                                       "--data-cache-path", str(tmp_path / f"cache_{variant}"), "--loss-log", log],
                      timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        runs[variant] = [(x["lm loss"], x["grad norm"]) for x in read_loss_log(log)]
        train, _, _ = build_fixed_length_datasets([prefix], "100,0,0", SEQ, 1234, tok, (8, 0, 0),
                                                  str(tmp_path / f"cache_{variant}"), reset_attention_mask=True)
        windows[variant] = np.stack([train[i]["tokens"].numpy() for i in range(8)])  # what the 2 iterations read
    assert (windows["base"] != windows["prompts"]).any(), "the changed documents are not in the trained windows"
    base, prompts = runs["base"], runs["prompts"]
    assert len(base) == 2
    for (l0, g0), (l1, g1) in zip(base, prompts):  # iteration 2's loss sees iteration 1's whole update
        assert l1 == pytest.approx(l0, rel=1e-6, abs=1e-7) and g1 == pytest.approx(g0, rel=1e-6, abs=1e-7)
