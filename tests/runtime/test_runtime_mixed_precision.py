"""Megatron's mixed precision in the adaptive runtime.

--bf16: parameters and activations bf16, gradients accumulated over micro-batches in fp32
main grads (views of one fp32 buffer), fp32 master, gradient shard and Adam (asserted);
one step under a mixed layout (TP2 beside two TP1 replicas, recompute on some
micro-batches) stays within bf16 rounding of the fp32 single-process reference.
--fp16: megatron-core's dynamic loss scaler; a step whose scaled gradients overflow is
skipped (master weights untouched) and the scale backs off, as Megatron does; the first
step that fits updates like the fp32 reference (within fp16 rounding).
"""
import pytest

from tests.support.helpers import run_ranks

pytestmark = pytest.mark.dist

MIXED = [([0, 1], 2, 1, 1, 2), ([2], 1, 1, 1, 2), ([3], 1, 1, 1, 1)]
PIPELINE = [([0, 1], 1, 1, 2, 3), ([2, 3], 1, 1, 2, 2)]


def _relative_error(a, b):
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-12))


def _update_error(got, want, init):
    """How far this step's update is from the reference's, relative to the update (L2)."""
    return float((got - want).norm() / (want - init).norm())


def _types(layout):
    from dcp_ext.planning.layout import ReplicaType

    return [ReplicaType(tp, cp, pp, tuple(ranks)) for ranks, tp, cp, pp, _ in layout]


def _args(world, precision):
    from megatron.training.arguments import parse_args
    from tests.support.runtime_helpers import RUNTIME_MODEL, VOCAB

    args = parse_args(RUNTIME_MODEL + [f"--{precision}"], world_size=world)
    args.padded_vocab_size = VOCAB
    return args


def _bf16_worker(rank, world):
    import torch

    from tests.support.runtime_helpers import Reference, engine_step, make_engine, plan_for, random_docs, tiny_args

    args = _args(world, "bf16")
    engine = make_engine(args, _types(MIXED))
    init = engine.gather_canonical()
    docs = random_docs(14, seed=5)
    got = engine_step(engine, plan_for(0, MIXED, len(docs), recompute_every=2), docs)
    pushed = engine.server.exchange.allgather(engine.optimizer.grad)
    stage = next(iter(engine.bank.stages.values()))
    views = all(lp.param.main_grad.data_ptr() >= engine.bank.main_grads.data_ptr() and
                lp.param.main_grad.dtype == torch.float32 and lp.param.dtype == torch.bfloat16 for lp in stage.local)
    ref = Reference(engine, tiny_args(world), init)  # fp32, plain torch, one process
    loss, norm = ref.step(docs)
    return {
        "dtypes": [str(engine.bank.params.dtype), str(engine.bank.main_grads.dtype), str(engine.optimizer.master().dtype),
                   str(engine.optimizer.grad.dtype)],
        "views": views,
        "loss": abs(got.loss - loss) / abs(loss),
        "norm": abs(got.grad_norm - norm) / norm,
        "grads": _relative_error(pushed, ref.last_grad),
        "update": _update_error(engine.gather_canonical(), ref.flat(), init),
    }


def test_bf16_runtime_accumulates_fp32_main_grads_and_tracks_fp32():
    for rank, r in enumerate(run_ranks(4, fn=_bf16_worker)):
        assert r["dtypes"] == ["torch.bfloat16", "torch.float32", "torch.float32", "torch.float32"], r
        assert r["views"], "a stage parameter is not bf16 or its main grad is not an fp32 view of the buffer"
        # bf16 keeps 8 bits of mantissa: 2^-8 = 0.4% per rounding
        assert r["loss"] < 4e-3, (rank, r)
        assert r["norm"] < 2e-2, (rank, r)
        assert r["grads"] < 5e-2, (rank, r)
        # Adam's first step moves each weight by about lr * sign(grad): bf16 rounding flips the
        # sign of a few near-zero gradients, the rest of the update is the reference's
        assert r["update"] < 0.1, (rank, r)


def _fp16_worker(rank, world):
    import torch
    from megatron.core.optimizer.grad_scaler import DynamicGradScaler

    from tests.support.runtime_helpers import Reference, engine_step, make_engine, plan_for, random_docs, tiny_args

    args = _args(world, "fp16")
    scaler = DynamicGradScaler(initial_scale=2.0**40, min_scale=1.0, growth_factor=2.0, backoff_factor=0.5,
                               growth_interval=1000, hysteresis=1)
    engine = make_engine(args, _types(PIPELINE), grad_scaler=scaler)
    init = engine.gather_canonical()
    docs = random_docs(12, seed=9)
    steps = []
    for i in range(40):
        before = engine.gather_canonical()
        got = engine_step(engine, plan_for(i, PIPELINE, len(docs)), docs)
        unchanged = bool(torch.equal(engine.gather_canonical(), before))
        steps.append({"ok": got.update_successful, "scale": got.loss_scale, "unchanged": unchanged,
                      "loss": got.loss, "norm": got.grad_norm})
        if got.update_successful:
            break
    ref = Reference(engine, tiny_args(world), init)
    loss, norm = ref.step(docs)
    return {"steps": steps, "ref_loss": loss, "ref_norm": norm, "dtype": str(engine.bank.params.dtype),
            "update": _update_error(engine.gather_canonical(), ref.flat(), init),
            "scale_after": float(scaler.scale.item())}


