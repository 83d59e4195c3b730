"""Activation memory on the CPU, measured exactly, vs the cost model's prediction.

Why it exists: the planner decides recompute and micro-batch sizes from
`CostModel.replica_peak_bytes`; if the activation terms are off, plans either run out
of memory or recompute for nothing. This measures what megatron-core's layers really
keep (and the transient peak on top) for single micro-batches under TP1, TP2 (sequence
parallel), CP2 and PP2 on a 2-rank gloo world, with and without full recompute, and
prints measured vs predicted.

    python benchmarks/bench_activation_memory.py            # 512 .. 16K tokens, ~4 min on 2 cores
    python benchmarks/bench_activation_memory.py --quick    # 512 and 2K tokens, TP1/CP2/PP2 (the test)
    python benchmarks/bench_activation_memory.py --docs single --tokens 512 2048 4096
    python benchmarks/bench_activation_memory.py --probe --layouts TP1 --tokens 2048   # itemized

Measurement. A `TorchDispatchMode` sees every aten op (forward, recompute and backward:
the autograd engine runs CPU backward ops on the calling thread with the mode active).
Every storage an op creates (not a view or in-place result of one of its inputs) is
counted once, keyed by its StorageImpl; a weakref finalizer on the storage takes it off
when it is freed. The peak of live bytes during forward+backward of the micro-batch,
counted from an empty tracker, is the activation peak: parameters and their gradients
(allocated before, accumulated in place) are not counted; weight-gradient tensors before
they are added into `.grad` are, as on a GPU without gradient-accumulation fusion.
Scratch that lives only inside one aten kernel is invisible (nothing of consequence
here: GEMMs and the math attention path allocate their outputs through ops). Exact and
deterministic: the same run gives the same bytes. Caches that would carry an earlier
point's sizes (megatron-core's global memory buffer, RoPE's lru cache) are dropped
before each point, so their allocation counts in it.

Prediction: `CostModel.replica_peak_bytes(layout, [T], [rs], mb_lengths=[lengths]) -
state_bytes(layout)`, with the ModelSpec built by `run_config.model_spec_for` from the
same Megatron args the model is built from, `ClusterSpec.cpu_gloo(2)` (the CPU backend:
it selects the CPU core attention's and torch norms' terms), T the padded pack length,
`lengths` its padded document lengths, rs = layers per stage for full recompute. For PP2
the measured value is the larger of the two stages' peaks, each stage with the one
micro-batch in flight (stage 0 keeps its activations until stage 1 sends the gradient
back): the cost model's replica peak.

Micro-batches: packed documents, as the runtime feeds them (THD, document-masked, each
document padded to 2*cp under CP and cut into CP chunks by `executor.localize`, the pack
padded to tp under sequence parallel, `data.thd.build_micro_batch`). Document lengths are
read in order from `/work/shared/data/lengths/text_reuters21578_cl100k.txt` (real Reuters
newswire stories, cl100k tokens, median 154), each truncated to `--max-doc` (default
1024), the last one cut so the pack holds exactly T tokens: 3 documents at 512 tokens,
74 at 16K. `--docs single` packs one document of T tokens instead: the CPU attention's
probabilities are quadratic (4 heads x T^2 x 4 bytes per layer), so keep T <= 4K there.
Token ids are random (memory does not depend on them).

Model (Megatron flags, fp32 on the CPU): 4 layers, hidden 128, 4 heads / 2 query groups
(GQA), SwiGLU ffn 384, RMSNorm, RoPE, no biases, tied embeddings, vocabulary 1024: small
enough for 16K tokens on one core, large enough that the per-token terms dominate the
per-parameter transients (under 1 MB).

CPU attention: by default (`--cpu-attention math`) `dcp_ext.runtime.stages.attention` calls SDPA on
3-D [heads, s, d] tensors, which torch runs on its math path: it keeps the softmax
probabilities, heads x s^2 per document per layer, and GQA-expanded keys/values of the whole
document on every CP rank. `--cpu-attention flash` (the run's `--dcp-cpu-attention flash`)
runs torch's CPU flash kernel, which keeps O(s) per document, as TE does on a GPU.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import sys
import tempfile
import time
import traceback
import weakref

REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, REPO)

LENGTHS = "/work/shared/data/lengths/text_reuters21578_cl100k.txt"
LAYERS, HIDDEN, HEADS, GROUPS, FFN, VOCAB = 4, 128, 4, 2, 384, 1024
MAX_POS = 16384
LAYOUTS = {  # name -> (tp, cp, pp, ranks)
    "TP1": (1, 1, 1, (0,)),
    "TP2": (2, 1, 1, (0, 1)),
    "CP2": (1, 2, 1, (0, 1)),
    "PP2": (1, 1, 2, (0, 1)),
}


def megatron_flags(groups: int = GROUPS) -> list[str]:
    return [
        "--num-layers", str(LAYERS), "--hidden-size", str(HIDDEN), "--num-attention-heads", str(HEADS),
        "--group-query-attention", "--num-query-groups", str(groups), "--ffn-hidden-size", str(FFN),
        "--seq-length", str(MAX_POS), "--max-position-embeddings", str(MAX_POS),
        "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--tokenizer-type", "NullTokenizer",
        "--vocab-size", str(VOCAB - 1), "--lr", "1e-3", "--train-iters", "1", "--data-path", "unused",
        "--dcp", "--dcp-global-batch-tokens", str(MAX_POS),
    ]


def megatron_args(world_size: int, groups: int = GROUPS, cpu_attention: str = "math"):
    from megatron.training.arguments import parse_args

    args = parse_args(megatron_flags(groups) + ["--dcp-cpu-attention", cpu_attention], world_size=world_size)
    args.padded_vocab_size = VOCAB
    # sequence parallel whenever tp > 1, as the runtime runs it (the flag itself is refused
    # at tp 1); run_config.model_spec_for reads it from here
    args.sequence_parallel = True
    return args


def pack_lengths(tokens: int, docs: str, max_doc: int) -> list[int]:
    """Document lengths of a micro-batch of exactly `tokens` tokens (see the module doc)."""
    if docs == "single":
        return [tokens]
    out, total = [], 0
    with open(LENGTHS) as f:
        for line in f:
            n = min(int(line), max_doc, tokens - total)
            out.append(n)
            total += n
            if total == tokens:
                return out
    raise ValueError(f"{LENGTHS} holds fewer than {tokens} tokens")


# --------------------------------------------------------------------------- measurement
def _tracker_class():
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class LiveBytes(TorchDispatchMode):
        """Live bytes of the storages aten ops create while the mode is active, and their peak.

        With `label_fn` (diagnostics), each storage also records what created it and the
        storages live at the peak are kept (by serial number: addresses get reused)."""

        def __init__(self, label_fn=None):
            super().__init__()
            self.live: dict[int, tuple[int, int]] = {}  # StorageImpl address -> (bytes, serial)
            self.current = 0
            self.peak = 0
            self.serial = 0
            self.label_fn = label_fn
            self.labels: dict[int, tuple] = {}  # serial -> (module, op, shape, dtype)
            self.peak_live: dict[int, int] = {}  # serial -> bytes, at the peak
            self.peak_at = None

        def _free(self, key, serial):
            got = self.live.get(key)
            if got is not None and got[1] == serial:
                del self.live[key]
                self.current -= got[0]

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            inputs = None
            for t in tree_leaves(out):
                if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                    continue
                st = t.untyped_storage()
                key = st._cdata
                if key in self.live:
                    continue
                if inputs is None:  # views and in-place results alias an input: not new
                    inputs = {x.untyped_storage()._cdata for x in tree_leaves((args, kwargs))
                              if isinstance(x, torch.Tensor) and x.device.type != "meta"}
                if key in inputs:
                    continue
                n = st.nbytes()
                self.serial += 1
                self.live[key] = (n, self.serial)
                self.current += n
                weakref.finalize(st, self._free, key, self.serial)
                if self.label_fn is not None:
                    self.labels[self.serial] = (self.label_fn(), str(func), tuple(t.shape), str(t.dtype))
            if self.current > self.peak:
                self.peak = self.current
                if self.label_fn is not None:
                    self.peak_at = (self.label_fn(), str(func))
                    self.peak_live = self.sizes()
            return out

        def sizes(self) -> dict[int, int]:
            return {s: n for n, s in self.live.values()}

    return LiveBytes


def _module_labels(model):
    """A stack of module names kept by hooks: the name of the module running now."""
    stack = []
    for name, mod in model.named_modules():
        mod.register_forward_pre_hook(lambda m, a, name=name: stack.append(name))
        mod.register_forward_hook(lambda m, a, o: (stack.pop(), None)[1])
    return lambda: stack[-1] if stack else "<backward>"


def _itemize(tracker, serials, sizes, rows):
    """Storages grouped by (module, op, dtype): [label, bytes per row, count, first shape]."""
    groups = {}
    for s in serials:
        mod, op, shape, dtype = tracker.labels.get(s, ("?", "?", (), ""))
        g = groups.setdefault(f"{mod} | {op} | {dtype}", [0, 0, list(shape)])
        g[0] += sizes[s]
        g[1] += 1
    return sorted(([k, v[0] / rows, v[1], v[2]] for k, v in groups.items()), key=lambda r: -r[1])


def _seed_rng_tracker(seed: int, tp_rank: int) -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    tracker = get_cuda_rng_tracker()
    tracker.reset()
    tracker.add("model-parallel-rng", seed + 2718 + tp_rank)
    tracker.add("data-parallel-rng", seed)
    tracker.add("expert-parallel-rng", seed + 1024 + tp_rank)


def run_rank(rank: int, world: int, cfg: dict) -> list[dict]:
    """This rank's part of every (layout, recompute, tokens) point it belongs to."""
    import numpy as np
    import torch
    import torch.distributed as dist

    from dcp_ext.compat import mcore_compat
    from dcp_ext.data.thd import build_micro_batch
    from dcp_ext.runtime.stages.model import build_gpt_model
    from dcp_ext.runtime.schedule.executor import localize, set_recompute
    from dcp_ext.planning.layout import ReplicaType
    from dcp_ext.runtime.stages.groups import GroupRegistry
    from megatron.core import parallel_state
    from megatron.training.flags.core_configs import transformer_config_from_args

    LiveBytes = _tracker_class()
    args = megatron_args(world, cfg["groups"], cfg["cpu_attention"])
    mcore_compat.ensure_global_memory_buffer()
    reps = {name: ReplicaType(tp, cp, pp, ranks) for name, (tp, cp, pp, ranks) in LAYOUTS.items()}
    registry = GroupRegistry(list(reps.values()))  # every group, once, in the same order everywhere
    rng = np.random.default_rng(0)
    probe = cfg.get("probe", False)
    rows = []
    for name in cfg["layouts"]:
        rep = reps[name]
        if rank not in rep.ranks:
            dist.barrier()
            continue
        tp_rank, cp_rank, pp_rank = rep.coords(rank)
        sp = rep.tp > 1 and args.sequence_parallel
        config = transformer_config_from_args(args, tensor_model_parallel_size=rep.tp, context_parallel_size=rep.cp,
                                              pipeline_model_parallel_size=rep.pp, sequence_parallel=sp)
        first, last = pp_rank == 0, pp_rank == rep.pp - 1
        model = build_gpt_model(config, VOCAB, args.max_position_embeddings, first, last,
                                pg_collection=registry.collection(rep), position_embedding_type="rope",
                                share_embeddings_and_output_weights=True, cpu_attention=cfg["cpu_attention"])
        model.train()
        for p in model.parameters():  # gradients exist before: model state, not activations
            p.grad = torch.zeros_like(p)
        layers_in_stage = LAYERS // rep.pp
        label = _module_labels(model) if probe else None
        prev = rep.rank_at(tp_rank, cp_rank, pp_rank - 1) if not first else None
        nxt = rep.rank_at(tp_rank, cp_rank, pp_rank + 1) if not last else None
        group = registry.group(rep.ranks)
        for full in cfg["recompute"]:
            rs = layers_in_stage if full else 0  # recomputed layers of this stage
            for tokens in cfg["tokens"]:
                lengths = pack_lengths(tokens, cfg["docs"], cfg["max_doc"])
                docs = [rng.integers(0, VOCAB - 1, size=n) for n in lengths]
                batch = build_micro_batch(docs, pad_each_to=2 * rep.cp if rep.cp > 1 else 1,
                                          pad_total_to=rep.tp if sp else 1)
                padded = torch.diff(batch.cu_seqlens_padded).tolist()
                mb = localize(batch, rep.cp, cp_rank, rep.tp, sp, HIDDEN, rs * rep.pp)
                set_recompute(config, layers_in_stage, rs)
                parallel_state._GLOBAL_MEMORY_BUFFER = None  # caches sized by an earlier point
                mcore_compat.ensure_global_memory_buffer()
                model.rotary_pos_emb.forward.cache_clear()
                _seed_rng_tracker(1234, tp_rank)
                gc.collect()
                dist.barrier(group=group)
                t0 = time.perf_counter()
                tracker = LiveBytes(label)
                with tracker:
                    x = None
                    if not first:  # the stage input, held until this stage's backward
                        x = torch.empty(mb.hidden_shape, dtype=torch.float32)
                        dist.recv(x, src=prev)
                        x.requires_grad_()
                        model.set_input_tensor(x)
                    out = model(mb.tokens, mb.position_ids, None, labels=mb.labels if last else None,
                                packed_seq_params=mb.packed_seq_params)
                    if last:
                        out = (out * mb.loss_mask).sum() / max(batch.num_loss_tokens, 1)
                    kept = tracker.current
                    fwd_serials = {s for _, s in tracker.live.values()} if probe else set()
                    fwd_sizes = tracker.sizes() if probe else {}
                    if last:
                        out.backward()
                    else:
                        dist.send(out.detach().contiguous(), dst=nxt)
                        grad = torch.empty_like(out)
                        dist.recv(grad, src=nxt)
                        torch.autograd.backward(out, grad_tensors=grad)
                    if not first:
                        dist.send(x.grad.contiguous(), dst=prev)
                    del out, x
                    gc.collect()
                row = dict(layout=name, rank=rank, stage=pp_rank, recompute=rs, tokens=tokens, docs=len(lengths),
                           lengths=padded, peak=tracker.peak, kept=kept, left=tracker.current,
                           seconds=time.perf_counter() - t0)
                if probe:
                    local = len(mb.tokens[0])
                    row.update(peak_at=tracker.peak_at,
                               kept_items=_itemize(tracker, fwd_serials, fwd_sizes, local),
                               peak_new_items=_itemize(tracker, set(tracker.peak_live) - fwd_serials,
                                                       tracker.peak_live, local))
                rows.append(row)
        del model
        gc.collect()
        dist.barrier()
    return rows


