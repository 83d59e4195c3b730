"""Every option of upstream Megatron-LM's pretrain_gpt.py parses here and ends as exactly one of:
honoured (our parser defines it), refused with one line naming it, or accepted without effect.
Checked against upstream's own flag list (tests/fixtures/upstream), which the product never reads."""
import csv
import glob
import os

import pytest

from tests.support.helpers import REPO, run_ranks
from megatron.training.flags import upstream_flags as uf
from megatron.training.arguments import ArgumentError, build_parser, parse_args, parse_flags
from megatron.training.flags.upstream_flag_table import FAMILIES, HARMLESS_VALUES, ROWS

UPSTREAM = os.path.join(REPO, "tests", "fixtures", "upstream")  # a copy of the workplace's shared/upstream
TSV = os.path.join(UPSTREAM, "megatron_flags.tsv")

BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--train-iters", "4", "--lr", "1e-3", "--mock-data", "--micro-batch-size", "1", "--global-batch-size", "1"]


def tsv_rows():
    if not os.path.isfile(TSV):
        return []
    with open(TSV) as f:
        return list(csv.DictReader(f, delimiter="\t"))


ROWS_TSV = tsv_rows()
PARSER = build_parser()
REGISTRY = {o: flag for flag in PARSER.get_default(uf.REGISTRY_ATTR).values() for o in flag.option_strings}


def a_value(row, avoid_default=True) -> list[str]:
    """Command-line tokens giving the row's first option a valid value that asks for something
    (neither upstream's default nor a value the table lists as harmless)."""
    option, kind, typ, nargs, default = row["flags"].split()[0], row["kind"], row["type"], row["nargs"], row["default"]
    if kind.startswith("switch"):
        return [option]
    choices = row["choices"].split(",") if row["choices"] else []
    if choices:
        asks_nothing = {default, *HARMLESS_VALUES.get(option, ())}
        pick = next((c for c in choices if c not in asks_nothing), choices[0]) if avoid_default else choices[0]
    elif typ == "int":
        pick = str(int(default) + 1) if default.lstrip("-").isdigit() else "2"
    elif typ == "float":
        pick = str(float(default) + 0.5) if default else "0.5"
    elif typ == "bool":
        pick = "1"
    else:
        pick = "x" if default != "x" else "y"
    count = int(nargs) if nargs.isdigit() else 1
    return [option] + [pick] * count


def outcome(argv):
    """('ok', args) or ('error', message); a traceback (any other exception) fails the test."""
    try:
        return "ok", parse_args(BASE + argv, world_size=1)
    except ArgumentError as e:
        return "error", str(e)


@pytest.mark.parametrize("row", ROWS_TSV, ids=[r["flags"].split()[0] for r in ROWS_TSV])
def test_every_upstream_flag_is_honoured_refused_or_accepted(row):
    argv = a_value(row)
    option = argv[0]
    status, got = outcome(argv)
    if status == "error":
        assert "unknown flag" not in got and "unrecognized" not in got, got
        assert "\n" not in got
    flag = REGISTRY.get(option)
    if flag is None:  # honoured: our own flag (its checks may still refuse this particular value)
        assert all(o in PARSER._option_string_actions for o in row["flags"].split())
        return
    if flag.verdict == uf.REFUSE:
        assert status == "error" and got.startswith(f"{option}: ") and "; " in got, got
    else:
        assert status == "ok", got
        assert option in uf.accepted_line(got), uf.accepted_line(got)


def test_counts_cover_all_838_rows(capsys):
    counts = uf.counts(PARSER, [r["flags"].split() for r in ROWS_TSV])
    with capsys.disabled():
        print(f"\nupstream flags: {counts['honoured']} honoured, {counts['refused']} refused, "
              f"{counts['accepted']} accepted without effect, {counts['unknown']} unknown")
    assert counts["unknown"] == 0
    assert sum(counts.values()) == len(ROWS_TSV) == 838


def test_table_rows_are_upstream_flags_with_upstream_types():
    tsv = {r["flags"]: r for r in ROWS_TSV}
    for flags, kind, typ, nargs, default, choices, family in ROWS:
        assert flags in tsv, f"{flags}: not an upstream flag (typo?)"
        row = tsv[flags]
        assert nargs == row["nargs"], flags
        assert ",".join(choices) == row["choices"], flags
        assert kind in row["kind"].replace("switch (--x/--no-x)", "bool_pair"), flags
        assert typ in ("", row["type"]), flags
        assert family in FAMILIES, flags


