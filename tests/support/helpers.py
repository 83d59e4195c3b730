"""Test helpers: the one way tests run real ranks (run_ranks: the entry point under torchrun,
or a function on spawned gloo ranks), the fork-server client for fast single-process rows,
and small shared utilities."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import traceback

import torch.multiprocessing as mp

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENTRY = os.path.join(REPO, "pretrain_gpt_dcp.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, fn, args, env, result_dir):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)

    os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    from dcp_ext.compat import cpu_compat

    cpu_compat.install()
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        out = fn(rank, world_size, *args)
        status = {"ok": True, "result": out}
    except BaseException:
        status = {"ok": False, "error": traceback.format_exc()}
    with open(os.path.join(result_dir, f"{rank}.json"), "w") as f:
        json.dump(status, f)
    dist.destroy_process_group()


def rank_env(env: dict | None = None) -> dict:
    """The environment of a launched run: this repository first on the path, one thread a rank."""
    full = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    full.update(env or {})
    return full


def start_ranks(nproc: int, flags: list[str], out, err=subprocess.STDOUT, *, max_restarts: int = 0,
                env: dict | None = None, entry: str = ENTRY) -> subprocess.Popen:
    """Start pretrain_gpt_dcp.py with `flags` on `nproc` CPU ranks and return at once: torchrun
    (with `max_restarts`), or plain python for one rank without restarts. For tests that signal
    or kill ranks mid-run; `out`/`err` are open files (never pipes, see run_ranks). The caller
    ends it with kill_tree."""
    cmd = [sys.executable, entry]
    if nproc > 1 or max_restarts:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               f"--max-restarts={max_restarts}", entry]
    return subprocess.Popen(cmd + flags, cwd=REPO, env=rank_env(env), stdout=out, stderr=err, text=True,
                            start_new_session=True, preexec_fn=sigint_as_a_terminal_gives_it)


def sigint_as_a_terminal_gives_it() -> None:
    """A suite started from a non-interactive shell's background job (`cmd &`) inherits
    SIGINT ignored, and Python then keeps ignoring it: the Ctrl-C tests would signal a run
    that cannot hear them. The job gets SIGINT's default back, as in a terminal."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def run_ranks(nproc: int, flags: list[str] | None = None, *, fn=None, args: tuple = (), env: dict | None = None,
              timeout: int = 600, torchrun: bool = False, entry: str = ENTRY):
    """Run a real job on `nproc` CPU gloo ranks and wait for it; give exactly one of:

    flags: the real entry point, `pretrain_gpt_dcp.py FLAGS`: `main()` in `nproc` children
        forked from the session's fork server (tests/support/entry_runner.py), each with the
        environment torchrun gives a worker, and torchrun's rule when one fails (the others
        get SIGTERM); the imports are paid once per session, not ~4 s per rank per run on 2
        shared cores. `torchrun=True` (or DCP_TESTS_FRESH=1) runs it in fresh processes:
        torchrun for several ranks, plain python for one; tests of what torchrun itself does
        (its failure report, restarts, signals) use that. Returns the CompletedProcess (exit code, stdout, stderr); a job past
        `timeout` s is killed and raises subprocess.TimeoutExpired. `entry`: another script
        that becomes the entry point (tests/support/group_count_entry.py: the same run, observed).
    fn: `fn(rank, world_size, *args)` in `nproc` freshly spawned processes, each with its gloo
        process group up (for tests that drive the runtime directly). Returns the ranks'
        JSON-able results in rank order; raises AssertionError naming the first rank that
        raised, or on timeout.
    """
    if (flags is None) == (fn is None):
        raise TypeError("run_ranks takes flags or fn, not both")
    if fn is not None:
        return _run_function(nproc, fn, args, env or {}, timeout)
    if not torchrun and not fresh_processes():
        from tests.support.entry_runner import shared_runner

        r = shared_runner().run(flags, env=env, timeout=timeout, nproc=nproc,
                                entry=None if entry == ENTRY else os.path.relpath(entry, REPO))
        if r.timed_out:
            raise subprocess.TimeoutExpired(entry, timeout)
        return r
    return run_fresh(nproc, flags, env=env, timeout=timeout, entry=entry)


