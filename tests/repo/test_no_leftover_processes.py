"""The session-end check (conftest.pytest_sessionfinish): a process the tests started that is
still alive at the end fails the run, even one orphaned by its parent's death (as
megatron-core's dist-checkpointing helper was when a rank died mid-save), and is killed."""
import os
import subprocess
import sys
import textwrap
import time

import pytest

from tests.support.helpers import REPO

pytestmark = pytest.mark.dist

LEAKY = '''
import subprocess, sys

import pytest


@pytest.mark.dist
def test_leaks(tmp_path):
    # the parent exits at once: the sleeper is reparented, no longer anyone's descendant here
    code = ("import os, sys, time\\nif os.fork(): os._exit(0)\\n"
            "open(sys.argv[1], 'w').write(str(os.getpid()))\\ntime.sleep(120)")
    subprocess.run([sys.executable, "-c", code, {pidfile!r}], check=True)
'''


def test_a_process_left_running_fails_the_session(tmp_path):
    import psutil

    pidfile = tmp_path / "orphan.pid"
    inner = tmp_path / "test_leaky.py"
    inner.write_text(textwrap.dedent(LEAKY.format(pidfile=str(pidfile))))
    env = dict(os.environ, PYTHONPATH=REPO)
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "tests.conftest", str(inner)], cwd=REPO,
                       env=env, capture_output=True, text=True, timeout=120)
    deadline = time.time() + 10
    while not pidfile.exists() and time.time() < deadline:
        time.sleep(0.1)
    pid = int(pidfile.read_text())
    try:
        assert r.returncode == 1, r.stdout[-2000:] + r.stderr[-2000:]
        assert "still running at the end" in r.stdout and f"pid {pid} " in r.stdout, r.stdout[-2000:]
        assert "test_leaky.py::test_leaks" in r.stdout  # names the test that started it
        gone = not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        assert gone, "the leftover process was not killed"
    finally:
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass
