"""--bf16 and --fp16 on the static (upstream Megatron) path, on CPU gloo ranks.

As upstream trains them: parameters and activations in half precision (Float16Module),
fp32 main gradients in DDP (--bf16 implies --accumulate-allreduce-grads-in-fp32), fp32
master weights in the optimizer, and under --fp16 megatron-core's dynamic loss scaler,
whose overflow skips the step and backs the scale off.

Tolerances. bf16 keeps 8 significant bits: unit roundoff u = 2**-8 ~ 3.9e-3. The loss is a
mean over ~1000 tokens of a cross-entropy computed from bf16 logits; the rounding errors of
the tokens average out, so the mean must agree with fp32 at least to within u (measured:
~1e-4). The gradient norm sums ~2e5 squared gradients, each the end of a backward through
bf16 activations (a few roundings of u each): within 5u ~ 2e-2 (measured: ~1e-3). The runs
load one initial checkpoint saved with another seed and init std, so a run whose fp32 master
weights were not refreshed from the loaded model would be off by ~60% in grad norm at
iteration 2.
"""
import math
import re

import pytest

from tests.conftest import TINY_MODEL
from tests.support.helpers import read_loss_log, run_ranks

BF16_U = 2.0 ** -8
BATCH = ["--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "3"]
FP16_MAX = 65504.0


@pytest.fixture(scope="module")
def root(text_corpus, tmp_path_factory):
    """Data flags and a shared fp32 initial checkpoint (1 rank, another seed and init std)."""
    root = tmp_path_factory.mktemp("mixed")
    data = ["--data-path", text_corpus, "--data-cache-path", str(root / "cache")]
    init = str(root / "init")
    r = run_ranks(1, TINY_MODEL + data + BATCH + ["--train-iters", "0", "--seed", "7", "--init-method-std", "0.05",
                                                  "--save", init])
    assert r.returncode == 0, r.stderr[-3000:]
    return root, data + ["--load", init, "--no-load-optim", "--no-load-rng"]


def run(root, name, nproc, extra, batch=BATCH):
    path, flags = root
    log = str(path / f"{name}.jsonl")
    r = run_ranks(nproc, TINY_MODEL + flags + batch + extra + ["--loss-log", log])
    assert r.returncode == 0, r.stderr[-4000:]
    return read_loss_log(log), r.stdout


@pytest.fixture(scope="module")
def fp32_reference(root):
    return run(root, "fp32", 1, [])[0]


@pytest.mark.dist
def test_bf16_trains_close_to_fp32(root, fp32_reference):
    """TP2 with the distributed optimizer: bf16 TP collectives, fp32 main grads reduce-scattered,
    fp32 master shards. (DP2 with the non-distributed Float16Optimizer: in-process test below.)"""
    name = "tp2-distopt"
    got, _ = run(root, f"bf16-{name}", 2, ["--bf16", "--tensor-model-parallel-size", "2",
                                           "--use-distributed-optimizer"])
    assert [r["iteration"] for r in got] == [1, 2, 3]
    for g, w in zip(got, fp32_reference):
        assert not g["skipped"] and g["loss scale"] == 1.0
        assert math.isfinite(g["lm loss"])
        assert g["lm loss"] == pytest.approx(w["lm loss"], rel=BF16_U), (name, g, w)
        assert g["grad norm"] == pytest.approx(w["grad norm"], rel=5 * BF16_U), (name, g, w)
    # it really ran in bf16: not bit-identical to fp32
    assert any(g["lm loss"] != w["lm loss"] for g, w in zip(got, fp32_reference))
    assert got[-1]["lm loss"] != got[0]["lm loss"]


def _iteration_lines(stdout: str) -> dict[int, dict]:
    out = {}
    for m in re.finditer(r"iteration\s+(\d+)/\s*\d+ \|.*?loss scale: ([0-9.]+) \|.*?"
                         r"number of skipped iterations:\s+(\d+) \| number of nan iterations:\s+(\d+)", stdout):
        out[int(m[1])] = {"loss scale": float(m[2]), "skipped": int(m[3]), "nan": int(m[4])}
    return out


def megatron_scale_trajectory(initial, skipped, window, hysteresis, min_scale=1.0):
    """The scale after each iteration under Megatron's rule (DynamicGradScaler.update)."""
    scale, growth, hyst, out = initial, 0, hysteresis, []
    for overflow in skipped:
        if overflow:
            growth, hyst = 0, hyst - 1
            if hyst <= 0:
                scale = max(scale / 2, min_scale)
        else:
            growth += 1
            if growth == window:
                growth, hyst, scale = 0, hysteresis, scale * 2
        out.append(scale)
    return out


@pytest.mark.dist
def test_fp16_dynamic_loss_scaling_skips_overflow_steps(root, fp32_reference):
    initial, window, iters = 2.0 ** 32, 4, 28  # upstream's --initial-loss-scale
    batch = ["--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", str(iters)]
    got, stdout = run(root, "fp16", 2, ["--fp16", "--use-distributed-optimizer", "--initial-loss-scale", str(initial),
                                        "--hysteresis", "1", "--loss-scale-window", str(window)], batch)
    # More overflows in a row than --max-nan-iterations (10): a loss-scale back-off is a
    # skipped iteration, not a NaN one, and the run goes on until the scale fits fp16.
    assert [r["iteration"] for r in got] == list(range(1, iters + 1))
    skipped = [r["skipped"] for r in got]
    scales = [r["loss scale"] for r in got]
    # the loss is divided by the global batch's tokens before the backward (as upstream's mean
    # is): a logit's gradient is then ~1/tokens, and a scale above 2 * FP16_MAX * tokens cannot fit
    tokens = 8 * 128
    assert skipped[0], "2**32 times a logit gradient of ~1/1024 overflows fp16: the first step must be skipped"
    assert scales[0] == initial / 2
    assert scales == megatron_scale_trajectory(initial, skipped, window, hysteresis=1)
    before = [initial] + scales[:-1]
    assert all(s for s, b in zip(skipped, before) if b > 2 * FP16_MAX * tokens), "a scale this large cannot fit fp16"
    assert sum(not s for s in skipped) >= 5, "the scale must come down far enough to train"
    for r in got:
        assert math.isfinite(r["lm loss"])
        assert (r["grad norm"] is None) == r["skipped"]
    # the LR schedule advances only on successful steps (upstream): the first successful
    # steps see the fp32 run's first learning rates
    assert all(r["lr"] == 0.0 for r in got[: skipped.index(False)])
    lrs = [r["lr"] for r in got if not r["skipped"]][: len(fp32_reference)]
    assert lrs == pytest.approx([r["lr"] for r in fp32_reference], rel=1e-12)
    # the iteration line reports the scaler's value and the skipped iteration
    lines = _iteration_lines(stdout)
    assert sorted(lines) == list(range(1, iters + 1))
    for r in got:
        line = lines[r["iteration"]]
        assert line["loss scale"] == r["loss scale"] and line["skipped"] == int(r["skipped"]) and line["nan"] == 0


@pytest.mark.dist
@pytest.mark.parametrize("path", ["static", "dcp"])
def test_fp16_with_upstreams_constant_loss_scale_trains(root, path):
    """--fp16 --loss-scale 8192 (upstream's sc21 line): sized for a mean loss. The per-token
    loss is divided by the global batch's tokens before the backward on both paths, so no
    step overflows and the loss falls (it was every step skipped, grad norm nan, static)."""
    extra = ["--fp16", "--loss-scale", "8192", "--tensor-model-parallel-size", "2"]
    extra += ["--dcp", "--dcp-global-batch-tokens", "1024", "--dcp-max-seq-len", "128"] if path == "dcp" else []
    got, _ = run(root, f"fp16-const-{path}", 2, extra, ["--micro-batch-size", "2", "--global-batch-size", "8",
                                                        "--train-iters", "6"])
    assert [r["iteration"] for r in got] == list(range(1, 7))
    for r in got:
        assert not r["skipped"] and r["loss scale"] == 8192.0, r
        assert r["grad norm"] is not None and math.isfinite(r["grad norm"]), r
    assert got[-1]["lm loss"] < got[0]["lm loss"] - 0.05, [r["lm loss"] for r in got]


# --- in-process: what the static path builds -----------------------------------------

def _build_and_step(rank, world, configs):
    """Per config: build the static model + optimizer as pretrain() does, run one step on a
    random batch, report dtypes of parameters, activations, main grads and master weights."""
    import torch

    import pretrain_gpt_dcp
    from megatron.core.optimizer.grad_scaler import DynamicGradScaler
    from megatron.training import global_vars
    from megatron.training.flags import core_configs
    from megatron.training.flags.records import static_options_for
    from megatron.training.static import training_static
    from megatron.training.arguments import parse_args
    from megatron.training.checkpointing import unwrap
    from megatron.training.initialize import initialize_model_parallel, set_random_seed
    from megatron.training.flags.records import model_parallel_for

    name = lambda dt: str(dt).replace("torch.", "")
    reports = {}
    for i, (label, extra) in enumerate(configs):
        args = parse_args(TINY_MODEL + ["--mock-data", "--micro-batch-size", "2", "--global-batch-size", "4",
                                        "--train-iters", "4", "--lr-warmup-iters", "0"] + extra,
                          world_size=world)
        global_vars.set_args(args)
        global_vars.build_tokenizer(args)
        if i == 0:
            initialize_model_parallel(**model_parallel_for(args))
        set_random_seed(args.seed)
        model, optimizer, config = training_static.build_model_and_optimizer(static_options_for(args),
                                                                             pretrain_gpt_dcp.model_provider)
        scheduler = core_configs.build_lr_scheduler(args, optimizer)
        gpt = unwrap(model)
        seen = {}

        def record(key):
            def hook(module, inputs, outputs):  # returns None: the output stays as it is
                seen.setdefault(key, outputs[0].dtype)
            return hook

        gpt.decoder.layers[0].register_forward_hook(record("layer"))
        gpt.output_layer.register_forward_hook(record("logits"))
        g = torch.Generator().manual_seed(rank)
        tokens = torch.randint(0, 255, (2, args.seq_length + 1), generator=g)
        batch = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": torch.ones(2, args.seq_length),
                 "position_ids": torch.arange(args.seq_length).expand(2, -1), "packed_seq_params": None}
        opts = getattr(optimizer, "chained_optimizers", [optimizer])
        masters = [p for o in opts for grp in o.optimizer.param_groups for p in grp["params"]]
        before = [p.detach().clone() for p in gpt.parameters()]
        masters_before = [p.detach().clone() for p in masters]
        losses, ok, grad_norm = training_static.train_step(model, optimizer, scheduler, config,
                                                           pretrain_gpt_dcp.forward_step, iter([batch]),
                                                           args.num_microbatches, args.seq_length, args.micro_batch_size,
                                                           lr_increment=args.lr_step_increment)
        model_ptrs = {p.data_ptr() for p in gpt.parameters()}
        synced = []
        for o in opts:  # Float16OptimizerWithFloat16Params: model params are their masters, rounded
            for model_group, master_group in zip(getattr(o, "float16_groups", []),
                                                 getattr(o, "fp32_from_float16_groups", [])):
                synced += [torch.equal(p, m.to(p.dtype)) for p, m in zip(model_group, master_group)]
        scaler = getattr(opts[0], "grad_scaler", None)
        reports[label] = {
            "loss": losses["lm loss"], "ok": ok, "grad_norm": grad_norm,
            "optimizer": sorted({type(o).__name__ for o in opts}),
            "param": sorted({name(p.dtype) for p in gpt.parameters()}),
            "main_grad": sorted({name(p.main_grad.dtype) for p in gpt.parameters()}),
            "master": sorted({name(p.dtype) for p in masters}),
            "master_is_model": any(p.data_ptr() in model_ptrs for p in masters),
            "adam_state": sorted({name(v.dtype) for o in opts for s in o.optimizer.state.values()
                                  for k, v in s.items() if k in ("exp_avg", "exp_avg_sq")}),
            "activation": name(seen["layer"]), "logits": name(seen["logits"]),
            "moved": [not torch.equal(b, p) for b, p in zip(before, gpt.parameters())],
            "masters_moved": all(not torch.equal(b, p) for b, p in zip(masters_before, masters)),
            "masters_synced": synced and all(synced),
            "scaler": None if scaler is None else {
                "type": type(scaler).__name__, "scale": scaler.scale.item(),
                **({"min": scaler.min_scale.item(), "window": scaler.growth_interval,
                    "hysteresis": scaler.hysteresis} if isinstance(scaler, DynamicGradScaler) else {})},
        }
    return reports


