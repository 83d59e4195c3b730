"""The README's tool commands run as written and produce what the README says they do.

Why it exists: a newcomer copies the README's commands first. The commands are read from the
README's pages (the fenced ```bash and indented blocks of "Data", "Planning on a laptop" and
"Checkpoints", up to their first subsection), so a command that changes there is the command
tested here; a command this file does not know fails the test until it is given a check. Each
runs in a fresh folder that holds the repository's tools/, examples/, data/lengths/ and entry
point (so outputs such as data/sample_text_document land there), `python` being this Python
and the console scripts (dcp-plan, dcp-simulate, dcp-profile) this environment's. Nothing is
shrunk. The quick ones run here (`dist`: they are processes); the profile, the SFT training
and the legacy conversion (each a minute or more on 2 cores) in the slow tier. Each command's
time is noted at the end of the session (tests/support/session_notes.py), never asserted.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time

import pytest

from tests.support.helpers import REPO, rank_env
from tests.support.session_notes import note

# the pages the README links for these tools, and the section of each whose commands run here
SECTIONS = (("docs/data.md", "Data"), ("docs/planning.md", "Planning on a laptop"),
            ("docs/checkpoints.md", "Checkpoints"))


def section_text(page: str, title: str, where: str = "README.md") -> str:
    """The section `## title` of `page` up to the next heading of level 2 or 3 (or the end)."""
    m = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^##+ |\Z)", page, flags=re.S | re.M)
    assert m, f"{where} has no section '## {title}'"
    return m.group(1)


def commands_in(text: str) -> list[str]:
    """Shell commands of the fenced ```bash blocks and 4-space indented blocks, continuation
    lines joined, comments dropped."""
    lines = []
    for block in re.findall(r"^```(?:bash|sh)?\n(.*?)^```", text, flags=re.S | re.M):
        lines += block.splitlines()
    outside = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    lines += [ln[4:] for ln in outside.splitlines() if ln.startswith("    ") and not ln.startswith("     ")
              and ln.strip() and not ln.lstrip().startswith(("-", "|"))]
    out, current = [], ""
    for ln in lines:
        ln = re.sub(r"\s+#.*$", "", ln).rstrip()
        if not ln.strip():
            continue
        if ln.endswith("\\"):
            current += ln[:-1].strip() + " "
            continue
        out.append((current + ln.strip()).strip())
        current = ""
    return out


def readme_commands() -> list[str]:
    out = []
    for path, title in SECTIONS:
        with open(os.path.join(REPO, path)) as f:
            out += commands_in(section_text(f.read(), title, path))
    return out


# --------------------------------------------------------------------------- checks
def _files(ws, *names):
    for name in names:
        path = os.path.join(ws, name)
        assert os.path.isfile(path) and os.path.getsize(path) > 0, f"{name} was not written"


def check_preprocess_text(ws, r):
    _files(ws, "data/sample_text_document.bin", "data/sample_text_document.idx")
    assert "train on it with --data-path data/sample_text_document" in r.stderr


def check_dataset_stats(ws, r):
    _files(ws, "data/sample_lengths.png")
    assert "padding overhead at --seq-length 4096" in r.stdout and "histogram image:" in r.stdout


def check_preprocess_sft(ws, r):
    _files(ws, "data/sample_sft_document.bin", "data/sample_sft_document.idx", "data/sample_sft_document_loss_mask.bin")
    assert "--sft writes one dataset, data/sample_sft_document" in r.stderr


def check_simulate(ws, r):
    _files(ws, "timeline.png")
    assert "12 iterations of 4194304 tokens" in r.stdout
    for planner in ("adaptive", "static", "dynamic-cp", "cp-buckets", "hydraulis"):
        assert f"| {planner} " in r.stdout
    assert "--iterations" not in r.stderr  # 12 full batches: no shortfall of iterations


def check_plan(ws, r):
    with open(os.path.join(ws, "plan.json")) as f:
        plan = json.load(f)
    assert len(plan["iterations"]) == 12 and "wrote 12 iterations to plan.json" in r.stdout


def check_profile(ws, r):
    with open(os.path.join(ws, "profile.json")) as f:
        profile = json.load(f)
    assert profile["records"] and "= 52 runs (--quick" in r.stderr and "wrote profile.json" in r.stdout


def check_sft_training(ws, r):
    assert "iteration       20/      20" in r.stdout and "lm loss" in r.stdout


def check_legacy_conversion(ws, r):
    assert "converted iteration 7 of upstream_ckpt" in r.stdout
    _files(ws, "upstream_ckpt_torch_dist/latest_checkpointed_iteration.txt",
           "upstream_ckpt_torch_dist/iter_0000007/metadata.json")


# (pattern the command matches, its check, slow); every README command matches exactly one
KNOWN = (
    (r"^python tools/preprocess_data\.py --input examples/data/sample_corpus\.jsonl ", check_preprocess_text, False),
    (r"^python tools/dataset_stats\.py --data-path data/sample_text_document ", check_dataset_stats, False),
    (r"^python tools/preprocess_data\.py --input examples/data/sample_sft\.jsonl --sft ", check_preprocess_sft, False),
    (r"^dcp-simulate ", check_simulate, False),
    (r"^dcp-plan ", check_plan, False),
    (r"^dcp-profile --quick ", check_profile, True),
    (r"^torchrun .*pretrain_gpt_dcp\.py --yaml-cfg examples/sft_demo\.yaml", check_sft_training, True),
    (r"^python tools/convert_legacy_checkpoint\.py --load upstream_ckpt ", check_legacy_conversion, True),
)


def known(command: str):
    found = [(check, slow) for pattern, check, slow in KNOWN if re.search(pattern, command)]
    assert len(found) == 1, (f"README command without a check in tests/tools/test_readme_commands.py (add it to KNOWN): "
                             f"{command}")
    return found[0]


def test_every_readme_command_has_a_check():
    commands = readme_commands()
    assert commands, "no commands found in the README's sections"
    checks = [known(c)[0] for c in commands]
    missing = [p for p, check, _ in KNOWN if check not in checks]
    assert not missing, f"the README no longer has these commands: {missing}"


def test_commands_are_read_whole():
    text = "x\n```bash\npython a.py --x 1 \\\n    --y 2   # note\ndcp-plan --z\n```\n\n    dcp-simulate --q\n"
    assert commands_in(text) == ["python a.py --x 1 --y 2", "dcp-plan --z", "dcp-simulate --q"]


