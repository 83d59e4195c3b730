"""Upstream Megatron's model, kernel and precision flags (megatron/training/flags/model_flags.py).

Each honoured flag changes what it should in the built config and model; the llama launch
line's model trains on 2 CPU ranks on both paths, and one --dcp runtime step of it under a
TP2 replica equals a single-process reference of the same model; fp8 and other requests this
machine cannot meet are one line; --sequence-parallel at TP1 is warned off, as upstream.
"""
import math
import re

import pytest

from tests.conftest import TINY_MODEL
from tests.support.helpers import read_loss_log, run_ranks
from tests.support.helpers import assert_one_line_error

# the llama line's model flags (examples/llama/train_llama3_8b_h100_fp8.sh), at tiny sizes;
# kv-channels 32 with hidden 64 / 4 heads: the head dim is not hidden/heads
LLAMA = ["--use-mcore-models", "--group-query-attention", "--num-query-groups", "2", "--kv-channels", "32",
         "--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--rotary-base", "1000000",
         "--rotary-percent", "1.0", "--untie-embeddings-and-output-weights", "--disable-bias-linear",
         "--apply-layernorm-1p", "--attention-backend", "fused", "--cross-entropy-loss-fusion",
         "--calculate-per-token-loss", "--no-gradient-accumulation-fusion", "--init-model-with-meta-device",
         "--no-check-for-nan-in-loss-and-grad", "--sequence-parallel"]
