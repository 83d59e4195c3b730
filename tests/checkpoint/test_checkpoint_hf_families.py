"""tools/checkpoint_hf.py beyond Llama: Qwen3, Phi-3 and Llama with biases (issue 38).

Why a file of its own: tests/checkpoint/test_checkpoint_hf.py holds the tool's contract on one Llama
(both paths, TP, fine-tuning across paths); these tests hold each further family to the
same rule, one family per fixture, cheaply: a tiny random model of the family (norm weights
and biases randomised so a swapped or dropped one shows) is built with `transformers`,
imported, and one real training iteration on each path (the static path on one rank, --dcp
on two as TP2 replicas; tests/support/hf_logits_entry.py writes every forward's logits) must give
the Hugging Face forward's logits on the same tokens within 1e-5 (fp32), and its logged loss
Hugging Face's loss; exported untrained, the safetensors equal the original bit for bit,
in the family's own layout, with a config that gives the same logits.

    qwen3        q_norm / k_norm per head (--qk-layernorm), head_dim 32 != hidden / heads
                 (--kv-channels), tied embeddings
    phi3         fused qkv_proj and gate_up_proj, partial_rotary_factor 0.5 (--rotary-percent)
    llama-bias   attention_bias and mlp_bias: a bias on every linear (no --disable-bias-linear)

What is refused (Gemma, Gemma2, sliding windows, longrope, a bias Megatron cannot place) is
in test_checkpoint_hf.py's REFUSALS table.
"""
import json
import os
import types

import pytest

from tests.support.helpers import run_tool
from tests.checkpoint.test_checkpoint_hf import (TOL, TOOL, VOCAB, assert_same_tensors, export, first_loss, hf_loss, hf_model,
                                      max_logit_difference, run_dumped, run_flags, save_tiny, tensors_of)

FAMILIES = {  # id: (model_type, config overrides, what the printed flags must hold)
    "qwen3": ("qwen3", dict(head_dim=32, tie_word_embeddings=True),
              ["--qk-layernorm", "--kv-channels 32", "--disable-bias-linear"]),
    "phi3": ("phi3", dict(partial_rotary_factor=0.5, pad_token_id=None, eos_token_id=None, bos_token_id=None),
             ["--rotary-percent 0.5", "--untie-embeddings-and-output-weights", "--disable-bias-linear"]),
    "llama-bias": ("llama", dict(attention_bias=True, mlp_bias=True), ["--swiglu --untie"]),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    """One family's tiny model, imported once."""
    kind, overrides, needles = FAMILIES[request.param]
    root = tmp_path_factory.mktemp(request.param)
    hf_dir = save_tiny(str(root / "hf"), kind, seed=11, **overrides)
    r = run_tool(TOOL, ["import", "--hf", hf_dir, "--save", str(root / "ckpt")])
    assert r.returncode == 0, r.stderr[-3000:]
    flags = open(root / "ckpt" / "hf_model_args.txt").read().split()
    return types.SimpleNamespace(id=request.param, kind=kind, root=root, hf=hf_dir, ckpt=str(root / "ckpt"),
                                 flags=flags, needles=needles)


@pytest.mark.dist
def test_family_imports_trains_with_hugging_faces_logits_on_both_paths_and_round_trips(family, text_corpus):
    import torch

    line = " ".join(family.flags)
    for needle in family.needles:
        assert needle in line, needle
    hf = hf_model(family.hf)
    dcp_tp2 = ["--dcp", "--dcp-planner", "static", "--tensor-model-parallel-size", "2",
               "--dcp-global-batch-tokens", "512", "--dcp-recalibration", "off"]
    for path, ranks, extra in (("static", 1, []), ("dcp_tp2", 2, dcp_tp2)):
        dump = run_dumped(family, ranks, run_flags(family, text_corpus, path, *extra), path)
        assert max_logit_difference(dump, hf) < TOL, path
        assert first_loss(family, path) == pytest.approx(hf_loss(dump, hf), abs=TOL), path
    out = export(family.ckpt, str(family.root / "out"))
    assert_same_tensors(tensors_of(family.hf), tensors_of(out))
    assert json.load(open(os.path.join(out, "config.json")))["model_type"] == family.kind
    # the exported config means the same model (a bias or rotary fraction it dropped would not load as used)
    tokens = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(hf_model(out)(input_ids=tokens).logits, hf(input_ids=tokens).logits)


# ------------------------------------------------------------------ fast tier
def test_each_family_s_config_means_these_flags():
    from tools.hf_families import megatron_flags, shape_from_config

    base = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=128, rope_theta=10000.0, rms_norm_eps=1e-6)

    def line(**cfg):
        return " ".join(megatron_flags(shape_from_config(dict(base, **cfg), "config.json"))) + " "

    assert "--qk-layernorm " in line(model_type="qwen3") and "--qk-layernorm" not in line(model_type="llama")
    assert "--kv-channels 32 " in line(model_type="qwen3", head_dim=32)
    assert "--kv-channels 128 " in line(model_type="qwen3")  # transformers' Qwen3 default, not hidden / heads
    assert "--kv-channels" not in line(model_type="llama")
    # transformers 5 keeps partial_rotary_factor in rope_parameters, older ones at the top level
    assert "--rotary-percent 0.75 " in line(model_type="phi3", rope_parameters={"rope_theta": 10000.0,
                                                                                "partial_rotary_factor": 0.75})
    assert "--rotary-percent 0.5 " in line(model_type="phi3", partial_rotary_factor=0.5)
    biased = line(model_type="llama", attention_bias=True, mlp_bias=True)
    assert "--disable-bias-linear" not in biased and "--add-qkv-bias" not in biased
    assert "--disable-bias-linear " in line(model_type="mistral", attention_bias=True)  # Mistral has none
    # a window at least as long as any position never binds
    assert "--max-position-embeddings 128 " in line(model_type="mistral", sliding_window=128)