CONFIGS = [
    ("bf16", ["--bf16"]),
    ("bf16-distopt", ["--bf16", "--use-distributed-optimizer"]),
    ("bf16-grad-reduce-in-bf16", ["--bf16", "--grad-reduce-in-bf16"]),
    # megatron-core builds learned position embeddings as a plain fp32 torch.nn.Embedding:
    # without Float16Module the first LayerNorm met fp32 activations (CPU: "mixed dtype")
    ("bf16-learned-pos-layernorm", ["--bf16", "--position-embedding-type", "learned_absolute",
                                    "--normalization", "LayerNorm"]),
    ("fp16", ["--fp16", "--initial-loss-scale", "16", "--min-loss-scale", "0.5", "--loss-scale-window", "7",
              "--hysteresis", "3"]),
    ("fp16-fp32-grads", ["--fp16", "--initial-loss-scale", "16", "--accumulate-allreduce-grads-in-fp32"]),
]


@pytest.fixture(scope="module")
def built():
    return run_ranks(2, fn=_build_and_step, args=(CONFIGS,))


@pytest.mark.dist
def test_bf16_params_activations_half_main_grads_and_masters_fp32(built):
    for reports in built:  # both DP ranks
        for label in ("bf16", "bf16-distopt", "bf16-grad-reduce-in-bf16", "bf16-learned-pos-layernorm"):
            r = reports[label]
            assert r["ok"] and math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]), (label, r)
            assert r["param"] == ["bfloat16"] and r["activation"] == "bfloat16" and r["logits"] == "bfloat16", r
            assert r["master"] == ["float32"] and not r["master_is_model"], r
            assert r["adam_state"] == ["float32"], r
            # every fp32 master moves; a bf16 weight near 1 (norms: spacing 2**-7) cannot take
            # Adam's first step of ~lr = 1e-3, so some model weights keep their value
            assert r["masters_moved"] and any(r["moved"]) and not all(r["moved"]), r
            assert r["scaler"] is None, r  # bf16 needs no loss scaling (upstream: none unless --loss-scale)
        assert reports["bf16"]["main_grad"] == ["float32"]
        assert reports["bf16-distopt"]["main_grad"] == ["float32"]
        assert reports["bf16-grad-reduce-in-bf16"]["main_grad"] == ["bfloat16"]
        assert reports["bf16"]["optimizer"] == ["Float16OptimizerWithFloat16Params"]
        assert reports["bf16"]["masters_synced"], "model params must be the fp32 masters rounded to bf16"
        assert reports["bf16-distopt"]["optimizer"] == ["DistributedOptimizer"]


