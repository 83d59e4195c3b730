"""Measured vs predicted peak memory per micro-batch on one GPU (issue 6, memory safety).

Builds the model given by Megatron flags at TP1/PP1/CP1 on the GPU, runs forward+backward
of single packed micro-batches of growing token counts (with and without full recompute),
and compares torch.cuda.max_memory_allocated with dcp_ext.cost_model's prediction
(`replica_peak_bytes`). Prints a table and exits non-zero if any prediction is off by
more than 10%. Run by scripts/gpu_check.sh; needs CUDA.

    python scripts/gpu_memory_check.py --yaml-cfg examples/cpu_demo.yaml --bf16
"""
from __future__ import annotations

import sys

import torch


def main(argv=None) -> int:
    if not torch.cuda.is_available():
        print("gpu_memory_check: no CUDA device; skipped")
        return 0
    import os

    os.environ.setdefault("RANK", "0")
    from dcp_ext.cost_model import CostModel
    from dcp_ext.data.thd import build_micro_batch
    from dcp_ext.runtime.groups import ReplicaType
    from dcp_ext.runtime.executor import localize, set_recompute
    from dcp_ext.specs import ClusterSpec, ModelSpec
    from megatron.training.arguments import parse_args
    from megatron.training.initialize import initialize_distributed
    from megatron.training.training import transformer_config_from_args
    import pretrain_gpt_dcp as entry
    from megatron.training import global_vars

    args = parse_args(list(argv if argv is not None else sys.argv[1:]) + ["--dcp", "--dcp-global-batch-tokens",
                                                                           "1048576"], world_size=1)
    global_vars.set_args(args)
    initialize_distributed("nccl")
    global_vars.build_tokenizer(args)
    from dcp_ext.runtime.groups import GroupRegistry

    rep = ReplicaType(1, 1, 1, (0,))
    registry = GroupRegistry([rep])
    config = transformer_config_from_args(args)
    model = entry.model_provider(config, True, True, pg_collection=registry.collection(rep)).cuda()
    cm = CostModel(ModelSpec.from_megatron_args(args), ClusterSpec.from_preset("h100x1"), None, 0.0)
    layout = next(l for l in cm.all_layouts() if (l.tp, l.cp, l.pp) == (1, 1, 1))
    static = torch.cuda.memory_allocated()
    worst = 0.0
    print(f"{'tokens':>8s} {'recompute':>9s} {'measured MB':>12s} {'predicted MB':>13s} {'error':>7s}")
    for tokens in (1024, 2048, 4096, 8192):
        for recompute in (0, args.num_layers):
            docs = [torch.randint(0, 250, (tokens // 2,)).numpy()] * 2
            mb = localize(build_micro_batch(docs), 1, 0, 1, False, args.hidden_size, recompute, device="cuda")
            set_recompute(config, args.num_layers, recompute)
            torch.cuda.reset_peak_memory_stats()
            out = model(mb.tokens, mb.position_ids, None, labels=mb.labels, packed_seq_params=mb.packed_seq_params)
            (out * mb.loss_mask).sum().backward()
            measured = torch.cuda.max_memory_allocated() - static
            predicted = cm.replica_peak_bytes(layout, [tokens], [recompute]) - cm.state_bytes(layout)
            err = abs(measured - predicted) / measured
            worst = max(worst, err)
            print(f"{tokens:8d} {recompute:9d} {measured / 2**20:12.1f} {predicted / 2**20:13.1f} {err:7.1%}")
            model.zero_grad(set_to_none=True)
    print(f"worst error {worst:.1%} (goal <= 10%)")
    return 0 if worst <= 0.10 else 1


if __name__ == "__main__":
    sys.exit(main())
