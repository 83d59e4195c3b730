"""tools/checkpoint_hf.py: a Hugging Face Llama-family model in and out, and pretrained
weights loaded across the two paths (issue 28).

A tiny random Llama (2 layers, hidden 64, 4 heads in 2 query groups, untied, RoPE base
50000, its norm weights randomised too so a swapped norm would show) is built with
`transformers` and saved locally; nothing is downloaded. Then:
- imported, the logits of every forward of a real one-iteration run (tests/support/hf_logits_entry.py
  writes them) equal the Hugging Face forward's on the same tokens within 1e-5 (fp32): the
  static path at TP1 and TP2 (there through upstream's --pretrained-checkpoint), and under --dcp (2 ranks, TP2 replicas; each packed document
  against its own HF forward);
- `--dcp --finetune --load` of the static path's checkpoint (trained one step from the
  import) and the static path's `--finetune --load` of the --dcp run's checkpoint: their
  logits equal those of the checkpoint exported to Hugging Face, and the first iteration's
  logged loss equals that model's loss on the same batch (1e-5) - the loss the other path
  computes, since the other path's logits are the Hugging Face ones;
- exported without training, the safetensors equal the original bit for bit and
  `transformers` loads them with the same logits; a Qwen2-style (QKV bias) and a tied
  model round-trip too, and the Qwen2 one trains on both paths with HF's logits, as does a
  Llama 3.2-style RoPE scaling (megatron-core's --use-rope-scaling);
- what the GPT model cannot express is one `error:` line (the table at the end).
"""
import json
import os
import types

import pytest

from tests.support.helpers import REPO, drop_flags, read_loss_log, run_ranks, run_tool
from tests.support.helpers import assert_one_line_error

TOOL = "tools/checkpoint_hf.py"
ENTRY = os.path.join(REPO, "tests", "support", "hf_logits_entry.py")
VOCAB = 256  # the byte corpus: 255 values + EOD, NullTokenizer --vocab-size 255
TOL = 1e-5
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}  # Llama 3.2's


FAMILY_CLASSES = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3", "phi3": "Phi3"}


def tiny_config(kind: str = "llama", **overrides) -> dict:
    cfg = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=128, rope_theta=50000.0, rms_norm_eps=1e-6,
               tie_word_embeddings=False, initializer_range=0.1)
    cfg.update(overrides)
    return cfg


def save_tiny(path: str, kind: str = "llama", seed: int = 0, shard: str | None = None, **overrides) -> str:
    """A random model of `kind` saved with save_pretrained (fp32, safetensors; in shards of at
    most `shard`, with their index, if given)."""
    import torch
    import transformers

    name = FAMILY_CLASSES[kind]
    config_cls, model_cls = getattr(transformers, name + "Config"), getattr(transformers, name + "ForCausalLM")
    torch.manual_seed(seed)
    model = model_cls(config_cls(**tiny_config(kind, **overrides)))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.uniform_(0.5, 1.5) if "norm" in name else p.normal_(0, 0.1)
    model.save_pretrained(path, **({"max_shard_size": shard} if shard else {}))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:  # a stand-in: copied, never loaded here
        json.dump({"model_max_length": 128}, f)
    return path


def hf_model(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype="float32").eval()


def max_logit_difference(dump: str, hf) -> float:
    """Largest |ours - HF| over the logits of every forward of every rank (vocabulary shards of
    one TP group put together); packed documents each against their own HF forward."""
    import glob

    import torch

    dumps = [torch.load(f) for f in sorted(glob.glob(dump + ".*.pt"))]
    assert dumps, f"no logits written at {dump}"
    groups = {}
    for d in dumps:
        groups.setdefault(d["tokens"].numpy().tobytes(), []).append(d)
    worst = 0.0
    for shards in groups.values():
        shards.sort(key=lambda d: d["tp_rank"])
        assert len(shards) % shards[0]["tp_size"] == 0
        d = shards[0]
        logits = torch.cat([s["logits"] for s in shards[: d["tp_size"]]], dim=-1)[..., :VOCAB]  # [s, b, V]
        with torch.no_grad():
            if d["offsets"] is None:  # fixed-length samples [b, s]
                ref = hf(input_ids=d["tokens"]).logits.transpose(0, 1)
                worst = max(worst, float((ref - logits).abs().max()))
                continue
            tokens, flat = d["tokens"].reshape(-1), logits.reshape(-1, VOCAB)
            for i, n in enumerate(d["lengths"].tolist()):
                start = int(d["offsets"][i])
                ref = hf(input_ids=tokens[start : start + n][None]).logits[0]
                worst = max(worst, float((ref - flat[start : start + n]).abs().max()))
    return worst