def test_fp16_runtime_skips_overflow_steps_and_backs_off_the_loss_scale():
    for rank, r in enumerate(run_ranks(4, fn=_fp16_worker)):
        steps = r["steps"]
        assert r["dtype"] == "torch.float16"
        assert steps[-1]["ok"], f"no step fitted fp16 within 40 halvings: {steps[-1]}"
        skipped = steps[:-1]
        assert skipped, "2^40 should overflow fp16 gradients on the first step"
        for k, s in enumerate(skipped):
            assert not s["ok"] and s["unchanged"], (k, s)  # a skipped step leaves the master weights alone
        # hysteresis 1: the scale halves after every overflow
        assert [s["scale"] for s in steps] == [2.0**40 / 2**k for k in range(len(steps))]
        assert r["scale_after"] == steps[-1]["scale"]
        good = steps[-1]
        assert good["loss"] == pytest.approx(r["ref_loss"], rel=4e-3)
        assert good["norm"] == pytest.approx(r["ref_norm"], rel=2e-2)  # unscaled before the norm
        assert r["update"] < 0.1, r


def _static_vs_runtime_worker(rank, world):
    """The same packed batch, the same initial weights: one --bf16 step on the static path
    (pretrain()'s model and optimizer: Float16Module, megatron-core's DDP and mixed-precision
    optimizer) and one on the --dcp runtime (one TP1 replica)."""
    import torch

    import pretrain_gpt_dcp
    from dcp_ext.data.thd import build_micro_batch
    from megatron.training import global_vars
    from megatron.training.flags import core_configs
    from megatron.training.flags.records import static_options_for
    from megatron.training.static import training_static
    from megatron.training.arguments import parse_args
    from megatron.training.checkpointing import unwrap
    from megatron.training.initialize import initialize_model_parallel
    from megatron.training.flags.records import model_parallel_for
    from tests.support.runtime_helpers import RUNTIME_MODEL, VOCAB, engine_step, make_engine, plan_for, random_docs

    docs = random_docs(8, seed=21)
    engine = make_engine(_args(world, "bf16"), _types([([0], 1, 1, 1, 1)]))
    init = engine.gather_canonical()
    got = engine_step(engine, plan_for(0, [([0], 1, 1, 1, 1)], len(docs)), docs)
    after_runtime = engine.gather_canonical()

    flags = [f for f in RUNTIME_MODEL if f not in ("--dcp",)]
    flags = flags[: flags.index("--dcp-global-batch-tokens")] + flags[flags.index("--dcp-global-batch-tokens") + 2:]
    args = parse_args(flags + ["--bf16", "--micro-batch-size", "1", "--global-batch-size", "1",
                               "--lr-decay-style", "constant"], world_size=world)
    args.padded_vocab_size = VOCAB
    global_vars.set_args(args)
    from megatron.core import parallel_state

    parallel_state._GLOBAL_MEMORY_BUFFER = None  # the engine made one; the static path makes its own
    initialize_model_parallel(**model_parallel_for(args))
    model, optimizer, config = training_static.build_model_and_optimizer(static_options_for(args),
                                                                         pretrain_gpt_dcp.model_provider)
    scheduler = core_configs.build_lr_scheduler(args, optimizer)
    gpt = unwrap(model)
    space = engine.space
    with torch.no_grad():
        for name, p in gpt.named_parameters():
            t = space.tensors[name]
            p.copy_(init[t.offset : t.offset + t.numel].view(p.shape))
    optimizer.reload_model_params()  # the fp32 masters from the weights just set
    b = build_micro_batch(docs)
    batch = {"tokens": b.tokens[None], "labels": b.labels[None], "loss_mask": b.loss_mask[None],
             "position_ids": b.position_ids[None], "packed_seq_params": b.packed_seq_params()}
    losses, ok, norm = training_static.train_step(model, optimizer, scheduler, config, pretrain_gpt_dcp.forward_step,
                                                  iter([batch]), 1, int(b.tokens.numel()), args.micro_batch_size,
                                                  lr_increment=args.lr_step_increment)
    opts = getattr(optimizer, "chained_optimizers", [optimizer])
    masters = {}
    for o in opts:
        for model_group, master_group in zip(o.float16_groups, o.fp32_from_float16_groups):
            for p, m in zip(model_group, master_group):
                masters[id(p)] = m
    after_static = torch.empty_like(init)
    for name, p in gpt.named_parameters():
        t = space.tensors[name]
        after_static[t.offset : t.offset + t.numel] = masters[id(p)].detach().flatten()
    return {"loss": abs(got.loss - losses["lm loss"]) / losses["lm loss"], "ok": ok,
            "norm": abs(got.grad_norm - norm) / norm, "update": _update_error(after_runtime, after_static, init)}


def test_bf16_runtime_step_matches_the_bf16_static_path():
    (r,) = run_ranks(1, fn=_static_vs_runtime_worker)
    assert r["ok"]
    assert r["loss"] < 4e-3, r  # the same bf16 forward, one rounding apart
    assert r["norm"] < 2e-2, r
    assert r["update"] < 0.1, r
