"""The lower bound's C++ search (csrc/bound_solve.cpp) equals its Python reference
(`bound._solve_py`) bit for bit: same bound for every batch, with and without the
longest-document refinement and the pipeline floors, on GPU clusters (pipelines, CP) and
on the CPU demo's (quadratic memory), for real length distributions."""
import numpy as np
import pytest

from dcp_ext.data.lengths import read_lengths
from dcp_ext.planning.batching import global_batches
from dcp_ext.planning.bound import _kernel, bound_tables, lower_bound
from dcp_ext.planning.bound_v2 import lower_bound_v2
from dcp_ext.planning.cost_model import CostModel
from dcp_ext.planning.specs import ClusterSpec, ModelSpec

pytestmark = pytest.mark.skipif(_kernel() is None, reason="C++ kernels not built")

CASES = [  # model, cluster, lengths file, max_seq_len, tokens per batch
    ("llama2-7b", "h200x16", "code_python_cl100k.txt", 32768, 2**19),
    ("llama2-13b", "h200x8", "arxiv_summarization_total_llama2.txt", 65536, 2**19),
    ("llama2-70b", "h200x32", "mooncake_conversation_input_tokens.txt", 131072, 2**20),
    ("llama2-7b", "a800x8", "azure2023_conv_prompt_tokens.txt", 16384, 2**17),
]


def _batches(name, max_seq_len, tokens, count, start):
    lengths = np.minimum(np.asarray(read_lengths(name)), max_seq_len)
    return [lengths[ids].tolist() for ids in global_batches(lengths.tolist(), tokens, max_seq_len, count=count, start=start)]


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
