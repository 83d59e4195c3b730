"""dcp-plan: write the plan (dcp-plan/v1 JSON) of K iterations of a run.

Why it exists: the runtime can execute a precomputed plan, and a user can inspect what
the planner would do on their data and cluster without any GPU.

    dcp-plan --lengths data.txt --model llama2-7b --cluster h200x64 \
        --global-batch-tokens 4194304 --max-seq-len 131072 --iterations 20 \
        --planner adaptive --out plan.json
"""
from __future__ import annotations

import sys
import time

import numpy as np

from dcp_ext.cli.boundary import check_output, writing
from dcp_ext.cli.common import (Parser, add_common_args, batches, cluster_spec, load_lengths, model_spec,
                                planner_options, run_tool, validate_common_args)
from dcp_ext.data.progress import Progress
from dcp_ext.planning.plan import Plan, validate_iteration
from dcp_ext.planning.planner import OLD_NAMES, PLANNERS, make_planner


def main(argv: list[str] | None = None) -> int:
    return run_tool(lambda: _main(argv))


def _main(argv: list[str] | None) -> int:
    p = Parser(prog="dcp-plan", description=__doc__.split("\n\n")[0])
    add_common_args(p)
    p.add_argument("--planner", default="adaptive", choices=PLANNERS + tuple(OLD_NAMES))
    p.add_argument("--out", required=True, help="plan JSON to write")
    args = p.parse_args(argv)
    validate_common_args(args)
    check_output("--out", args.out)  # before the planning, not after it
    lengths = load_lengths(args.lengths)
    truncated = np.minimum(lengths, args.max_seq_len)
    model, cluster = model_spec(args.model), cluster_spec(args.cluster)
    planner = make_planner(args.planner, model, cluster, max_seq_len=args.max_seq_len,
                           global_batch_tokens=args.global_batch_tokens, length_sample=truncated,
                           profile=args.profile, memory_margin=args.memory_margin, seed=args.seed,
                           progress=not args.quiet, **planner_options(args.planner, args))
    plan = Plan(cluster=cluster.to_json(), model=model.to_json())
    bs = batches(args, lengths, "dcp-plan")
    times = []
    with Progress(f"dcp-plan {args.planner}", total=len(bs), unit="it", enabled=not args.quiet) as bar:
        for i, ids in enumerate(bs):
            t0 = time.perf_counter()
            it = planner.plan_iteration(i, ids, truncated[ids].tolist())
            times.append(time.perf_counter() - t0)
            validate_iteration(it, cluster.num_gpus, model.num_layers, model.num_attention_heads, model.num_query_groups)
            plan.iterations.append(it)
            bar.update(1)
    with writing("--out", args.out, "the plan"):
        plan.dump(args.out)
    print(f"{planner.describe()}", file=sys.stderr)
    print(f"wrote {len(plan.iterations)} iterations to {args.out}; predicted mean {np.mean([it.predicted_time_s for it in plan.iterations]):.3f} s/iter, "
          f"planning {1000 * float(np.median(times)):.1f} ms/iter (median)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
