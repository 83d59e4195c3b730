"""Stage 1 of the adaptive planner in C++ (csrc/planner.cpp: earliest finish, moves, swaps)
hands every replica the same documents as its Python reference (`planners.stage1.reference`),
for every candidate of the pool on real batches: GPU clusters with pipelines and CP, and
the CPU demo's quadratic memory."""
import numpy as np
import pytest

from dcp_ext.data.lengths import read_lengths
from dcp_ext.planning.batching import global_batches
from dcp_ext.planning.planner import make_planner
from dcp_ext.kernels import kernel
from dcp_ext.planning.planners import stage1 as stage1_module
from dcp_ext.planning.planners.batch_prep import BatchPrep, screen
from dcp_ext.planning.specs import ClusterSpec, ModelSpec

pytestmark = pytest.mark.skipif(kernel("stage1") is None, reason="C++ kernels not built")

CASES = [  # model, cluster, lengths file, max_seq_len, tokens per batch
    ("llama2-7b", "h200x16", "code_python_cl100k.txt", 131072, 2**20),
    ("llama2-70b", "h200x64", "arxiv_summarization_total_llama2.txt", 65536, 2**21),
    ("llama2-13b", "h200x32", "mooncake_conversation_input_tokens.txt", 131072, 2**21),
    ("demo", "cpu-gloox4", "text_reuters21578_cl100k.txt", 2048, 8192),
]


def full_plan_inputs(case, start: int):
    """(planner, prep, counts, placement, sync, order, j_of_pos): every finite candidate of
    the case's adaptive planner on two real batches, as _full_plan hands them to stage 1."""
    model, cluster, data, max_seq_len, tokens = case
    lengths = np.minimum(np.asarray(read_lengths(data)), max_seq_len)
    p = make_planner("adaptive", ModelSpec.from_preset(model), ClusterSpec.from_preset(cluster), max_seq_len=max_seq_len,
                     global_batch_tokens=tokens, length_sample=lengths, sample_count=4)
    for ids in global_batches(lengths.tolist(), tokens, max_seq_len, count=2, start=start):
        prep = BatchPrep(p.cm, p.pool_tables, lengths[ids])
        for counts in p.pool.layouts:
            t, order, bounds = screen(prep, counts)
            if not np.isfinite(t):
                continue
            placement = p.placements[counts]
            sync = [prep.sync(lay, len(placement)) for lay, _ in placement]
            j_of_pos = (np.searchsorted(np.asarray(bounds), np.arange(prep.n), side="right").tolist() if bounds
                        else [len(order) - 1] * prep.n)
            yield p, prep, counts, placement, sync, order, j_of_pos


@pytest.mark.parametrize("model,cluster,data,max_seq_len,tokens", CASES)
def test_cpp_stage1_equals_the_reference(model, cluster, data, max_seq_len, tokens):
    stage1 = kernel("stage1")
    compared = moved = pipelined = 0
    for p, prep, counts, placement, sync, order, j_of_pos in full_plan_inputs((model, cluster, data, max_seq_len,
                                                                               tokens), start=7):
        ref = stage1_module.reference(prep, counts, placement, sync, order, j_of_pos, p.move_targets, p.max_moves)
        got = stage1_module.by_kernel(stage1, prep, counts, placement, sync, order, j_of_pos, p.move_targets,
                                       p.max_moves)
        assert got == ref, counts
        compared += 1
        moved += any(d != sorted(d) for d in ref)  # rebalance moved or swapped a document
        pipelined += any(lay.pp > 1 for lay, _ in placement)
    assert compared >= 2 and moved, (compared, moved)
    if model == "llama2-70b":
        assert pipelined  # pipelines' finish estimate (bubble, largest document) was exercised


@pytest.mark.parametrize("model,cluster,data,max_seq_len,tokens", CASES)
def test_cpp_mix_dynamic_program_equals_the_reference(model, cluster, data, max_seq_len, tokens, monkeypatch):
    """The candidate pool's dynamic program (`best_mix_by_dynamic_program`): the same mix and
    the same time, with and without the replica count's sync, on every type of the planner."""
    from dcp_ext.planning.bound import lower_bound
    from dcp_ext.planning.planners.candidates import best_mix_by_dynamic_program

    lengths = np.minimum(np.asarray(read_lengths(data)), max_seq_len)
    p = make_planner("adaptive", ModelSpec.from_preset(model), ClusterSpec.from_preset(cluster), max_seq_len=max_seq_len,
                     global_batch_tokens=tokens, length_sample=lengths, sample_count=2)
    world = p.cluster.num_gpus
    mixes = set()
    for ids in global_batches(lengths.tolist(), tokens, max_seq_len, count=2, start=3):
        prep = BatchPrep(p.cm, p.tables, lengths[ids])
        lb = lower_bound(p.cm, lengths[ids].tolist(), layouts=list(p.tables))
        for num_replicas in (None, 8):
            monkeypatch.setenv("DCP_KERNELS", "python")
            ref = best_mix_by_dynamic_program(prep, list(p.tables), world, lb, num_replicas=num_replicas)
            monkeypatch.delenv("DCP_KERNELS")
            got = best_mix_by_dynamic_program(prep, list(p.tables), world, lb, num_replicas=num_replicas)
            assert got == ref
            mixes.add(ref[0])
    assert mixes


