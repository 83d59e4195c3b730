"""Cost model: FLOP counts against independent arithmetic, document masking, memory."""
import numpy as np
import pytest

from dcp_ext.planning.cost_model import CostModel, Layout
from dcp_ext.planning.specs import ClusterSpec, ModelSpec


@pytest.fixture(scope="module")
def cm7():
    return CostModel(ModelSpec.from_preset("llama2-7b"), ClusterSpec.from_preset("h200x64"))


def test_matmul_flops_are_twice_the_layer_weights(cm7):
    # forward GEMM FLOPs per token = 2 * weights (the 6N rule's forward third)
    m = cm7.model
    weights = m.layer_params - 2 * m.hidden_size  # without the two norm vectors
    assert cm7.layer_matmul_flops_per_token == pytest.approx(2 * weights)


def test_training_flops_match_6n_plus_attention(cm7):
    # one TP1 GPU, no recompute: b * tokens should be (6 * weights-per-token FLOPs) / achieved FLOP/s
    lay = Layout(1, 1, 1)
    co = cm7.coeffs(lay, 0)
    g = cm7.cluster.gpu
    m = cm7.model
    n_matmul = m.num_layers * (m.layer_params - 2 * m.hidden_size) + m.vocab_size * m.hidden_size
    assert co.b == pytest.approx(6 * n_matmul / (g.peak_flops * g.matmul_efficiency), rel=1e-9)
    # causal attention: 2*h*s^2 forward FLOPs per layer, 2.5x for the backward
    assert co.a == pytest.approx(m.num_layers * 2 * m.hidden_size * 3.5 / (g.peak_flops * g.attention_efficiency), rel=1e-9)


def test_attention_is_document_masked(cm7):
    lay = Layout(2, 1, 1)
    together = cm7.mb_stage_time([3000, 5000], lay)
    one_doc = cm7.mb_stage_time([8000], lay)
    co = cm7.coeffs(lay, 0)
    # packing two documents costs the sum of their squares, not the pack length squared
    assert one_doc - together == pytest.approx(co.a * (8000 ** 2 - 3000 ** 2 - 5000 ** 2), rel=1e-9)


def test_micro_batch_cost_is_at_least_its_documents(cm7):
    rng = np.random.default_rng(0)
    for lay in [Layout(1, 1, 1), Layout(2, 4, 1), Layout(1, 8, 2), Layout(8, 2, 1)]:
        co = cm7.coeffs(lay, 0)
        for _ in range(20):
            docs = rng.integers(1, 60000, size=rng.integers(1, 8))
            assert cm7.mb_stage_time(docs, lay) >= float(np.sum(co.doc_cost(docs))) + co.c0 - 1e-12
            # the pack's unhidden CP exchange never exceeds the documents' own
            s = docs.astype(float)
            assert co.excess(float(s @ s), float(s.sum())) <= sum(co.excess(x * x, x) for x in s) + 1e-12


def test_recompute_costs_time_and_saves_memory(cm7):
    lay = Layout(1, 1, 1)
    times = [cm7.mb_stage_time([20000], lay, rs) for rs in range(0, 33, 8)]
    caps = [cm7.max_tokens(lay, rs) for rs in range(0, 33, 8)]
    assert all(a < b for a, b in zip(times, times[1:]))
    assert all(a < b for a, b in zip(caps, caps[1:]))
    # full recompute adds one forward of every layer: about a third of the linear work
    assert times[-1] / times[0] == pytest.approx(4 / 3, rel=0.02)


def test_state_memory_by_hand(cm7):
    m, n = cm7.model, cm7.cluster.num_gpus
    P = m.num_params
    # bf16 parameters + fp32 main grads of the stage, fp32 master + gradient + Adam m, v
    # sharded over all ranks, one 40M-element bucket's send and receive buffers (fp32)
    exchange = 2 * 40_000_000 * 4
    assert cm7.state_bytes(Layout(1, 1, 1)) == pytest.approx(P * (2 + 4) + 16 * P / n + exchange)
    # TP4 splits every matrix and the vocabulary; norms (a few 1e-4 of P) stay whole
    assert cm7.state_bytes(Layout(4, 2, 1)) == pytest.approx(P / 4 * (2 + 4) + 16 * P / n + exchange, rel=1e-3)


