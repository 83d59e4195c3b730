"""The cost model prices the kernels the run builds, not the cluster's kind (issue 35, fault 5).

A GPU without transformer-engine runs megatron-core's local spec with our document attention
and torch norms, as CPU ranks do: its activation terms are the CPU's (quadratic with the
math kernel, linear with flash), not TE's. `ModelSpec.layer_kernels`, `fused_swiglu` and
`fused_rope` say which; unset, the cluster decides as before (pinned numbers below), and
`AdaptiveRunConfig.from_args` sets them from the rules that build the model.
"""
import pytest

from dcp_ext.planning.cost_model import CostModel, Layout
from dcp_ext.planning.specs import ClusterSpec, ModelSpec, SpecError
from tests.conftest import TINY_MODEL

GPU, CPU = ClusterSpec.from_preset("h200x8"), ClusterSpec.cpu_gloo(8)
LAYOUTS = [Layout(1, 1, 1), Layout(2, 1, 1), Layout(1, 2, 1), Layout(2, 2, 2)]
AS_ON_THE_CPU = dict(layer_kernels="local", fused_swiglu=False, fused_rope=False)


def terms(model, cluster, layout, **kernels):
    return CostModel(model.with_(**kernels), cluster).act_terms(layout)


@pytest.mark.parametrize("kernel", ["math", "flash"])
@pytest.mark.parametrize("preset", ["demo", "llama2-70b"])
def test_local_layers_on_a_gpu_are_priced_as_on_the_cpu(preset, kernel):
    model = ModelSpec.from_preset(preset).with_(cpu_attention=kernel)
    for lay in LAYOUTS:
        local = terms(model, GPU, lay, **AS_ON_THE_CPU)
        assert local == terms(model, CPU, lay), lay
        assert local != terms(model, GPU, lay), lay  # TE's
        assert local == terms(model, GPU, lay, layer_kernels="local", fused_swiglu=False)  # no RoPE fusion without TE
    one = Layout(1, 1, 1)
    te = terms(model, GPU, one)
    local = terms(model, GPU, one, **AS_ON_THE_CPU)
    assert te["pair"] == 0
    # math keeps every head's probabilities per (query, key) pair; flash none (its CP mask aside)
    assert local["pair"] == (model.num_attention_heads * model.activation_bytes if kernel == "math" else 0)


@pytest.mark.parametrize("kernel", ["math", "flash"])
def test_memory_of_local_layers_on_a_gpu_follows_the_document_lengths(kernel):
    """Quadratic with math (one long document costs more than the same tokens in short ones),
    linear with flash and with TE, on the same GPU cluster."""
    model = ModelSpec.from_preset("llama2-7b").with_(cpu_attention=kernel)
    lay, tokens = Layout(1, 1, 1), [8192]
    long, short = [[8192]], [[1024] * 8]
    local, te = CostModel(model.with_(layer_kernels="local"), GPU), CostModel(model, GPU)
    assert local.quadratic(lay) == (kernel == "math") and not te.quadratic(lay)
    grow = local.replica_peak_bytes(lay, tokens, [0], long) - local.replica_peak_bytes(lay, tokens, [0], short)
    if kernel == "math":
        pairs = 8192**2 - 8 * 1024**2
        assert grow >= model.num_layers * model.num_attention_heads * model.activation_bytes * pairs
    else:
        assert grow == 0
    assert te.replica_peak_bytes(lay, tokens, [0], long) == te.replica_peak_bytes(lay, tokens, [0], short)


def test_unset_kernels_keep_todays_numbers_on_both_cluster_kinds():
    # act_terms before the kernel fields existed (the cluster's rule), at tp2 cp2
    lay = Layout(2, 2, 1)
    assert terms(ModelSpec.from_preset("llama2-70b"), GPU, lay) == {
        "full": 137344.0, "ckpt": 8192.0, "emb": 8192.0, "work": 65536.0, "ws": 16384, "mlp": 86016.0,
        "last_keep": 72192.0, "logits_trans": 32000.0, "pair": 0.0, "pair_bwd": 0.0}
    assert terms(ModelSpec.from_preset("demo"), ClusterSpec.cpu_gloo(4), lay) == {
        "full": 6852.0, "ckpt": 256.0, "emb": 256.0, "work": 1664.0, "ws": 512, "mlp": 3520.0,
        "last_keep": 1538.0, "logits_trans": 1536.0, "pair": 16.0, "pair_bwd": 16.0}
    # unset is the cluster's choice spelled out
    for preset in ("demo", "llama2-70b"):
        model = ModelSpec.from_preset(preset)
        for lay in LAYOUTS:
            assert terms(model, GPU, lay) == terms(model, GPU, lay, layer_kernels="te", fused_swiglu=True,
                                                   fused_rope=True)
            assert terms(model, CPU, lay) == terms(model, CPU, lay, **AS_ON_THE_CPU)


