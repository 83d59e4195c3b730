"""Runs of the real entry point that end in an error line or a fault, fast: a fork server.

Why it exists: speed. Tables of single-process rows (bad inputs, refused launch lines) each
run `pretrain_gpt_dcp.py`'s main() with an argv and read its exit code and stderr; a fresh
interpreter would pay ~5 s of imports (torch, megatron-core) a row on 2 shared cores. The
server (`python tests/entry_runner.py --serve`) imports once and forks one child per row,
so a row costs only its own work. It is not a rank launcher (one process, no torchrun):
real multi-rank runs go through helpers.run_ranks. FreshRunner does the same rows in a
fresh `python pretrain_gpt_dcp.py` each (the check that forking changes nothing).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.helpers import REPO, ForkServerClient, rank_env, reap_forked, run_ranks


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
        code, timed_out = reap_forked(pid, req["timeout"])
        print(json.dumps({"code": code, "timed_out": timed_out}), flush=True)


class ForkRunner(ForkServerClient):
    """The client: `run(argv)` runs one row in a child forked from the server."""

    def __init__(self, workdir: str):
        self.workdir = workdir
        super().__init__(__file__, rank_env(), "fork server")

    def run(self, argv: list[str], env: dict | None = None, timeout: int = 180,
            entry: str | None = None) -> subprocess.CompletedProcess:
        out = os.path.join(self.workdir, f"{self.count + 1}.out")
        err = os.path.join(self.workdir, f"{self.count + 1}.err")
        full_env = {"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", **(env or {})}
        reply = self.request({"argv": argv, "env": full_env, "out": out, "err": err, "timeout": timeout,
                              "entry": entry})
        return subprocess.CompletedProcess(argv, reply["code"], open(out).read(), open(err).read())


class FreshRunner:
    """Every row in its own `python pretrain_gpt_dcp.py` (BAD_INPUTS_FRESH=1)."""

    def run(self, argv, env=None, timeout=180, entry=None):
        if entry is None:
            return run_ranks(1, argv, env=env, timeout=timeout)
        return subprocess.run([sys.executable, os.path.join(REPO, entry)] + argv, cwd=REPO, env=rank_env(env),
                              capture_output=True, text=True, timeout=timeout)

    def close(self):
        pass


def make_runner(workdir: str):
    """The fork server; a FreshRunner when BAD_INPUTS_FRESH is set."""
    return FreshRunner() if os.environ.get("BAD_INPUTS_FRESH") else ForkRunner(workdir)


def run_case(runner, argv, env=None, timeout=180, entry=None):
    try:
        return runner.run(argv, env=env, timeout=timeout, entry=entry)
    except subprocess.TimeoutExpired:  # FreshRunner
        return subprocess.CompletedProcess(argv, 124, "", "")


if __name__ == "__main__" and "--serve" in sys.argv:
    _serve()
