"""Shared fixtures: a small real-text corpus, the tiny model's Megatron flags, the CPU demo's
adaptive reference run; and a session-end check that the tests left no process running."""
import glob
import json
import os
import signal
import time
import uuid
from typing import NamedTuple

import numpy as np
import pytest

# Every process the tests start inherits this variable (torchrun workers, forked servers,
# dist-checkpointing helpers, even ones orphaned when their parent was killed), so the
# session-end check finds them all, descendants or not.
SESSION_MARK = "DCP_TEST_SESSION"
os.environ[SESSION_MARK] = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"


def _own_helpers() -> set:
    """multiprocessing's resource tracker (and forkserver) of this very process: started by
    `spawn`, they read a pipe this process holds and exit with it, so they are not left over."""
    import multiprocessing.forkserver
    import multiprocessing.resource_tracker

    pids = {getattr(multiprocessing.resource_tracker._resource_tracker, "_pid", None),
            getattr(multiprocessing.forkserver._forkserver, "_forkserver_pid", None)}
    return {pid for pid in pids if pid}


def leftover_processes(mark: str) -> list:
    """Live processes other than this one that carry `mark` or descend from this one."""
    import psutil

    me = psutil.Process()
    own = _own_helpers()
    found = {p.pid: p for p in me.children(recursive=True) if p.pid not in own}
    for p in psutil.process_iter():
        if p.pid in found or p.pid == me.pid or p.pid in own:
            continue
        try:
            if p.environ().get(SESSION_MARK) == mark:
                found[p.pid] = p
        except (psutil.Error, OSError):
            continue
    alive = []
    for p in found.values():
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                alive.append(p)
        except psutil.Error:
            continue
    return alive


def pytest_addoption(parser):
    parser.addoption("--repin", action="store_true",
                     help="re-pin the plans of tests/planning/test_plan_digests.py that changed (and say what changed)")


def pytest_configure(config):
    """The tier rule (tests/support/tiers.py): only `dist` tests start processes."""
    from tests.support import tiers

    tiers.register(config)


def pytest_sessionstart(session):
    """Build matplotlib's font cache before any test: on a machine that has none (a fresh CI
    runner) the first plot runs `fc-list`, a process start the tier rule would pin on
    whichever unit test happens to draw first."""
    try:
        import matplotlib.font_manager  # noqa: F401  (the import builds the cache)
    except ImportError:
        pass


def pytest_terminal_summary(terminalreporter):
    """The figures tests noted for the record (tests/support/session_notes.py)."""
    from tests.support.session_notes import NOTES

    for section, lines in NOTES.items():
        terminalreporter.section(section)
        for line in lines:
            terminalreporter.write_line(line)


def pytest_sessionfinish(session, exitstatus):
    """Fail the run if a process the tests started is still alive (then kill it, by pid)."""
    import psutil

    from tests.support.entry_runner import close_shared

    close_shared()  # the one-rank fork server (helpers.run_ranks)
    mark = os.environ[SESSION_MARK]
    deadline = time.time() + 3  # just-killed processes may take a moment to go
    alive = leftover_processes(mark)
    while alive and time.time() < deadline:
        time.sleep(0.2)
        alive = leftover_processes(mark)
    if not alive:
        return
    lines = []
    for p in alive:
        try:
            test = p.environ().get("PYTEST_CURRENT_TEST", "?")
            lines.append(f"  pid {p.pid} ({p.memory_info().rss >> 20} MiB, started by {test}): "
                         f"{' '.join(p.cmdline())[:200]}")
            p.send_signal(signal.SIGKILL)
        except psutil.Error:
            continue
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    message = f"{len(alive)} process(es) started by the tests were still running at the end (now killed):"
    if reporter is not None:
        reporter.write_line("")
        reporter.write_line("error: " + message, red=True)
        for line in lines:
            reporter.write_line(line)
    else:
        print("error: " + message + "\n" + "\n".join(lines))
    session.exitstatus = pytest.ExitCode.TESTS_FAILED