def run_tool(script: str, argv: list[str], *, env: dict | None = None, timeout: int = 600):
    """A console tool of this repository (`script` relative to it, e.g. tools/preprocess_data.py)
    as its own process: forked from the session's fork server, or fresh with DCP_TESTS_FRESH=1.
    Returns the CompletedProcess; past `timeout` s raises subprocess.TimeoutExpired."""
    if fresh_processes():
        return subprocess.run([sys.executable, os.path.join(REPO, script)] + argv, cwd=REPO, env=rank_env(env),
                              capture_output=True, text=True, timeout=timeout)
    from tests.support.entry_runner import shared_runner

    r = shared_runner().run(argv, env=env, timeout=timeout, entry=script)
    if r.timed_out:
        raise subprocess.TimeoutExpired(script, timeout)
    return r


def fresh_processes() -> bool:
    """DCP_TESTS_FRESH=1 (or BAD_INPUTS_FRESH=1): every one-rank run in a fresh interpreter,
    not forked from the shared server (the check that forking changes nothing)."""
    return bool(os.environ.get("DCP_TESTS_FRESH") or os.environ.get("BAD_INPUTS_FRESH"))


def run_fresh(nproc: int, flags: list[str], *, env: dict | None = None, timeout: int = 600, entry: str = ENTRY):
    """The entry point in fresh processes: torchrun for several ranks, plain python for one."""
    # Output goes to files, not pipes, and the whole process group is killed afterwards:
    # dist-checkpointing starts a multiprocessing manager per rank that outlives a rank
    # killed mid-save and would otherwise hold a pipe open forever.
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = start_ranks(nproc, flags, out, err, env=env, entry=entry)
        try:
            code = proc.wait(timeout=timeout)
        finally:
            kill_tree(proc)
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(proc.args, code, out.read(), err.read())


def _run_function(nproc: int, fn, args: tuple, env: dict, timeout: int) -> list:
    import time

    with tempfile.TemporaryDirectory() as d:
        ctx = mp.start_processes(_worker, args=(nproc, free_port(), fn, args, env, d), nprocs=nproc,
                                 start_method="spawn", join=False)
        deadline = time.time() + timeout
        while not ctx.join(timeout=max(0.1, deadline - time.time())):
            if time.time() >= deadline:
                for p in ctx.processes:
                    p.kill()
                raise AssertionError(f"{fn.__name__} on {nproc} ranks: still running after {timeout} s")
        results = []
        for r in range(nproc):
            with open(os.path.join(d, f"{r}.json")) as f:
                status = json.load(f)
            if not status["ok"]:
                raise AssertionError(f"rank {r} failed:\n{status['error']}")
            results.append(status["result"])
    return results


