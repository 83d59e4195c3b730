"""Bad inputs, as a table: each ends with one clear `error:` line and a non-zero exit, and
loses nothing (issue 6).

Why a table: every row is one way a user or a machine can get a run wrong (flags, layouts,
YAML, data files, --dcp limits, checkpoints, NaN/inf loss, a rank that dies), with the
substring its error line must carry. The contract per row (`assert_one_line_error`, as in
test_bad_input.py): exit code != 0 (or the exact one named), no traceback, exactly one
non-empty stderr line, starting with `error:`. Rows that touch a checkpoint also check
that its files are byte-identical afterwards, and the last test resumes from both
checkpoints. Rows that show a real bug are `xfail(strict=True)` with the reason, so they
flip to failures once the bug is fixed and the mark can go.

Speed: the rows run the real entry point (`pretrain_gpt_dcp.py`'s `main()`, argv, exit
code, stderr) in processes forked from one server that has already imported torch and
megatron-core, so a row costs its own work, not 5 s of imports (2 shared cores).
`BAD_INPUTS_FRESH=1` runs every row in a fresh `python pretrain_gpt_dcp.py` instead.
Layout rows that need several ranks set WORLD_SIZE as torchrun would (the checks run
before any process group); one row per multi-rank path runs real torchrun ranks.
"""
from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

if __name__ != "__main__":
    import pytest

    from tests.conftest import TINY_MODEL
    from tests.helpers import ENTRY, REPO, launch, read_loss_log
    from tests.test_bad_input import assert_one_line_error

    pytestmark = pytest.mark.dist


