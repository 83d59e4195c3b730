"""Planners keep the CPU attention's quadratic memory within the device budget.

Why it exists: on CPU ranks the core attention keeps every document's softmax
probabilities (heads/tp x s^2 values per layer), so a micro-batch's memory depends on its
documents, not only its token count. The CPU demo ships with a 256 MB budget
(--dcp-device-memory 256MB) and documents up to 2048 tokens: there a 2048-token document
needs ~537 MB of probabilities on tp1, so plans made by token caps overflow. These tests
check every planner's plans against the runtime's own padding (dcp_ext.data.thd) and the
cost model's exact peak (`replica_peak_bytes` with the padded lengths), the recompute level
of a lone document against `act_bytes_per_token`, and that nothing changes where the
quadratic term does not bind (the 4 GiB demo) or does not exist (GPUs).

`python tests/planning/test_planner_quadratic_memory.py` prints, for the demo setting, the adaptive
planner's pool, the layout mixes it picks over 30 batches of the code length file, and how
many replicas of each planner's plans are over the budget (it runs on older checkouts too:
it uses plan_iteration, not the post-condition).
"""
from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest

from dcp_ext.data.lengths import DATA_DIR
from dcp_ext.data.thd import padded_lengths
from dcp_ext.planning.batching import global_batches
from dcp_ext.planning.cost_model import CostModel
from dcp_ext.planning.layout import Layout
from dcp_ext.planning.plan import iteration_to_json
from dcp_ext.planning.planner import PlanningError, make_planner
from dcp_ext.planning.planners.packing import pack_replica
from dcp_ext.planning.planners.tables import make_type_table
from dcp_ext.planning.simulator import lower_bound, simulate_iteration
from dcp_ext.planning.specs import ClusterSpec, ModelSpec

CODE = os.path.join(DATA_DIR, "code_python_cl100k.txt")
MODEL = ModelSpec.from_preset("demo")  # 4 layers, h 128, 8 heads, 4 groups, ffn 352, vocab 512, fp32, tied
BUDGET = ClusterSpec.cpu_gloo(4).with_(memory_bytes=256e6, reserved_bytes=0.0)  # --dcp-device-memory 256MB
KW = dict(max_seq_len=2048, global_batch_tokens=8192)
# every planner that can run the setting (static: a layout that holds 2048 tokens), and
# pipelines, whose 1F1B windows mix micro-batches of many tokens with long documents
SETTINGS = [("adaptive", {}), ("static", {"layout": (2, 2, 1)}), ("static", {"layout": (1, 4, 1)}),
            ("dynamic-cp", {}), ("cp-buckets", {}), ("hydraulis", {}), ("static", {"layout": (1, 2, 2)}),
            ("dynamic-cp", {"setting": (1, 2, 2)}),
            ("adaptive", {"layouts": ["1xtp1cp2pp2", "1xtp2cp1pp2", "2xtp1cp1pp2", "1xtp2cp1pp1+2xtp1cp1pp1"]})]


def setting_id(name, opt) -> str:
    return name + "".join(f"-{v}" for v in opt.values()).replace(" ", "")


def code_lengths(cap: int) -> np.ndarray:
    if not os.path.exists(CODE):
        pytest.skip("data/lengths not present")
    return np.minimum(np.loadtxt(CODE, dtype=np.int64), cap)


def runtime_padding(lay: Layout, lengths) -> list[int]:
    """The runtime's padding of one micro-batch (the engine's padding_for + thd's packer)."""
    each = 2 * lay.cp if lay.cp > 1 else 1
    total = lay.tp * lay.cp if (lay.tp > 1 and MODEL.sequence_parallel) else 1
    return padded_lengths(list(lengths), each, total)


def replica_peaks(cm: CostModel, it, length_of) -> list[float]:
    """Every replica's peak by its padded micro-batches (tokens and lengths)."""
    out = []
    for r in it.replicas:
        lay = Layout(r.tp, r.cp, r.pp)
        lens = [runtime_padding(lay, [length_of[i] for i in mb.sample_ids]) for mb in r.micro_batches]
        rss = [cm.stage_recompute(lay, mb.recompute_layers) for mb in r.micro_batches]
        out.append(cm.replica_peak_bytes(lay, [float(sum(x)) for x in lens], rss, mb_lengths=lens))
    return out