def hf_loss(dump: str, hf) -> float:
    """The Hugging Face model's per-token loss over every micro-batch the run's forwards saw
    (the TP rank 0 copies): fixed-length samples against their labels, packed documents
    against their next tokens (a document's last position has none), as the run counts them."""
    import glob

    import torch
    import torch.nn.functional as F

    total, count = 0.0, 0
    for f in sorted(glob.glob(dump + ".*.pt")):
        d = torch.load(f)
        if d["tp_rank"] != 0:
            continue
        with torch.no_grad():
            if d["offsets"] is None:
                logits = hf(input_ids=d["tokens"]).logits
                total += float(F.cross_entropy(logits.reshape(-1, VOCAB).double(), d["labels"].reshape(-1),
                                               reduction="sum"))
                count += d["labels"].numel()
                continue
            tokens, labels = d["tokens"].reshape(-1), d["labels"].reshape(-1)
            for i, n in enumerate(d["lengths"].tolist()):
                start = int(d["offsets"][i])
                logits = hf(input_ids=tokens[start : start + n][None]).logits[0, : n - 1]
                total += float(F.cross_entropy(logits.double(), labels[start : start + n - 1], reduction="sum"))
                count += n - 1
    return total / count


def first_loss(imported, name: str) -> float:
    losses = read_loss_log(str(imported.root / f"{name}.jsonl"))
    assert [x["iteration"] for x in losses] == [1]
    return losses[0]["lm loss"]


def tensors_of(folder: str) -> dict:
    from safetensors.torch import load_file

    out = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(folder, name)))
    return out


def assert_same_tensors(a: dict, b: dict) -> None:
    import torch

    assert sorted(a) == sorted(b)
    different = [k for k in a if a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k])]
    assert not different, different


# ------------------------------------------------------------------ fast tier
def test_fused_qkv_layout_round_trips_per_query_group():
    import torch

    from tools.checkpoint_hf import Shape, fuse_qkv, split_qkv

    shape = Shape("llama", 1, 8, 16, heads=4, groups=2, head_dim=2, vocab=10, eps=1e-6, rope_base=10000,
                  max_positions=8, tied=False, qkv_bias=False)
    q, k, v = torch.arange(8 * 8.).reshape(8, 8), -torch.arange(4 * 8.).reshape(4, 8) - 1, torch.rand(4, 8) + 100
    fused = fuse_qkv(q, k, v, shape)
    # group 0: query heads 0 and 1, then its key head, then its value head
    assert torch.equal(fused[:4], q[:4]) and torch.equal(fused[4:6], k[:2]) and torch.equal(fused[6:8], v[:2])
    assert torch.equal(fused[8:12], q[4:]) and torch.equal(fused[12:14], k[2:])
    assert all(torch.equal(a, b) for a, b in zip(split_qkv(fused, shape), (q, k, v)))