# A tiny Llama-style GPT: RoPE, GQA (4 heads, 2 groups), SwiGLU, RMSNorm; fp32.
# Vocabulary: 255 byte values + EOD = 256 ids, which pads to 256 under TP1 and TP2 alike
# (Megatron pads to a multiple of 128*tp; a different padding would be a different model).
TINY_MODEL = [
    "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--num-query-groups", "2",
    "--ffn-hidden-size", "128", "--seq-length", "128", "--max-position-embeddings", "128",
    "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
    "--hidden-dropout", "0", "--attention-dropout", "0", "--tokenizer-type", "NullTokenizer", "--vocab-size", "255",
    "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine", "--lr-warmup-iters", "1",
    "--lr-decay-iters", "8", "--clip-grad", "1.0", "--log-interval", "1", "--eval-interval", "1000",
    "--eval-iters", "0", "--split", "100,0,0",
]


@pytest.fixture(scope="session")
def text_corpus(tmp_path_factory) -> str:
    """Byte-valued documents cut from real source files, ~20 to ~600 tokens, EOD = 255."""
    from dcp_ext.data.indexed import write_documents

    root = tmp_path_factory.mktemp("corpus")
    files = sorted(glob.glob(os.path.join(os.path.dirname(json.__file__), "*.py")))
    rng = np.random.default_rng(0)
    docs = []
    for path in files:
        data = open(path, "rb").read()
        for _ in range(8):
            n = int(rng.integers(20, 600))
            start = int(rng.integers(0, max(1, len(data) - n)))
            docs.append([min(b, 254) for b in data[start : start + n]] + [255])
    return write_documents(str(root / "corpus_text_document"), docs, vocab_size=256)


# the demo's model and corpus with 512-token documents and no memory budget (faster): the
# shipped examples/cpu_demo.yaml is what `make demo` runs
DEMO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "cpu_demo_tests.yaml")


def demo_flags(cache, planner, iters, log, plan_log=None):
    """The CPU demo with --dcp (4 ranks): `iters` iterations of `planner`; losses to `log`.
    Nothing here depends on `iters` but the stopping point (the documents and the LR
    schedule do not), so a shorter run's losses are a longer run's first ones."""
    flags = ["--yaml-cfg", DEMO, "--dcp", "--dcp-planner", planner, "--data-cache-path", cache, "--dcp-recalibration", "off",
             "--dcp-global-batch-tokens", "4096", "--train-iters", str(iters), "--lr-decay-iters", "60",
             "--log-interval", "1", "--eval-iters", "0", "--loss-log", log]
    return flags + (["--dcp-log-plan", plan_log] if plan_log else [])


@pytest.fixture(scope="session")
def demo_cache(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("dcp_cache"))


class DemoRun(NamedTuple):
    losses: list  # loss records
    plans: dict  # plan records by index
    ckpt: str  # its checkpoint folder
    groups: dict  # rank -> process-group creations ({"call", "iterations_done"}), tests/support/group_count_entry.py


@pytest.fixture(scope="session")
def adaptive_demo(demo_cache, tmp_path_factory):
    """One uninterrupted 20-iteration adaptive run of the CPU demo on 4 ranks, the reference of
    the runs that restart or resume it (a DemoRun; its process-group creations recorded). It saves every 3 iterations (saving changes nothing it computes), so the tests
    that resume a 4-rank checkpoint take theirs from here instead of a run of their own."""
    from tests.support.helpers import REPO, read_loss_log, read_plan_log, run_ranks

    root = tmp_path_factory.mktemp("adaptive_demo")
    log, plans, save = str(root / "loss.jsonl"), str(root / "plans.jsonl"), str(root / "ckpt")
    groups = str(root / "groups")
    r = run_ranks(4, demo_flags(demo_cache, "adaptive", 20, log, plans) + ["--save", save, "--save-interval", "3"],
                  env={"DCP_GROUP_LOG": groups}, entry=os.path.join(REPO, "tests", "support", "group_count_entry.py"))
    assert r.returncode == 0, r.stderr[-3000:]
    created = {rank: read_loss_log(f"{groups}.{rank}") if os.path.exists(f"{groups}.{rank}") else []
               for rank in range(4)}
    return DemoRun(read_loss_log(log), read_plan_log(plans), save, created)
