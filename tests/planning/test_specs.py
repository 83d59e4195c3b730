"""Specs: presets, Megatron arguments, JSON round trip (pure, fast)."""

import pytest

from dcp_ext.planning.specs import ClusterSpec, ModelSpec, SpecError


@pytest.mark.parametrize("name,n,per_node,kind", [
    ("h200x64", 64, 8, "h200"), ("h100x8", 8, 8, "h100"), ("a800x64", 64, 8, "a800"), ("h200x256", 256, 8, "h200"),
    ("cpu-gloox4", 4, 4, "cpu-gloo"), ("cpu-gloo x4", 4, 4, "cpu-gloo"), ("cpu-gloo-x8", 8, 8, "cpu-gloo"),
    ("H200x4", 4, 4, "h200"),
])
def test_cluster_presets(name, n, per_node, kind):
    c = ClusterSpec.from_preset(name)
    assert (c.num_gpus, c.gpus_per_node, c.gpu_kind) == (n, per_node, kind)
    assert ClusterSpec.from_json(c.to_json()) == c


@pytest.mark.parametrize("bad", ["h200", "x64", "tpu-v5x8", "h200x0"])
def test_cluster_preset_errors(bad):
    with pytest.raises(ValueError):
        ClusterSpec.from_preset(bad)


def test_cpu_gloo_is_one_node():
    c = ClusterSpec.cpu_gloo(6)
    assert c.num_gpus == c.gpus_per_node == 6 and c.name == "cpu-gloox6"


# Published parameter counts (Llama 2 paper / model cards: 6.74B, 13.0B, 68.98B)
@pytest.mark.parametrize("name,params", [("llama2-7b", 6.738e9), ("llama2-13b", 13.016e9), ("llama2-70b", 68.977e9)])
def test_model_presets_match_published_sizes(name, params):
    m = ModelSpec.from_preset(name)
    assert abs(m.num_params - params) / params < 0.002


def test_gpt_preset_and_demo():
    g = ModelSpec.from_preset("gpt-1.3b")
    assert 1.2e9 < g.num_params < 1.45e9 and not g.swiglu
    d = ModelSpec.from_preset("demo")
    assert d.num_layers == 4 and d.num_attention_heads % d.num_query_groups == 0 and 256 <= d.vocab_size <= 512


def test_model_json_round_trip():
    m = ModelSpec.from_preset("llama2-70b")
    assert ModelSpec.from_json(m.to_json()) == m
    assert ModelSpec.from_json({"name": "llama2-7b"}) == ModelSpec.from_preset("llama2-7b")


def test_cpu_attention_in_json_only_when_not_the_default():
    m = ModelSpec.from_preset("demo")
    assert "cpu_attention" not in m.to_json()  # earlier runs' JSON and the pinned plans stay as they were
    flash = m.with_(cpu_attention="flash")
    assert flash.to_json()["cpu_attention"] == "flash"
    assert ModelSpec.from_json(flash.to_json()) == flash
    with pytest.raises(SpecError, match='cpu_attention must be "math" or "flash"'):
        ModelSpec.from_json({**flash.to_json(), "cpu_attention": "fast"})