def lone_peak(cm: CostModel, lay: Layout, rs: int, s: int, copies: int) -> float:
    """Peak of `copies` micro-batches holding one document of s tokens each (1F1B keeps pp
    in flight), written out from act_bytes_per_token: the reference of the planners' choice."""
    p = runtime_padding(lay, [s])
    kp, tr, lg = cm.act_bytes_per_token(lay, rs, lengths=p)
    t = float(sum(p))
    tied = MODEL.vocab_size / lay.tp * MODEL.hidden_size * MODEL.activation_bytes \
        if (lay.pp == 1 and not MODEL.untie_embeddings_and_output_weights) else 0.0
    alone = kp * t + max((tr + lg) * t, tr * t + tied)
    window = copies * kp * t + tr * t if copies > 1 else 0.0
    return cm.state_bytes(lay) + max(alone, window)


def least_level(cm: CostModel, lay: Layout, s: int, copies: int):
    for rs in range(cm.layers_per_stage(lay) + 1):
        if lone_peak(cm, lay, rs, s, copies) <= cm.capacity_bytes:
            return rs
    return None


# ---------------------------------------------------------------------------- a lone document
@pytest.mark.parametrize("lay", [(1, 1, 1), (1, 2, 1), (2, 1, 1), (1, 4, 1), (2, 2, 1), (4, 1, 1), (1, 1, 2), (1, 2, 2),
                                 (2, 1, 2), (1, 1, 4)])
def test_lone_document_gets_the_least_recompute_that_fits(lay):
    cm = CostModel(MODEL, BUDGET)
    lay = Layout(*lay)
    tt = make_type_table(cm, lay)
    seen = set()
    for s in (100, 512, 948, 949, 950, 1024, 1061, 1062, 1300, 1500, 1777, 2047, 2048, 2049, 2500):
        want = least_level(cm, lay, s, lay.pp)  # pipelines: pp like it in flight, as token caps did
        assert tt.rs_planned(s) == want, (lay, s)
        if lay.pp == 1:
            assert tt.rs_for(s) == want, (lay, s)
        seen.add(want)
    assert len(seen) >= 2  # the lengths cross levels: the check can fail
    # the longest document a layout holds is exact too
    n = int(tt.max_doc)
    assert least_level(cm, lay, n, lay.pp) is not None and least_level(cm, lay, n + 1, lay.pp) is None


def test_demo_estimates_hold_by_the_cost_model():
    """The brief's estimates for the 256 MB demo, and the gap token caps leave open."""
    cm = CostModel(MODEL, BUDGET)

    def level(lay, s):
        return make_type_table(cm, Layout(*lay)).rs_planned(s)

    for lay in [(1, 1, 1), (1, 1, 2), (1, 1, 4)]:
        assert level(lay, 2048) is None  # no recompute holds it on tp1 cp1
    assert level((1, 2, 1), 2048) == level((2, 1, 1), 2048) == 4  # cp2 / tp2: full recompute
    for lay in [(1, 4, 1), (2, 2, 1), (4, 1, 1)]:
        assert 0 < level(lay, 2048) < 4  # cp4, tp2·cp2, tp4: some recompute
    assert level((1, 1, 1), 1024) > 0
    assert level((1, 1, 1), 512) == 0
    # what the planners used to go by: the token cap holds 2048 tokens on tp1 without
    # recompute, while one such document's probabilities alone are over the budget
    assert make_type_table(cm, Layout(1, 1, 1)).caps_alone[0] > 2048
    assert MODEL.num_layers * MODEL.num_attention_heads * MODEL.activation_bytes * 2048**2 > cm.capacity_bytes


