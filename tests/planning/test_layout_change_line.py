"""The one log line a layout change gets: the longest document, where it runs, and why the
old layout would not do (cannot hold it, would recompute, or was priced slower); the planner
says it (`explain`), the training loop prints it."""
from dcp_ext.planning.planner import make_planner
from dcp_ext.planning.specs import ClusterSpec, ModelSpec

MODEL = ModelSpec.from_preset("demo").with_(vocab_size=512, param_bytes=4, grad_bytes=4, activation_bytes=4)
CLUSTER = ClusterSpec.cpu_gloo(4).with_(memory_bytes=256e6, reserved_bytes=0.0)


def planner():
    return make_planner("adaptive", MODEL, CLUSTER, max_seq_len=2048, global_batch_tokens=4096,
                        length_sample=[200, 600, 2048] * 30, seed=0, layouts=["4xtp1cp1pp1", "1xtp1cp4pp1"])


def layout_change_line(iteration, before, it, lengths_of, p):
    """The layout-change line of what the planner says about `it` (None when it says none)."""
    lines = [x for x in p.explain(iteration, before, it, lengths_of) if x.startswith("> layout change")]
    return lines[0] if lines else None


def plan(p, index, lengths):
    ids = list(range(100 * index, 100 * index + len(lengths)))
    return p.plan(index, ids, lengths), dict(zip(ids, lengths))


def test_a_long_document_the_old_layout_cannot_hold():
    p = planner()
    short, short_len = plan(p, 0, [300] * 12)
    long, long_len = plan(p, 1, [2048] + [300] * 6)
    assert [r.cp for r in short.replicas] == [1, 1, 1, 1] and [r.cp for r in long.replicas] == [4]
    line = layout_change_line(2, (short, 300), long, long_len, p)
    tp1_cap = int(p.tables[(1, 1, 1)].max_doc)
    assert tp1_cap < 2048
    assert line.startswith("> layout change at iteration 2: 4×tp1 -> cp4 | longest document 2048 tokens (before: 300)")
    assert f"tp1 cannot hold it (at most {tp1_cap} tokens)" in line
    # and back: cp4 could hold the short batch, the planner priced 4×tp1 faster
    back = layout_change_line(3, (long, 2048), short, short_len, p)
    assert "on tp1, no recompute" in back and "cp4 holds it without recompute: 4×tp1 was priced faster" in back
    # no change, no line
    assert layout_change_line(4, (short, 300), short, short_len, p) is None
    assert layout_change_line(1, None, short, short_len, p) is None


def test_a_document_the_old_layout_holds_only_with_recompute():
    p = planner()
    short, _ = plan(p, 0, [300] * 12)
    tp1 = p.tables[(1, 1, 1)]
    need = next(n for n in range(300, 2048, 16) if (tp1.rs_planned(n) or 0) > 0 and tp1.rs_planned(n) is not None)
    it, lengths = plan(p, 1, [need] + [300] * 6)
    assert [r.cp for r in it.replicas] == [4]
    line = layout_change_line(2, (short, 300), it, lengths, p)
    assert line.endswith(f"on cp4, no recompute | tp1 would recompute {tp1.rs_planned(need)}/4 layers")