BATCH = ["--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "1"]
SP_WARNING = "disabling --sequence-parallel because --tensor-model-parallel-size is 1"


def _args(extra, world_size=1):
    from megatron.training.arguments import parse_args

    return parse_args(TINY_MODEL + BATCH + ["--data-path", "unused"] + extra, world_size=world_size)


def _config(extra, machine=None, world_size=1, **overrides):
    """The built TransformerConfig on this machine; with `machine`, the fields for that one
    (a TransformerConfig checks its kernels against the machine it is built on)."""
    from types import SimpleNamespace

    from megatron.training.flags.model_flags import config_fields
    from megatron.training.flags.core_configs import transformer_config_from_args

    args = _args(extra, world_size)
    if machine is None:
        return transformer_config_from_args(args, **overrides)
    return SimpleNamespace(**config_fields(args, machine))


def test_flags_reach_the_config():
    plain = _config([])
    assert not plain.layernorm_zero_centered_gamma and not plain.qk_layernorm
    assert plain.cross_entropy_loss_fusion is False  # upstream default on the static path: the unfused loss
    got = _config(["--apply-layernorm-1p", "--qk-layernorm", "--cross-entropy-loss-fusion"])
    assert got.layernorm_zero_centered_gamma and got.qk_layernorm
    assert got.cross_entropy_loss_fusion and got.cross_entropy_fusion_impl == "native"
    # --dcp: the only loss that takes the replica's TP group, flag or not
    assert _config(["--dcp", "--dcp-global-batch-tokens", "1024"]).cross_entropy_loss_fusion
    # the loss rule is per token over the global batch either way (docs/contracts.md)
    assert plain.calculate_per_token_loss and got.calculate_per_token_loss


def test_sequence_parallel_at_tp1_is_turned_off_with_one_warning(capsys):
    assert _args(["--sequence-parallel"]).sequence_parallel is False
    assert capsys.readouterr().out.count(SP_WARNING) == 1
    assert _args(["--sequence-parallel", "--tensor-model-parallel-size", "2"], world_size=2).sequence_parallel


def test_gpu_machine_honours_attention_fusion_and_fp8_flags():
    from megatron.core.transformer.enums import AttnBackend

    from megatron.training.flags.model_flags import Machine, config_fields

    h100 = Machine(cuda=True, te=True, capability=(9, 0), flash_attn=True)
    c = _config(["--attention-backend", "fused"], h100)
    assert c.attention_backend == AttnBackend.fused
    assert c.bias_activation_fusion and c.bias_dropout_fusion and c.apply_rope_fusion and c.gradient_accumulation_fusion
    assert _config(["--use-flash-attn"], h100).attention_backend == AttnBackend.flash
    off = _config(["--no-bias-swiglu-fusion", "--no-bias-dropout-fusion", "--no-rope-fusion",
                   "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion"], h100)
    assert not (off.bias_activation_fusion or off.bias_dropout_fusion or off.apply_rope_fusion
                or off.gradient_accumulation_fusion or off.masked_softmax_fusion)
    # the --dcp runtime accumulates its own fp32 main grads
    assert not _config(["--dcp", "--dcp-global-batch-tokens", "1024"], h100).gradient_accumulation_fusion
    # fp8 (refused on this CPU at parse time, so set after parsing as an FP8 GPU would keep them)
    args = _args(["--fp8-amax-history-len", "1024", "--fp8-amax-compute-algo", "max", "--fp8-margin", "1",
                  "--use-distributed-optimizer"])
    args.fp8_format, args.fp8_param_gather = "hybrid", True
    fp8 = config_fields(args, h100)
    assert (fp8["fp8"], fp8["fp8_amax_history_len"], fp8["fp8_amax_compute_algo"], fp8["fp8_margin"],
            fp8["fp8_recipe"], fp8["fp8_param"]) == ("hybrid", 1024, "max", 1, "delayed", True)
    # this CPU: no fused kernels, TE attention not used
    cpu = _config(["--attention-backend", "fused"], Machine(cuda=False, te=False))
    assert cpu.attention_backend == AttnBackend.auto
    assert not (cpu.bias_activation_fusion or cpu.apply_rope_fusion or cpu.gradient_accumulation_fusion)
    assert not hasattr(cpu, "fp8")  # no fp8 field without --fp8-format


def test_fp8_problems_per_machine():
    from megatron.training.flags.model_flags import Machine, fp8_problem

    args = _args([])
    args.fp8_format = "hybrid"
    assert fp8_problem(args, Machine(cuda=True, te=True, capability=(9, 0))) is None
    assert "8.9+" in fp8_problem(args, Machine(cuda=True, te=True, capability=(8, 0)))
    assert "transformer-engine" in fp8_problem(args, Machine(cuda=True, te=False, capability=(9, 0)))
    assert "none" in fp8_problem(args, Machine(cuda=False, te=False))
    args.fp8_recipe = "mxfp8"
    assert "10.0+" in fp8_problem(args, Machine(cuda=True, te=True, capability=(9, 0)))
    args.fp8_recipe, args.dcp = "delayed", True
    assert "--dcp" in fp8_problem(args, Machine(cuda=True, te=True, capability=(9, 0)))


def _model_worker(rank, world, extra):
    import torch
    from megatron.core import parallel_state

    from dcp_ext.runtime.stages.model import build_gpt_model
    from megatron.training.flags.core_configs import transformer_config_from_args

    parallel_state.initialize_model_parallel(1, 1)
    args = _args(extra)
    config = transformer_config_from_args(args)
    model = build_gpt_model(config, 256, args.max_position_embeddings, True, True,
                            position_embedding_type="rope", rotary_percent=args.rotary_percent)
    layer = model.decoder.layers[0]
    attn = layer.self_attention
    norm = layer.input_layernorm
    x = torch.randn(3, 64)
    with torch.no_grad():
        at_init = norm(x)
        norm.weight.fill_(0.5)
        at_half = norm(x)
    plain = torch.nn.functional.rms_norm(x, (64,), eps=args.norm_epsilon)
    out = {
        "rotary_dim": 2 * model.rotary_pos_emb.inv_freq.numel(),
        "qkv": list(attn.linear_qkv.weight.shape),
        "proj": list(attn.linear_proj.weight.shape),
        "q_norm": list(attn.q_layernorm.weight.shape) if hasattr(attn.q_layernorm, "weight") else None,
        "k_norm": list(attn.k_layernorm.weight.shape) if hasattr(attn.k_layernorm, "weight") else None,
        "init_is_plain": float((at_init - plain).abs().max()),
        "half_is_1p5": float((at_half - 1.5 * plain).abs().max()),
    }
    with torch.no_grad():
        fresh = build_gpt_model(config, 256, args.max_position_embeddings, True, True, position_embedding_type="rope")
    out["norm_init"] = [float(fresh.decoder.layers[0].input_layernorm.weight.abs().max()),
                        float(fresh.decoder.final_layernorm.weight.abs().max())]
    parallel_state.destroy_model_parallel()
    return out


@pytest.mark.dist
def test_model_shape_flags():
    base = ["--kv-channels", "32"]
    plain = run_ranks(1, fn=_model_worker, args=(base,))[0]
    shaped_flags = base + ["--rotary-percent", "0.5", "--qk-layernorm", "--apply-layernorm-1p"]
    shaped = run_ranks(1, fn=_model_worker, args=(shaped_flags,))[0]
    # GQA with a head dim of 32 (not 64/4): 4 query heads + 2 x 2 key/value groups
    assert plain["qkv"] == shaped["qkv"] == [(4 + 2 * 2) * 32, 64]
    assert plain["proj"] == [64, 4 * 32]
    assert plain["rotary_dim"] == 32 and shaped["rotary_dim"] == 16
    assert plain["q_norm"] is None and shaped["q_norm"] == shaped["k_norm"] == [32]
    # zero-centred gamma: weights start at 0 and scale by (1 + weight)
    assert shaped["norm_init"] == [0.0, 0.0] and plain["norm_init"] == [1.0, 1.0]
    assert shaped["init_is_plain"] < 1e-6 and shaped["half_is_1p5"] < 1e-5
    assert plain["half_is_1p5"] > 0.1  # a plain norm scales by its weight (0.5)


def test_engine_initialises_zero_centred_norms_at_zero():
    from dcp_ext.runtime.params.initial_values import init_values

    name = "decoder.layers.self_attention.linear_qkv.layer_norm_weight"
    assert float(init_values(name, 0, 8, 1, 0.02, 4).min()) == 1.0
    assert float(init_values(name, 0, 8, 1, 0.02, 4, norm_init=0.0).abs().max()) == 0.0


def _llama_step_worker(rank, world):
    """One runtime step of the llama model under a TP2 replica vs one process, plain torch."""
    import torch

    from dcp_ext.data.thd import build_micro_batch
    from dcp_ext.runtime.stages.model import build_gpt_model
    from dcp_ext.runtime.engine import AdaptiveEngine
    from dcp_ext.runtime.options import EngineOptions
    from dcp_ext.runtime.params.sharded_optimizer import OptimizerOptions
    from dcp_ext.planning.layout import ReplicaType
    from megatron.training.arguments import parse_args
    from megatron.training.flags.core_configs import transformer_config_from_args
    from tests.support.runtime_helpers import RUNTIME_MODEL, engine_step, loss_tokens, plan_for, random_docs

    flags = RUNTIME_MODEL + ["--kv-channels", "16", "--rotary-percent", "0.5", "--qk-layernorm",
                             "--apply-layernorm-1p", "--untie-embeddings-and-output-weights", "--rotary-base", "1000000"]
    args = parse_args(flags, world_size=world)

    def make_config(tp, cp, pp, sp):
        return transformer_config_from_args(args, tensor_model_parallel_size=tp, context_parallel_size=cp,
                                            pipeline_model_parallel_size=pp, sequence_parallel=sp)

    def build(config, pre, post, pg):
        return build_gpt_model(config, 256, args.max_position_embeddings, pre, post, pg_collection=pg,
                               position_embedding_type="rope", share_embeddings_and_output_weights=False,
                               rotary_base=args.rotary_base, rotary_percent=args.rotary_percent)

    layout = [([0, 1], 2, 1, 1, 2)]
    engine = AdaptiveEngine([ReplicaType(2, 1, 1, (0, 1))], make_config, build, EngineOptions(
        OptimizerOptions(lr=args.lr, weight_decay=args.weight_decay, eps=args.adam_eps, clip_grad=args.clip_grad),
        sequence_parallel=True))
    init = engine.gather_canonical()
    docs = random_docs(8, seed=3)
    got = engine_step(engine, plan_for(0, layout, len(docs)), docs)
    ref = build(make_config(1, 1, 1, False), True, True, engine.registry.single_rank_collection())
    with torch.no_grad():
        for name, p in ref.named_parameters():
            t = engine.space.tensors[name]
            p.copy_(init[t.offset : t.offset + t.numel].view(p.shape))
    n, total = loss_tokens(docs), 0.0
    for d in docs:
        b = build_micro_batch([d])
        out = ref(b.tokens[None], b.position_ids[None], None, labels=b.labels[None],
                  packed_seq_params=b.packed_seq_params())
        loss = (out * b.loss_mask[None]).sum()
        (loss / n).backward()
        total += float(loss.detach())
    norm = math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in ref.parameters()))
    qnorm = [p for name, p in ref.named_parameters() if "q_layernorm" in name][0]
    return {"loss": got.loss, "ref_loss": total / n, "norm": got.grad_norm, "ref_norm": norm,
            "norms_zero": float(max(init[t.offset : t.offset + t.numel].abs().max() for name, t in
                                    engine.space.tensors.items() if "norm" in name)),
            "qnorm_grad": float(qnorm.grad.abs().max())}


