"""`--dcp` added to an upstream Megatron launch line is enough (the DCP part).

- `--mock-data` trains on both paths (megatron-core's MockGPTDataset on the static one,
  mock documents with the code length distribution's spread under --dcp) and the loss falls;
- the mock documents' lengths have the spread of data/lengths/code_python_cl100k.txt
  (scaled to --seq-length), and are deterministic per seed;
- tokens per global batch default to --global-batch-size x --seq-length;
- the line's static TP/PP/CP layout is in the planner's pool (and said in one line at
  start); --dcp-candidates changes the pool's size;
- the fixed sharding's optimizer makes megatron-core's update: --optimizer sgd (momentum,
  weight decay, no decay of 1-D parameters, clipping), adam betas, and --decoupled-lr /
  --decoupled-min-lr (the embedding's own LR schedule), step for step against the static
  path's megatron-core optimizer on the same batch;
- GPU specs come from the device's name and memory (pure): a table of known kinds, or the
  flags, or one line naming the flag; never the CPU preset.
"""
import os
import re

import numpy as np
import pytest

from tests.conftest import TINY_MODEL
from tests.support.helpers import REPO, read_loss_log, run_ranks


# ----------------------------------------------------------------------------- mock lengths
def test_mock_document_lengths_have_the_code_distributions_spread():
    from dcp_ext.data.mock_documents import length_scale, mock_lengths

    real = np.loadtxt(os.path.join(REPO, "data", "lengths", "code_python_cl100k.txt"), dtype=np.int64)
    for max_len in (128, 4096, 131072):
        got = mock_lengths(20000, max_len, seed=3)
        assert got.min() >= 2 and got.max() <= max_len
        want = np.clip(np.rint(real * length_scale(max_len)), 2, max_len)
        for q in (10, 25, 50, 75):
            a, b = np.percentile(got, q), np.percentile(want, q)
            assert abs(a - b) <= max(2.0, 0.12 * b), (max_len, q, a, b)
        # the share truncated to the maximum is the real one (about a tenth below 9k tokens)
        assert abs(np.mean(got == max_len) - np.mean(want == max_len)) < 0.02, max_len
    short = mock_lengths(20000, 128, seed=3)
    assert np.percentile(short, 90) / np.percentile(short, 10) > 20  # a real spread, not near-constant
    assert np.array_equal(mock_lengths(500, 512, seed=7), mock_lengths(500, 512, seed=7))
    assert not np.array_equal(mock_lengths(500, 512, seed=7), mock_lengths(500, 512, seed=8))


def test_mock_documents_are_deterministic_and_in_the_vocabulary():
    from dcp_ext.data.mock_documents import MockDocumentDataset

    a = MockDocumentDataset(256, vocab_size=256, eod=255, seed=1)
    b = MockDocumentDataset(256, vocab_size=256, eod=255, seed=1)
    for i in (0, 5, 70000):  # past the split's documents: wraps
        x, y = a[i], b[i]
        assert np.array_equal(x, y) and len(x) == a.lengths_of([i])[0]
        assert x[-1] == 255 and x.min() >= 0 and x[:-1].max() < 255
    tokens = np.concatenate([a[i] for i in range(300)])
    counts = np.bincount(tokens, minlength=256)
    assert counts.max() > 10 * np.median(counts[counts > 0])  # Zipfian: something to learn
    assert not np.array_equal(a[3], MockDocumentDataset(256, 256, 255, seed=2)[3])


# ----------------------------------------------------------------------------- flags
def _parse(extra, world=2):
    from megatron.training.arguments import parse_args

    return parse_args(TINY_MODEL + ["--train-iters", "4", "--mock-data"] + extra, world_size=world)


def test_batch_tokens_default_to_global_batch_times_seq_length():
    args = _parse(["--dcp", "--global-batch-size", "6"])
    assert args.dcp_global_batch_tokens == 6 * 128
    args = _parse(["--dcp", "--micro-batch-size", "3"])  # gbs defaults to mbs x dp = 3 x 2
    assert args.dcp_global_batch_tokens == 6 * 128
    assert _parse(["--dcp", "--global-batch-size", "6", "--dcp-global-batch-tokens", "999"]).dcp_global_batch_tokens == 999