def test_pool_shares_buffers_sized_to_its_largest_stage():
    from dcp_ext.planning.cost_model import CostModel
    from dcp_ext.planning.specs import ClusterSpec, ModelSpec

    cm = CostModel(ModelSpec.from_preset("llama2-7b"), ClusterSpec.from_preset("h200x64"))
    alone = {lay: cm.state_bytes(lay) for lay in (Layout(1, 1, 1), Layout(8, 1, 1), Layout(2, 1, 2))}
    assert alone[Layout(8, 1, 1)] < alone[Layout(2, 1, 2)] < alone[Layout(1, 1, 1)]
    cm.charge_shared_buffers([Layout(8, 1, 1), Layout(2, 1, 2)])
    # TP8 now pays for the TP2xPP2 stage the same ranks also play; TP1 is not in the pool
    assert cm.state_bytes(Layout(8, 1, 1)) == pytest.approx(alone[Layout(2, 1, 2)])
    assert cm.state_bytes(Layout(1, 1, 1)) == pytest.approx(alone[Layout(1, 1, 1)])


def test_max_tokens_is_where_memory_runs_out(cm7):
    for lay, rs in [(Layout(1, 1, 1), 0), (Layout(2, 4, 1), 0), (Layout(1, 2, 4), 3)]:
        t = cm7.max_tokens(lay, rs, lay.pp)
        peak = cm7.replica_peak_bytes(lay, [t] * lay.pp, [rs] * lay.pp)
        assert peak == pytest.approx(cm7.capacity_bytes, rel=1e-6)
        assert cm7.replica_peak_bytes(lay, [t * 1.01] * lay.pp, [rs] * lay.pp) > cm7.capacity_bytes


def test_tensor_and_context_parallel_cut_activation_memory(cm7):
    base = cm7.act_bytes_per_token(Layout(1, 1, 1), 0)[0]
    assert cm7.act_bytes_per_token(Layout(4, 1, 1), 0)[0] == pytest.approx(base / 4, rel=0.02)
    assert cm7.act_bytes_per_token(Layout(1, 4, 1), 0)[0] == pytest.approx(base / 4)


def test_sync_by_hand(cm7):
    # TP1 on 64 GPUs: every device receives all parameters (bf16), 7/8 of them over the
    # network, and pushes all gradients (fp32 unless --grad-reduce-in-bf16)
    P = cm7.model.num_params
    bw = cm7.cluster.gpu.inter_node_bw
    t = cm7.sync_time(Layout(1, 1, 1), None)
    expected = P * (2 + 4) * 56 / 64 / bw
    assert t == pytest.approx(expected, rel=0.01)
    assert cm7.sync_time(Layout(2, 1, 2), None) < t / 3


def test_layouts_respect_model_and_node():
    cm = CostModel(ModelSpec.from_preset("llama2-70b"), ClusterSpec.from_preset("h200x64"))
    for lay in cm.all_layouts():
        assert 8 % lay.tp == 0 and 64 % lay.tp == 0 and 80 % lay.pp == 0 and lay.tp <= 8
        assert 64 % lay.size == 0
        assert cm.state_bytes(lay) < cm.capacity_bytes
    assert Layout(1, 1, 1) not in cm.all_layouts()  # 70B does not fit one device


@pytest.mark.parametrize("kernel", ["flash", "math"])
def test_max_tokens_is_the_largest_micro_batch_replica_peak_bytes_fits(kernel):
    """The planner packs under `max_tokens` and the simulator checks `replica_peak_bytes`: they
    must agree at the edge. With tied embeddings the last stage's backward holds the embedding's
    gradient beside the layer transients (tied_bytes), which a cap of free / bytes-per-token
    alone left out: a 3,200-token micro-batch passed a 3,202-token cap and overflowed by 0.1 MiB
    (the demo model on 4 CPU ranks, flash attention, 190 MiB free)."""
    model = ModelSpec.from_preset("demo").with_(cpu_attention=kernel)
    for budget in (190e6, 256e6, 1e9):
        cm = CostModel(model, ClusterSpec.cpu_gloo(4).with_(memory_bytes=budget, reserved_bytes=0.0))
        assert cm.tied_bytes(Layout(1, 1, 1)) > 0
        for lay in (Layout(1, 1, 1), Layout(2, 1, 1), Layout(1, 2, 1), Layout(2, 1, 2)):
            for rs in range(cm.layers_per_stage(lay) + 1):
                cap = cm.max_tokens(lay, rs, 1)
                if cap < 2:
                    continue
                fits = cm.replica_peak_bytes(lay, [float(int(cap))], [rs])
                over = cm.replica_peak_bytes(lay, [float(int(cap) + 2)], [rs])
                assert fits <= cm.capacity_bytes < over, (lay, rs, cap)
