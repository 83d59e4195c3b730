"""The static (upstream Megatron) path trains the same model under every layout.

From one shared initialisation (a 1-rank checkpoint resharded on load), 3 iterations on
4 gloo ranks under TP2, PP2, CP2 and TP2 with sequence parallelism and the distributed
optimizer must give the 1-rank losses and gradient norms (fp32, rel 1e-5). On 4 ranks
each of those layouts is also 2-way data parallel, so data parallelism (the batch split
over replicas, the gradient all-reduce, accumulation over micro-batches) is checked in
every case; a layout of data parallelism alone would repeat it.
"""
import pytest

from tests.conftest import TINY_MODEL
from tests.support.helpers import read_loss_log, run_ranks

pytestmark = pytest.mark.dist

BATCH = ["--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "3"]


@pytest.fixture(scope="module")
def shared_init(text_corpus, tmp_path_factory):
    root = tmp_path_factory.mktemp("static")
    init = str(root / "init")
    r = run_ranks(1, TINY_MODEL + ["--data-path", text_corpus, "--data-cache-path", str(root / "cache"),
                                   "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "0",
                                   "--save", init])
    assert r.returncode == 0, r.stderr[-3000:]
    return root, init


def run_layout(shared_init, text_corpus, name, nproc, layout, packed=True):
    root, init = shared_init
    log = str(root / f"{name}.jsonl")
    flags = TINY_MODEL + BATCH + layout + [
        "--data-path", text_corpus, "--data-cache-path", str(root / "cache"),
        "--load", init, "--no-load-optim", "--no-load-rng", "--loss-log", log,
    ]
    if packed:
        flags += ["--reset-attention-mask", "--reset-position-ids"]
    r = run_ranks(nproc, flags)
    assert r.returncode == 0, r.stderr[-4000:]
    return read_loss_log(log)


@pytest.fixture(scope="module")
def reference(shared_init, text_corpus):
    return {packed: run_layout(shared_init, text_corpus, f"ref{packed}", 1, [], packed) for packed in (True, False)}


LAYOUTS = {
    "tp2": (["--tensor-model-parallel-size", "2"], True),
    "pp2": (["--pipeline-model-parallel-size", "2"], True),
    "cp2-packed": (["--context-parallel-size", "2"], True),
    "cp2-rows": (["--context-parallel-size", "2"], False),
    "tp2-sp-distopt": (["--tensor-model-parallel-size", "2", "--sequence-parallel", "--use-distributed-optimizer"], True),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_single_rank(name, shared_init, text_corpus, reference):
    layout, packed = LAYOUTS[name]
    got = run_layout(shared_init, text_corpus, name, 4, layout, packed)
    want = reference[packed]
    assert [r["iteration"] for r in got] == [1, 2, 3]
    for g, w in zip(got, want):
        assert g["lm loss"] == pytest.approx(w["lm loss"], rel=1e-5), (name, g, w)
        assert g["grad norm"] == pytest.approx(w["grad norm"], rel=1e-5), (name, g, w)
    # the model learns something: loss moves
    assert got[-1]["lm loss"] != got[0]["lm loss"]
