"""Test tiers, enforced: a test is `unit` (one process), `dist` (starts processes: ranks,
torchrun, a fork server, a tool run as a subprocess), `slow` (over ~30 s) or `gpu`.

Why it exists: `make test-fast` runs the unit tier only, so the tier of a test must say
what the test does. Marks drift as tests change; this plugin keeps them true:

- while a test that is not marked `dist` runs (setup, call, teardown), starting a process
  (subprocess, multiprocessing, os.fork/posix_spawn/system) is refused at the call, with
  an error naming the mark to add, and the test fails even if it swallowed that error;
- a fixture that started processes while a `dist` test set it up is remembered, so a
  unit test that uses it fails too, whatever order the tests ran in;
- at the end it prints each tier's test count and time, and the unit tests slower than
  `UNIT_BUDGET_S` (a hint to move or shrink them; never a failure: no test asserts time).

Registered by tests/conftest.py.
"""
from __future__ import annotations

import _posixsubprocess
import os
import subprocess

import pytest

UNIT_BUDGET_S = 2.0
SLOW_HINT_S = 30.0
TIERS = ("gpu", "slow", "dist", "unit")


class SpawnRefused(OSError):
    """Raised where a unit-tier test starts a process."""


def tier_of(item) -> str:
    """The first of gpu, slow, dist that marks the test; `unit` when none does."""
    for tier in TIERS[:-1]:
        if item.get_closest_marker(tier) is not None:
            return tier
    return "unit"


def may_spawn(item) -> bool:
    """Only `dist` tests start processes (a slow or gpu test that does is `dist` too)."""
    return item.get_closest_marker("dist") is not None


class _Guard:
    """Wraps every way a Python process starts another; `watching` says who is running now.

    The wrappers are installed once per session. Nested pytest sessions in one process (a
    test of this plugin) push their own watcher: only the innermost one sees a spawn."""

    def __init__(self):
        self.stack: list[dict] = []  # watchers: {"allowed": bool, "spawns": [...], "fixture": name}
        self._saved: list[tuple] = []

    def install(self):
        targets = [(_posixsubprocess, "fork_exec"), (subprocess, "_fork_exec")]
        targets += [(os, name) for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system")
                    if hasattr(os, name)]
        for module, name in targets:
            original = getattr(module, name)
            if getattr(original, "_tier_guard", False):
                continue  # an outer session's guard already wraps it
            wrapper = self._wrap(original, f"{module.__name__}.{name}")
            self._saved.append((module, name, original))
            setattr(module, name, wrapper)

    def uninstall(self):
        for module, name, original in reversed(self._saved):
            setattr(module, name, original)
        self._saved.clear()

    def _wrap(self, original, what):
        def guarded(*args, **kwargs):
            watcher = _ACTIVE[-1] if _ACTIVE else None
            if watcher is not None:
                watcher["spawns"].append((what, _describe(what, args)))
                if not watcher["allowed"]:
                    raise SpawnRefused(
                        f"{watcher['test']} started a process ({_describe(what, args)}) but is not marked "
                        "dist: add @pytest.mark.dist (or make it a one-process test)")
            return original(*args, **kwargs)

        guarded._tier_guard = True
        return guarded


# The watchers of all sessions in this process, innermost last (module-level: a nested
# in-process session imports this same module).
_ACTIVE: list[dict] = []


def _describe(what: str, args) -> str:
    if what.endswith("fork_exec") and args:
        argv = args[0]
        try:
            words = [a.decode() if isinstance(a, bytes) else str(a) for a in argv]
        except TypeError:
            words = [repr(argv)]
        return "exec " + " ".join(words)[:160]
    if what.endswith("system") and args:
        return f"os.system({args[0]!r})"[:160]
    return what


def _fixture_key(fixturedef) -> tuple[str, str]:
    """A fixture by where it is defined and its name: two files may each define (or
    parametrize) a `runs` that have nothing to do with each other."""
    return (fixturedef.baseid, fixturedef.argname)


def _fixtures_used(item) -> list[tuple[str, str]]:
    """The fixtures `item` resolves to (the innermost definition of each name it uses)."""
    defs = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
    return [_fixture_key(chain[-1]) for name in item.fixturenames if (chain := defs.get(name))]


