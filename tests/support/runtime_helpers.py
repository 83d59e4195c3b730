"""Shared pieces of the runtime tests: the tiny model, an engine, plans and a plain-torch reference."""
from __future__ import annotations

import numpy as np
import torch

from dcp_ext.planning.plan import IterationPlan, MicroBatchPlan, ReplicaPlan

# RoPE, GQA (8 heads, 4 groups: TP up to 4), SwiGLU, RMSNorm, fp32, tied embeddings.
RUNTIME_MODEL = [
    "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "8", "--num-query-groups", "4",
    "--ffn-hidden-size", "128", "--seq-length", "256", "--max-position-embeddings", "256",
    "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
    "--hidden-dropout", "0", "--attention-dropout", "0", "--tokenizer-type", "NullTokenizer",
    "--vocab-size", "255", "--lr", "1e-3", "--weight-decay", "0.1", "--clip-grad", "0.5",
    # Adam divides by sqrt(v) + eps: with eps 1e-8, fp32 rounding noise in gradients of
    # ~1e-8 (rarely used embedding rows) moves parameters by ~1e-4 in the first step. A
    # larger eps keeps the update well conditioned; gradients are compared directly too.
    "--adam-eps", "1e-5",
    "--train-iters", "10", "--data-path", "unused", "--dcp", "--dcp-global-batch-tokens", "4096",
    "--dcp-recalibration", "off",  # plans from fixed prices: runs comparable bit for bit
]
VOCAB = 256


def tiny_args(world_size: int):
    from megatron.training.arguments import parse_args

    args = parse_args(RUNTIME_MODEL, world_size=world_size)
    args.padded_vocab_size = VOCAB
    return args


def make_builders(args):
    from dcp_ext.runtime.stages.model import build_gpt_model
    from megatron.training.flags.core_configs import transformer_config_from_args

    def make_config(tp, cp, pp, sp):
        return transformer_config_from_args(args, tensor_model_parallel_size=tp, context_parallel_size=cp,
                                            pipeline_model_parallel_size=pp, sequence_parallel=sp)

    def build_model(config, pre, post, pg):
        return build_gpt_model(config, VOCAB, args.max_position_embeddings, pre, post, pg_collection=pg,
                               position_embedding_type="rope", share_embeddings_and_output_weights=True)

    return make_config, build_model


def make_engine(args, replica_types, grad_scaler=None, optimizer_options=None, **options):
    """options: EngineOptions' fields (sequence_parallel, exchange, overlap, bucket_numel,
    device, layer_strategies, ...); the optimizer AdamW from the args unless given."""
    from dcp_ext.runtime.engine import AdaptiveEngine
    from dcp_ext.runtime.options import EngineOptions
    from dcp_ext.runtime.params.sharded_optimizer import OptimizerOptions

    make_config, build_model = make_builders(args)
    optimizer = optimizer_options or OptimizerOptions(lr=args.lr, weight_decay=args.weight_decay, eps=args.adam_eps,
                                                      clip_grad=args.clip_grad)
    return AdaptiveEngine(replica_types, make_config, build_model, EngineOptions(optimizer=optimizer, **options),
                          grad_scaler=grad_scaler)


def random_docs(n: int, seed: int, lo: int = 5, hi: int = 70) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, VOCAB - 1, size=int(rng.integers(lo, hi))) for _ in range(n)]


def loss_tokens(docs) -> int:
    return sum(len(d) - 1 for d in docs)


def plan_for(index: int, layout: list[tuple], n_docs: int, recompute_every: int = 0) -> IterationPlan:
    """layout: [(ranks, tp, cp, pp, n_micro_batches)]; documents dealt round robin over
    replicas, then over each replica's micro-batches; every `recompute_every`-th
    micro-batch recomputes all layers."""
    shares = [list(range(i, n_docs, len(layout))) for i in range(len(layout))]
    replicas = []
    k = 0
    for (ranks, tp, cp, pp, n_mb), share in zip(layout, shares):
        mbs = []
        for m in range(n_mb):
            ids = share[m::n_mb]
            k += 1
            mbs.append(MicroBatchPlan(ids, 4 if recompute_every and k % recompute_every == 0 else 0))
        replicas.append(ReplicaPlan(list(ranks), tp, cp, pp, mbs))
    return IterationPlan(index, list(range(n_docs)), replicas)


class InMemoryDocuments:
    """Token arrays as a document dataset (what the engine's batch path reads)."""

    def __init__(self, docs):
        self.docs = docs

    def __getitem__(self, i: int):
        return self.docs[i]

    def lengths_of(self, ids):
        return [len(self.docs[i]) for i in ids]


def engine_step(engine, plan: IterationPlan, docs):
    """One step through the engine's own batch path (fetch, pack, pad, localise, count)."""
    return engine.train_iteration(plan, InMemoryDocuments(docs))


class Reference:
    """One process, full model, plain torch: per-token loss over the global batch, clip, AdamW."""

    def __init__(self, engine, args, flat: torch.Tensor):
        make_config, build_model = make_builders(args)
        self.model = build_model(make_config(1, 1, 1, False), True, True, engine.registry.single_rank_collection())
        self.space = engine.space
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                t = self.space.tensors[name]
                p.copy_(flat[t.offset : t.offset + t.numel].view(p.shape))
        decay = [p for n, p in self.model.named_parameters() if not self.space.tensors[n].no_weight_decay]
        no_decay = [p for n, p in self.model.named_parameters() if self.space.tensors[n].no_weight_decay]
        self.opt = torch.optim.AdamW([{"params": decay}, {"params": no_decay, "weight_decay": 0.0}], lr=args.lr,
                                     weight_decay=args.weight_decay, eps=args.adam_eps, foreach=False)
        self.clip = args.clip_grad

    def step(self, docs):
        from dcp_ext.data.thd import build_micro_batch

        self.model.zero_grad()
        n = loss_tokens(docs)
        total = 0.0
        for d in docs:
            b = build_micro_batch([d])
            out = self.model(b.tokens[None], b.position_ids[None], None, labels=b.labels[None],
                             packed_seq_params=b.packed_seq_params())
            loss = (out * b.loss_mask[None]).sum()
            (loss / n).backward()
            total += float(loss.detach())
        params = list(self.model.parameters())
        self.last_grad = self.flat(grad=True)
        norm = float(torch.sqrt(sum(p.grad.double().pow(2).sum() for p in params)))
        coeff = self.clip / (norm + 1e-6)
        if coeff < 1:
            for p in params:
                p.grad.mul_(coeff)
        self.opt.step()
        return total / n, norm

    def flat(self, grad: bool = False) -> torch.Tensor:
        out = torch.empty(self.space.numel)
        for name, p in self.model.named_parameters():
            t = self.space.tensors[name]
            out[t.offset : t.offset + t.numel] = (p.grad if grad else p).detach().flatten()
        return out