def test_vocabulary_rows_hold_the_tokenizer_and_the_embedding(tmp_path):
    """Megatron pads the tokenizer's vocabulary; the rows must also hold every HF embedding row."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from tools.checkpoint_hf import Shape, vocabulary

    vocab = {f"t{i}": i for i in range(299)}
    vocab["</s>"] = 299
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>").save_pretrained(str(tmp_path / "tok"))
    shape = Shape("llama", 1, 8, 16, heads=4, groups=2, head_dim=2, vocab=256, eps=1e-6, rope_base=10000,
                  max_positions=8, tied=False, qkv_bias=False)
    hf_tokenizer = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", os.path.abspath("/x/save")]
    assert vocabulary(shape, str(tmp_path / "tok"), "/x/save") == (384, 128, hf_tokenizer)  # 300 tokens
    shape.vocab = 1000  # an embedding larger than the tokenizer: its rows, and the padding that keeps them
    assert vocabulary(shape, str(tmp_path / "tok"), "/x/save") == (
        1024, 1024, hf_tokenizer + ["--make-vocab-size-divisible-by", "1024"])
    shape.vocab = 256  # no tokenizer: NullTokenizer, the last id its EOD
    assert vocabulary(shape, str(tmp_path), "/x/save") == (256, 128, ["--tokenizer-type", "NullTokenizer",
                                                                      "--vocab-size", "255"])


# ------------------------------------------------------------------ dist tier
@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    hf_dir = save_tiny(str(root / "llama"))
    ckpt = str(root / "ckpt")
    r = run_tool(TOOL, ["import", "--hf", hf_dir, "--save", ckpt])
    assert r.returncode == 0, r.stderr[-3000:]
    flags = open(os.path.join(ckpt, "hf_model_args.txt")).read().split()
    assert " ".join(flags) in r.stdout
    return types.SimpleNamespace(root=root, hf=hf_dir, ckpt=ckpt, flags=flags, stdout=r.stdout)


def run_flags(imported, corpus, name, *extra):
    return imported.flags + ["--seq-length", "128", "--micro-batch-size", "2", "--global-batch-size", "4",
                             "--train-iters", "1", "--lr", "1e-3", "--data-path", corpus,
                             "--data-cache-path", str(imported.root / "cache"), "--split", "100,0,0",
                             "--eval-iters", "0", "--log-interval", "1",
                             "--loss-log", str(imported.root / f"{name}.jsonl")] + list(extra)


def run_dumped(imported, nproc, flags, name):
    dump = str(imported.root / f"{name}_logits")
    r = run_ranks(nproc, flags, env={"HF_LOGITS_DUMP": dump}, entry=ENTRY)
    assert r.returncode == 0, r.stderr[-3000:]
    return dump


@pytest.fixture(scope="module")
def static_tp1(imported, text_corpus):
    """The static path at TP1 from the import: its logits, and its checkpoint after one step."""
    save = str(imported.root / "static_saved")
    dump = run_dumped(imported, 1, run_flags(imported, text_corpus, "static_tp1", "--save", save), "static_tp1")
    return dump, save


@pytest.fixture(scope="module")
def dcp_tp2(imported, text_corpus):
    """--dcp on 2 ranks (TP2 replicas) from the import: its logits and its checkpoint."""
    save = str(imported.root / "dcp_saved")
    flags = run_flags(imported, text_corpus, "dcp_tp2", "--dcp", "--dcp-planner", "static",
                      "--tensor-model-parallel-size", "2", "--dcp-global-batch-tokens", "512",
                      "--dcp-recalibration", "off", "--save", save)
    return run_dumped(imported, 2, flags, "dcp_tp2"), save


def export(load: str, out: str) -> str:
    r = run_tool(TOOL, ["export", "--load", load, "--hf", out])
    assert r.returncode == 0, r.stderr[-3000:]
    return out


@pytest.mark.dist
def test_import_prints_the_model_flags_and_copies_the_tokenizer(imported):
    line = " ".join(imported.flags)
    for part in ("--num-layers 2", "--hidden-size 64", "--ffn-hidden-size 128", "--num-attention-heads 4",
                 "--group-query-attention --num-query-groups 2", "--position-embedding-type rope",
                 "--rotary-base 50000", "--normalization RMSNorm", "--norm-epsilon 1e-06", "--swiglu",
                 "--untie-embeddings-and-output-weights", "--disable-bias-linear", "--vocab-size 255", "--finetune"):
        assert part in line, part
    assert os.path.isfile(os.path.join(imported.ckpt, "tokenizer_config.json"))
    assert os.path.isfile(os.path.join(imported.ckpt, "hf_config.json"))


@pytest.mark.dist
def test_static_tp1_logits_equal_hugging_face(imported, static_tp1):
    hf = hf_model(imported.hf)
    assert max_logit_difference(static_tp1[0], hf) < TOL
    assert first_loss(imported, "static_tp1") == pytest.approx(hf_loss(static_tp1[0], hf), abs=TOL)


@pytest.mark.dist
def test_static_tp2_logits_equal_hugging_face(imported, text_corpus):
    # upstream's way: --pretrained-checkpoint while --load (also --save) holds no checkpoint yet
    own = str(imported.root / "tp2_own")
    flags = drop_flags(run_flags(imported, text_corpus, "static_tp2", "--tensor-model-parallel-size", "2"),
                       "--load", "--finetune")
    dump = run_dumped(imported, 2, flags + ["--pretrained-checkpoint", imported.ckpt, "--load", own, "--save", own],
                      "static_tp2")
    assert max_logit_difference(dump, hf_model(imported.hf)) < TOL
    assert open(os.path.join(own, "latest_checkpointed_iteration.txt")).read().strip() == "1"


@pytest.mark.dist
def test_dcp_logits_equal_hugging_face(imported, dcp_tp2):
    hf = hf_model(imported.hf)
    assert max_logit_difference(dcp_tp2[0], hf) < TOL
    assert first_loss(imported, "dcp_tp2") == pytest.approx(hf_loss(dcp_tp2[0], hf), abs=TOL)


@pytest.mark.dist
def test_dcp_finetunes_from_a_static_checkpoint(imported, static_tp1, text_corpus):
    _, static_save = static_tp1
    flags = [f for f in run_flags(imported, text_corpus, "dcp_from_static", "--dcp", "--dcp-global-batch-tokens", "512",
                                  "--dcp-recalibration", "off") if f != imported.ckpt]
    flags[flags.index("--load") + 1:flags.index("--load") + 1] = [static_save]
    dump = run_dumped(imported, 1, flags, "dcp_from_static")
    trained = hf_model(export(static_save, str(imported.root / "static_exported")))
    assert max_logit_difference(dump, trained) < TOL
    # the one static step moved the weights: the import's model gives other logits
    assert max_logit_difference(dump, hf_model(imported.hf)) > 1e-4
    # its first loss is the static model's on the same batch (HF = the static path's logits, above)
    assert first_loss(imported, "dcp_from_static") == pytest.approx(hf_loss(dump, trained), abs=TOL)


@pytest.mark.dist
def test_static_path_finetunes_from_a_dcp_checkpoint(imported, dcp_tp2, text_corpus):
    _, dcp_save = dcp_tp2
    flags = [f for f in run_flags(imported, text_corpus, "static_from_dcp") if f != imported.ckpt]
    flags[flags.index("--load") + 1:flags.index("--load") + 1] = [dcp_save]
    dump = run_dumped(imported, 1, flags, "static_from_dcp")
    trained = hf_model(export(dcp_save, str(imported.root / "dcp_exported")))
    assert max_logit_difference(dump, trained) < TOL
    assert first_loss(imported, "static_from_dcp") == pytest.approx(hf_loss(dump, trained), abs=TOL)


@pytest.mark.dist
def test_import_then_export_gives_the_same_tensors(imported):
    import torch

    out = export(imported.ckpt, str(imported.root / "round_trip"))
    assert_same_tensors(tensors_of(imported.hf), tensors_of(out))
    assert os.path.isfile(os.path.join(out, "tokenizer_config.json"))
    tokens = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(hf_model(out)(input_ids=tokens).logits, hf_model(imported.hf)(input_ids=tokens).logits)


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    """A Qwen2-style model (QKV bias) imported once."""
    root = tmp_path_factory.mktemp("qwen2")
    hf_dir = save_tiny(str(root / "hf"), "qwen2", seed=5)
    r = run_tool(TOOL, ["import", "--hf", hf_dir, "--save", str(root / "ckpt")])
    assert r.returncode == 0, r.stderr[-3000:]
    flags = open(root / "ckpt" / "hf_model_args.txt").read().split()
    return types.SimpleNamespace(root=root, hf=hf_dir, ckpt=str(root / "ckpt"), flags=flags)


@pytest.mark.dist
def test_qwen2_round_trips(qwen2):
    assert "--add-qkv-bias" in qwen2.flags and "--untie-embeddings-and-output-weights" in qwen2.flags
    out = export(qwen2.ckpt, str(qwen2.root / "out"))
    assert_same_tensors(tensors_of(qwen2.hf), tensors_of(out))
    assert json.load(open(os.path.join(out, "config.json")))["model_type"] == "qwen2"
    hf_model(out)  # transformers loads it


@pytest.mark.dist
def test_tied_sharded_llama_round_trips_and_import_checks_dcp(tmp_path):
    hf_dir = save_tiny(str(tmp_path / "tied"), seed=3, shard="100KB", tie_word_embeddings=True, num_key_value_heads=4)
    assert os.path.isfile(os.path.join(hf_dir, "model.safetensors.index.json"))
    r = run_tool(TOOL, ["import", "--hf", hf_dir, "--save", str(tmp_path / "ckpt"), "--dcp"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "--untie-embeddings-and-output-weights" not in r.stdout and "--group-query-attention" not in r.stdout
    assert r.stdout.rstrip().endswith("--finetune --dcp")
    out = export(str(tmp_path / "ckpt"), str(tmp_path / "out"))
    assert_same_tensors(tensors_of(hf_dir), tensors_of(out))
    assert "lm_head.weight" not in tensors_of(out)
    hf_model(out)


@pytest.mark.dist
@pytest.mark.parametrize("path", ["static", "dcp"])
def test_qwen2_qkv_bias_trains_with_hugging_faces_logits(path, qwen2, text_corpus):
    extra = ["--dcp", "--dcp-global-batch-tokens", "512", "--dcp-recalibration", "off"] if path == "dcp" else []
    dump = run_dumped(qwen2, 1, run_flags(qwen2, text_corpus, path, *extra), path)
    hf = hf_model(qwen2.hf)
    assert max_logit_difference(dump, hf) < TOL
    assert first_loss(qwen2, path) == pytest.approx(hf_loss(dump, hf), abs=TOL)


@pytest.mark.dist
def test_llama3_rope_scaling_imports_trains_and_exports(tmp_path, text_corpus):
    hf_dir = save_tiny(str(tmp_path / "llama3"), seed=7, rope_theta=None, rope_parameters=LLAMA3_ROPE,
                       max_position_embeddings=16384)
    r = run_tool(TOOL, ["import", "--hf", hf_dir, "--save", str(tmp_path / "ckpt")])
    assert r.returncode == 0, r.stderr[-3000:]
    run = types.SimpleNamespace(root=tmp_path, flags=open(tmp_path / "ckpt" / "hf_model_args.txt").read().split())
    assert "--use-rope-scaling --rope-scaling-factor 32.0 " in " ".join(run.flags) + " "
    dump = run_dumped(run, 1, run_flags(run, text_corpus, "llama3"), "llama3")
    assert max_logit_difference(dump, hf_model(hf_dir)) < TOL  # unscaled, the logits are ~0.1 off
    out = export(str(tmp_path / "ckpt"), str(tmp_path / "out"))
    assert json.load(open(os.path.join(out, "config.json")))["rope_parameters"] == LLAMA3_ROPE
    assert_same_tensors(tensors_of(hf_dir), tensors_of(out))


# ------------------------------------------------------------------ refusals
REFUSALS = [  # (id, config.json changes, the error line's substring)
    ("unknown-model-type", {"model_type": "gpt2"}, "model_type 'gpt2' is not supported"),
    ("activation", {"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ("sliding-window", {"model_type": "mistral", "sliding_window": 64}, "sliding-window attention is active"),
    ("qwen2-sliding-window", {"model_type": "qwen2", "use_sliding_window": True}, "sliding-window attention"),
    ("yarn-rope-scaling", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 500000.0, "factor": 8.0}},
     "RoPE scaling 'yarn' is not supported"),
    ("llama3-rope-other-window", {"rope_parameters": dict(LLAMA3_ROPE, original_max_position_embeddings=4096)},
     "{'original_max_position_embeddings': 4096}: megatron-core 0.16.1's --use-rope-scaling has"),
    ("attention-bias", {"attention_bias": True}, "attention_bias is true with mlp_bias false"),
    ("mlp-bias-alone", {"mlp_bias": True}, "mlp_bias is true and attention_bias false"),
    ("qwen3-attention-bias", {"model_type": "qwen3", "attention_bias": True},
     "attention_bias is true with no MLP bias in 'qwen3'"),
    ("gemma", {"model_type": "gemma", "hidden_act": "gelu_pytorch_tanh", "head_dim": 32},
     "model_type 'gemma' cannot be expressed by this fork's GPT model (the (1 + weight) RMSNorm and head_dim would "
     "be: --apply-layernorm-1p, --kv-channels); it lacks an embedding scale"),
    ("gemma2", {"model_type": "gemma2", "hidden_activation": "gelu_pytorch_tanh", "attn_logit_softcapping": 50.0,
                "final_logit_softcapping": 30.0, "sliding_window": 64},
     "norms after attention and after the MLP (post_attention/post_feedforward_layernorm; megatron-core's layer "
     "normalises before them only); logit softcapping (attn_logit_softcapping, final_logit_softcapping"),
    ("phi3-longrope", {"model_type": "phi3", "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0,
                                                                 "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}},
     "RoPE scaling 'longrope' (Phi-3's long-context per-dimension factors) is not supported"),
    ("phi3-sliding-window", {"model_type": "phi3", "sliding_window": 64},
     "sliding-window attention is active (sliding_window 64, max_position_embeddings 128): this fork's attention "
     "has no window"),
    ("partial-rotary", {"partial_rotary_factor": 0.5}, "partial RoPE"),
    ("missing-field", {"num_hidden_layers": None}, "num_hidden_layers"),
]


@pytest.fixture(scope="module")
def plain_config(tmp_path_factory):
    """A Llama config.json with one tiny weights file (the refusals are found before reading it)."""
    root = tmp_path_factory.mktemp("hf_refusals")
    cfg = dict(tiny_config(), model_type="llama", hidden_act="silu", architectures=["LlamaForCausalLM"])
    return root, cfg


def call_tool(argv, capsys):
    from tools.checkpoint_hf import main

    code = main(argv)
    out = capsys.readouterr()
    return types.SimpleNamespace(returncode=code, stdout=out.out, stderr=out.err)


@pytest.mark.parametrize("name,changes,needle", REFUSALS, ids=[r[0] for r in REFUSALS])
def test_what_the_gpt_model_cannot_express_is_one_line(name, changes, needle, plain_config, capsys):
    root, cfg = plain_config
    folder = root / name
    folder.mkdir()
    cfg = dict(cfg, **changes)
    cfg = {k: v for k, v in cfg.items() if v is not None}
    (folder / "config.json").write_text(json.dumps(cfg))
    r = call_tool(["import", "--hf", str(folder), "--save", str(root / f"{name}_out")], capsys)
    assert_one_line_error(r, needle)
    assert not os.path.exists(root / f"{name}_out")


@pytest.mark.parametrize("change,needle", [({"normalization": "LayerNorm"}, "--normalization is not RMSNorm"),
                                           ({"swiglu": False}, "--swiglu is off"),
                                           ({"apply_layernorm_1p": True}, "--apply-layernorm-1p is on"),
                                           ({"qk_layernorm": True, "rotary_percent": 0.5},
                                            "no Hugging Face family here holds --qk-layernorm with --rotary-percent 0.5"),
                                           ({"add_qkv_bias": True, "qk_layernorm": True},
                                            "holds --qk-layernorm with --add-qkv-bias")])
def test_export_refuses_what_no_family_can_hold(change, needle):
    import argparse

    from tools.checkpoint_hf import HFError, shape_from_args

    llama = dict(normalization="RMSNorm", swiglu=True, position_embedding_type="rope", disable_bias_linear=True,
                 num_attention_heads=4, hidden_size=64, num_layers=2, ffn_hidden_size=128, num_query_groups=2)
    assert shape_from_args(argparse.Namespace(**llama), "ckpt").groups == 2
    with pytest.raises(HFError, match=needle):
        shape_from_args(argparse.Namespace(**dict(llama, **change)), "ckpt")


def test_bad_paths_are_one_line(tmp_path, capsys):
    r = call_tool(["import", "--hf", str(tmp_path / "nowhere"), "--save", str(tmp_path / "out")], capsys)
    assert_one_line_error(r, "no such directory")
    (tmp_path / "empty").mkdir()
    r = call_tool(["import", "--hf", str(tmp_path / "empty"), "--save", str(tmp_path / "out")], capsys)
    assert_one_line_error(r, "no config.json")
    r = call_tool(["export", "--load", str(tmp_path / "nowhere"), "--hf", str(tmp_path / "out")], capsys)
    assert_one_line_error(r, "no such directory")
    r = call_tool(["import", "--hf", str(tmp_path / "empty")], capsys)
    assert_one_line_error(r, "--save")
    assert r.returncode == 2
