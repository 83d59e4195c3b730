"""The adaptive engine through TP, CP and PP layouts, a layout switch and a layer-strategy
micro-batch, on 4 ranks: on the simulated CUDA device (SIMULATED_CUDA=1) or on the CPU.

    torchrun --standalone --nproc_per_node 4 tests/support/simulated_cuda/scenario.py OUT_PREFIX

Each rank writes OUT_PREFIX.RANK.json: per step the loss and gradient norm, and on the
simulated device the host synchronisations inside the step (kind, call site), the device
collectives in issue order, the bytes allocated while the engine was built and at rest,
the peak over the optimizer step beyond what is at rest before it, and every engine or
stage tensor that is not on the model's device. The same plans run on both, so the
losses can be compared one to one.
"""
from __future__ import annotations

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
sys.path.insert(0, REPO)

SIMULATED = os.environ.get("SIMULATED_CUDA") == "1"
if SIMULATED:
    from tests.support import simulated_cuda

    sim = simulated_cuda.install(os.environ.get("SIMULATED_CUDA_SHIM"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

# (name, replicas: [(ranks, tp, cp, pp, micro-batches, recompute every k-th)], layer strategies of replica 0)
STEPS = [
    ("2×tp2 (sequence parallel)", [((0, 1), 2, 1, 1, 2, 0), ((2, 3), 2, 1, 1, 2, 2)], False),
    ("cp2 + pp2 (a layout switch)", [((0, 1), 1, 2, 1, 2, 0), ((2, 3), 1, 1, 2, 3, 0)], False),
    ("tp2 switching layers to cp2 + 2×tp1", [((0, 1), 2, 1, 1, 3, 0), ((2,), 1, 1, 1, 1, 0), ((3,), 1, 1, 1, 2, 0)],
     True),
    ("2×tp2 again", [((0, 1), 2, 1, 1, 2, 0), ((2, 3), 2, 1, 1, 2, 0)], False),
]


def plan(index: int, replicas, switching: bool, n_docs: int):
    from dcp_ext.planning.plan import IterationPlan, LayerStrategy, MicroBatchPlan, ReplicaPlan

    shares = [list(range(i, n_docs, len(replicas))) for i in range(len(replicas))]
    out = []
    for r, ((ranks, tp, cp, pp, n_mb, every), share) in enumerate(zip(replicas, shares)):
        mbs = [MicroBatchPlan(share[m::n_mb], 4 if every and (m + 1) % every == 0 else 0) for m in range(n_mb)]
        if switching and r == 0:
            mbs[0].layer_strategies = [LayerStrategy(0, 1, tp, cp), LayerStrategy(2, 3, 1, 2)]
            mbs[1].layer_strategies = [LayerStrategy(0, 3, 1, 2)]
        out.append(ReplicaPlan(list(ranks), tp, cp, pp, mbs))
    return IterationPlan(index, list(range(n_docs)), out)


def replica_types():
    from dcp_ext.planning.layout import ReplicaType

    types = set()
    for _, replicas, _ in STEPS:
        for ranks, tp, cp, pp, _, _ in replicas:
            types.add(ReplicaType(tp, cp, pp, tuple(ranks)))
    return sorted(types, key=ReplicaType.sort_key)


def off_device(engine, device) -> list[str]:
    """Every tensor of the engine's state and stages that is not on `device` (Adam's step
    counts excepted: torch keeps them on the host by design)."""
    found = []

    def check(name, t):
        if isinstance(t, torch.Tensor) and t.device.type != device.type:
            found.append(f"{name} on {t.device}")

    check("bank.params", engine.bank.params)
    check("bank.main_grads", engine.bank.main_grads)
    opt = engine.optimizer
    check("optimizer.flat", opt.flat)
    check("optimizer.grad", opt.grad)
    for i, state in enumerate(opt.inner.state.values()):
        for key, t in state.items():
            if key != "step":
                check(f"optimizer.state[{i}].{key}", t)
    for rep, stage in engine.bank.stages.items():
        for name, module in stage.model.named_modules():
            for key, t in list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False)):
                check(f"{rep.label()}:{name}.{key}", t)
            for key, t in vars(module).items():
                check(f"{rep.label()}:{name}.{key}", t)
    return found


def main(prefix: str) -> None:
    from dcp_ext.compat import cpu_compat

    cpu_compat.install()  # a no-op on the simulated device (CUDA is there)
    dist.init_process_group("nccl" if SIMULATED else "gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    from tests.support.runtime_helpers import InMemoryDocuments, make_engine, random_docs, tiny_args

    args = tiny_args(dist.get_world_size())
    report = {"steps": [], "simulated": SIMULATED}
    if SIMULATED:
        sim.peak, total_before = sim.allocated, sim.allocated_total
    engine = make_engine(args, replica_types(), sequence_parallel=True, layer_strategies=True, overlap=True,
                         bucket_numel=8192)
    if SIMULATED:
        report["build"] = {"peak": sim.peak, "at_rest": sim.allocated,
                           "allocated_total": sim.allocated_total - total_before,
                           "persistent": sum(engine.persistent_bytes().values())}
        report["shard_numel"] = engine.optimizer.flat.numel()
        step = engine.server.step

        def observed_step(norm):  # the optimizer's transient beyond what is at rest
            before = sim.allocated
            sim.peak = before
            try:
                return step(norm)
            finally:
                report.setdefault("optimizer_transient", []).append(sim.peak - before)

        engine.server.step = observed_step
        from dcp_ext.runtime.params import sharded_optimizer

        sharded_optimizer.NORM_CHUNK = 4096  # well below the shard: a copy of it would show
        square_sum = engine.optimizer.grad_square_sum

        def observed_square_sum():  # the gradient norm's transient
            before = sim.allocated
            sim.peak = before
            try:
                return square_sum()
            finally:
                report.setdefault("norm_transient", []).append(sim.peak - before)

        engine.optimizer.grad_square_sum = observed_square_sum
    for index, (name, replicas, switching) in enumerate(STEPS):
        docs = random_docs(16, seed=70 + index, lo=5, hi=90)
        it = plan(index, replicas, switching, len(docs))
        syncs = len(sim.sync_log) if SIMULATED else 0
        collectives = len(sim.collective_log) if SIMULATED else 0
        result = engine.train_iteration(it, InMemoryDocuments(docs))
        entry = {"name": name, "loss": result.loss, "grad_norm": result.grad_norm}
        if SIMULATED:
            entry["syncs"] = sim.sync_log[syncs:]
            entry["collectives"] = sim.collective_log[collectives:]
        report["steps"].append(entry)
    if SIMULATED:
        report["at_rest_after_steps"] = sim.allocated
        report["off_device"] = off_device(engine, engine.device)
        report["faults"] = simulated_cuda.violations()
        report["group_ranks"] = sim.group_ranks
    with open(f"{prefix}.{rank}.json", "w") as f:
        json.dump(report, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