def rank_processes(proc: subprocess.Popen, marker: str, direct: bool = False, rank: str | None = None) -> list:
    """The running descendants of a launched job whose command line holds `marker` (the
    ranks of a torchrun job), in start order. A descendant that ends while it is being
    looked at (a compiler the rank started, a rank exiting) is left out, not an error:
    the process table changes under the walk."""
    import psutil

    found = []
    try:
        descendants = psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:
        return found
    for p in descendants:
        try:
            if marker not in " ".join(p.cmdline()):
                continue
            if direct and p.ppid() != proc.pid:
                continue
            if rank is not None and p.environ().get("RANK") != rank:
                continue
        except psutil.Error:
            continue
        found.append(p)
    return found


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL a launched job: the descendants of a launcher still running, then its process
    group. torchrun starts each worker in a session of its own, so the group alone would
    leave the workers of a job that timed out running (tests/conftest.py fails the session
    on any leftover)."""
    import psutil

    descendants = []
    if proc.poll() is None:  # still running: its pid is still its own
        try:
            descendants = psutil.Process(proc.pid).children(recursive=True)
        except psutil.Error:
            pass
    for p in descendants:
        try:
            p.kill()
        except psutil.Error:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def read_loss_log(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def read_plan_log(path: str) -> dict[int, dict]:
    """A --dcp-log-plan file by iteration index; a restarted run re-logs: the last one counts."""
    plans = {}
    with open(path) as f:
        for line in f:
            it = json.loads(line)
            plans[it["index"]] = it
    return plans


def reap_ranks(pids: list[int], timeout: float, poll: float = 0.05, grace: float = 10.0) -> tuple[int, bool]:
    """Wait for the forked ranks of one job as torchrun does: all exit 0 -> 0; the first that
    fails gives the job its exit code, and the others get SIGTERM, then SIGKILL after `grace`
    s. Past `timeout` s every rank is killed -> (124, True). Each rank's process group (the
    rank and whatever it started) is killed at the end."""
    import time

    deadline = time.time() + timeout
    running, code, timed_out, term_at = set(pids), 0, False, None
    while running:
        for pid in list(running):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                running.discard(pid)
                rc = os.waitstatus_to_exitcode(status)
                if rc != 0 and code == 0:
                    code = rc
                    term_at = time.time()
                    for other in running:
                        _signal_group(other, signal.SIGTERM)
        if not running:
            break
        now = time.time()
        if now >= deadline or (term_at is not None and now - term_at > grace):
            timed_out = now >= deadline
            for pid in running:
                _signal_group(pid, signal.SIGKILL)
            for pid in running:
                os.waitpid(pid, 0)
            running.clear()
            break
        time.sleep(poll)
    for pid in pids:
        _signal_group(pid, signal.SIGKILL)
    return (124, True) if timed_out else (code, False)


def _signal_group(pid: int, sig) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def reap_forked(pid: int, timeout: float, poll: float = 0.05) -> tuple[int, bool]:
    """Wait up to `timeout` s for a forked child (a fork server's request), then SIGKILL its
    process group (the child and whatever it started: dist-checkpointing workers).
    Returns (exit code, 124 when it timed out; timed out)."""
    import time

    deadline = time.time() + timeout
    status = None
    while time.time() < deadline:
        done, st = os.waitpid(pid, os.WNOHANG)
        if done:
            status = st
            break
        time.sleep(poll)
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    if status is None:
        os.waitpid(pid, 0)
        return 124, True
    return os.waitstatus_to_exitcode(status), False


def drop_flags(flags: list[str], *names: str) -> list[str]:
    """`flags` without each named flag and its values (the tokens after it up to the next --flag)."""
    out, dropping = [], False
    for f in flags:
        if f.startswith("--"):
            dropping = f in names
        if not dropping:
            out.append(f)
    return out


class ForkServerClient:
    """Client of a test file's fork server (`python FILE --serve`: imports once, then forks one
    child per JSON request line and answers one JSON line). Subclasses add the request shape.

    Why it exists: speed. The bad-input table, the refused upstream launch lines
    (tests/support/entry_runner.py) and the save-fault rows (test_save_faults.py) are hundreds of
    single-process runs that each end in an error line or a fault; a fresh interpreter would
    spend ~5 s of imports (torch, megatron-core) per row on 2 shared cores, a fork costs only
    the row's own work. It is not a rank launcher: every child is one process, never several
    ranks; a real multi-rank run goes through run_ranks."""

    def __init__(self, script: str, env: dict, what: str):
        self.count = 0
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(script), "--serve"], cwd=REPO, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     start_new_session=True)
        assert json.loads(self.proc.stdout.readline()).get("ready"), f"{what} did not start"

    def request(self, req: dict) -> dict:
        self.count += 1
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def close(self):
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=30)
        finally:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def assert_one_line_error(result, needle):
    """The bad-input contract: a non-zero exit, no traceback, one non-empty stderr line, `error:` and the needle."""
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
    assert len(lines) == 1, result.stderr[-2000:]
    assert lines[0].startswith("error:") and needle in lines[0], lines[0]


def read_only_dir(root: str, on_teardown, unavailable: dict) -> str:
    """`root/ro`, a directory nobody may write into: mode 555 for a non-root user, the
    immutable attribute for root (undone at teardown); where neither can be had,
    `unavailable["ro"]` says why."""
    ro = os.path.join(root, "ro")
    os.makedirs(ro)
    if os.geteuid() != 0:
        os.chmod(ro, 0o555)
        on_teardown(lambda: os.chmod(ro, 0o755))
    elif subprocess.run(["chattr", "+i", ro], capture_output=True).returncode == 0:
        on_teardown(lambda: subprocess.run(["chattr", "-i", ro], capture_output=True))
    else:
        unavailable["ro"] = "root without CAP_LINUX_IMMUTABLE: cannot make a read-only directory"
    return ro
