"""The tier rule fires: a test not marked `dist` that starts a process fails (at the call,
before anything starts, and even when it swallows the error); a `dist` test may; a unit test
that uses a fixture which started processes fails too (that fixture, not another of its name). Nested in-process sessions."""
import textwrap

import pytest

INI = """
[pytest]
markers =
    dist: starts processes
    slow: long
"""

BODY = '''
import multiprocessing
import os
import subprocess

import pytest

MARK = {mark!r}


@pytest.fixture(scope="session")
def server():
    subprocess.run(["true"], check=True)
    return "up"


def test_subprocess_unmarked():
    subprocess.run(["sh", "-c", "touch " + MARK])


def test_swallowed_unmarked():
    try:
        subprocess.run(["true"])
    except Exception:
        pass


def test_fork_unmarked():
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)


def test_multiprocessing_unmarked():
    p = multiprocessing.get_context("spawn").Process(target=print)
    p.start()
    p.join()


def test_system_unmarked():
    os.system("true")


@pytest.mark.dist
def test_dist_may_spawn(server):
    assert subprocess.run(["true"]).returncode == 0


def test_unit_uses_spawning_fixture(server):
    assert server == "up"


def test_plain_unit():
    assert 1 + 1 == 2
'''

# another file whose parameter shares the spawning fixture's name: not that fixture
OTHER = '''
import pytest


@pytest.mark.parametrize("server", ["down"])
def test_parameter_named_like_a_spawning_fixture(server):
    assert server == "down"
'''


def test_the_tier_rule_fires(pytester, tmp_path):
    mark = tmp_path / "started"
    pytester.makefile(".ini", pytest=INI)
    pytester.makepyfile(test_inner=textwrap.dedent(BODY.format(mark=str(mark))), test_other=OTHER)
    result = pytester.runpytest_inprocess("-p", "tests.support.tiers", "-p", "no:cacheprovider", "-rA")
    text = result.stdout.str()
    summary = [line for line in result.outlines if line.startswith(("PASSED", "FAILED", "ERROR"))]
    outcomes = {k: v for k, v in result.parseoutcomes().items() if k in ("passed", "failed", "errors")}
    assert outcomes == {"passed": 3, "failed": 5, "errors": 1}, (outcomes, summary)
    # a unit test that starts a process fails, however it does it, and nothing starts
    for name in ("subprocess", "swallowed", "fork", "multiprocessing", "system"):
        assert f"FAILED test_inner.py::test_{name}_unmarked" in text
    assert "not marked dist: add @pytest.mark.dist" in text
    assert not mark.exists(), "the refused process ran anyway"
    # a dist test may; a unit test may not use a fixture that started processes
    assert "PASSED test_inner.py::test_dist_may_spawn" in text
    assert "PASSED test_inner.py::test_plain_unit" in text
    assert "ERROR test_inner.py::test_unit_uses_spawning_fixture" in text
    assert "uses fixture 'server', which starts processes" in text
    # a fixture is told apart by where it is defined, not by its name alone
    assert "PASSED test_other.py::test_parameter_named_like_a_spawning_fixture" in text
    # the summary gives each tier's count
    counts = {w[0]: int(w[1]) for w in (line.split() for line in result.outlines) if w[:1] in (["unit"], ["dist"])}
    assert counts == {"unit": 8, "dist": 1}, result.outlines[-30:]