class TierPlugin:
    def __init__(self, config):
        self.config = config
        self.guard = _Guard()
        self.spawning_fixtures: dict[tuple[str, str], str] = {}  # (where defined, name) -> what it started
        self.durations: dict[str, dict] = {t: {"count": 0, "seconds": 0.0} for t in TIERS}
        self.slow_units: list[tuple[float, str]] = []
        self.unmarked_slow: list[tuple[float, str]] = []
        self._test_seconds: dict[str, float] = {}
        self._current = None

    # ---------------------------------------------------------------- session
    def pytest_sessionstart(self, session):
        self.guard.install()

    def pytest_unconfigure(self, config):
        self.guard.uninstall()

    # ---------------------------------------------------------------- one test
    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        watcher = {"allowed": may_spawn(item), "spawns": [], "test": item.nodeid, "fixture": None}
        self._current = watcher
        _ACTIVE.append(watcher)
        try:
            yield
        finally:
            _ACTIVE.remove(watcher)
            self._current = None

    @pytest.hookimpl(hookwrapper=True)
    def pytest_fixture_setup(self, fixturedef, request):
        watcher = self._current
        before = len(watcher["spawns"]) if watcher else 0
        yield
        if watcher and len(watcher["spawns"]) > before:
            self.spawning_fixtures.setdefault(_fixture_key(fixturedef), watcher["spawns"][before][1])

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        outcome = yield
        report = outcome.get_result()
        watcher = self._current
        if watcher is None:
            return
        self._test_seconds[item.nodeid] = self._test_seconds.get(item.nodeid, 0.0) + report.duration
        if call.when == "teardown":
            self._count(item, self._test_seconds.pop(item.nodeid))
        if watcher["allowed"] or report.skipped:
            return
        problem = None
        if watcher["spawns"]:
            problem = (f"{item.nodeid} started a process ({watcher['spawns'][0][1]}) but is not marked dist: "
                       "add @pytest.mark.dist (or make it a one-process test)")
        elif call.when == "setup":
            used = [key for key in _fixtures_used(item) if key in self.spawning_fixtures]
            if used:
                problem = (f"{item.nodeid} uses fixture '{used[0][1]}', which starts processes "
                           f"({self.spawning_fixtures[used[0]]}), but is not marked dist: add @pytest.mark.dist")
        if problem and not report.failed:
            report.outcome = "failed"
            report.longrepr = "tier rule: " + problem
        watcher["spawns"].clear()  # reported once, in the phase that spawned

    def _count(self, item, seconds: float) -> None:
        tier = tier_of(item)
        self.durations[tier]["count"] += 1
        self.durations[tier]["seconds"] += seconds
        if tier == "unit" and seconds > UNIT_BUDGET_S:
            self.slow_units.append((seconds, item.nodeid))
        if tier != "slow" and seconds > SLOW_HINT_S:
            self.unmarked_slow.append((seconds, item.nodeid))

    # ---------------------------------------------------------------- summary
    def pytest_terminal_summary(self, terminalreporter):
        tr = terminalreporter
        total = sum(d["count"] for d in self.durations.values())
        if not total:
            return
        tr.section("tiers")
        for tier in reversed(TIERS):
            d = self.durations[tier]
            if d["count"]:
                tr.write_line(f"{tier:5s} {d['count']:5d} tests  {d['seconds']:8.1f} s")
        if self.slow_units:
            tr.write_line(f"unit tests over {UNIT_BUDGET_S:.0f} s (shrink them, or mark them slow):")
            for seconds, nodeid in sorted(self.slow_units, reverse=True)[:15]:
                tr.write_line(f"  {seconds:6.1f} s  {nodeid}")
        if self.unmarked_slow:
            tr.write_line(f"tests over {SLOW_HINT_S:.0f} s not marked slow:")
            for seconds, nodeid in sorted(self.unmarked_slow, reverse=True)[:15]:
                tr.write_line(f"  {seconds:6.1f} s  {nodeid}")


def register(config) -> None:
    if not config.pluginmanager.has_plugin("tiers"):
        config.pluginmanager.register(TierPlugin(config), "tiers")


def pytest_configure(config):
    """Loaded with `-p tests.support.tiers` (a nested session in tests/repo/test_tiers.py)."""
    register(config)
