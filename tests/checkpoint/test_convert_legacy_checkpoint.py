"""Upstream Megatron-LM's legacy checkpoints (`--ckpt-format torch`: `iter_N/mp_rank_TT[_PPP]/
model_optim_rng.pt`) convert with tools/convert_legacy_checkpoint.py into a torch_dist
checkpoint both paths load, and `--load` of one says what it is and the command that converts it.

The legacy checkpoints here are written as upstream writes them (megatron/training/checkpointing.py
at d98e8a6: `generate_state_dict` with `state_dict_for_save_checkpoint()`, `torch.save` per
model-parallel rank): the run's argparse Namespace (with megatron-core enums and torch dtypes in
it, as upstream's args hold), checkpoint_version 3.0, the iteration, the stage's state dict under
transformer-engine's names with `_extra_state`, optimizer and RNG state (numpy arrays). A TP2
model's per-token losses on the static path's first global batch equal the converted TP1
model's; a PP2 model's stages equal the converted model's layers, renumbered; both paths
train from the conversion with --finetune.
"""
import argparse
import io
import os
import zlib

import pytest

from tests.support import checkpoint_payloads as payloads
from tests.conftest import TINY_MODEL
from tests.support.helpers import read_loss_log, run_ranks, run_tool
from tests.support.helpers import assert_one_line_error

TOOL = "tools/convert_legacy_checkpoint.py"
BATCH = ["--micro-batch-size", "2", "--global-batch-size", "4", "--seed", "1234"]
_TE_NORMS = (("input_layernorm.", "self_attention.linear_qkv.layer_norm_"),
             ("pre_mlp_layernorm.", "mlp.linear_fc1.layer_norm_"))


def _te_name(name: str) -> str:
    for local, te in _TE_NORMS:
        if f".{local}" in name:
            return name.replace(f".{local}", f".{te}")
    return name


def _batches(args, entry):
    from functools import partial

    from megatron.training.flags.records import packing_for
    from megatron.training.loop.batches import collate_fixed_length
    from megatron.training.static.training_static import micro_batches

    train_ds, _, _ = entry.train_valid_test_datasets_provider(args)
    return list(micro_batches(train_ds, 0, args.micro_batch_size, 0, 1,
                              partial(collate_fixed_length, packing=packing_for(args)), args.global_batch_size))


def _token_losses(model, batches, entry):
    import torch

    out = []
    with torch.no_grad():
        for b in batches:
            output, _ = entry.forward_step(iter([b]), model)
            out.append(output.detach().float().clone())
    return torch.stack(out)


def _setup(flags, world, tp, pp):
    from megatron.core import parallel_state

    import pretrain_gpt_dcp as entry
    from megatron.training import global_vars
    from megatron.training.arguments import parse_args
    from megatron.training.initialize import set_random_seed

    args = parse_args(flags + ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp)],
                      world_size=world)
    global_vars.set_args(args)
    global_vars.build_tokenizer(args)
    parallel_state.initialize_model_parallel(tp, pp)
    set_random_seed(args.seed)
    return args, entry


