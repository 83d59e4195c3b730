"""Runs of the real entry point that end in an error line or a fault, fast: a fork server.

Why it exists: speed. Tables of single-process rows (bad inputs, refused launch lines) each
run `pretrain_gpt_dcp.py`'s main() with an argv and read its exit code and stderr; a fresh
interpreter would pay ~5 s of imports (torch, megatron-core) a row on 2 shared cores. The
server (`python tests/support/entry_runner.py --serve`) imports once and forks one child per row,
so a row costs only its own work. It is not a rank launcher (one process, no torchrun):
real multi-rank runs go through helpers.run_ranks. FreshRunner does the same rows in a
fresh `python pretrain_gpt_dcp.py` each (the check that forking changes nothing).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.support.helpers import REPO, ForkServerClient, free_port, fresh_processes, rank_env, reap_ranks, run_fresh


def _serve() -> None:
    """Fork server: one JSON request a line on stdin -> run main() in `nproc` forked children
    (ranks of one job, with the environment torchrun would give them)."""
    import warnings

    warnings.filterwarnings("ignore")
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.path.insert(0, repo)
    entry = os.path.join(repo, "pretrain_gpt_dcp.py")
    # what every run imports anyway; nothing here installs patches or touches state
    import torch  # noqa: F401
    import yaml  # noqa: F401
    from megatron.core import dist_checkpointing, parallel_state  # noqa: F401
    from megatron.core.models.gpt import GPTModel  # noqa: F401
    from megatron.core.optimizer import get_megatron_optimizer  # noqa: F401

    import pretrain_gpt_dcp  # noqa: F401
    from megatron.training import training  # noqa: F401
    from megatron.training.adaptive import training_adaptive

    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        nproc = req.get("nproc", 1)
        for path in (req["out"], req["err"]):  # every rank appends to the same two files
            open(path, "w").close()
        ranks = {}
        port = str(free_port())
        for rank in range(nproc):
            env = dict(req["env"])
            if nproc > 1:  # what torchrun --standalone --nproc_per_node=N sets for each worker
                env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
                           GROUP_RANK="0", ROLE_RANK=str(rank), ROLE_WORLD_SIZE=str(nproc),
                           MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
            pid = os.fork()
            if pid == 0:
                _run_child(repo, entry, req, env)  # never returns
            ranks[pid] = rank
        code, timed_out = reap_ranks(list(ranks), req["timeout"])
        print(json.dumps({"code": code, "timed_out": timed_out}), flush=True)


def _run_child(repo: str, entry: str, req: dict, env: dict) -> None:
    """In a forked child: become the entry point (or a tool) with `req`'s argv, then exit."""
    import runpy
    import traceback

    os.setsid()
    code = 1
    try:
        os.environ.update(env)
        os.chdir(repo)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        out = os.open(req["out"], os.O_WRONLY | os.O_APPEND)
        err = os.open(req["err"], os.O_WRONLY | os.O_APPEND)
        os.dup2(out, 1)
        os.dup2(err, 2)
        path = os.path.join(repo, req["entry"]) if req.get("entry") else entry
        sys.argv = [path] + req["argv"]
        try:
            runpy.run_path(path, run_name="__main__")
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


class ForkRunner(ForkServerClient):
    """The client: `run(argv)` runs one row in a child forked from the server."""

    def __init__(self, workdir: str):
        self.workdir = workdir
        super().__init__(__file__, rank_env(), "fork server")

    def run(self, argv: list[str], env: dict | None = None, timeout: int = 180,
            entry: str | None = None, nproc: int = 1) -> subprocess.CompletedProcess:
        out = os.path.join(self.workdir, f"{self.count + 1}.out")
        err = os.path.join(self.workdir, f"{self.count + 1}.err")
        full_env = {"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", **(env or {})}
        reply = self.request({"argv": argv, "env": full_env, "out": out, "err": err, "timeout": timeout,
                              "entry": entry, "nproc": nproc})
        result = subprocess.CompletedProcess(argv, reply["code"], open(out).read(), open(err).read())
        for path in (out, err):
            os.remove(path)
        result.timed_out = reply["timed_out"]
        return result


class FreshRunner:
    """Every row in its own `python pretrain_gpt_dcp.py` (BAD_INPUTS_FRESH=1)."""

    def run(self, argv, env=None, timeout=180, entry=None):
        if entry is None:
            return run_fresh(1, argv, env=env, timeout=timeout)
        return subprocess.run([sys.executable, os.path.join(REPO, entry)] + argv, cwd=REPO, env=rank_env(env),
                              capture_output=True, text=True, timeout=timeout)

    def close(self):
        pass


def make_runner(workdir: str):
    """The fork server; a FreshRunner when BAD_INPUTS_FRESH (or DCP_TESTS_FRESH) is set."""
    return FreshRunner() if fresh_processes() else ForkRunner(workdir)


_SHARED: ForkRunner | None = None


def shared_runner() -> ForkRunner:
    """One fork server for the session's one-rank runs (helpers.run_ranks(1, flags)), started
    on first use; conftest closes it at the end of the session."""
    global _SHARED
    if _SHARED is None or _SHARED.proc.poll() is not None:
        import tempfile

        _SHARED = ForkRunner(tempfile.mkdtemp(prefix="dcp_one_rank_"))
    return _SHARED


def close_shared() -> None:
    global _SHARED
    if _SHARED is not None:
        import shutil

        _SHARED.close()
        shutil.rmtree(_SHARED.workdir, ignore_errors=True)
        _SHARED = None


def run_case(runner, argv, env=None, timeout=180, entry=None):
    try:
        return runner.run(argv, env=env, timeout=timeout, entry=entry)
    except subprocess.TimeoutExpired:  # FreshRunner
        return subprocess.CompletedProcess(argv, 124, "", "")


if __name__ == "__main__" and "--serve" in sys.argv:
    _serve()