@pytest.mark.dist
def test_fp16_has_megatron_dynamic_loss_scaler(built):
    for reports in built:
        r = reports["fp16"]
        assert r["param"] == ["float16"] and r["activation"] == "float16", r
        assert r["master"] == ["float32"] and not r["master_is_model"], r
        # upstream: fp16 accumulates grads in fp16 unless --accumulate-allreduce-grads-in-fp32
        assert r["main_grad"] == ["float16"], r
        assert reports["fp16-fp32-grads"]["main_grad"] == ["float32"]
        assert r["scaler"] == {"type": "DynamicGradScaler", "scale": 16.0, "min": 0.5, "window": 7,
                               "hysteresis": 3}, r
        assert r["ok"] and math.isfinite(r["grad_norm"]) and r["masters_moved"] and r["masters_synced"], r


def test_half_precision_attention_returns_its_dtype_and_matches_fp32():
    """Our CPU core attention in bf16/fp16: output in the input dtype, within two of its
    rounding units of fp32 attention over the same (rounded) inputs."""
    import torch

    from dcp_ext.runtime.stages.attention import document_causal_attention

    g = torch.Generator().manual_seed(0)
    lengths = [40, 70, 18]
    q, k, v = (torch.randn(sum(lengths), h, 16, generator=g) for h in (4, 2, 2))
    for dtype, u in ((torch.bfloat16, 2.0 ** -8), (torch.float16, 2.0 ** -11)):
        qh, kh, vh = (x.to(dtype).requires_grad_() for x in (q, k, v))
        out = document_causal_attention(qh, kh, vh, lengths, 0.25)
        ref = document_causal_attention(*(x.detach().float() for x in (qh, kh, vh)), lengths, 0.25)
        assert out.dtype == dtype
        torch.testing.assert_close(out.float(), ref, rtol=2 * u, atol=2 * u)
        out.float().sum().backward()
        assert qh.grad.dtype == dtype and torch.isfinite(qh.grad.float()).all()