@pytest.mark.parametrize("layers", ["te", "local"])
def test_fusion_flags_move_exactly_the_mlp_and_rope_terms(layers):
    model = ModelSpec.from_preset("llama2-7b")
    e, f, d = model.activation_bytes, model.ffn_hidden_size, model.head_dim
    for lay in LAYOUTS:
        base = terms(model, GPU, lay, layer_kernels=layers, fused_swiglu=True, fused_rope=True)
        swiglu = terms(model, GPU, lay, layer_kernels=layers, fused_swiglu=False, fused_rope=True)
        rope = terms(model, GPU, lay, layer_kernels=layers, fused_swiglu=True, fused_rope=False)
        # unfused SwiGLU keeps 5f per row where the fused one keeps 3f (per TP rank)
        assert swiglu["mlp"] - base["mlp"] == swiglu["full"] - base["full"] == 2 * f * e / lay.tp
        # unfused RoPE keeps cos and sin for q and k: 4d per row, shared by the heads
        assert rope["full"] - base["full"] == 4 * d * e and rope["mlp"] == base["mlp"]
        for other in set(base) - {"full", "mlp"}:
            assert swiglu[other] == base[other] and rope[other] == base[other], other
    # a GELU model has no SwiGLU to fuse
    gelu = ModelSpec.from_preset("gpt-1.3b")
    assert terms(gelu, GPU, Layout(1, 1, 1), fused_swiglu=False) == terms(gelu, GPU, Layout(1, 1, 1))


def _args(extra=()):
    from megatron.training.arguments import parse_args

    return parse_args(TINY_MODEL + ["--micro-batch-size", "1", "--global-batch-size", "4", "--train-iters", "1",
                                    "--data-path", "unused", "--dcp", "--dcp-global-batch-tokens", "1024", *extra],
                      world_size=1)


def _kernels(args, **machine):
    from megatron.training.flags.model_flags import Machine
    from megatron.training.adaptive.run_config import AdaptiveRunConfig

    m = AdaptiveRunConfig.from_args(args, on_cpu=False, machine=Machine(**machine)).model
    return m.layer_kernels, m.fused_swiglu, m.fused_rope


def test_run_config_records_the_kernels_the_engine_builds():
    args = _args()
    assert _kernels(args, cuda=True, te=False) == ("local", True, False)  # fused SwiGLU is jit, RoPE's is TE's
    assert _kernels(args, cuda=True, te=True) == ("te", True, True)
    assert _kernels(args, cuda=False, te=False) == ("local", False, False)
    # the flags that change them, through model_flags' rules
    assert _kernels(_args(["--no-bias-swiglu-fusion", "--no-rope-fusion"]), cuda=True, te=True) == ("te", False, False)
    assert _kernels(_args(["--attention-backend", "local"]), cuda=True, te=True) == ("local", True, False)
    assert _kernels(_args(["--transformer-impl", "local"]), cuda=True, te=True) == ("local", True, False)


def test_a_gpu_run_without_te_is_priced_with_its_document_attention():
    from megatron.training.flags.model_flags import Machine
    from megatron.training.adaptive.run_config import AdaptiveRunConfig

    args = _args()
    without = AdaptiveRunConfig.from_args(args, on_cpu=False, machine=Machine(cuda=True, te=False)).model
    with_te = AdaptiveRunConfig.from_args(args, on_cpu=False, machine=Machine(cuda=True, te=True)).model
    assert CostModel(without, GPU).quadratic(Layout(1, 1, 1))  # --dcp-cpu-attention math, the default
    assert not CostModel(with_te, GPU).quadratic(Layout(1, 1, 1))
    flash = AdaptiveRunConfig.from_args(_args(["--dcp-cpu-attention", "flash"]), on_cpu=False,
                                        machine=Machine(cuda=True, te=False)).model
    assert not CostModel(flash, GPU).quadratic(Layout(1, 1, 1)) and CostModel(flash, GPU).quadratic(Layout(1, 2, 1))


def test_json_round_trip_and_one_line_errors():
    model = ModelSpec.from_preset("llama2-7b")
    assert not {"layer_kernels", "fused_swiglu", "fused_rope"} & set(model.to_json())  # unset: as before
    assert ModelSpec.from_json(model.to_json()) == model
    te = dict(layer_kernels="te", fused_swiglu=True, fused_rope=True)
    for kernels in (AS_ON_THE_CPU, te, dict(fused_rope=False)):
        spec = model.with_(**kernels)
        d = spec.to_json()
        assert {k: d[k] for k in kernels} == kernels
        assert ModelSpec.from_json(d) == spec
    bad = [("layer_kernels", "flash", 'layer_kernels must be "te" or "local" (got \'flash\')'),
           ("layer_kernels", None, 'layer_kernels must be "te" or "local" (got null)'),
           ("fused_swiglu", 1, "fused_swiglu must be true or false (got 1)"),
           ("fused_rope", "yes", "fused_rope must be true or false (got 'yes')")]
    for key, value, message in bad:
        with pytest.raises(SpecError) as err:
            ModelSpec.from_json({**model.to_json(), key: value})
        assert str(err.value).startswith(message) and "\n" not in str(err.value)