def _write_legacy(rank, world, flags, root, tp, pp, te_names):
    """One rank of an upstream run at (tp, pp) saving its legacy checkpoint at iteration 7; rank 0
    of a TP-only run also keeps the per-token losses of the first global batch."""
    import numpy as np
    import torch
    from megatron.core import parallel_state
    from megatron.core.enums import ModelType
    from megatron.core.transformer.enums import AttnBackend

    from megatron.training.flags.core_configs import transformer_config_from_args

    args, entry = _setup(flags, world, tp, pp)
    first, last = parallel_state.is_pipeline_first_stage(), parallel_state.is_pipeline_last_stage()
    model = entry.model_provider(transformer_config_from_args(args), pre_process=first, post_process=last)
    with torch.no_grad():  # trained weights: not the initial values a fresh model of this seed has at any layout
        for name, prm in model.named_parameters():
            prm.add_(0.05 * torch.randn(prm.shape, generator=torch.Generator().manual_seed(zlib.crc32(name.encode()))))
    model_sd = model.state_dict_for_save_checkpoint()
    if te_names:  # a GPU run's transformer-engine layers: fused norm names, _extra_state as BytesIO
        model_sd = {_te_name(k): (io.BytesIO(b"fp8 meta") if k.endswith("_extra_state") else v)
                    for k, v in model_sd.items()}
    saved = argparse.Namespace(**{k: v for k, v in vars(args).items()})
    saved.ckpt_format, saved.attention_backend, saved.model_type = "torch", AttnBackend.auto, ModelType.encoder_or_decoder
    saved.params_dtype, saved.consumed_train_samples = torch.float32, 28
    state = {"args": saved, "checkpoint_version": 3.0, "iteration": 7, "model": model_sd,
             "optimizer": {"state": {0: {"exp_avg": torch.zeros(3)}}, "param_groups": [{"lr": 1e-3}]},
             "opt_param_scheduler": {"max_lr": 1e-3, "num_steps": 28},
             "rng_state": [{"random_rng_state": (3, tuple(range(5)), None), "np_rng_state": np.random.get_state(),
                            "torch_rng_state": torch.get_rng_state(), "cuda_rng_state": torch.zeros(16, dtype=torch.uint8),
                            "rng_tracker_states": {}}],
             "num_floating_point_operations_so_far": 1.5e12}
    t, p = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_pipeline_model_parallel_rank()
    folder = os.path.join(root, "iter_0000007", f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 else ""))
    os.makedirs(folder, exist_ok=True)
    torch.save(state, os.path.join(folder, "model_optim_rng.pt"))
    if pp == 1:  # every tensor-parallel rank takes part in the forward
        losses = _token_losses(model, _batches(args, entry), entry)
        if rank == 0:
            torch.save(losses, os.path.join(root, "reference_losses.pt"))
    if rank == 0:
        with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write("7")
    torch.distributed.barrier()
    if tp > 1:
        return None
    offset = p * (args.num_layers // pp)  # this stage's weights under the whole model's layer numbers
    out = {}
    for name, prm in model.named_parameters():
        if name.startswith("decoder.layers."):
            parts = name.split(".")
            parts[2] = str(int(parts[2]) + offset)
            name = ".".join(parts)
        out[name] = prm.detach().tolist()
    return out


def _converted(rank, world, flags, converted, reference):
    """The conversion loaded into the TP1 model: its per-token losses on the same batch (the
    reference's, when one is given) or its weights."""
    import torch
    from megatron.core import dist_checkpointing

    from megatron.training.checkpoint.protocol import checkpoint_dir, read_tracker
    from megatron.training.flags.core_configs import transformer_config_from_args

    args, entry = _setup(flags, world, 1, 1)
    model = entry.model_provider(transformer_config_from_args(args))
    if reference:  # what the losses would be without the load: far from the reference
        fresh = _token_losses(model, _batches(args, entry), entry)
        want = torch.load(reference, weights_only=True)
        unloaded = float(((fresh - want).abs() / want.abs().clamp_min(1e-6)).max())
    path = checkpoint_dir(converted, read_tracker(converted))
    model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), path), strict=False)
    common = dist_checkpointing.load_common_state_dict(path)
    out = {"iteration": common["iteration"], "consumed": common["consumed_train_samples"]}
    if reference:
        want = torch.load(reference, weights_only=True)
        got = _token_losses(model, _batches(args, entry), entry)
        out["max_rel"] = float(((got - want).abs() / want.abs().clamp_min(1e-6)).max())
        out["mean"], out["unloaded_max_rel"] = float(want.mean()), unloaded
    else:
        out["weights"] = {n: p.detach().tolist() for n, p in model.named_parameters()}
    return out


@pytest.fixture(scope="module")
def legacy_tp2(text_corpus, tmp_path_factory):
    root = tmp_path_factory.mktemp("legacy_tp2")
    flags = TINY_MODEL + BATCH + ["--untie-embeddings-and-output-weights", "--train-iters", "4",
                                  "--data-path", text_corpus, "--data-cache-path", str(root / "cache")]
    run_ranks(2, fn=_write_legacy, args=(flags, str(root / "upstream"), 2, 1, True))
    return root, flags


