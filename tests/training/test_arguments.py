"""Megatron-compatible flags: derived values, YAML, and one clear error per invalid combination."""
import pytest

from megatron.training.arguments import ArgumentError, parse_args

BASE = [
    "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "8", "--seq-length", "128",
    "--train-iters", "10", "--lr", "1e-3", "--data-path", "/data/x_text_document",
    "--micro-batch-size", "2", "--global-batch-size", "16",
]


def test_defaults_and_derived_values_follow_megatron():
    args = parse_args(BASE, world_size=4)
    assert args.data_parallel_size == 4
    assert args.num_microbatches == 2  # 16 / (2 * 4)
    assert args.ffn_hidden_size == 256  # 4h
    assert args.kv_channels == 8
    assert args.num_query_groups == 8  # no GQA -> one group per head
    assert args.max_position_embeddings == 128
    assert args.lr_decay_iters == 10
    assert args.distributed_backend in ("gloo", "nccl")


def test_swiglu_ffn_size_keeps_parameter_count_like_megatron():
    args = parse_args(BASE + ["--swiglu", "--hidden-size", "192", "--num-attention-heads", "8"], world_size=1)
    assert args.ffn_hidden_size == 512  # int(4*192*2/3 / 64) * 64


def test_yaml_keys_are_flag_names_and_command_line_wins(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("num-layers: 6\nhidden_size: 96\nnum-attention-heads: 4\nseq-length: 64\n"
                   "train-iters: 3\nlr: 0.01\ndata-path: /d/p_text_document\n")
    args = parse_args(["--yaml-cfg", str(cfg), "--num-layers", "2"], world_size=1)
    assert args.num_layers == 2 and args.hidden_size == 96 and args.data_path == ["/d/p_text_document"]


@pytest.mark.parametrize(
    "extra,world,needle",
    [
        (["--tensor-model-parallel-size", "3"], 4, "world size 4 is not divisible by tp*pp*cp"),
        (["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--context-parallel-size", "2"],
         4, "not divisible by tp*pp*cp"),
        (["--tensor-model-parallel-size", "16"], 16, "--num-attention-heads 8 is not divisible by --tensor-model-parallel-size 16"),
        (["--num-query-groups", "2", "--tensor-model-parallel-size", "4"], 4,
         "--num-query-groups 2 is not divisible by --tensor-model-parallel-size 4"),
        (["--context-parallel-size", "2", "--seq-length", "130"], 2, "multiple of 2*context-parallel-size = 4"),
        (["--global-batch-size", "12"], 4, "--global-batch-size 12 is not divisible by micro-batch-size x data-parallel-size"),
        (["--pipeline-model-parallel-size", "3"], 3, "--num-layers 4 is not divisible by --pipeline-model-parallel-size 3"),
        (["--no-such-flag"], 1, "unknown flag --no-such-flag"),
        (["--dcp", "--dcp-global-batch-tokens", "0"], 1, "--dcp-global-batch-tokens 0 must be >= 1"),
        (["--ckpt-format", "torch"], 1, "this fork writes and reads torch_dist"),
        (["--bf16", "--fp16"], 1, "mutually exclusive"),
        (["--lr-warmup-iters", "10"], 1, "--lr-warmup-iters 10 must be smaller than --lr-decay-iters 10"),
        (["--tensorboard-log-interval", "0"], 1, "--tensorboard-log-interval and --tensorboard-queue-size must be > 0"),
    ],
)
def test_invalid_combinations_give_one_line_naming_the_fix(extra, world, needle):
    with pytest.raises(ArgumentError) as e:
        parse_args(BASE + extra, world_size=world)
    message = str(e.value)
    assert needle in message
    assert "\n" not in message


def test_missing_required_flag_and_data_path():
    with pytest.raises(ArgumentError, match="--lr is required"):
        parse_args([a for a in BASE if a not in ("--lr", "1e-3")], world_size=1)
    no_data = BASE[: BASE.index("--data-path")] + BASE[BASE.index("--data-path") + 2 :]
    with pytest.raises(ArgumentError, match="--data-path is required"):
        parse_args(no_data, world_size=1)


def test_yaml_unknown_key_and_bad_file(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("num-layerz: 6\n")
    with pytest.raises(ArgumentError, match="unknown key 'num-layerz'"):
        parse_args(["--yaml-cfg", str(cfg)] + BASE, world_size=1)
    with pytest.raises(ArgumentError, match="no such file"):
        parse_args(["--yaml-cfg", str(tmp_path / "missing.yaml")] + BASE, world_size=1)
    cfg.write_text("a: [unclosed\n")
    with pytest.raises(ArgumentError, match="not valid YAML"):
        parse_args(["--yaml-cfg", str(cfg)] + BASE, world_size=1)


@pytest.mark.parametrize(
    "extra,needle",
    [
        (["--lr", "-1e-3"], "--lr -0.001 must be >= 0"),  # argparse alone read "-1e-3" as a flag
        (["--lr", "-.5"], "--lr -0.5 must be >= 0"),
        (["--lr", "inf"], "--lr inf is not a finite number"),
        (["--min-lr", "0.5"], "--min-lr 0.5 is above --lr 0.001"),
        (["--adam-beta1", "1"], "--adam-beta1 1 must be in [0, 1)"),
        (["--micro-batch-size", "0"], "--micro-batch-size 0 must be >= 1"),
        (["--num-attention-heads", "0"], "--num-attention-heads 0 must be >= 1"),
        (["--global-batch-size", "0"], "--global-batch-size 0 must be >= 1"),
        (["--recompute-granularity", "full", "--recompute-method", "block"], "needs --recompute-num-layers"),
        (["--dcp", "--dcp-global-batch-tokens", "512", "--position-embedding-type", "learned_absolute",
          "--dcp-max-seq-len", "256"], "--dcp-max-seq-len 256 exceeds --max-position-embeddings 128"),
        (["--data-path", "nan", "a", "1", "b"], "--data-path weights must be finite numbers > 0"),
        (["--split", "90,-10"], "bad --split"),
        (["--load", __file__], "is a file, not a checkpoint directory"),
    ],
)
def test_ranges_and_relations_are_one_line(extra, needle):
    with pytest.raises(ArgumentError) as e:
        parse_args(BASE + extra, world_size=1)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_negative_numbers_are_values_but_flags_stay_flags():
    assert parse_args(BASE + ["--lr", "1e-3", "--init-method-std", "2e-2"], world_size=1).lr == 1e-3
    with pytest.raises(ArgumentError, match="expected one argument"):
        parse_args(BASE + ["--lr", "--min-lr", "0"], world_size=1)


def test_yaml_types_and_duplicate_keys(tmp_path):
    cfg = tmp_path / "c.yaml"
    for text, needle in (("num-layers: yes\n", "key 'num-layers': expected an integer, got true"),
                         ("lr: off\n", "key 'lr': expected a number, got false"),
                         ("num-layers: 2\nnum-layers: 3\n", "key 'num-layers' appears twice (lines 1 and 2)"),
                         ("num-layers: 2\nnum_layers: 3\n", "key 'num_layers' repeats 'num-layers'"),
                         ("tokenizer-type: yes\n", "expected a string, got true")):
        cfg.write_text(text)
        with pytest.raises(ArgumentError) as e:
            parse_args(["--yaml-cfg", str(cfg)] + BASE, world_size=1)
        assert needle in str(e.value), (text, str(e.value))
    cfg.write_text("use-distributed-optimizer: true\nlr: 2.0e-4\n")
    args = parse_args(["--yaml-cfg", str(cfg)] + [a for a in BASE if a not in ("--lr", "1e-3")], world_size=1)
    assert args.use_distributed_optimizer is True and args.lr == 2e-4


def test_launcher_environment_is_checked():
    from megatron.training.arguments import world_size_from_env

    master = {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
    assert world_size_from_env({}) == 1 and world_size_from_env({"WORLD_SIZE": "8", "RANK": "7", **master}) == 8
    for env, needle in (({"WORLD_SIZE": "x"}, "WORLD_SIZE='x' is not an integer"),
                        ({"WORLD_SIZE": "2", "RANK": "2"}, "RANK=2 is not in [0, WORLD_SIZE=2)"),
                        ({"MASTER_PORT": "0"}, "MASTER_PORT=0 is not a TCP port"),
                        ({"WORLD_SIZE": "2", "MASTER_PORT": "29500"}, "WORLD_SIZE=2 is set but MASTER_ADDR is not"),
                        ({"WORLD_SIZE": "4", "RANK": "1", "MASTER_ADDR": "h"}, "RANK=1 are set but MASTER_PORT is not")):
        with pytest.raises(ArgumentError, match=needle.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
            world_size_from_env(env)


@pytest.mark.parametrize("given", ["dcp", "cp-buckets"])
def test_the_cp_buckets_planner_answers_to_its_old_name_too(given):
    """`--dcp-planner dcp` (the old name) runs the same planner as `cp-buckets` and says so
    at start in one line; the new name says nothing."""
    from dcp_ext.planning.planner import make_planner
    from dcp_ext.planning.specs import ClusterSpec, ModelSpec
    from megatron.training.flags.model_flags import Machine, startup_notes

    args = parse_args(BASE + ["--dcp", "--dcp-planner", given], world_size=4)
    assert args.dcp_planner == "cp-buckets"
    renamed = [n for n in startup_notes(args, Machine.here()) if "cp-buckets" in n]
    assert renamed == (["--dcp-planner dcp is now named cp-buckets (context parallelism per length bucket, NUS "
                        "DCP's scheme); the old name still works"] if given == "dcp" else [])
    p = make_planner(given, ModelSpec.from_preset("demo"), ClusterSpec.cpu_gloo(4), max_seq_len=512,
                     global_batch_tokens=2048, length_sample=[100, 200, 512] * 20)
    assert p.name == "cp-buckets"