def test_no_table_row_is_shadowed_by_a_flag_we_define():
    # Fails once another part of the work defines one of these flags: then delete its row.
    shadowed = [flags for flags, *_, family in ROWS if family != "alias"
                and any(not isinstance(PARSER._option_string_actions.get(o), uf._Recording) for o in flags.split())]
    assert not shadowed, f"rows for flags build_parser now defines (delete them from the table): {shadowed}"


def test_refusal_lines_say_why_and_what_instead():
    for family, (verdict, text) in FAMILIES.items():
        if verdict == uf.REFUSE:
            why, _, instead = text.partition("; ")
            assert why and instead, f"{family}: '{text}' lacks '<why>; <what to use instead>'"


@pytest.mark.parametrize("row", [r for r in ROWS_TSV if r["default"] not in ("", "[]") and r["kind"] == "value"
                                 and REGISTRY.get(r["flags"].split()[0]) is not None
                                 and REGISTRY[r["flags"].split()[0]].verdict == uf.REFUSE],
                         ids=lambda r: r["flags"].split()[0])
def test_a_refused_flag_at_upstreams_default_asks_for_nothing(row):
    option, default = row["flags"].split()[0], row["default"]
    values = default.strip("[]").replace('"', "").split(",") if default.startswith("[") else [default]
    status, got = outcome([option] + values)
    assert status == "ok", got
    assert f"{option} (" in uf.accepted_line(got) and "upstream's default" in uf.accepted_line(got)


def test_store_false_and_paired_switches_at_default_are_accepted():
    assert outcome(["--no-rl-skip-bos-token"])[0] == "ok"  # --x/--no-x: --no-x is upstream's default
    status, got = outcome(["--rl-skip-bos-token"])
    assert status == "error" and got.startswith("--rl-skip-bos-token: reinforcement learning")
    status, got = outcome(["--expert-model-parallel-size", "1"])
    assert status == "ok" and "--expert-model-parallel-size (1 is upstream's default" in uf.accepted_line(got)
    status, got = outcome(["--expert-model-parallel-size", "8"])
    assert status == "error" and got.startswith("--expert-model-parallel-size: mixture of experts")


def test_aliases_parse_and_the_typed_spelling_is_named():
    status, got = outcome(["--disable-tp-comm-bulk-wgrad"])  # alias of --no-tp-comm-bulk-wgrad
    assert status == "ok" and "--disable-tp-comm-bulk-wgrad (" in uf.accepted_line(got)
    status, got = outcome(["--disable-mamba-mem-eff-path"])
    assert status == "error" and got.startswith("--disable-mamba-mem-eff-path: hybrid")
    args = parse_args(BASE + ["--persistent-save-interval", "3", "--save", "/tmp/ckpt"], world_size=1)
    assert args.save_interval == 3  # upstream's alias of --save-interval: honoured
    for spelling in ("--override-opt-param-scheduler", "--override-opt_param-scheduler"):  # honoured, both
        assert parse_args(BASE + [spelling], world_size=1).override_opt_param_scheduler
    status, got = outcome(["--override-opt-param-scheduler", "--use-checkpoint-opt_param-scheduler"])
    assert status == "error" and "exclude each other" in got