def test_export_names_the_family_a_checkpoint_s_flags_need():
    import argparse

    from tools.hf_families import fits, shape_from_args

    plain = dict(normalization="RMSNorm", swiglu=True, position_embedding_type="rope", disable_bias_linear=True,
                 num_attention_heads=4, hidden_size=64, num_layers=2, ffn_hidden_size=128, num_query_groups=2)

    def family(**change):
        return shape_from_args(argparse.Namespace(**dict(plain, **change)), "ckpt")

    assert family().model_type == "llama"
    assert family(qk_layernorm=True).model_type == "qwen3"
    assert family(add_qkv_bias=True).model_type == "qwen2"
    assert family(rotary_percent=0.5).model_type == "phi3"
    biased = family(disable_bias_linear=False, add_qkv_bias=True)  # every linear's bias covers q/k/v's
    assert (biased.model_type, biased.linear_bias, biased.qkv_bias) == ("llama", True, False)
    # an imported model's own family is kept where it holds the flags
    assert fits("mistral", family()) and fits("phi3", family()) and not fits("mistral", family(rotary_percent=0.5))
    assert not fits("qwen2", family()) and not fits("mistral", biased) and fits("llama", biased)


def test_fused_phi3_projections_split_and_fuse_back():
    import torch

    from tools.hf_families import Shape, canonical_to_hf, hf_to_canonical

    shape = Shape("phi3", 1, 8, 6, heads=4, groups=2, head_dim=2, vocab=5, eps=1e-6, rope_base=10000,
                  max_positions=8, tied=True, qkv_bias=False, rotary_percent=0.5)
    g = torch.Generator().manual_seed(0)
    hf = {"model.embed_tokens.weight": torch.randn(5, 8, generator=g), "model.norm.weight": torch.rand(8),
          "model.layers.0.self_attn.qkv_proj.weight": torch.arange(16 * 8.).reshape(16, 8),
          "model.layers.0.self_attn.o_proj.weight": torch.randn(8, 8, generator=g),
          "model.layers.0.input_layernorm.weight": torch.rand(8),
          "model.layers.0.post_attention_layernorm.weight": torch.rand(8),
          "model.layers.0.mlp.gate_up_proj.weight": torch.randn(12, 8, generator=g),
          "model.layers.0.mlp.down_proj.weight": torch.randn(8, 6, generator=g)}
    ours = hf_to_canonical(hf, shape, rows=8)
    qkv = ours["decoder.layers.0.self_attention.linear_qkv.weight"]
    # rows 0-7 of qkv_proj are the 4 query heads, 8-11 the 2 keys, 12-15 the 2 values;
    # ours: group 0 = query heads 0 and 1, key 0, value 0
    assert qkv[:, 0].tolist()[:8] == [0, 8, 16, 24, 64, 72, 96, 104]
    assert torch.equal(ours["decoder.layers.0.mlp.linear_fc1.weight"], hf["model.layers.0.mlp.gate_up_proj.weight"])
    assert_same_tensors(hf, canonical_to_hf(ours, shape))


def test_weights_of_other_sizes_than_the_config_s_are_one_line():
    import torch

    from tools.hf_families import HFError, Shape, hf_shapes, hf_to_canonical

    shape = Shape("qwen3", 1, 8, 6, heads=4, groups=2, head_dim=4, vocab=5, eps=1e-6, rope_base=10000,
                  max_positions=8, tied=True, qkv_bias=False, qk_norm=True)
    hf = {name: torch.zeros(size) for name, size in hf_shapes(shape).items()}
    assert hf["model.layers.0.self_attn.q_norm.weight"].shape == (4,)
    assert hf["model.layers.0.self_attn.k_proj.weight"].shape == (8, 8)
    hf_to_canonical(hf, shape, rows=8)
    hf["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(4, 8)  # a head_dim the config does not give
    with pytest.raises(HFError, match=r"the weights' model.layers.0.self_attn.k_proj.weight is \[4, 8\], "
                                      r"config.json's sizes give \[8, 8\]"):
        hf_to_canonical(hf, shape, rows=8)
