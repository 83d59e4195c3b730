"""The cost model's activation memory against an exact measurement on the CPU.

`benchmarks/bench_activation_memory.py --quick` measures the peak of live activation bytes
(a TorchDispatchMode tracking every storage, forward + backward) for packed micro-batches
of 512 and 2048 tokens under TP1, CP2 and PP2 on 2 gloo ranks, with and without full
recompute, and prints the cost model's prediction beside it. Memory, not time: the claim
is numeric and deterministic, so it is asserted (within 15%).
"""
import json
import os
import subprocess
import sys

import pytest

from dcp_ext.planning.cost_model import CostModel, Layout
from dcp_ext.planning.specs import ClusterSpec, ModelSpec

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(REPO, "benchmarks", "bench_activation_memory.py")


@pytest.mark.dist
@pytest.mark.parametrize("kernel", ["math", "flash"])
def test_predicted_activation_peak_matches_measurement(tmp_path, kernel):
    out = tmp_path / "act.json"
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, BENCH, "--quick", "--cpu-attention", kernel, "--json", str(out)], cwd=REPO,
                          env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.load(open(out))["rows"]
    assert {(r["layout"], bool(r["recompute"])) for r in rows} == {
        (lay, rc) for lay in ("TP1", "CP2", "PP2") for rc in (False, True)}
    for r in rows:
        assert r["measured"] > 1 << 20  # activations, not noise
        assert abs(r["predicted"] - r["measured"]) <= 0.15 * r["measured"], r
    # full recompute really keeps less
    by = {(r["layout"], r["recompute"] > 0, r["tokens"]): r["measured"] for r in rows}
    for lay in ("TP1", "CP2", "PP2"):
        assert by[(lay, True, 2048)] < 0.5 * by[(lay, False, 2048)]


def test_quadratic_attention_terms_are_cpu_only():
    model = ModelSpec.from_preset("demo")
    lengths = [1024, 512, 512]
    cpu = CostModel(model, ClusterSpec.cpu_gloo(4))
    gpu = CostModel(model, ClusterSpec.from_preset("h100x8"))
    lay = Layout(1, 1, 1)
    # flash/TE attention keeps O(s) per document: lengths change nothing on a GPU
    assert gpu.act_bytes_per_token(lay, 0, lengths) == gpu.act_bytes_per_token(lay, 0)
    assert gpu.replica_peak_bytes(lay, [2048], [0], mb_lengths=[lengths]) == gpu.replica_peak_bytes(lay, [2048], [0])
    # the CPU math path keeps heads x s^2 probabilities per layer: one long document costs more
    packed = cpu.replica_peak_bytes(lay, [2048], [0], mb_lengths=[lengths])
    single = cpu.replica_peak_bytes(lay, [2048], [0], mb_lengths=[[2048]])
    assert single > packed > cpu.replica_peak_bytes(lay, [2048], [0])
    extra = model.num_layers * model.num_attention_heads * model.activation_bytes * (2048**2 - sum(s * s for s in lengths))
    assert single - packed >= extra


def test_flash_kernel_keeps_no_probabilities():
    """--dcp-cpu-attention flash: memory linear in document lengths without CP (the kernel
    keeps log-sum-exp, not probabilities); under CP the float mask of each document, one
    value per (query, key) pair for all heads, where math keeps one per head."""
    model = ModelSpec.from_preset("demo")
    math_cm = CostModel(model, ClusterSpec.cpu_gloo(4))
    flash_cm = CostModel(model.with_(cpu_attention="flash"), ClusterSpec.cpu_gloo(4))
    one, cp2 = Layout(1, 1, 1), Layout(1, 2, 1)
    assert not flash_cm.quadratic(one) and flash_cm.quadratic(cp2) and math_cm.quadratic(one)
    packed, single = [1024, 512, 512], [2048]
    assert flash_cm.replica_peak_bytes(one, [2048], [0], mb_lengths=[single]) == \
        flash_cm.replica_peak_bytes(one, [2048], [0], mb_lengths=[packed])
    assert flash_cm.replica_peak_bytes(one, [2048], [0], mb_lengths=[single]) < \
        math_cm.replica_peak_bytes(one, [2048], [0], mb_lengths=[packed])
    # under CP2: the mask's pairs (one value each) make a long document cost more
    mask = model.num_layers * model.activation_bytes * (2048 ** 2 - sum(s * s for s in packed)) / 2
    grow = flash_cm.replica_peak_bytes(cp2, [2048], [0], mb_lengths=[single]) - \
        flash_cm.replica_peak_bytes(cp2, [2048], [0], mb_lengths=[packed])
    assert grow == pytest.approx(mask, rel=1e-9)