def test_planner_pool_holds_the_static_layout_and_follows_dcp_candidates():
    from megatron.training.adaptive import training_adaptive
    from megatron.training.adaptive import run_config
    from megatron.training.adaptive.run_config import AdaptiveRunConfig
    from dcp_ext.data.mock_documents import MockDocumentDataset

    def planner(extra, world=8):
        args = _parse(["--dcp", "--global-batch-size", "64", "--vocab-size", "255"] + extra, world)
        args.padded_vocab_size = 256
        cluster = run_config.cluster_for(world, args)
        ds = MockDocumentDataset(128, 256, 255, args.seed, num_documents=4000)
        config = AdaptiveRunConfig.from_args(args, on_cpu=True, device="meta")
        return config.planner, training_adaptive.build_planner(config.planner, ds.lengths, cluster, config.model)

    sizes = {}
    for tp, pp in ((2, 1), (1, 2), (2, 2)):
        config, p = planner(["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp)])
        assert p.static_entry in p.pool.layouts, (tp, pp, p.describe())
        (lay, count), = p.static_entry
        assert (lay.tp, lay.cp, lay.pp, count) == (tp, 1, pp, 8 // (tp * pp))
        line = training_adaptive.static_layout_line(config, p)
        assert line.startswith(f"dcp: static layout tp={tp} pp={pp} cp=1 is in the candidate pool ("), line
        sizes[tp, pp] = len(p.pool.layouts)
    _, small = planner(["--tensor-model-parallel-size", "2", "--dcp-candidates", "1"])
    assert [small.static_entry] == small.pool.layouts  # a pool of one: the static layout itself
    assert sizes[2, 1] > 1  # the default pool is larger: the flag changed it
    _, static = planner(["--tensor-model-parallel-size", "2", "--dcp-planner", "static"])
    assert {(lay.tp, lay.cp, lay.pp) for lay, _ in static.replicas} == {(2, 1, 1)} and len(static.replicas) == 4


def test_optimizer_flags_the_fixed_sharding_cannot_run_are_refused():
    from megatron.training.flags.argument_checks import check_dcp_optimizer
    from megatron.training.arguments import ArgumentError

    args = _parse(["--dcp"])
    args.optimizer_cpu_offload = True  # as upstream's parser would set it
    with pytest.raises(ArgumentError, match="--optimizer-cpu-offload is not supported with --dcp"):
        check_dcp_optimizer(args)
    args = _parse(["--dcp"])
    args.decoupled_lr, args.decoupled_min_lr = 1e-4, 1e-3
    with pytest.raises(ArgumentError, match="--decoupled-min-lr 0.001 is above --decoupled-lr 0.0001"):
        check_dcp_optimizer(args)


# ----------------------------------------------------------------------------- GPU specs
def test_gpu_spec_from_device_name_and_memory():
    from dcp_ext.planning.gpu_table import UnknownDevice, gpu_kind_for_device
    from dcp_ext.planning.specs import GPU_KINDS, GiB

    cpu = GPU_KINDS["cpu-gloo"]
    for name, tflops in (("NVIDIA B200", 2250), ("NVIDIA GB200", 2500), ("NVIDIA L40S", 362), ("NVIDIA L4", 121),
                         ("NVIDIA H20", 148), ("NVIDIA H200", 989), ("NVIDIA A100-SXM4-80GB", 312),
                         ("NVIDIA A10", 125), ("NVIDIA GeForce RTX 4090", 165), ("NVIDIA H100 PCIe", 756)):
        mem = 44.5 * GiB
        k = gpu_kind_for_device(name, mem)
        assert k.peak_flops == tflops * 1e12, name
        assert k.memory_bytes == mem, name  # the device's own memory, not the table's
        assert k.peak_flops != cpu.peak_flops and k.memory_bytes != cpu.memory_bytes
        assert 0 < k.reserved_bytes < mem / 4
    assert gpu_kind_for_device("NVIDIA H200", 150e9, memory_gb=100).memory_bytes == 100 * GiB
    with pytest.raises(UnknownDevice, match="--dcp-device-tflops"):
        gpu_kind_for_device("NVIDIA Quantum X9", 64 * GiB)
    k = gpu_kind_for_device("NVIDIA Quantum X9", 64 * GiB, tflops=500)
    assert k.peak_flops == 500e12 and k.memory_bytes == 64 * GiB


# ----------------------------------------------------------------------------- optimizer equivalence
STEPS = 3


def _static_vs_dcp_optimizer_worker(rank, world, extra, decoupled):
    """The same packed batch and initial weights, STEPS steps (with the LR schedule) on the
    static path's megatron-core optimizer and on the --dcp fixed sharding (one TP1 replica)."""
    import torch
    from megatron.core import parallel_state
    from megatron.core.optimizer import get_megatron_optimizer

    import pretrain_gpt_dcp
    from dcp_ext.data.thd import build_micro_batch
    from dcp_ext.planning.layout import ReplicaType
    from megatron.training import global_vars
    from megatron.training.flags import core_configs
    from megatron.training.flags.records import static_options_for
    from megatron.training.static import training_static
    from megatron.training.adaptive import run_config
    from megatron.training.arguments import parse_args
    from megatron.training.checkpointing import unwrap
    from megatron.training.initialize import initialize_model_parallel
    from megatron.training.flags.records import model_parallel_for
    from tests.support.runtime_helpers import RUNTIME_MODEL, VOCAB, engine_step, make_engine, plan_for, random_docs

    sched = ["--lr-decay-style", "cosine", "--lr-warmup-iters", "1", "--lr-decay-iters", "4", "--min-lr", "1e-4"]
    args = parse_args(RUNTIME_MODEL + sched + extra, world_size=world)
    args.padded_vocab_size = VOCAB
    if decoupled:
        args.decoupled_lr, args.decoupled_min_lr = decoupled
    docs = random_docs(8, seed=21)
    layout = [([0], 1, 1, 1, 1)]
    engine = make_engine(args, [ReplicaType(1, 1, 1, (0,))], optimizer_options=run_config.optimizer_options_for(args))
    scheduler = core_configs.build_lr_scheduler(args, engine.optimizer)
    init = engine.gather_canonical()
    runtime = []
    for i in range(STEPS):
        got = engine_step(engine, plan_for(i, layout, len(docs)), docs)
        scheduler.step(increment=1)
        runtime.append((got.loss, got.grad_norm))
    after_runtime = engine.gather_canonical()

    flags = [f for f in RUNTIME_MODEL if f != "--dcp"]
    k = flags.index("--dcp-global-batch-tokens")
    flags = flags[:k] + flags[k + 2:]
    sargs = parse_args(flags + sched + extra + ["--micro-batch-size", "1", "--global-batch-size", "1"],
                       world_size=world)
    sargs.padded_vocab_size = VOCAB
    global_vars.set_args(sargs)
    parallel_state._GLOBAL_MEMORY_BUFFER = None
    initialize_model_parallel(**model_parallel_for(sargs))
    model, optimizer, config = training_static.build_model_and_optimizer(static_options_for(sargs),
                                                                         pretrain_gpt_dcp.model_provider)
    if decoupled:  # megatron-core's own decoupled LR (the flag's static-path wiring is the TRAIN helper's)
        cfg = core_configs.optimizer_config_from_args(sargs)
        cfg.decoupled_lr, cfg.decoupled_min_lr = decoupled
        optimizer = get_megatron_optimizer(cfg, [model])
        config.grad_scale_func = optimizer.scale_loss
    sched_static = core_configs.build_lr_scheduler(sargs, optimizer)
    gpt = unwrap(model)
    with torch.no_grad():
        for name, p in gpt.named_parameters():
            t = engine.space.tensors[name]
            p.copy_(init[t.offset : t.offset + t.numel].view(p.shape))
    b = build_micro_batch(docs)
    batch = {"tokens": b.tokens[None], "labels": b.labels[None], "loss_mask": b.loss_mask[None],
             "position_ids": b.position_ids[None], "packed_seq_params": b.packed_seq_params()}
    static = []
    for i in range(STEPS):
        losses, ok, norm = training_static.train_step(model, optimizer, sched_static, config,
                                                      pretrain_gpt_dcp.forward_step, iter([batch]), 1,
                                                      int(b.tokens.numel()), sargs.micro_batch_size,
                                                      lr_increment=sargs.lr_step_increment)
        static.append((losses["lm loss"], norm))
    after_static = torch.empty_like(init)
    for name, p in gpt.named_parameters():
        t = engine.space.tensors[name]
        after_static[t.offset : t.offset + t.numel] = p.detach().flatten()
    emb = engine.space.tensors["embedding.word_embeddings.weight"]
    moved = (after_runtime - init)[emb.offset : emb.offset + emb.numel].norm().item()
    return {"runtime": runtime, "static": static, "moved_embedding": moved,
            "update": float((after_runtime - after_static).norm() / (after_static - init).norm()),
            "groups": [(g.get("is_decoupled_lr", False), g["lr"]) for g in engine.optimizer.param_groups]}


def _run_equivalence(extra, decoupled=None, update_tol=2e-3):
    (r,) = run_ranks(1, fn=_static_vs_dcp_optimizer_worker, args=(extra, decoupled))
    for (rl, rn), (sl, sn) in zip(r["runtime"], r["static"]):
        assert rl == pytest.approx(sl, rel=1e-5), r
        # megatron-core's static norm reads ~5e-4 above the runtime's exact fp64 one (also on
        # the first step, before any update); clipping scales the update by it
        assert rn == pytest.approx(sn, rel=2e-3), r
    assert r["runtime"][-1][0] < r["runtime"][0][0], r  # it trains
    assert r["update"] < update_tol, r
    return r


@pytest.mark.dist
def test_sgd_under_dcp_matches_static_sgd():
    # (AdamW at lr 0.3, what --dcp ran before, diverges here: loss 7.8 after 3 steps)
    r = _run_equivalence(["--optimizer", "sgd", "--sgd-momentum", "0.8", "--lr", "0.3"])
    assert r["runtime"][-1][0] < 5.4, r


@pytest.mark.dist
def test_adam_betas_and_decoupled_lr_under_dcp_match_megatron_core():
    # Adam's first steps move each weight by about lr * sign(grad): the static norm's offset
    # (above) flips a few near-zero ones, so the update agrees to ~0.3%, the losses to 1e-5
    r = _run_equivalence(["--adam-beta1", "0.8", "--adam-beta2", "0.95"], decoupled=(1e-2, 1e-3), update_tol=1e-2)
    assert any(dec and lr > 1e-3 for dec, lr in r["groups"])  # the embedding's group on its own schedule
    plain = _run_equivalence(["--adam-beta1", "0.8", "--adam-beta2", "0.95"], update_tol=1e-2)
    assert r["runtime"][-1][0] != pytest.approx(plain["runtime"][-1][0], rel=1e-2)
    assert r["moved_embedding"] > 3 * plain["moved_embedding"]  # lr 1e-2 vs 1e-3 on the embedding


# ----------------------------------------------------------------------------- end to end
BATCH = ["--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "8"]


@pytest.mark.dist
@pytest.mark.parametrize("path", ["static", "dcp"])
def test_mock_data_trains_on_both_paths(path, tmp_path):
    log = str(tmp_path / "loss.jsonl")
    flags = TINY_MODEL + BATCH + ["--mock-data", "--loss-log", log, "--data-cache-path", str(tmp_path / "cache"),
                                  "--tensor-model-parallel-size", "2" if path == "dcp" else "1", "--lr", "3e-3"]
    if path == "dcp":
        flags += ["--dcp"]
    r = run_ranks(2, flags, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    losses = [x["lm loss"] for x in read_loss_log(log)]
    assert len(losses) == 8
    assert np.mean(losses[-3:]) < losses[0] - 0.05, losses
    if path == "dcp":
        assert re.search(r"dcp: static layout tp=2 pp=1 cp=1 is in the candidate pool \(\d+ candidates?, "
                         r"--dcp-candidates 16\)", r.stdout), r.stdout[-2000:]
        assert len(re.findall(r"^> dcp: adaptive planner built in \d+\.\d s$", r.stdout, re.M)) == 1, r.stdout[-2000:]
        tokens = [int(t) for t in re.findall(r"\| tokens: (\d+) \|", r.stdout)]
        assert tokens and all(8 * 128 - 128 < t <= 8 * 128 for t in tokens), tokens  # gbs x seq by default
        sizes = [int(n) for n in re.findall(r"global batch size:\s+(\d+)", r.stdout)]
        assert len(set(sizes)) > 1  # documents of many lengths: the sample count varies


def test_gpu_launch_scripts_export_one_cuda_connection_and_the_cpu_one_does_not():
    def exports(path):
        with open(os.path.join(REPO, path)) as f:
            return re.search(r"^export CUDA_DEVICE_MAX_CONNECTIONS=1$", f.read(), re.M) is not None

    for gpu in ("examples/train_llama2_7b.sh", "examples/slurm_llama2_7b.sbatch", "scripts/gpu_check.sh"):
        assert exports(gpu), gpu
    assert not exports("examples/train_gpt_cpu.sh")


def test_the_slurm_script_saves_before_the_time_limit_and_logs_where_it_can():
    """SLURM signals the job step before its time limit and the ranks save on it (the README's
    advice for SLURM scripts); the log file's folder exists when SLURM opens it (it does not
    create folders), so no folder is named."""
    with open(os.path.join(REPO, "examples/slurm_llama2_7b.sbatch")) as f:
        text = f.read()
    signal = re.search(r"^#SBATCH --signal=(B:)?(\w+)@(\d+)$", text, re.M)
    assert signal and not signal.group(1), "the job step (torchrun), not only the batch shell, gets the signal"
    assert signal.group(2) in ("TERM", "SIGTERM") and int(signal.group(3)) >= 60  # --exit-signal's default
    args = text[text.index("ARGS=("):]
    assert "--exit-signal-handler" in args[:args.index(")\n")]
    output = re.search(r"^#SBATCH --output=(\S+)$", text, re.M).group(1)
    assert "/" not in output


def _sgd_resume_worker(rank, world):
    import torch

    from dcp_ext.runtime.params.sharded_optimizer import OptimizerOptions, ShardedOptimizer

    opts = OptimizerOptions(optimizer="sgd", lr=0.1, weight_decay=0.1, sgd_momentum=0.9, clip_grad=0.0)
    runs = [(0, 6, False, False), (6, 8, True, False), (8, 12, False, True)]
    init = torch.linspace(-1, 1, 12)
    grads = [torch.randn(12, generator=torch.Generator().manual_seed(k)) for k in range(3)]
    a = ShardedOptimizer(init, runs, opts)
    for g in grads[:2]:
        a.grad.copy_(g)
        a.step()
    b = ShardedOptimizer(a.master().clone(), runs, opts)
    b.set_moments(*a.moments())  # what a checkpoint saves and loads
    fresh = ShardedOptimizer(a.master().clone(), runs, opts)  # the same weights, no momentum
    for o in (a, b, fresh):
        o.grad.copy_(grads[2])
        o.step()
    return {"resumed": torch.equal(a.master(), b.master()), "steps": a.moments()[2],
            "momentum_matters": not torch.allclose(fresh.master(), b.master())}


@pytest.mark.dist
def test_sgd_momentum_survives_a_checkpoint_round_trip():
    (r,) = run_ranks(1, fn=_sgd_resume_worker)
    assert r["resumed"] and r["steps"] == 3
    assert r["momentum_matters"]  # without the saved momentum the step differs