def test_every_refused_flag_of_the_line_is_reported_at_once_before_other_errors():
    # a bad layout (tp 3) and a bad range (--lr -1) are not the answer while refused flags are on the line
    status, got = outcome(["--use-megatron-fsdp", "--expert-model-parallel-size", "4", "--tensor-model-parallel-size",
                           "3", "--DDP-impl", "local", "--fsdp-double-buffer", "--lr", "-1"])
    assert status == "error" and "\n" not in got, got
    assert got.startswith("4 flags are refused here (--DDP-impl, --use-megatron-fsdp, --fsdp-double-buffer, "
                          "--expert-model-parallel-size); for each, why and what to use instead: "), got
    groups = got.split("what to use instead: ", 1)[1].split(" | ")
    assert groups[0].startswith("--DDP-impl: a flag of older Megatron-LM")  # not unknown: what it was, what instead
    assert groups[1].startswith("--use-megatron-fsdp, --fsdp-double-buffer: Megatron FSDP is not wired")  # one reason
    assert groups[2].startswith("--expert-model-parallel-size: mixture of experts") and len(groups) == 3
    status, got = outcome(["--expert-model-parallel-size", "4"])  # one refused flag: the one line it always was
    assert got.startswith("--expert-model-parallel-size: mixture of experts"), got
    status, got = outcome(["--no-such-flag", "--fp8-format", "hybrid", "--fp8-param-gather", "--num-layer", "2"])
    assert got.startswith("4 flags are refused here (--no-such-flag, --num-layer, --fp8-format, --fp8-param-gather)")
    assert "unknown flag --no-such-flag (see pretrain_gpt_dcp.py --help)" in got
    assert "unknown flag --num-layer (did you mean --num-layers? " in got
    assert "drop the fp8 flags (--fp8-format, --fp8-param-gather)" in got


@pytest.mark.parametrize("argv,verdict,needle", [
    # upstream: --no-position-embedding unsets the learned absolute embedding, which rope has not
    (["--position-embedding-type", "rope", "--no-position-embedding"], "ok", "with rope (or none) there is no learned"),
    (["--use-rotary-position-embeddings", "--no-position-embedding"], "ok", "with rope (or none)"),
    (["--position-embedding-type", "none", "--no-position-embedding"], "ok", "with rope (or none)"),
    (["--no-position-embedding"], "error", "--no-position-embedding: without --position-embedding-type rope it is "
                                           "upstream's deprecated switch"),
    # upstream's standard attention runs rope; yarn is multi-latent attention's
    (["--rope-type", "rope"], "ok", "--rope-type (rope asks for nothing)"),
    (["--rope-type", "yarn"], "error", "--rope-type: YaRN rotary embeddings belong to multi-latent attention"),
    # no experts in a dense model: their tensor-parallel size cannot matter (any value, as upstream's default = TP)
    (["--expert-tensor-parallel-size", "1"], "ok", "--expert-tensor-parallel-size (it sizes the experts'"),
    (["--expert-tensor-parallel-size", "2"], "ok", "a dense model has no experts"),
    (["--expert-model-parallel-size", "2"], "error", "--expert-model-parallel-size: mixture of experts"),
    (["--sft-tokenizer-prompt-format", "identity"], "error", "the chat template is applied when SFT data is "
                                                             "preprocessed here"),
    (["--rampup-batch-size", "8", "8", "100"], "error", "use --step-batch-size-schedule"),
    (["--tokenizer-type", "SFTTokenizer"], "error", "SFTTokenizer is upstream's tokenizer for --sft: add --sft"),
])
def test_flags_judged_by_what_they_mean_in_the_line(argv, verdict, needle):
    status, got = outcome(argv)
    assert status == verdict, got
    shown = uf.accepted_line(got) if status == "ok" else got
    assert needle in shown, shown


def test_values_keep_upstream_types_nargs_and_choices():
    for argv, needle in [(["--expert-model-parallel-size", "two"], "invalid int value"),
                         (["--cuda-graph-impl", "bogus"], "invalid choice"),
                         (["--rampup-batch-size", "1", "2"], "expected 3 arguments"),
                         (["--cp-comm-type"], "expected at least one argument")]:
        status, got = outcome(argv)
        assert status == "error" and needle in got and argv[0] in got, got
    args = parse_flags(build_parser(), BASE + ["--cp-comm-type", "p2p", "a2a", "--rampup-batch-size", "8", "8", "100"], "")
    assert args.cp_comm_type == ["p2p", "a2a"] and args.rampup_batch_size == [8, 8, 100]


