"""tools/convert_dcp_checkpoint.py: a --dcp checkpoint exported as a plain Megatron TP/PP
checkpoint is the same model, and the static path loads it.

One short adaptive run (2 ranks) saves a checkpoint whose vocabulary padding (384 rows:
256 ids, divisible-by 96, every TP the planner may choose on 2 ranks: {1, 2}) differs from
what the static path pads to at TP1 (288), so the export must carry the padding. It is exported at TP2 and at PP2 (tied
embeddings: the last stage holds the output copy). Then:
- a reference process builds the full TP1/PP1 model, fills it from the checkpoint's
  canonical tensors directly (no converter code), and computes the static path's first
  global batch's per-token loss; it also loads each export back at TP1 through
  megatron-core's own resharding and compares every weight with the canonical tensor,
  bit for bit;
- `pretrain_gpt_dcp.py --load EXPORT --finetune` (static, TP2 / PP2) logs an iteration-1
  loss equal to the reference within 1e-5 (the loss is computed before the update);
- the reference's loss from the random init differs, so a converter that wrote the wrong
  weights could not pass; bad requests end with one `error:` line.
"""
import os

import pytest

from tests.conftest import TINY_MODEL
from tests.support.helpers import read_loss_log, run_ranks, run_tool
from tests.support.helpers import assert_one_line_error

pytestmark = pytest.mark.dist

TOOL = "tools/convert_dcp_checkpoint.py"
PAD = ["--make-vocab-size-divisible-by", "96"]  # 256 ids -> 288 rows at TP1, 384 at TP2 (and under --dcp)
STATIC = ["--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "1",
          "--reset-attention-mask", "--reset-position-ids"]


def convert(*flags, timeout=600):
    return run_tool(TOOL, list(flags), timeout=timeout)


def vocab_flag(stdout: str) -> list[str]:
    """The `--make-vocab-size-divisible-by D` the converter says the static path needs."""
    words = stdout.split()
    if "--make-vocab-size-divisible-by" not in words:
        return []
    i = words.index("--make-vocab-size-divisible-by")
    return words[i : i + 2]


@pytest.fixture(scope="module")
def exported(text_corpus, tmp_path_factory):
    root = tmp_path_factory.mktemp("convert")
    data = ["--data-path", text_corpus, "--data-cache-path", str(root / "cache")]
    dcp = str(root / "dcp")
    r = run_ranks(2, TINY_MODEL + PAD + data + ["--dcp", "--dcp-global-batch-tokens", "512", "--dcp-recalibration", "off", "--train-iters", "3",
                                                "--save", dcp])
    assert r.returncode == 0, r.stderr[-3000:]
    exports = {}
    for name, tp, pp in (("tp2", 2, 1), ("pp2", 1, 2)):
        out = str(root / name)
        r = convert("--load", dcp, "--save", out, "--tensor-model-parallel-size", str(tp),
                    "--pipeline-model-parallel-size", str(pp))
        assert r.returncode == 0, r.stderr[-3000:]
        exports[name] = (out, tp, pp, vocab_flag(r.stdout))
    return root, data, dcp, exports


def _reference(rank, world, flags, dcp_dir, export_dirs):
    """Full TP1/PP1 model from the canonical tensors; loss on the static path's first batch;
    each export reloaded at TP1 compared weight by weight."""
    from functools import partial

    import torch
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    import pretrain_gpt_dcp as entry
    from megatron.training import global_vars
    from megatron.training.arguments import parse_args
    from megatron.training.flags.records import packing_for
    from megatron.training.loop.batches import collate_fixed_length
    from megatron.training.checkpoint.protocol import checkpoint_dir, read_tracker
    from megatron.training.checkpoint.checkpointing_adaptive import tensor_key
    from megatron.training.initialize import set_random_seed
    from megatron.training.flags.core_configs import transformer_config_from_args
    from megatron.training.static.training_static import micro_batches

    args = parse_args(flags, world_size=1)
    global_vars.set_args(args)
    global_vars.build_tokenizer(args)
    parallel_state.initialize_model_parallel(1, 1)
    set_random_seed(args.seed)

    def build():
        return entry.model_provider(transformer_config_from_args(args))

    path = checkpoint_dir(dcp_dir, read_tracker(dcp_dir))
    common = dist_checkpointing.load_common_state_dict(path)
    request = {n: ShardedTensor.from_rank_offsets(tensor_key(common, "param", n), torch.empty(s), replica_id=0)
               for n, s in common["canonical"]}
    canonical = {n: v for n, v in dist_checkpointing.load(request, path).items() if n in request}  # less common.pt

    train_ds, _, _ = entry.train_valid_test_datasets_provider(args)
    batches = list(micro_batches(train_ds, 0, args.micro_batch_size, 0, 1,
                                 partial(collate_fixed_length, packing=packing_for(args)), args.global_batch_size))

    def loss_of(model):
        total, tokens = 0.0, 0.0
        with torch.no_grad():
            for b in batches:
                output, loss_fn = entry.forward_step(iter([b]), model)
                loss_sum, n, _ = loss_fn(output)
                total, tokens = total + float(loss_sum), tokens + float(n)
        return total / tokens

    model = build()
    init_loss = loss_of(model)
    names = {n for n, _ in model.named_parameters()}
    assert names == set(canonical), sorted(names ^ set(canonical))
    model.load_state_dict(canonical, strict=False)
    loaded_loss = loss_of(model)

    mismatched = {}
    for export in export_dirs:
        fresh = build()
        sd = dist_checkpointing.load(fresh.sharded_state_dict(), checkpoint_dir(export, read_tracker(export)))
        fresh.load_state_dict(sd, strict=False)
        bad = [n for n, p in fresh.named_parameters() if not torch.equal(p.detach(), canonical[n])]
        mismatched[export] = bad
    return {"init": init_loss, "loaded": loaded_loss, "mismatched": mismatched,
            "padded": args.padded_vocab_size, "rows": dict(common["canonical"])["embedding.word_embeddings.weight"][0]}


