"""Plans are pinned: the planners' output on the shipped length files must not change.

Why it exists: refactoring the planning code (moving modules, merging helpers) must leave
every plan identical. Each case runs `dcp-plan` on one of the shipped length files
(data/lengths) and compares the plan file, byte for byte, with the one pinned in
tests/fixtures/pinned_plans.json.gz (tests/support/plan_pins.py). A failure names the case and the
first iteration, replica and micro-batch that differ, with the old and new predicted
times. A deliberate change to planning re-pins in one step,
`pytest tests/planning/test_plan_digests.py --repin` (or `python tests/planning/test_plan_digests.py --repin`),
and says why in its commit.
"""
import json
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

from dcp_ext.cli import plan as plan_cli  # noqa: E402
from tests.support.plan_pins import describe_change, load_pins, save_pins  # noqa: E402

LENGTHS = os.path.join(HERE, "..", "..", "data", "lengths")  # the repo ships the files of ../shared/data/lengths
PLANNERS = ("adaptive", "static", "dynamic-cp", "cp-buckets", "hydraulis")
SMALL = ("demo", "cpu-gloox4", 8192, 2048)
FILES = ("code_python_cl100k.txt", "mooncake_conversation_input_tokens.txt", "arxiv_summarization_total_llama2.txt",
         "azure2023_conv_prompt_tokens.txt", "text_reuters21578_cl100k.txt", "azure2023_code_prompt_tokens.txt")
# (length file, model, cluster, global batch tokens, max seq len, planners)
CASES = [(f, *SMALL, PLANNERS) for f in FILES] + [
    ("azure2023_code_prompt_tokens.txt", "gpt-1.3b", "h100x8", 524288, 32768, PLANNERS),
    ("arxiv_summarization_total_llama2.txt", "llama2-13b", "h200x64", 2097152, 65536, ("static", "dynamic-cp", "cp-buckets")),
    ("mooncake_conversation_input_tokens.txt", "llama2-7b", "h200x64", 4194304, 131072, ("adaptive",)),
]


def case_ids():
    return [(planner, *c[:5]) for c in CASES for planner in c[5]]


def plan_text(tmp_dir, planner, lengths, model, cluster, gbt, msl) -> str:
    out = os.path.join(tmp_dir, f"{planner}-{model}-{lengths}.json")
    rc = plan_cli.main(["--lengths", os.path.join(LENGTHS, lengths), "--model", model, "--cluster", cluster,
                        "--global-batch-tokens", str(gbt), "--max-seq-len", str(msl), "--iterations", "3",
                        "--planner", planner, "--out", out, "--quiet"])
    assert rc == 0
    with open(out) as f:
        return f.read()


def key(case) -> str:
    return "/".join(str(x) for x in case)


@pytest.fixture(scope="module")
def pins():
    return load_pins()


def check_pin(name: str, got: str, pins: dict, repin: bool, save=save_pins) -> str | None:
    """None when the plan is the pinned one; with `repin`, pin it (and return what changed);
    otherwise the failure message."""
    want = pins.get(name)
    if want == got:
        return None
    change = describe_change(want, got) if want is not None else "newly pinned"
    if repin:
        pins[name] = got
        save(pins)
        return f"re-pinned {name}:\n{change}"
    if want is None:
        return f"no plan pinned for {name}; run pytest tests/planning/test_plan_digests.py --repin"
    return (f"the plan of {name} changed:\n{change}\n"
            "if the change is meant, re-pin: pytest tests/planning/test_plan_digests.py --repin")


@pytest.mark.skipif(not os.path.isdir(LENGTHS), reason="data/lengths not present")
@pytest.mark.parametrize("case", case_ids(), ids=key)
def test_plan_is_unchanged(case, tmp_path, pins, request):
    repin = request.config.getoption("--repin")
    message = check_pin(key(case), plan_text(str(tmp_path), *case), pins, repin)
    if message and repin:
        print("\n" + message)
    elif message:
        pytest.fail(message, pytrace=False)


def test_every_pin_belongs_to_a_case(pins):
    assert sorted(pins) == sorted(key(c) for c in case_ids())


if __name__ == "__main__" and "--repin" in sys.argv:
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        table = load_pins()
        for case in case_ids():
            print(check_pin(key(case), plan_text(d, *case), table, repin=True) or f"{key(case)} unchanged",
                  file=sys.stderr)