@pytest.mark.dist
def test_llama_model_runtime_step_matches_single_process():
    for r in run_ranks(2, fn=_llama_step_worker):
        assert r["norms_zero"] == 0.0, "zero-centred norms must start at 0 in the runtime's initial model"
        assert r["qnorm_grad"] > 0  # the q norm is in the graph
        assert r["loss"] == pytest.approx(r["ref_loss"], rel=1e-5), r
        # q/k norm gradients are partial per TP rank (each holds its own heads): summed, they match
        assert r["norm"] == pytest.approx(r["ref_norm"], rel=1e-4), r


def _iteration_losses(stdout):
    return [float(x) for x in re.findall(r"lm loss: ([0-9.E+-]+)", stdout)]


@pytest.mark.dist
@pytest.mark.parametrize("path", ["static", "dcp"])
def test_llama_line_trains_on_two_ranks(path, text_corpus, tmp_path):
    extra = ["--dcp", "--dcp-global-batch-tokens", "1024"] if path == "dcp" else []
    log = str(tmp_path / "loss.jsonl")
    r = run_ranks(2, TINY_MODEL + LLAMA + ["--bf16", "--data-path", text_corpus,
                                           "--data-cache-path", str(tmp_path / "c"),
                                           "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "8",
                                           "--lr", "3e-3", "--loss-log", log] + extra)
    assert r.returncode == 0, r.stderr[-3000:]
    # upstream's rule: --sequence-parallel at TP1 is turned off with one warning (rank 0 only)
    assert r.stdout.count(SP_WARNING) == 1, r.stdout[-3000:]
    assert "--attention-backend fused needs transformer-engine" in r.stdout
    losses = [x["lm loss"] for x in read_loss_log(log)]
    assert len(losses) == 8 and all(math.isfinite(x) for x in losses)
    assert sum(losses[-2:]) / 2 < sum(losses[:2]) / 2 - 0.2, losses  # it learns