@pytest.mark.dist
@pytest.mark.slow
def test_tp2_legacy_checkpoint_converts_to_the_same_model_and_trains_on_both_paths(legacy_tp2):
    root, flags = legacy_tp2
    upstream, out = str(root / "upstream"), str(root / "converted")
    # --load of the legacy checkpoint: what it is and the command that converts it
    r = run_ranks(1, flags + ["--load", upstream, "--finetune"])
    assert r.returncode == 1
    assert_one_line_error(r, "legacy format (--ckpt-format torch: 2 mp_rank_*/model_optim_rng.pt files, "
                             "tensor-parallel 2, pipeline-parallel 1)")
    assert f"python tools/convert_legacy_checkpoint.py --load {upstream} --save {upstream}_torch_dist" in r.stderr

    r = run_tool(TOOL, ["--load", upstream, "--save", out])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "converted iteration 7" in r.stdout and "tensor-parallel 2, pipeline-parallel 1" in r.stdout
    assert "--untie-embeddings-and-output-weights" in r.stdout and "--num-query-groups 2" in r.stdout

    (got,) = run_ranks(1, fn=_converted, args=(flags, out, str(root / "upstream" / "reference_losses.pt")))
    assert got["iteration"] == 7 and got["consumed"] == 28
    assert got["max_rel"] < 1e-5, got  # TP2's per-token losses, every token of the global batch
    assert got["unloaded_max_rel"] > 1e-2, got  # (the model before the load is another one)

    # both paths train from it; the static path's first loss is the reference batch's mean
    for name, extra, nproc in (("static", ["--tensor-model-parallel-size", "2"], 2),
                               ("dcp", ["--dcp", "--dcp-planner", "static"], 2)):
        log = str(root / f"{name}.jsonl")
        r = run_ranks(nproc, flags + extra + ["--load", out, "--finetune", "--train-iters", "1", "--loss-log", log])
        assert r.returncode == 0, r.stderr[-3000:]
        first = read_loss_log(log)[0]
        assert first["iteration"] == 1
        if name == "static":
            assert abs(first["lm loss"] - got["mean"]) < 1e-4 * got["mean"], (first, got["mean"])
        else:
            assert "loaded the weights of" in r.stdout


@pytest.mark.dist
def test_pp2_legacy_checkpoint_converts_layer_by_layer(text_corpus, tmp_path):
    flags = TINY_MODEL + BATCH + ["--train-iters", "4", "--data-path", text_corpus,
                                  "--data-cache-path", str(tmp_path / "cache")]
    upstream, out = str(tmp_path / "upstream"), str(tmp_path / "converted")
    stages = run_ranks(2, fn=_write_legacy, args=(flags, upstream, 1, 2, False))
    assert sorted(os.listdir(os.path.join(upstream, "iter_0000007"))) == ["mp_rank_00_000", "mp_rank_00_001"]
    r = run_tool(TOOL, ["--load", upstream, "--save", out])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "pipeline-parallel 2" in r.stdout
    want = {**stages[0], **stages[1]}
    (got,) = run_ranks(1, fn=_converted, args=(flags, out, None))
    tied_copy = {"output_layer.weight"}  # the last stage's copy of the tied embedding is not a parameter of TP1
    assert set(got["weights"]) == set(want) - tied_copy
    bad = [n for n in got["weights"] if got["weights"][n] != want[n]]
    assert not bad, bad[:3]

    # a rank file that would run code: one line, nothing runs
    target = os.path.join(upstream, "iter_0000007", "mp_rank_00_001", "model_optim_rng.pt")
    marker = tmp_path / "ran"
    with open(target, "rb") as f:
        real = f.read()
    with open(target, "wb") as f:
        f.write(payloads._torch_payload(str(marker), real))
    r = run_tool(TOOL, ["--load", upstream, "--save", str(tmp_path / "again")])
    assert r.returncode == 1 and not marker.exists()
    assert_one_line_error(r, f"{target}: refused: reading it would run code (it names builtins.eval")