# ----------------------------------------------------------------------------- runner
def _serve() -> None:
    """Fork server: one JSON request a line on stdin -> run main() in a forked child."""
    import runpy
    import traceback
    import warnings

    warnings.filterwarnings("ignore")
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, repo)
    entry = os.path.join(repo, "pretrain_gpt_dcp.py")
    # what every run imports anyway; nothing here installs patches or touches state
    import torch  # noqa: F401
    import yaml  # noqa: F401
    from megatron.core import dist_checkpointing, parallel_state  # noqa: F401
    from megatron.core.models.gpt import GPTModel  # noqa: F401
    from megatron.core.optimizer import get_megatron_optimizer  # noqa: F401

    import pretrain_gpt_dcp  # noqa: F401
    from megatron.training import training, training_dcp  # noqa: F401

    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        pid = os.fork()
        if pid == 0:
            os.setsid()
            code = 1
            try:
                os.environ.update(req["env"])
                os.chdir(repo)
                devnull = os.open(os.devnull, os.O_RDONLY)
                os.dup2(devnull, 0)
                out = os.open(req["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
                err = os.open(req["err"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
                os.dup2(out, 1)
                os.dup2(err, 2)
                sys.argv = [entry] + req["argv"]
                try:
                    runpy.run_path(entry, run_name="__main__")
                    code = 0
                except SystemExit as e:
                    if e.code is None:
                        code = 0
                    elif isinstance(e.code, int):
                        code = e.code
                    else:
                        print(e.code, file=sys.stderr)
                        code = 1
                except BaseException:  # what the interpreter would print
                    traceback.print_exc()
                    code = 1
            finally:
                try:
                    sys.stdout.flush()
                    sys.stderr.flush()
                finally:
                    os._exit(code)
        deadline = time.time() + req["timeout"]
        status = None
        while time.time() < deadline:
            done, st = os.waitpid(pid, os.WNOHANG)
            if done:
                status = st
                break
            time.sleep(0.05)
        timed_out = status is None
        try:
            os.killpg(pid, signal.SIGKILL)  # the child and anything it started
        except ProcessLookupError:
            pass
        if timed_out:
            _, status = os.waitpid(pid, 0)
        code = os.waitstatus_to_exitcode(status)
        print(json.dumps({"code": 124 if timed_out else code, "timed_out": timed_out}), flush=True)


class ForkRunner:
    def __init__(self, workdir: str):
        self.workdir = workdir
        self.count = 0
        env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--serve"], cwd=REPO, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     start_new_session=True)
        assert json.loads(self.proc.stdout.readline()).get("ready"), "fork server did not start"

    def run(self, argv: list[str], env: dict | None = None, timeout: int = 180) -> subprocess.CompletedProcess:
        self.count += 1
        out = os.path.join(self.workdir, f"{self.count}.out")
        err = os.path.join(self.workdir, f"{self.count}.err")
        full_env = {"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", **(env or {})}
        self.proc.stdin.write(json.dumps({"argv": argv, "env": full_env, "out": out, "err": err,
                                          "timeout": timeout}) + "\n")
        self.proc.stdin.flush()
        reply = json.loads(self.proc.stdout.readline())
        return subprocess.CompletedProcess(argv, reply["code"], open(out).read(), open(err).read())

    def close(self):
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=30)
        finally:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


class FreshRunner:
    """Every row in its own `python pretrain_gpt_dcp.py` (BAD_INPUTS_FRESH=1)."""

    def run(self, argv, env=None, timeout=180):
        return launch(argv, nproc=1, env=env, timeout=timeout)

    def close(self):
        pass


def run_case(runner, argv, env=None, timeout=180):
    try:
        return runner.run(argv, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:  # FreshRunner
        return subprocess.CompletedProcess(argv, 124, "", "")


# ------------------------------------------------------------------------------ table
@dataclass
class Case:
    id: str
    flags: list[str]  # {corpus}, {bad}, {static_ckpt}, {dcp_ckpt}, {tmp} are filled in
    needle: str  # substring of the one error line
    code: int | None = None  # exact exit code, when it is part of the contract
    env: dict = field(default_factory=dict)
    keeps: tuple[str, ...] = ()  # fixture checkpoints whose files must not change
    bug: str | None = None  # a real bug: xfail(strict) with this reason
    timeout: int = 180
    base: str = "static"  # static | dcp | none


B_STATIC = ["--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "1",
            "--data-path", "{corpus}", "--data-cache-path", "{tmp}/cache"]
B_DCP = ["--dcp", "--dcp-global-batch-tokens", "512", "--train-iters", "1",
         "--data-path", "{corpus}", "--data-cache-path", "{tmp}/cache"]
SHAPE = ["--hidden-size", "32", "--ffn-hidden-size", "64"]
NAN = ["--lr", "1e30", "--lr-warmup-iters", "0", "--train-iters", "6", "--max-nan-iterations", "2"]
W2 = {"WORLD_SIZE": "2"}  # what torchrun --nproc_per_node=2 sets; layout checks precede any group

CASES = [
    # flags
    Case("unknown-flag", ["--no-such-flag"], "unknown flag --no-such-flag", code=2),
    Case("bad-int", ["--num-layers", "four"], "invalid int value: 'four'", code=2),
    Case("bad-float", ["--lr", "fast"], "invalid float value: 'fast'", code=2),
    Case("bad-choice", ["--normalization", "BatchNorm"], "invalid choice: 'BatchNorm'", code=2),
    Case("missing-value", ["--train-iters"], "expected one argument", code=2),
    Case("conflicting-precision", ["--bf16", "--fp16"], "--bf16 and --fp16 are mutually exclusive", code=2),
    Case("missing-required-lr", ["--drop", "--lr"], "--lr is required", code=2),
    Case("save-interval-without-save", ["--save-interval", "1"], "--save-interval needs --save DIR", code=2),
    Case("no-data-path", ["--drop", "--data-path"], "--data-path is required", code=2),
    # layouts
    Case("world-not-divisible", ["--tensor-model-parallel-size", "2"], "world size 1 is not divisible by tp*pp*cp",
         code=2),
    Case("heads-vs-tp", ["--num-attention-heads", "3", "--tensor-model-parallel-size", "2"],
         "--num-attention-heads 3 is not divisible by --tensor-model-parallel-size 2", code=2, env=W2),
    Case("groups-vs-tp", ["--num-query-groups", "1", "--tensor-model-parallel-size", "2"],
         "--num-query-groups 1 is not divisible by --tensor-model-parallel-size 2", code=2, env=W2),
    Case("layers-vs-pp", ["--num-layers", "3", "--pipeline-model-parallel-size", "2"],
         "--num-layers 3 is not divisible by --pipeline-model-parallel-size 2", code=2, env=W2),
    Case("seq-vs-2cp", ["--context-parallel-size", "2", "--seq-length", "126"],
         "--seq-length 126 must be a multiple of 2*context-parallel-size = 4", code=2, env=W2),
    Case("positions-below-seq", ["--position-embedding-type", "learned_absolute", "--max-position-embeddings", "64"],
         "--max-position-embeddings 64 is smaller than --seq-length 128", code=2),
    # YAML
    Case("yaml-unknown-key", ["--yaml-cfg", "{bad}/unknown_key.yaml"], "unknown key 'num-layerz'", code=2),
    Case("yaml-malformed", ["--yaml-cfg", "{bad}/malformed.yaml"], "not valid YAML", code=2),
    Case("yaml-missing-file", ["--yaml-cfg", "{bad}/nope.yaml"], "nope.yaml: no such file", code=2),
    Case("yaml-bad-value", ["--yaml-cfg", "{bad}/bad_value.yaml", "--drop", "--hidden-size"],
         "invalid int value: 'sixty'", code=2),
    Case("yaml-list-for-int", ["--yaml-cfg", "{bad}/list_value.yaml", "--drop", "--num-layers"], "num-layers", code=2),
    # data files
    Case("data-missing-prefix", ["--data-path", "{bad}/nope_text_document"], "no dataset at"),
    Case("data-missing-bin", ["--data-path", "{bad}/only_idx_text_document"], "only_idx_text_document.bin not found"),
    Case("data-truncated-bin", ["--data-path", "{bad}/trunc_text_document"], "trunc_text_document.bin is truncated"),
    Case("data-corrupt-idx", ["--data-path", "{bad}/garbled_text_document"],
         "garbled_text_document.idx is not a Megatron index file"),
    Case("data-empty", ["--data-path", "{bad}/empty_text_document"], "empty_text_document is empty"),
    Case("data-vocab-mismatch", ["--vocab-size", "100"], "vocabulary mismatch"),
    Case("data-vocab-mismatch-dcp", ["--vocab-size", "100"], "vocabulary mismatch", base="dcp"),
    Case("data-empty-dcp", ["--data-path", "{bad}/empty_text_document"], "empty_text_document is empty", base="dcp"),
    Case("data-split-without-documents", ["--split", "969,30,1", "--eval-iters", "1", "--eval-interval", "1"],
         "split", timeout=40),
    # --dcp
    Case("dcp-no-batch-tokens", ["--dcp", "--train-iters", "1"], "--dcp needs --dcp-global-batch-tokens", code=2),
    Case("dcp-max-seq-above-batch", ["--dcp-max-seq-len", "1024", "--dcp-global-batch-tokens", "512"],
         "--dcp-max-seq-len 1024 exceeds --dcp-global-batch-tokens 512", code=2, base="dcp"),
    Case("dcp-bad-memory-margin", ["--dcp-memory-margin", "1.5"], "--dcp-memory-margin must be in [0, 1)", code=2,
         base="dcp"),
    Case("dcp-sequence-fits-nowhere", ["--dcp-max-seq-len", "4000000", "--dcp-global-batch-tokens", "4000000"],
         "fits no layout", base="dcp"),
    # checkpoints
    Case("ckpt-tracker-names-missing-iteration", ["--load", "{tmp}/tracker7"], "iter_0000007"),
    Case("ckpt-garbage-tracker", ["--load", "{tmp}/garbage"], "expected an iteration number, found 'latest'"),
    Case("ckpt-garbage-tracker-dcp", ["--load", "{tmp}/garbage"], "expected an iteration number", base="dcp"),
    Case("ckpt-exit-on-missing", ["--load", "{tmp}/empty_ckpt", "--exit-on-missing-checkpoint"],
         "no latest_checkpointed_iteration.txt found"),
    Case("ckpt-static-loaded-with-dcp", ["--load", "{static_ckpt}", "--train-iters", "2"],
         "not an adaptive-runtime checkpoint", keeps=("static_ckpt",), base="dcp"),
    Case("ckpt-dcp-loaded-without-dcp", ["--load", "{dcp_ckpt}", "--train-iters", "2"], "--dcp",
         keeps=("dcp_ckpt",)),
    Case("ckpt-dcp-other-model-shape", ["--load", "{dcp_ckpt}", "--train-iters", "2"] + SHAPE,
         "model shape differs", keeps=("dcp_ckpt",), base="dcp"),
    Case("ckpt-static-other-model-shape", ["--load", "{static_ckpt}", "--train-iters", "2"] + SHAPE,
         "shape", keeps=("static_ckpt",)),
    Case("ckpt-static-other-vocab-padding", ["--load", "{static_ckpt}", "--train-iters", "2",
                                             "--make-vocab-size-divisible-by", "192"],
         "vocab", keeps=("static_ckpt",)),
    # NaN / inf loss
    Case("nan-loss-static", NAN, "NaN/inf iterations in a row"),
    Case("nan-loss-dcp", NAN, "NaN/inf iterations in a row", base="dcp"),
]


def _drop(flags: list[str], names: list[str]) -> list[str]:
    out, skip = [], False
    for i, f in enumerate(flags):
        if skip:
            skip = False
            continue
        if f in names:
            skip = i + 1 < len(flags) and not flags[i + 1].startswith("--")
            continue
        out.append(f)
    return out


def argv_for(case: Case, paths: dict) -> list[str]:
    own, drop = [], []
    it = iter(case.flags)
    for f in it:
        if f == "--drop":
            drop.append(next(it))
        else:
            own.append(f)
    base = {"static": TINY_MODEL + B_STATIC, "dcp": TINY_MODEL + B_DCP, "none": []}[case.base]
    argv = _drop(base, drop) + own
    return [a.format(**paths) for a in argv]


def tree_digest(root: str) -> str:
    h = hashlib.sha256()
    for d, _, files in sorted(os.walk(root)):
        for name in sorted(files):
            p = os.path.join(d, name)
            h.update(os.path.relpath(p, root).encode())
            with open(p, "rb") as f:
                h.update(f.read())
    return h.hexdigest()


# ---------------------------------------------------------------------------- fixtures
if __name__ != "__main__":

    @pytest.fixture(scope="module")
    def runner(tmp_path_factory):
        work = tmp_path_factory.mktemp("runs")
        r = FreshRunner() if os.environ.get("BAD_INPUTS_FRESH") else ForkRunner(str(work))
        yield r
        r.close()

    @pytest.fixture(scope="module")
    def paths(text_corpus, tmp_path_factory, runner):
        from dcp_ext.data.indexed import write_documents

        tmp = tmp_path_factory.mktemp("bad_inputs")
        bad = tmp / "bad"
        bad.mkdir()
        idx, bin_ = open(text_corpus + ".idx", "rb").read(), open(text_corpus + ".bin", "rb").read()
        (bad / "only_idx_text_document.idx").write_bytes(idx)
        (bad / "trunc_text_document.idx").write_bytes(idx)
        (bad / "trunc_text_document.bin").write_bytes(bin_[: len(bin_) // 2])
        (bad / "garbled_text_document.idx").write_bytes(b"garbage!" + idx[8:])
        (bad / "garbled_text_document.bin").write_bytes(bin_)
        write_documents(str(bad / "empty_text_document"), [], vocab_size=256)
        (bad / "unknown_key.yaml").write_text("num-layerz: 4\n")
        (bad / "malformed.yaml").write_text("num-layers: [4\nhidden-size: 64\n")
        (bad / "bad_value.yaml").write_text("hidden-size: sixty\n")
        (bad / "list_value.yaml").write_text("num-layers: [1, 2]\n")
        (tmp / "tracker7").mkdir()
        (tmp / "tracker7" / "latest_checkpointed_iteration.txt").write_text("7")
        (tmp / "garbage").mkdir()
        (tmp / "garbage" / "latest_checkpointed_iteration.txt").write_text("latest\n")
        (tmp / "empty_ckpt").mkdir()
        p = {"corpus": text_corpus, "bad": str(bad), "tmp": str(tmp),
             "static_ckpt": str(tmp / "static_ckpt"), "dcp_ckpt": str(tmp / "dcp_ckpt")}
        # two good checkpoints (1 rank, 2 iterations) the checkpoint rows try to misuse
        for name, base in (("static_ckpt", B_STATIC), ("dcp_ckpt", B_DCP)):
            argv = [a.format(**p) for a in TINY_MODEL + base] + ["--train-iters", "2", "--save", p[name]]
            r = run_case(runner, argv)
            assert r.returncode == 0, r.stderr[-3000:]
        p["digests"] = {name: tree_digest(p[name]) for name in ("static_ckpt", "dcp_ckpt")}
        return p

    def _param(case):
        marks = [pytest.mark.xfail(strict=True, reason=case.bug)] if case.bug else []
        return pytest.param(case, id=case.id, marks=marks)

    def test_table_has_twenty_plus_rows():
        assert len(CASES) >= 20 and len({c.id for c in CASES}) == len(CASES)

    @pytest.mark.parametrize("case", [_param(c) for c in CASES])
    def test_bad_input(case, runner, paths):
        r = run_case(runner, argv_for(case, paths), env=case.env, timeout=case.timeout)
        try:
            assert r.returncode != 124, f"no exit within {case.timeout} s (hang)"
            assert_one_line_error(r, case.needle)
            if case.code is not None:
                assert r.returncode == case.code, (r.returncode, r.stderr)
        finally:  # nothing lost, whatever the error looked like
            for name in case.keeps:
                assert tree_digest(paths[name]) == paths["digests"][name], f"{name} changed"

    # -------------------------------------------------------------- several real ranks
    def _worker_lines(stderr: str) -> list[str]:
        """stderr of the ranks: torchrun's own failure report (its log lines and
        ChildFailedError traceback) starts at its first `[WE]MMDD hh:mm:ss` line."""
        import re

        lines = []
        for line in stderr.splitlines():
            if re.match(r"^[WEI]\d{4} \d\d:\d\d:\d\d", line):
                break
            if line.strip():
                lines.append(line)
        return lines

    def test_layout_error_on_real_ranks(paths):
        argv = argv_for(Case("x", ["--num-layers", "3", "--pipeline-model-parallel-size", "2"], ""), paths)
        r = launch(argv, nproc=2, timeout=180)
        assert r.returncode != 0
        lines = _worker_lines(r.stderr)
        assert lines == ["error: --num-layers 3 is not divisible by --pipeline-model-parallel-size 2"], r.stderr[-3000:]

    @pytest.fixture(scope="module")
    def killed_run(paths, tmp_path_factory):
        """2 ranks resume the dcp checkpoint and train; rank 1 is killed (SIGKILL) mid-run."""
        import psutil

        work = tmp_path_factory.mktemp("killed")
        log = str(work / "loss.jsonl")
        argv = argv_for(Case("x", ["--train-iters", "100000", "--load", "{dcp_ckpt}", "--save", str(work / "save"),
                                   "--save-interval", "100000", "--loss-log", log], "", base="dcp"), paths)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", ENTRY] + argv
        env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
        with open(work / "out", "w") as out, open(work / "err", "w") as err:
            proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=err, start_new_session=True)
            try:
                deadline = time.time() + 300
                while time.time() < deadline and proc.poll() is None:
                    if os.path.exists(log) and len(read_loss_log(log)) >= 2:
                        break
                    time.sleep(0.1)
                assert proc.poll() is None, "the run ended before it could be killed"
                ranks = [c for c in psutil.Process(proc.pid).children(recursive=True)
                         if ENTRY in " ".join(c.cmdline()) and c.environ().get("RANK") == "1"]
                assert len(ranks) == 1
                ranks[0].send_signal(signal.SIGKILL)
                killed_at = time.time()
                try:
                    code = proc.wait(timeout=120)
                except subprocess.TimeoutExpired:
                    code = None
                waited = time.time() - killed_at
            finally:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        return code, waited, open(work / "err").read(), read_loss_log(log)

    def test_rank_killed_mid_run_exits_and_loses_nothing(killed_run, paths):
        code, waited, stderr, losses = killed_run
        assert code is not None, "the surviving rank hung after its peer died"
        assert code != 0
        assert losses and losses[0]["iteration"] == 3  # it did resume from the checkpoint and train
        assert tree_digest(paths["dcp_ckpt"]) == paths["digests"]["dcp_ckpt"]

    def test_rank_killed_mid_run_reports_one_line(killed_run):
        _, _, stderr, _ = killed_run
        lines = _worker_lines(stderr)
        assert "Traceback" not in "\n".join(lines), "\n".join(lines)[-3000:]
        assert len(lines) == 1 and "error:" in lines[0], lines

    # ------------------------------------------------------------- and nothing lost
    def test_checkpoints_still_resume(paths, runner, tmp_path):
        """After every row above, both checkpoints resume (iteration 3 follows 2)."""
        for name, base in (("static_ckpt", B_STATIC), ("dcp_ckpt", B_DCP)):
            log = str(tmp_path / f"{name}.jsonl")
            argv = [a.format(**paths) for a in TINY_MODEL + base] + ["--train-iters", "3", "--load", paths[name],
                                                                    "--loss-log", log]
            r = run_case(runner, argv)
            assert r.returncode == 0, r.stderr[-3000:]
            assert [x["iteration"] for x in read_loss_log(log)] == [3]


if __name__ == "__main__" and "--serve" in sys.argv:
    _serve()