def test_cpp_first_fit_decreasing_equals_the_reference(monkeypatch):
    """Same bins in the same order, ties in size kept in the documents' order, items larger
    than the cap alone, integer and fractional sizes."""
    from dcp_ext.planning.planners.packing import first_fit_decreasing

    rng = np.random.default_rng(5)
    for trial in range(200):
        n = int(rng.integers(2, 300))
        sizes = rng.integers(1, 5000, size=n + 10)
        if trial % 2:
            sizes = sizes / 7.0
        else:
            sizes = sizes.tolist()  # the planner passes its lengths as a list of ints
        docs = rng.permutation(n + 10)[:n].tolist()
        cap = float(rng.choice([4096, 8192.5, 1e9]))
        monkeypatch.setenv("DCP_KERNELS", "python")
        ref = first_fit_decreasing(docs, sizes, cap)
        monkeypatch.delenv("DCP_KERNELS")
        got = first_fit_decreasing(docs, sizes, cap)
        assert got == ref
        assert sorted(d for b in got for d in b) == sorted(docs)


@pytest.mark.parametrize("model,cluster,data,max_seq_len,tokens", CASES[:3])
def test_cpp_stage2_equals_the_reference(model, cluster, data, max_seq_len, tokens, monkeypatch):
    """Stage 2 of every candidate's full plan on real batches (`pack_and_price`: the kernel
    pack_replicas, which packs every replica and prices the single-stage ones) equals
    pack_replica + finish_replica run in Python replica by replica: the same micro-batches,
    recompute and times, bit for bit; pipelines included (llama2-70b)."""
    from dcp_ext.planning.planners import packing

    by_kernel = recomputed = pipelined = 0
    for p, prep, counts, placement, sync, order, j_of_pos in full_plan_inputs((model, cluster, data, max_seq_len,
                                                                               tokens), start=5):
        docs = stage1_module.reference(prep, counts, placement, sync, order, j_of_pos, p.move_targets, p.max_moves)
        fast = packing._pack_by_kernel(p.cm, p.pool_tables, prep, placement, docs)
        got = packing.pack_and_price(p.cm, p.pool_tables, prep, placement, docs)
        monkeypatch.setenv("DCP_KERNELS", "python")
        ref = [packing.finish_replica(p.cm, p.pool_tables[lay], ranks, prep.s_list,
                                     packing.pack_replica(p.cm, p.pool_tables[lay], prep.s_list,
                                                         [prep.order_list[q] for q in docs[k]],
                                                         stage_cost=prep.cost_by_position(lay)), len(placement))
               for k, (lay, ranks) in enumerate(placement)]
        monkeypatch.delenv("DCP_KERNELS")
        for k, (g, r) in enumerate(zip(got, ref)):
            assert (g.micro_batches, g.time_s, g.pipeline_s, g.sync_s) == (r.micro_batches, r.time_s, r.pipeline_s,
                                                                            r.sync_s), (counts, k)
            if fast is not None and fast[k] is not None:
                by_kernel += 1
                recomputed += any(rs > 0 for _, rs in g.micro_batches)
                pipelined += g.layout.pp > 1
    assert by_kernel >= 10, by_kernel
    if model == "llama2-70b":
        assert pipelined  # the kernel packed pipelined replicas (lpt_bins)
    if model == "llama2-7b":
        assert recomputed  # a document longer than the micro-batch cap ran alone with recompute


@pytest.mark.parametrize("model,cluster,data,max_seq_len,tokens", [CASES[0], CASES[2]])  # pools with pp == 1
def test_cpp_single_stage_pricing_equals_the_reference(model, cluster, data, max_seq_len, tokens, monkeypatch):
    """finish_replica's pricing of pp == 1 replicas (`price_single_stage`): every call the
    planner made on real batches priced again by the Python path, bit for bit; a micro-batch
    over its cap leaves it to the Python path (memory fitted first)."""
    from dcp_ext.planning.planners import packing

    lengths = np.minimum(np.asarray(read_lengths(data)), max_seq_len)
    p = make_planner("adaptive", ModelSpec.from_preset(model), ClusterSpec.from_preset(cluster), max_seq_len=max_seq_len,
                     global_batch_tokens=tokens, length_sample=lengths, sample_count=4)
    calls = []
    real = packing._price_single_stage

    def recorded(cm, tt, s, mbs):
        got = real(cm, tt, s, mbs)
        calls.append((cm, tt, s, list(mbs), got))
        return got

    monkeypatch.setattr(packing, "_price_single_stage", recorded)
    # stage 2 replica by replica (pack_and_price's batched kernel off), so each is priced here
    monkeypatch.setattr(packing, "kernel", lambda name: None if name == "pack_replicas" else kernel(name))
    for i, ids in enumerate(global_batches(lengths.tolist(), tokens, max_seq_len, count=2, start=3)):
        p.plan_iteration(i, ids, lengths[ids].tolist())
    monkeypatch.setattr(packing, "_price_single_stage", real)
    monkeypatch.setenv("DCP_KERNELS", "python")
    priced = with_cp = 0
    for cm, tt, s, mbs, got in calls:
        ref = packing.finish_replica(cm, tt, [0], s, mbs, 1)
        if got is None:
            continue
        assert got == ref.pipeline_s, (tt.layout, got, ref.pipeline_s)
        priced += 1
        with_cp += tt.layout.cp > 1
    assert priced >= 10, priced
    if model == "llama2-13b":
        assert with_cp  # the kv exchange's excess term was exercised


def test_references_are_asked_for_by_either_name(monkeypatch):
    """DCP_KERNELS=python runs the references; DCP_ASSIGN_IMPL=python, its old name, still does."""
    from dcp_ext.kernels import built, kernel

    for name in ("DCP_KERNELS", "DCP_ASSIGN_IMPL"):
        monkeypatch.delenv("DCP_KERNELS", raising=False)
        monkeypatch.delenv("DCP_ASSIGN_IMPL", raising=False)
        assert (kernel("stage1") is not None) == built()
        monkeypatch.setenv(name, "python")
        assert kernel("stage1") is None