# ---------------------------------------------------------------------------- packed micro-batches
def test_packing_bounds_the_sum_and_max_of_squares():
    """Documents that fit alone without recompute are packed only as far as their squares
    allow; the token cap alone would put them all in one micro-batch."""
    cm = CostModel(MODEL, BUDGET)
    lay = Layout(1, 1, 1)
    tt = make_type_table(cm, lay)
    s = np.array([900, 900, 900, 600, 300, 120, 60, 20])
    assert s.sum() <= tt.cap_mb and s.max() <= tt.doc_caps[0]
    mbs = pack_replica(cm, tt, s, list(range(len(s))))
    assert sorted(d for docs, _ in mbs for d in docs) == list(range(len(s)))
    assert all(rs == 0 for _, rs in mbs)
    peaks = [cm.replica_peak_bytes(lay, [float(s[docs].sum())], [0], mb_lengths=[s[docs].tolist()]) for docs, _ in mbs]
    assert max(peaks) <= cm.capacity_bytes
    assert 1 < len(mbs) < len(s)  # split, but still packed
    # a pipeline replica: the 1F1B windows fit after recompute is raised where needed
    it_ok = []
    for lay in (Layout(1, 1, 2), Layout(1, 2, 2)):
        p = make_planner("adaptive", MODEL, BUDGET, **KW, layouts=[f"{4 // lay.size}x{lay}"])
        lengths = [1400, 1300, 900, 900, 800, 700, 400, 300, 200, 100]
        it = p.plan(0, list(range(len(lengths))), lengths)
        it_ok.append(max(replica_peaks(p.cm, it, dict(enumerate(lengths)))) <= p.cm.capacity_bytes)
    assert all(it_ok)


# ---------------------------------------------------------------------------- every planner
@pytest.fixture(scope="module")
def code_batches():
    lengths = code_lengths(2048)
    return lengths, global_batches(lengths.tolist(), 8192, 2048, count=12)


@pytest.mark.parametrize("name,opt", SETTINGS, ids=[setting_id(n, o) for n, o in SETTINGS])
def test_every_plan_fits_by_its_padded_documents(code_batches, name, opt):
    lengths, batches = code_batches
    p = make_planner(name, MODEL, BUDGET, **KW, length_sample=lengths, **opt)
    cm = p.cm
    for i, ids in enumerate(batches):
        it = p.plan(i, ids, lengths[ids].tolist())  # the post-condition: the simulator's check
        length_of = dict(zip(ids, lengths[ids].tolist()))
        # the lower bound knows no quadratic term: it can only be lower than the plans
        res = simulate_iteration(cm, it, length_of)
        assert res.time_s >= lower_bound(cm, lengths[ids].tolist()) * (1 - 1e-9)
        peaks = replica_peaks(cm, it, length_of)
        assert max(peaks) <= cm.capacity_bytes * (1 + 1e-9), (name, i, max(peaks) / cm.capacity_bytes)
        for r in it.replicas:  # no 2048-token document on a layout that cannot hold it
            for mb in r.micro_batches:
                if max(length_of[j] for j in mb.sample_ids) == 2048:
                    assert r.tp * r.cp >= 2
                    assert mb.recompute_layers > 0


def test_pool_sees_the_same_feasibility(code_batches):
    """The adaptive planner's pool holds no layout mix that cannot run a 2048 document, and
    every layout in it can hold what the water-filling estimate gives it."""
    lengths, _ = code_batches
    p = make_planner("adaptive", MODEL, BUDGET, **KW, length_sample=lengths)
    assert p.pool.layouts
    for mix in p.pool.layouts:
        assert any(p.tables[lay].max_doc >= 2048 for lay, _ in mix), mix
    for t in p.tables.values():  # tp1 cp1 cannot hold 2048 tokens, whatever its buffers
        if t.layout.tp * t.layout.cp == 1:
            assert t.max_doc < 2048


def test_simulator_checks_padded_micro_batches():
    from dcp_ext.planning.plan import IterationPlan, MicroBatchPlan, ReplicaPlan

    cm = CostModel(MODEL, BUDGET)
    lengths = [1021, 333, 7]
    lay = Layout(2, 2, 1)
    rep = ReplicaPlan([0, 1, 2, 3], 2, 2, 1, [MicroBatchPlan([0, 1, 2], 2 * 1)])
    res = simulate_iteration(cm, IterationPlan(0, [0, 1, 2], [rep]), dict(enumerate(lengths)))
    padded = runtime_padding(lay, lengths)
    assert padded != lengths
    want = cm.replica_peak_bytes(lay, [float(sum(padded))], [2], mb_lengths=[padded])
    assert res.replicas[0].peak_bytes == pytest.approx(want, rel=1e-12)
    assert res.replicas[0].peak_bytes > cm.replica_peak_bytes(lay, [float(sum(lengths))], [2], mb_lengths=[lengths])


