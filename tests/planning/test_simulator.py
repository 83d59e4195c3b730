"""Simulator: 1F1B against textbook numbers and an independent solver; the lower bound
against exhaustive search on tiny clusters and against every planner on real batches."""
import itertools
import random

import numpy as np
import pytest

from dcp_ext.planning.cost_model import CostModel, Layout
from dcp_ext.planning.plan import IterationPlan, MicroBatchPlan, ReplicaPlan
from dcp_ext.planning.simulator import lower_bound, one_f_one_b, simulate_iteration
from dcp_ext.planning.specs import ClusterSpec, ModelSpec


@pytest.mark.parametrize("m,pp", [(1, 1), (4, 1), (1, 4), (4, 4), (8, 4), (3, 8), (16, 2)])
def test_equal_micro_batches_match_the_textbook(m, pp):
    f, b = 1.0, 2.0
    got = one_f_one_b([f] * m, [b] * m, pp).makespan
    assert got == pytest.approx((m + pp - 1) * (f + b))


def _reference_1f1b(fwd, bwd, pp):
    """Independent solver: explicit per-stage op lists, relaxed to a fixpoint."""
    m = len(fwd)
    ops = []  # per stage list of (kind, mb)
    for j in range(pp):
        warm = min(pp - 1 - j, m)
        seq = [("F", i) for i in range(warm)]
        for i in range(m - warm):
            seq += [("F", warm + i), ("B", i)]
        seq += [("B", i) for i in range(m - warm, m)]
        ops.append(seq)
    end = {}
    changed = True
    while changed:
        changed = False
        for j in range(pp):
            t = 0.0
            for kind, i in ops[j]:
                dur = fwd[i] if kind == "F" else bwd[i]
                if kind == "F":
                    dep = end.get(("F", i, j - 1), 0.0 if j == 0 else None)
                else:
                    dep = end.get(("F", i, j)) if j == pp - 1 else end.get(("B", i, j + 1))
                if dep is None:
                    break
                e = max(t, dep) + dur
                if end.get((kind, i, j)) != e:
                    end[(kind, i, j)] = e
                    changed = True
                t = e
    return max(end.values())


def test_1f1b_matches_an_independent_solver():
    rng = random.Random(7)
    for _ in range(300):
        pp = rng.choice([1, 2, 3, 4, 6])
        m = rng.randint(1, 9)
        fwd = [rng.uniform(0.1, 3) for _ in range(m)]
        bwd = [f * rng.uniform(1.5, 3.5) for f in fwd]
        assert one_f_one_b(fwd, bwd, pp).makespan == pytest.approx(_reference_1f1b(fwd, bwd, pp))


def test_makespan_at_least_the_work_of_one_stage_and_one_micro_batch_alone():
    rng = random.Random(3)
    for _ in range(200):
        pp = rng.choice([2, 4, 8])
        m = rng.randint(1, 12)
        fwd = [rng.uniform(0.01, 2) for _ in range(m)]
        bwd = [2 * f for f in fwd]
        t = one_f_one_b(fwd, bwd, pp).makespan
        assert t >= sum(fwd) + sum(bwd) - 1e-9
        assert t >= pp * max(f + b for f, b in zip(fwd, bwd)) - 1e-9


# ---------------------------------------------------------------------------- exhaustive
def _set_partitions(items):
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for part in _set_partitions(rest):
        for k in range(len(part)):
            yield part[:k] + [[first] + part[k]] + part[k + 1:]
        yield [[first]] + part


def _layout_multisets(types, world):
    types = sorted(types, key=lambda l: (-l.size, l))

    def rec(i, left):
        if left == 0:
            yield []
            return
        if i == len(types):
            return
        t = types[i]
        for k in range(left // t.size, -1, -1):
            for rest in rec(i + 1, left - k * t.size):
                yield [t] * k + rest

    yield from rec(0, world)


def _best_plan_time(cm, lengths):
    """Minimum simulated time over every layout, assignment, packing, order and (none /
    least / full) recompute: the exhaustive optimum of small instances."""
    world = cm.cluster.num_gpus
    docs = list(range(len(lengths)))
    length_of = dict(enumerate(lengths))
    best = np.inf
    for layout in _layout_multisets(cm.all_layouts(), world):
        R = len(layout)
        ranks, start = [], 0
        for lay in layout:
            ranks.append(list(range(start, start + lay.size)))
            start += lay.size
        for assign in itertools.product(range(R), repeat=len(docs)):
            per = [[d for d in docs if assign[d] == r] for r in range(R)]
            options = []
            for r, lay in enumerate(layout):
                Ls = cm.layers_per_stage(lay)
                opts = []
                for part in _set_partitions(per[r]):
                    for order in itertools.permutations(part):
                        for rsv in itertools.product(sorted({0, Ls // 2, Ls}), repeat=len(order)):
                            opts.append([MicroBatchPlan(list(mb), rs * lay.pp) for mb, rs in zip(order, rsv)])
                options.append(opts if opts else [[]])
            for combo in itertools.product(*options):
                it = IterationPlan(0, docs, [ReplicaPlan(ranks[r], *layout[r], micro_batches=list(combo[r])) for r in range(R)])
                res = simulate_iteration(cm, it, length_of)
                if res.memory_ok:
                    best = min(best, res.time_s)
    return best


def _tiny(world, memory=None):
    cl = ClusterSpec.cpu_gloo(world)
    if memory is not None:
        cl = cl.with_(memory_bytes=memory, reserved_bytes=0.0)
    return CostModel(ModelSpec.from_preset("demo"), cl)


@pytest.mark.parametrize("world,lengths,memory", [
    (2, [2048, 300], None),
    (2, [1500, 1500, 200], None),
    # tight memory: recompute and splitting matter (the CPU attention's probabilities of a
    # 2048-token document alone need ~134 MB in its backward on 2 ranks: 0.3 GB, not 0.12)
    (2, [2048, 1024, 64], 0.3e9),
    (4, [2048, 700], None),
    (4, [1200, 900, 50], 0.12e9),
])
def test_lower_bound_below_exhaustive_optimum(world, lengths, memory):
    cm = _tiny(world, memory)
    opt = _best_plan_time(cm, lengths)
    lb = lower_bound(cm, lengths)
    assert np.isfinite(opt)
    assert lb <= opt * (1 + 1e-9)
    assert lb >= 0.5 * opt  # and not vacuous


def test_lower_bound_is_exact_for_one_document_on_one_device():
    cm = _tiny(1)
    for s in [64, 700, 2048]:
        opt = _best_plan_time(cm, [s])
        assert lower_bound(cm, [s]) == pytest.approx(opt, rel=1e-9)


def test_simulated_memory_flags_overfull_plans():
    cm = _tiny(1, 0.1e9)
    it = IterationPlan(0, [0], [ReplicaPlan([0], 1, 1, 1, [MicroBatchPlan([0], 0)])])
    assert not simulate_iteration(cm, it, {0: 200000}).memory_ok
    assert simulate_iteration(cm, it, {0: 100}).memory_ok
