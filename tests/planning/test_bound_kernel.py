"""The lower bound's tables, vectorised over recompute levels, equal their one-level-at-a-
time reference, and its C++ search (csrc/bound.cpp) equals its Python reference
(`bound._solve_py`) bit for bit: same bound for every batch, with and without the
longest-document refinement and the pipeline floors, on GPU clusters (pipelines, CP) and
on the CPU demo's (quadratic memory), for real length distributions."""
import math

import numpy as np
import pytest

from dcp_ext.data.lengths import read_lengths
from dcp_ext.planning.batching import global_batches
from dcp_ext.kernels import kernel
from dcp_ext.planning.bound import BoundTables, _blank_tables, _layout_constants, bound_tables, lower_bound
from dcp_ext.planning.bound_v2 import RelaxedPrices, lower_bound_v2
from dcp_ext.planning.cost_model import CostModel, Layout
from dcp_ext.planning.specs import ClusterSpec, ModelSpec

needs_kernel = pytest.mark.skipif(kernel("bound_solve") is None, reason="C++ kernels not built")

CASES = [  # model, cluster, lengths file, max_seq_len, tokens per batch
    ("llama2-7b", "h200x16", "code_python_cl100k.txt", 32768, 2**19),
    ("llama2-13b", "h200x8", "arxiv_summarization_total_llama2.txt", 65536, 2**19),
    ("llama2-70b", "h200x32", "mooncake_conversation_input_tokens.txt", 131072, 2**20),
    ("llama2-7b", "a800x8", "azure2023_conv_prompt_tokens.txt", 16384, 2**17),
    ("demo", "cpu-gloox4", "text_reuters21578_cl100k.txt", 2048, 8192),  # quadratic memory
]


def _batches(name, max_seq_len, tokens, count, start):
    lengths = np.minimum(np.asarray(read_lengths(name)), max_seq_len)
    return [lengths[ids].tolist() for ids in global_batches(lengths.tolist(), tokens, max_seq_len, count=count, start=start)]


@pytest.mark.parametrize("model,cluster,data,max_seq_len,tokens", CASES)
def test_tables_equal_the_reference(model, cluster, data, max_seq_len, tokens):
    """Every array, bit for bit, numpy and C++ (where built), with the per-layout terms
    cached across batches, for the cost model and for the v2 bound's relaxed prices."""
    cm = CostModel(ModelSpec.from_preset(model), ClusterSpec.from_preset(cluster))
    for prices in (cm, RelaxedPrices(cm)):
        cache = {}
        for batch in _batches(data, max_seq_len, tokens, 2, start=5) + [[max_seq_len] * 3, [1, 2, 3]]:
            ref = _reference_tables(prices, batch)
            for impl in ("python", "auto"):
                got = bound_tables(prices, batch, cache=cache, impl=impl)
                for name in ("x0", "x1", "psi", "alone", "sync", "size", "q", "c0", "c0fb", "cv", "gamma"):
                    assert np.array_equal(getattr(got, name), getattr(ref, name)), (impl, name)
                assert got.layouts == ref.layouts
        assert cache


@needs_kernel
@pytest.mark.parametrize("model,cluster,data,max_seq_len,tokens", CASES)
def test_cpp_bound_equals_the_reference(model, cluster, data, max_seq_len, tokens):
    cm = CostModel(ModelSpec.from_preset(model), ClusterSpec.from_preset(cluster))
    for batch in _batches(data, max_seq_len, tokens, 3, start=5):
        tb = bound_tables(cm, batch)
        for refine in (True, False):
            for pipeline in (True, False):
                py = lower_bound(cm, batch, tables=tb, refine=refine, pipeline=pipeline, impl="python")
                cpp = lower_bound(cm, batch, tables=tb, refine=refine, pipeline=pipeline)
                assert cpp == py, (refine, pipeline, cpp, py)
        assert lower_bound_v2(cm, batch) > 0


@needs_kernel
def test_cpp_bound_equals_the_reference_on_the_cpu_demo():
    """Quadratic memory (CPU attention keeps its probabilities), 4 gloo ranks, short batches
    including a single document and repeated lengths (ties in the refinement's order)."""
    cm = CostModel(ModelSpec.from_preset("demo"), ClusterSpec.from_preset("cpu-gloox4"))
    rng = np.random.default_rng(3)
    batches = [[2048], [17, 17, 17, 2048], [300] * 20 + [900, 900]]
    batches += [rng.integers(1, 2049, size=int(rng.integers(2, 60))).tolist() for _ in range(12)]
    for batch in batches:
        for refine in (True, False):
            py = lower_bound(cm, batch, refine=refine, impl="python")
            assert lower_bound(cm, batch, refine=refine) == py, batch


def test_the_bound_moves_with_its_input():
    """Not a constant: more work gives a larger bound, in both implementations alike."""
    cm = CostModel(ModelSpec.from_preset("llama2-7b"), ClusterSpec.from_preset("h200x8"))
    small, large = [4096] * 16, [4096] * 64
    for impl in ("python", "auto"):
        assert lower_bound(cm, large, impl=impl) > 3 * lower_bound(cm, small, impl=impl)


def _reference_tables(cm, lengths, layouts=None):
    """`bound_tables` one recompute level at a time (its first form), as the reference."""
    layouts, s, x0, x1, psi, alone, sync, per = _blank_tables(cm, lengths, layouts)
    n = len(s)
    for j, lay in enumerate(layouts):
        c0, c0fb, cv, gamma, rho, kappa, c0f, c0b = _layout_constants(cm, lay)
        sync[j] = cm.sync_time(lay, None)
        per[:, j] = (lay.size, lay.pp - 1, c0, c0fb, cv, gamma)
        Ls = cm.layers_per_stage(lay)
        free = cm.capacity_bytes - cm.state_bytes(lay)
        if free <= 0 or n == 0:
            continue
        # smallest recompute that holds each document alone (caps made monotone)
        caps = np.array([cm.max_tokens(lay, rs, 1) for rs in range(Ls + 1)])
        caps = np.maximum.accumulate(caps)
        rs_min = np.searchsorted(caps, s, side="left")  # first rs with cap >= s
        b_min = np.full(n, np.inf)
        a_min = np.full(n, np.inf)
        for rs in range(int(rs_min.min()), Ls + 1):
            sel = rs_min <= rs
            if not sel.any():
                continue
            co = cm.coeffs(lay, rs)
            keep = cm.act_bytes_per_token(lay, rs)[0]
            ss = s[sel]
            cost = co.doc_cost(ss)
            x0[sel, j] = np.minimum(x0[sel, j], cost)
            x1[sel, j] = np.minimum(x1[sel, j], cost + c0 * lay.pp * keep / free * ss)
            b_min[sel] = np.minimum(b_min[sel], co.a_b * ss * ss + co.b_b * ss + co.c_b)
            a_min[sel] = np.minimum(a_min[sel], lay.pp * co.mb_time(ss * ss, ss, 1))
        alone[:, j] = a_min + sync[j]
        if lay.pp > 1 and rho >= 1.0 and math.isfinite(kappa):
            # (3): f_0 + (1 - 1/rho) * b_k - kappa/rho, b_k >= c0_b + the document's backward
            ok = np.isfinite(b_min)
            psi[ok, j] = c0f + (1.0 - 1.0 / rho) * (c0b + b_min[ok]) - kappa / rho
    return BoundTables(x0, x1, psi, alone, sync, layouts, *per)
