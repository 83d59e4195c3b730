"""The flags become the planner's ModelSpec in one place (`run_config.model_spec_for`, issue 39).

Why it exists: the planning package is pure (no Megatron flags); the door turns the validated
namespace into the planner's view of the model, with the runtime's overlap decision as the one
source of the exchange slots. A llama2-7b line gives the preset's model; GQA, the ffn default,
precision, the CPU attention kernel and the overlap rule follow the flags.
"""
from megatron.training.adaptive.run_config import AdaptiveRunConfig, model_spec_for
from megatron.training.arguments import parse_args
from dcp_ext.planning.specs import ModelSpec

LLAMA2_7B = ["--num-layers", "32", "--hidden-size", "4096", "--num-attention-heads", "32", "--ffn-hidden-size",
             "11008", "--seq-length", "4096", "--max-position-embeddings", "4096", "--swiglu",
             "--untie-embeddings-and-output-weights", "--bf16", "--tokenizer-type", "NullTokenizer",
             "--vocab-size", "31999", "--micro-batch-size", "1", "--train-iters", "1", "--lr", "1e-4", "--mock-data"]
SMALL_GQA = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8", "--group-query-attention",
             "--num-query-groups", "4", "--seq-length", "2048", "--max-position-embeddings", "2048",
             "--tokenizer-type", "NullTokenizer", "--vocab-size", "259", "--micro-batch-size", "1",
             "--train-iters", "1", "--lr", "1e-4", "--mock-data"]


def args_of(flags, **set_):
    args = parse_args(flags, world_size=1)
    for k, v in set_.items():
        setattr(args, k, v)
    return args


def test_a_llama2_7b_line_is_the_preset_model():
    m = model_spec_for(args_of(LLAMA2_7B, padded_vocab_size=32000), name="llama2-7b")
    ref = ModelSpec.from_preset("llama2-7b")
    assert m.num_params == ref.num_params
    assert m.num_query_groups == 32 and m.param_bytes == 2 and m.activation_bytes == 2


def test_gqa_the_ffn_default_and_the_vocabulary_follow_the_flags():
    m = model_spec_for(args_of(SMALL_GQA, padded_vocab_size=None))
    assert m.num_query_groups == 4 and m.ffn_hidden_size == 1024 and m.param_bytes == 4
    assert m.vocab_size == 259  # no padded vocabulary yet: the flag's
    assert model_spec_for(args_of(SMALL_GQA, padded_vocab_size=384)).vocab_size == 384
    assert m.cpu_attention == "math"  # the parser's default
    assert model_spec_for(args_of(SMALL_GQA + ["--dcp-cpu-attention", "flash"])).cpu_attention == "flash"


def test_exchange_slots_follow_the_overlap_the_runtime_decided():
    args = args_of(SMALL_GQA + ["--overlap-grad-reduce"], padded_vocab_size=384)
    assert model_spec_for(args).exchange_slots == 2  # as the flags ask
    assert model_spec_for(args, overlap=False).exchange_slots == 1
    # on CPU ranks the runtime sets the overlap aside: the planner's model says so too
    on_cpu = AdaptiveRunConfig.from_args(args, on_cpu=True, device="meta")
    assert not on_cpu.engine.overlap and on_cpu.model.exchange_slots == 1


def test_the_vocabulary_is_padded_once_for_every_layout_of_a_dcp_run():
    """build_tokenizer is the one place that pads: for --tensor-model-parallel-size on the
    static path (upstream's rule: 259 -> 384 at tp1), for every tp the planner could choose on
    the cluster on --dcp (tp up to 8 divides the 8 heads and 4 groups only up to 4: 259 -> 512);
    the --dcp records then read it, never pad again."""
    from dcp_ext.planning.specs import ClusterSpec
    from megatron.training import global_vars
    from megatron.training.adaptive.run_config import vocab_padding_for

    static = args_of(SMALL_GQA)
    global_vars.build_tokenizer(static)
    assert static.padded_vocab_size == 384
    dcp = args_of(SMALL_GQA + ["--dcp"])
    cluster = ClusterSpec.cpu_gloo(4)
    global_vars.build_tokenizer(dcp, cluster)
    assert dcp.padded_vocab_size == vocab_padding_for(dcp, 259, cluster) == 512
    assert AdaptiveRunConfig.from_args(dcp, on_cpu=True).model.vocab_size == 512