# --- flags: upstream Megatron's names, defaults and derived values ---------------------

ARGS = TINY_MODEL + ["--mock-data", "--train-iters", "3"]


def test_loss_scale_flags_have_upstream_defaults_and_reach_the_optimizer_config():
    from megatron.training.arguments import parse_args
    from megatron.training.flags.core_configs import optimizer_config_from_args

    a = parse_args(ARGS + ["--fp16"], world_size=1)
    assert (a.loss_scale, a.initial_loss_scale, a.min_loss_scale, a.loss_scale_window, a.hysteresis) == \
        (None, 2.0 ** 32, 1.0, 1000, 2)
    a = parse_args(ARGS + ["--fp16", "--initial-loss-scale", "1024", "--min-loss-scale", "0.25",
                           "--loss-scale-window", "50", "--hysteresis", "4"], world_size=1)
    c = optimizer_config_from_args(a)
    assert (c.fp16, c.initial_loss_scale, c.min_loss_scale, c.loss_scale_window, c.hysteresis) == \
        (True, 1024, 0.25, 50, 4)


@pytest.mark.parametrize("extra,fp32_grads", [
    ([], False),
    (["--bf16"], True),  # upstream: bf16 accumulates and all-reduces in fp32 ...
    (["--bf16", "--grad-reduce-in-bf16"], False),  # ... unless told otherwise
    (["--fp16"], False),  # upstream: fp16 grads stay fp16 ...
    (["--fp16", "--accumulate-allreduce-grads-in-fp32"], True),  # ... unless asked
])
def test_gradient_accumulation_dtype_follows_upstream(extra, fp32_grads):
    from megatron.training.arguments import parse_args

    assert parse_args(ARGS + extra, world_size=1).accumulate_allreduce_grads_in_fp32 is fp32_grads


@pytest.mark.parametrize("extra,needle", [
    (["--fp16", "--initial-loss-scale", "0.5"], "below --min-loss-scale"),
    (["--fp16", "--hysteresis", "0"], "--hysteresis 0 must be >= 1"),
    (["--fp16", "--loss-scale", "-1"], "--loss-scale -1 must be > 0"),
])
def test_invalid_loss_scaling_is_one_line(extra, needle):
    from megatron.training.arguments import ArgumentError, parse_args

    with pytest.raises(ArgumentError, match=re.escape(needle)):
        parse_args(ARGS + extra, world_size=1)