def test_yaml_keys_are_judged_like_flags(tmp_path):
    def run(text):
        cfg = tmp_path / "c.yaml"
        cfg.write_text(text)
        return outcome(["--yaml-cfg", str(cfg)])

    status, got = run("expert-model-parallel-size: 4\n")
    assert status == "error" and got.startswith("--expert-model-parallel-size: mixture of experts"), got
    status, got = run("rl_skip_bos_token: true\n")  # --x/--no-x through YAML
    assert status == "error" and got.startswith("--rl-skip-bos-token: "), got
    status, got = run("rampup-batch-size: [1, 2, 3]\n")  # nargs 3
    assert status == "error" and got.startswith("--rampup-batch-size: "), got
    status, got = run("moe-aux-loss-coeff: 0.0\nno-mmap-bin-files: false\n")  # '+' given one value; store_false
    assert status == "ok", got
    line = uf.accepted_line(got)
    assert "--moe-aux-loss-coeff (0.0 is upstream's default" in line and "--no-mmap-bin-files (" in line
    status, got = run("rampup-batch-size: [1, 2]\n")
    assert status == "error" and "expected 3 values" in got


def test_namespace_holds_no_placeholder_and_a_second_check_keeps_the_list():
    args = parse_args(BASE + ["--no-mmap-bin-files", "--logging-level", "20"], world_size=1)
    values = vars(args)
    assert not any(v is uf.NOT_GIVEN for v in values.values())
    assert uf.REGISTRY_ATTR not in values and uf.ORDER_ATTR not in values
    assert "expert_model_parallel_size" not in values  # not given: not carried (nor saved in checkpoints)
    assert values["logging_level"] == 20
    before = list(args.accepted_without_effect)
    from megatron.training.flags.flag_refusals import check_upstream_flags

    check_upstream_flags(args)
    assert args.accepted_without_effect == before == [
        ["--no-mmap-bin-files", "a dataloader hint this fork does not need"],
        ["--logging-level", "a logging option this fork does not have"]]
    printed = []
    uf.announce(args, printed.append)
    assert printed == ["accepted without effect here: --no-mmap-bin-files (a dataloader hint this fork does not "
                       "need), --logging-level (a logging option this fork does not have)"]
    printed.clear()
    uf.announce(parse_args(BASE, world_size=1), printed.append)
    assert printed == []  # nothing given: no line


def launch_line(name):
    with open(os.path.join(UPSTREAM, name)) as f:
        return [line.rstrip("\n") for line in f if line.strip() and not line.startswith("#")]


@pytest.mark.parametrize("name", [os.path.basename(p) for p in sorted(glob.glob(os.path.join(UPSTREAM, "*.args")))])
def test_upstream_launch_lines_parse_and_their_refusals_are_listed(name, capsys):
    from megatron.training.flags.upstream_flag_legacy import explain
    from tests.training.test_upstream_examples import EXPECTED_REFUSED

    argv = launch_line(name)
    flags = [t for t in argv if t.startswith("--")]
    unknown = [f for f in flags if f not in PARSER._option_string_actions]
    # only flags upstream's own parser no longer has (older Megatron-LM, ModelOpt's), each explained
    assert all(explain(f) for f in unknown), [f for f in unknown if not explain(f)]
    args, _ = build_parser().parse_known_args(argv)  # the whole line: some verdicts depend on other flags
    given = uf.judge_upstream_flags(args)
    refused = [g.shown for g in given]
    with capsys.disabled():
        print(f"\n{name}: refused by the table {refused or 'none'}; unknown here {unknown or 'none'}; accepted without "
              f"effect {[a for a, _ in args.accepted_without_effect]}")
    assert set(refused) | set(unknown) <= EXPECTED_REFUSED[name]
    if "llama3_8b_fsdp" in name:
        assert refused == ["--use-megatron-fsdp", "--fsdp-double-buffer", "--fsdp-manual-registration"]
        assert all(g.flag.family == "fsdp" for g in given)
    elif "llama3" in name or "gpt3" in name:
        assert refused == [] and unknown == []


@pytest.mark.dist
def test_fsdp_launch_line_ends_in_one_line_through_the_entry_point():
    argv = launch_line("llama3_8b_fsdp_h100_fp8.args")
    r = run_ranks(1, argv, timeout=300)
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith(
        "error: 8 flags are refused here (--use-megatron-fsdp, --fsdp-double-buffer, --fsdp-manual-registration, "
        "--fp8-format, --fp8-amax-history-len, --fp8-amax-compute-algo, --fp8-param-gather, --ckpt-format)"), lines
    assert ("--use-megatron-fsdp, --fsdp-double-buffer, --fsdp-manual-registration: Megatron FSDP is not wired"
            in lines[0]), lines