@pytest.fixture(scope="module")
def reference(exported):
    root, data, dcp, exports = exported
    # the reference is a TP1 model: with the export's flag it pads as the checkpoint does
    flags = TINY_MODEL + exports["pp2"][3] + data + STATIC
    return run_ranks(1, fn=_reference, args=(flags, dcp, [e[0] for e in exports.values()]))[0]


def test_export_layout_is_megatrons(exported):
    _, _, _, exports = exported
    for out, _, _, _ in exports.values():
        assert open(os.path.join(out, "latest_checkpointed_iteration.txt")).read().strip() == "3"
        assert os.path.isfile(os.path.join(out, "iter_0000003", "metadata.json"))
        assert not [n for n in os.listdir(out) if n.endswith(".incomplete")]


def test_export_reloads_bit_identical_to_canonical(reference, exported):
    assert reference["rows"] == reference["padded"] == 384
    for export, bad in reference["mismatched"].items():
        assert bad == [], f"{export}: weights differ from the checkpoint's canonical tensors: {bad}"


def test_export_keeps_the_vocabulary_padding(exported):
    _, _, _, exports = exported
    # at TP1 the static path pads 256 ids to 288 with divisible-by 96: the export says 384
    assert exports["pp2"][3] == ["--make-vocab-size-divisible-by", "384"]
    assert exports["tp2"][3] == []  # TP2 pads to 384 already


@pytest.mark.parametrize("name", ["tp2", "pp2"])
def test_static_path_loads_export_with_the_same_loss(exported, reference, name, tmp_path):
    root, data, _, exports = exported
    out, tp, pp, vflag = exports[name]
    assert abs(reference["loaded"] - reference["init"]) > 1e-2  # the weights matter to this loss
    log = str(tmp_path / "static.jsonl")
    r = run_ranks(tp * pp, TINY_MODEL + PAD + vflag + data + STATIC +
                           ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
                            "--load", out, "--finetune", "--loss-log", log])
    assert r.returncode == 0, r.stderr[-3000:]
    got = read_loss_log(log)
    assert [x["iteration"] for x in got] == [1]
    assert got[0]["lm loss"] == pytest.approx(reference["loaded"], abs=1e-5), (got[0], reference)


def test_bad_requests_end_with_one_line(exported, tmp_path):
    root, _, dcp, exports = exported
    tracker = os.path.join(dcp, "latest_checkpointed_iteration.txt")
    before = open(tracker).read()
    out = str(tmp_path / "out")
    r = convert("--load", str(tmp_path / "nowhere"), "--save", out)
    assert_one_line_error(r, "no such directory")
    r = convert("--load", dcp, "--save", out, "--iteration", "2")
    assert_one_line_error(r, "iter_0000002")
    r = convert("--load", exports["tp2"][0], "--save", out)
    assert_one_line_error(r, "not an adaptive-runtime (--dcp) checkpoint")
    r = convert("--load", dcp, "--save", out, "--tensor-model-parallel-size", "3")
    assert_one_line_error(r, "not divisible by --tensor-model-parallel-size 3")
    assert r.returncode == 2
    r = convert("--load", dcp, "--save", dcp)
    assert_one_line_error(r, "--save must differ from --load")
    # flags that describe another model: found by the ranks, still one line
    r = convert("--load", dcp, "--save", out, "--num-layers", "2")
    assert_one_line_error(r, "do not describe the checkpoint's model")
    assert not os.path.exists(os.path.join(out, "latest_checkpointed_iteration.txt"))
    assert open(tracker).read() == before
