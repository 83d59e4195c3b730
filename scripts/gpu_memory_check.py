"""Measured vs predicted memory of the adaptive runtime on one GPU (NCCL, world size 1).

Builds the `--dcp` engine for the model given by Megatron flags (one TP1 replica on this
GPU: its shared parameter and fp32 main-grad buffers, the optimizer shard, the exchange
buffers), then runs `engine.step` on single packed micro-batches of growing token counts,
with and without full recompute, and compares
- the engine's persistent bytes (measured: `torch.cuda.memory_allocated` after a first step
  has created Adam's state) with `CostModel.state_bytes`, and
- each step's peak (`torch.cuda.max_memory_allocated`) with `CostModel.replica_peak_bytes`.
Prints a table; exits non-zero if a prediction is off by more than 10%. `--json PATH` (taken
out before the Megatron flags are parsed) also writes the table there (scripts/gpu_check.py
puts it in its summary, phase d). Run by scripts/gpu_check.sh; needs CUDA (without it, it
says so and exits 0).

    python scripts/gpu_memory_check.py --yaml-cfg examples/cpu_demo.yaml --bf16 [--json table.json]
"""
from __future__ import annotations

import json
import sys

import torch

TOKENS = (1024, 2048, 4096, 8192, 16384)
GOAL = 0.10  # the largest relative error accepted


def take_json_path(argv: list[str]) -> tuple[list[str], str | None]:
    """argv without `--json PATH`, and PATH (None when absent)."""
    if "--json" not in argv:
        return argv, None
    i = argv.index("--json")
    if i + 1 >= len(argv):
        raise SystemExit("gpu_memory_check: --json needs a path")
    return argv[:i] + argv[i + 2:], argv[i + 1]


def write_json(path: str | None, table: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(table, f, indent=1)


def main(argv=None) -> int:
    argv, json_path = take_json_path(list(argv if argv is not None else sys.argv[1:]))
    if not torch.cuda.is_available():
        print("gpu_memory_check: no CUDA device; skipped")
        write_json(json_path, {"skipped": "no CUDA device: torch.cuda.max_memory_allocated needs a GPU"})
        return 0
    # plain python, one process: initialize_distributed makes the world of one (and its port)
    import pretrain_gpt_dcp as entry
    from dcp_ext.planning.cost_model import CostModel, Layout
    from dcp_ext.data.thd import build_micro_batch
    from dcp_ext.planning.plan import IterationPlan, MicroBatchPlan, ReplicaPlan
    from dcp_ext.runtime.engine import AdaptiveEngine
    from dcp_ext.planning.layout import ReplicaType
    from megatron.training import global_vars
    from megatron.training.arguments import parse_args
    from megatron.training.initialize import initialize_distributed
    from megatron.training.adaptive.run_config import AdaptiveRunConfig
    from megatron.training.adaptive.run_config import cluster_for
    from megatron.training.flags.core_configs import transformer_config_from_args

    args = parse_args(argv + ["--dcp", "--dcp-global-batch-tokens", str(2 * max(TOKENS))], world_size=1)
    global_vars.set_args(args)
    initialize_distributed("nccl")
    global_vars.build_tokenizer(args, cluster_for(1, args))  # the vocabulary padded as a --dcp run pads it
    rep = ReplicaType(1, 1, 1, (0,))
    run_config = AdaptiveRunConfig.from_args(args, on_cpu=False)
    engine = AdaptiveEngine(
        [rep],
        lambda tp, cp, pp, sp: transformer_config_from_args(args, tensor_model_parallel_size=tp,
                                                            context_parallel_size=cp, pipeline_model_parallel_size=pp,
                                                            sequence_parallel=sp),
        lambda config, pre, post, pg: entry.model_provider(config, pre_process=pre, post_process=post,
                                                           pg_collection=pg),
        run_config.engine,
    )
    # the run's own view: the planner's ModelSpec (with the kernels this machine builds) and this GPU
    cm = CostModel(run_config.model, cluster_for(1, args), None, 0.0)
    layout = Layout(1, 1, 1)
    vocab = min(args.padded_vocab_size, 250)

    def step(index: int, tokens: int, recompute: int):
        docs = [torch.randint(0, vocab, (tokens // 2,)).numpy()] * 2
        plan = IterationPlan(index, [0, 1], [ReplicaPlan([0], 1, 1, 1, [MicroBatchPlan([0, 1], recompute)])])
        return engine.step(plan, [build_micro_batch(docs)], tokens - 2)

    step(0, TOKENS[0], 0)  # Adam's moments exist from the first step on
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated()
    own = sum(engine.persistent_bytes().values())
    predicted_state = cm.state_bytes(layout)
    worst = abs(held - predicted_state) / held
    print(f"persistent: measured {held / 2**20:.1f} MiB, engine's count {own / 2**20:.1f} MiB "
          f"({engine.persistent_bytes()}), cost model {predicted_state / 2**20:.1f} MiB, "
          f"error {abs(held - predicted_state) / held:.1%}")
    table = {"device": torch.cuda.get_device_name(), "replica": "tp1 cp1 pp1, one GPU",
             "persistent": {"measured_bytes": int(held), "engine_count_bytes": int(own),
                            "predicted_bytes": float(predicted_state),
                            "error": float(abs(held - predicted_state) / held),
                            "engine_parts": {k: int(v) for k, v in engine.persistent_bytes().items()}},
             "rows": [], "goal": GOAL}
    print(f"{'tokens':>8s} {'recompute':>9s} {'peak MiB':>10s} {'predicted MiB':>14s} {'error':>7s}")
    for i, tokens in enumerate(TOKENS):
        for recompute in (0, args.num_layers):
            torch.cuda.reset_peak_memory_stats()
            step(1 + i, tokens, recompute)
            measured = torch.cuda.max_memory_allocated()
            predicted = cm.replica_peak_bytes(layout, [tokens], [recompute])
            err = abs(measured - predicted) / measured
            worst = max(worst, err)
            table["rows"].append({"tokens": tokens, "recompute_layers": recompute, "peak_bytes": int(measured),
                                  "predicted_bytes": float(predicted), "error": float(err)})
            print(f"{tokens:8d} {recompute:9d} {measured / 2**20:10.1f} {predicted / 2**20:14.1f} {err:7.1%}")
    print(f"worst error {worst:.1%} (goal <= {GOAL:.0%})")
    table.update(worst_error=float(worst), passed=bool(worst <= GOAL))
    write_json(json_path, table)
    return 0 if worst <= GOAL else 1


if __name__ == "__main__":
    sys.exit(main())