@pytest.mark.parametrize("name,opt,needle", [
    ("static", {"layout": (1, 1, 1)}, "cannot hold a pack of 2048 tokens"),
    ("adaptive", {"layouts": ["4xtp1cp1pp1"]}, "fits no candidate layout"),
])
def test_a_document_nothing_holds_is_one_line(name, opt, needle):
    p = None
    with pytest.raises(PlanningError) as e:
        p = make_planner(name, MODEL, BUDGET, **KW, **opt)
        p.plan(0, [0, 1], [2048, 100])
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_too_long_for_every_layout_is_one_line():
    for name in ("adaptive", "dynamic-cp"):
        with pytest.raises(PlanningError) as e:
            make_planner(name, MODEL, BUDGET, max_seq_len=4096, global_batch_tokens=8192)
        assert "4096" in str(e.value) and "\n" not in str(e.value), name


# ---------------------------------------------------------------------------- unchanged elsewhere
def _plans(name, cluster, lengths, batches, **opt):
    p = make_planner(name, MODEL, cluster, max_seq_len=2048, global_batch_tokens=8192, length_sample=lengths, **opt)
    return p.describe(), [json.dumps(iteration_to_json(p.plan(i, ids, lengths[ids].tolist()))) for i, ids in enumerate(batches)]


@pytest.mark.parametrize("name", ["adaptive", "static", "dynamic-cp", "cp-buckets", "hydraulis"])
def test_old_demo_plans_unchanged(name, monkeypatch):
    """4 GiB CPU ranks and documents up to 512 tokens: the quadratic term never binds, and
    the plans are those of the token caps alone (the quadratic checks switched off)."""
    from dcp_ext.planning.cost_memory import MemoryAccounting

    lengths = code_lengths(512)
    batches = global_batches(lengths.tolist(), 8192, 2048, count=4)
    cluster = ClusterSpec.cpu_gloo(4)
    assert CostModel(MODEL, cluster).quadratic(Layout(1, 1, 1))
    with_quadratic = _plans(name, cluster, lengths, batches)
    monkeypatch.setattr(MemoryAccounting, "quadratic", lambda self, layout: False)
    assert not CostModel(MODEL, cluster).quadratic(Layout(1, 1, 1))
    assert _plans(name, cluster, lengths, batches) == with_quadratic


def test_gpus_have_no_quadratic_term():
    model = ModelSpec.from_preset("llama2-7b")
    cm = CostModel(model, ClusterSpec.from_preset("h100x8"))
    for lay in cm.all_layouts():
        assert not cm.quadratic(lay)
        tt = make_type_table(cm, lay)
        assert not tt.quadratic and tt.doc_caps == tt.plan_caps and tt.max_doc == tt.plan_caps[-1]


# ---------------------------------------------------------------------------- the figures
def main() -> None:
    lengths = code_lengths(2048)
    batches = global_batches(lengths.tolist(), 8192, 2048, count=30)
    print(f"demo on {BUDGET.name}, {BUDGET.gpu.memory_bytes / 1e6:.0f} MB per rank, 30 batches of {os.path.basename(CODE)}")
    for name, opt in SETTINGS:
        try:
            p = make_planner(name, MODEL, BUDGET, **KW, length_sample=lengths, **opt)
        except PlanningError as e:
            print(f"{name} {opt}: {e}")
            continue
        over = total = 0
        mixes: dict[str, int] = {}
        for i, ids in enumerate(batches):
            it = p.plan_iteration(i, ids, lengths[ids].tolist())
            peaks = replica_peaks(p.cm, it, dict(zip(ids, lengths[ids].tolist())))
            over += sum(x > p.cm.capacity_bytes * (1 + 1e-9) for x in peaks)
            total += len(peaks)
            mix = "+".join(sorted(f"tp{r.tp}cp{r.cp}pp{r.pp}" for r in it.replicas))
            mixes[mix] = mixes.get(mix, 0) + 1
        print(f"{setting_id(name, opt)}: {over}/{total} replicas over the budget; {p.describe()}")
        if name == "adaptive":
            print(f"  {len(mixes)} distinct layout mixes picked: " + ", ".join(f"{m} x{n}" for m, n in mixes.items()))


if __name__ == "__main__":
    sys.exit(main())