# --------------------------------------------------------------------------- running them
@pytest.fixture
def workspace(tmp_path):
    """A folder with the repository's tools, examples, sample lengths and entry point."""
    for name in ("tools", "examples", "pretrain_gpt_dcp.py"):
        os.symlink(os.path.join(REPO, name), tmp_path / name)
    (tmp_path / "data").mkdir()
    os.symlink(os.path.join(REPO, "data", "lengths"), tmp_path / "data" / "lengths")
    return str(tmp_path)


def run_command(ws: str, command: str, timeout: int = 900) -> subprocess.CompletedProcess:
    """`command` as a user types it in `ws`: `python` is this Python, the console scripts and
    torchrun this environment's."""
    argv = shlex.split(command)
    if argv[0] == "python":
        argv[0] = sys.executable
    env = rank_env({"PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")})
    env.pop("OMP_NUM_THREADS", None)  # as a user's shell has it
    t0 = time.perf_counter()
    r = subprocess.run(argv, cwd=ws, env=env, capture_output=True, text=True, timeout=timeout)
    note("README commands (seconds, as written)", f"{time.perf_counter() - t0:6.1f}  {command}")
    assert r.returncode == 0, f"{command}\nexit {r.returncode}\n{r.stderr[-3000:]}"
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    return r


def _run_all(ws: str, slow: bool, before=()) -> None:
    commands = readme_commands()
    for command in before:  # what a slow command needs from a quick one (its inputs)
        run_command(ws, command)
    for command in commands:
        check, is_slow = known(command)
        if is_slow == slow:
            check(ws, run_command(ws, command))


@pytest.mark.dist
def test_quick_readme_commands_run_as_written(workspace):
    _run_all(workspace, slow=False)


def _legacy_checkpoint(rank, world, flags, root):
    from tests.checkpoint.test_convert_legacy_checkpoint import _write_legacy

    return _write_legacy(rank, world, flags, root, 1, 1, True)


@pytest.mark.dist
@pytest.mark.slow
def test_slow_readme_commands_run_as_written(workspace, text_corpus):
    from tests.conftest import TINY_MODEL
    from tests.support.helpers import run_ranks

    # an upstream legacy checkpoint where the README's conversion reads it
    flags = TINY_MODEL + ["--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "4", "--data-path",
                          text_corpus, "--data-cache-path", os.path.join(workspace, "cache")]
    run_ranks(1, fn=_legacy_checkpoint, args=(flags, os.path.join(workspace, "upstream_ckpt")))
    sft = [c for c in readme_commands() if known(c)[0] is check_preprocess_sft]
    _run_all(workspace, slow=True, before=sft)