def _worker(rank, world, port, cfg, result_dir):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    from dcp_ext.compat import cpu_compat

    cpu_compat.install()
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        status = {"ok": True, "rows": run_rank(rank, world, cfg)}
    except BaseException:
        status = {"ok": False, "error": traceback.format_exc()}
    with open(os.path.join(result_dir, f"{rank}.json"), "w") as f:
        json.dump(status, f)
    dist.destroy_process_group()


def measure(cfg: dict, world: int = 2) -> list[dict]:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as d:
        mp.start_processes(_worker, args=(world, port, cfg, d), nprocs=world, start_method="spawn", join=True)
        rows = []
        for r in range(world):
            with open(os.path.join(d, f"{r}.json")) as f:
                status = json.load(f)
            if not status["ok"]:
                raise RuntimeError(f"rank {r} failed:\n{status['error']}")
            rows += status["rows"]
    return rows


# --------------------------------------------------------------------------- prediction
def predict(rows: list[dict], groups: int = GROUPS, cpu_attention: str = "math") -> list[dict]:
    """One row per (layout, recompute, tokens): the replica's measured peak (the largest of
    its ranks') and the cost model's activation peak."""
    from dcp_ext.planning.cost_model import CostModel, Layout
    from dcp_ext.planning.specs import ClusterSpec
    from megatron.training.adaptive.run_config import model_spec_for

    cm = CostModel(model_spec_for(megatron_args(2, groups, cpu_attention)), ClusterSpec.cpu_gloo(2))
    points = {}
    for r in rows:
        points.setdefault((r["layout"], r["recompute"], r["tokens"]), []).append(r)
    out = []
    for (name, rs, tokens), ranks in points.items():
        ranks = sorted(ranks, key=lambda r: r["rank"])
        tp, cp, pp, _ = LAYOUTS[name]
        lay = Layout(tp, cp, pp)
        lengths = ranks[0]["lengths"]
        pred = cm.replica_peak_bytes(lay, [sum(lengths)], [rs], mb_lengths=[lengths]) - cm.state_bytes(lay)
        meas = max(r["peak"] for r in ranks)
        out.append(dict(layout=name, recompute=rs, tokens=tokens, docs=ranks[0]["docs"], padded=sum(lengths),
                        measured=meas, predicted=pred, ratio=pred / meas, per_rank=[r["peak"] for r in ranks],
                        kept=[r["kept"] for r in ranks], seconds=max(r["seconds"] for r in ranks)))
    return out