@pytest.mark.dist
def test_bf16_layernorm_tp2_with_zero_centred_and_qk_norms(text_corpus, tmp_path):
    """The mixed-dtype LayerNorm traceback of the issue: --bf16, LayerNorm with biases, TP2 + SP."""
    model = [f for f in TINY_MODEL if f not in ("RMSNorm", "--normalization", "--disable-bias-linear")]
    r = run_ranks(2, model + ["--normalization", "LayerNorm", "--bf16", "--apply-layernorm-1p", "--qk-layernorm",
                              "--tensor-model-parallel-size", "2", "--sequence-parallel", "--data-path", text_corpus,
                              "--data-cache-path", str(tmp_path / "c")] + ["--micro-batch-size", "2",
                              "--global-batch-size", "4", "--train-iters", "2"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    losses = _iteration_losses(r.stdout)
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)
    assert SP_WARNING not in r.stdout  # TP2 keeps sequence parallelism


@pytest.mark.dist
@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="what a CPU-only machine says")
@pytest.mark.parametrize("flags,needle", [
    (["--fp8-format", "hybrid"], "--fp8-format hybrid needs transformer-engine on a GPU with FP8 (compute "
                                 "capability 8.9+); this machine has none: drop the fp8 flags"),
    (["--fp8-param-gather"], "--fp8-param-gather needs --fp8-format"),
    (["--cross-entropy-loss-fusion", "--cross-entropy-fusion-impl", "te"], "use --cross-entropy-fusion-impl native"),
    (["--rotary-percent", "0"], "--rotary-percent 0 must be in (0, 1]"),
])
def test_requests_this_machine_cannot_meet_are_one_line(flags, needle, text_corpus):
    r = run_ranks(1, TINY_MODEL + BATCH + ["--data-path", text_corpus] + flags)
    assert_one_line_error(r, needle)
    assert r.returncode == 2
