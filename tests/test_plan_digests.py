"""Plans are pinned: the planners' output on the shipped length files must not change.

Why it exists: refactoring the planning code (moving modules, merging helpers) must leave
every plan identical. Each case runs `dcp-plan` on one of the shipped length files (data/lengths) and
compares the SHA-256 of the plan file with the digest recorded in
tests/data/plan_digests.json. A deliberate change to planning re-records them with
`python tests/test_plan_digests.py --update` and says why in its commit.
"""
import hashlib
import json
import os
import sys

import pytest

from dcp_ext.cli import plan as plan_cli

HERE = os.path.dirname(os.path.abspath(__file__))
LENGTHS = os.path.join(HERE, "..", "data", "lengths")  # the repo ships the files of ../shared/data/lengths
DIGESTS = os.path.join(HERE, "data", "plan_digests.json")
PLANNERS = ("adaptive", "static", "dynamic-cp", "dcp", "hydraulis")
SMALL = ("demo", "cpu-gloox4", 8192, 2048)
FILES = ("code_python_cl100k.txt", "mooncake_conversation_input_tokens.txt", "arxiv_summarization_total_llama2.txt",
         "azure2023_conv_prompt_tokens.txt", "text_reuters21578_cl100k.txt", "azure2023_code_prompt_tokens.txt")
# (length file, model, cluster, global batch tokens, max seq len, planners)
CASES = [(f, *SMALL, PLANNERS) for f in FILES] + [
    ("azure2023_code_prompt_tokens.txt", "gpt-1.3b", "h100x8", 524288, 32768, PLANNERS),
    ("arxiv_summarization_total_llama2.txt", "llama2-13b", "h200x64", 2097152, 65536, ("static", "dynamic-cp", "dcp")),
    ("mooncake_conversation_input_tokens.txt", "llama2-7b", "h200x64", 4194304, 131072, ("adaptive",)),
]


def case_ids():
    return [(planner, *c[:5]) for c in CASES for planner in c[5]]


def plan_digest(tmp_dir, planner, lengths, model, cluster, gbt, msl) -> str:
    out = os.path.join(tmp_dir, f"{planner}-{model}-{lengths}.json")
    rc = plan_cli.main(["--lengths", os.path.join(LENGTHS, lengths), "--model", model, "--cluster", cluster,
                        "--global-batch-tokens", str(gbt), "--max-seq-len", str(msl), "--iterations", "3",
                        "--planner", planner, "--out", out, "--quiet"])
    assert rc == 0
    with open(out, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def key(case) -> str:
    return "/".join(str(x) for x in case)


@pytest.mark.skipif(not os.path.isdir(LENGTHS), reason="data/lengths not present")
@pytest.mark.parametrize("case", case_ids(), ids=key)
def test_plan_is_unchanged(case, tmp_path, capsys):
    with open(DIGESTS) as f:
        want = json.load(f)
    assert key(case) in want, f"no digest recorded for {key(case)}; run python tests/test_plan_digests.py --update"
    assert plan_digest(str(tmp_path), *case) == want[key(case)], f"the plan of {key(case)} changed"


if __name__ == "__main__" and "--update" in sys.argv:
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        table = {}
        for case in case_ids():
            table[key(case)] = plan_digest(d, *case)
            print(key(case), table[key(case)][:16], file=sys.stderr)
    with open(DIGESTS, "w") as f:
        json.dump(table, f, indent=1, sort_keys=True)
        f.write("\n")