def _print_probe(raw):
    for r in raw:
        if "kept_items" not in r:
            continue
        print(f"== {r['layout']} rank {r['rank']} recompute {r['recompute']} tokens {r['tokens']}: "
              f"peak at {r['peak_at']}; bytes per local row")
        print("   -- live at the peak, created after the forward:")
        for k, b, n, shape in r["peak_new_items"][:12]:
            print(f"   {b:10.1f}  x{n:<4d} {k}  {shape}")
        print("   -- kept at the end of the forward (one layer shown):")
        for k, b, n, shape in r["kept_items"]:
            if ".layers." not in k or ".layers.0." in k or k.startswith("decoder.layers.0 "):
                print(f"   {b:10.1f}  x{n:<4d} {k}  {shape}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="512 and 2048 tokens under TP1, CP2, PP2 (~1 min)")
    ap.add_argument("--tokens", type=int, nargs="+", default=None)
    ap.add_argument("--layouts", nargs="+", default=None, choices=list(LAYOUTS))
    ap.add_argument("--recompute", choices=["both", "none", "full"], default="both")
    ap.add_argument("--docs", choices=["packed", "single"], default="packed")
    ap.add_argument("--max-doc", type=int, default=1024, help="truncate packed documents to this length")
    ap.add_argument("--groups", type=int, default=GROUPS, help=f"query groups (GQA; {HEADS} = plain multi-head)")
    ap.add_argument("--probe", action="store_true", help="itemize what is kept and what is live at the peak")
    ap.add_argument("--cpu-attention", choices=["math", "flash"], default="math",
                    help="the document attention's kernel (--dcp-cpu-attention)")
    ap.add_argument("--json", default=None, help="write the table here")
    a = ap.parse_args(argv)
    tokens = a.tokens or ([512, 2048] if a.quick else [512, 1024, 2048, 4096, 8192, 16384])
    layouts = a.layouts or (["TP1", "CP2", "PP2"] if a.quick else list(LAYOUTS))
    recompute = {"both": [False, True], "none": [False], "full": [True]}[a.recompute]
    cfg = dict(tokens=tokens, layouts=layouts, recompute=recompute, docs=a.docs, max_doc=a.max_doc, probe=a.probe,
               groups=a.groups, cpu_attention=a.cpu_attention)
    t0 = time.perf_counter()
    raw = measure(cfg)
    table = predict(raw, a.groups, a.cpu_attention)
    if a.probe:
        _print_probe(raw)
    import torch

    print(f"model: {LAYERS} layers, hidden {HIDDEN}, {HEADS} heads / {a.groups} query groups, SwiGLU ffn {FFN}, "
          f"vocab {VOCAB}, RMSNorm, RoPE, tied embeddings, fp32; TP2 with sequence parallel; torch {torch.__version__}; "
          f"{a.cpu_attention} attention")
    print("micro-batches: " + (f"packed documents from {os.path.basename(LENGTHS)} (in file order, each <= "
                               f"{a.max_doc} tokens)" if a.docs == "packed" else "one document each"))
    print(f"{'layout':6s} {'recompute':9s} {'tokens':>7s} {'docs':>5s} {'measured MB':>12s} {'predicted MB':>13s} "
          f"{'ratio':>6s}  {'per rank MB':>13s}")
    worst = 0.0
    for r in table:
        worst = max(worst, abs(r["predicted"] - r["measured"]) / r["measured"])
        per = "/".join(f"{p / 2**20:.1f}" for p in r["per_rank"])
        print(f"{r['layout']:6s} {'full' if r['recompute'] else 'none':9s} {r['tokens']:7d} {r['docs']:5d} "
              f"{r['measured'] / 2**20:12.2f} {r['predicted'] / 2**20:13.2f} {r['ratio']:6.3f}  {per:>13s}")
    print(f"MB = 2^20 bytes. worst |pred-meas|/meas = {worst:.1%} (target <= 15%); {time.perf_counter() - t0:.0f} s")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rows": table, "worst": worst, "config": cfg}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
