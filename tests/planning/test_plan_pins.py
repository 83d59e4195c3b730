"""What a failing plan pin says (tests/support/plan_pins.py, tests/planning/test_plan_digests.py): the case,
the first iteration, replica and micro-batch that differ, old and new predicted times; and
--repin writes the new plan and says what changed."""
import copy
import json

from tests.support.plan_pins import describe_change, load_pins, save_pins
from tests.planning.test_plan_digests import case_ids, check_pin, key

NAME = key(("adaptive", "code_python_cl100k.txt", "demo", "cpu-gloox4", 8192, 2048))


def pinned(name=NAME):
    text = load_pins()[name]
    return text, json.loads(text)


def two_by_two(it):
    return len(it["replicas"]) > 1 and len(it["replicas"][1]["micro_batches"]) > 1


def changed(plan, edit):
    new = copy.deepcopy(plan)
    edit(new)
    return json.dumps(new, indent=1)


def test_every_case_is_pinned():
    assert sorted(load_pins()) == sorted(key(c) for c in case_ids())


def test_a_moved_sample_names_iteration_replica_and_micro_batch():
    # a pinned plan with an iteration of several replicas, the second with several micro-batches
    name = next(n for n, t in sorted(load_pins().items()) if any(two_by_two(i) for i in json.loads(t)["iterations"]))
    text, plan = pinned(name)
    it = next(i for i in plan["iterations"] if two_by_two(i))
    index = it["index"]

    def edit(p):
        r = next(i for i in p["iterations"] if i["index"] == index)["replicas"][1]
        moved = r["micro_batches"][0]["sample_ids"].pop()
        r["micro_batches"][1]["sample_ids"].append(moved)
        r["predicted_time_s"] *= 1.5
        next(i for i in p["iterations"] if i["index"] == index)["predicted_time_s"] *= 1.25

    message = describe_change(text, changed(plan, edit))
    lines = message.splitlines()
    old_it = it["predicted_time_s"]
    assert lines[0].startswith("predicted time over 3 -> 3 iterations")
    assert lines[1].startswith(f"iteration {index}: predicted {old_it:.6g} s -> {old_it * 1.25:.6g} s (+25.000%)")
    assert lines[2].startswith("  replica 1 (tp") and f"predicted {it['replicas'][1]['predicted_time_s']:.6g} s" in lines[2]
    assert lines[3].startswith("  micro-batch 0: ") and lines[4].strip().startswith("-> ")


def test_a_new_layout_is_named():
    text, plan = pinned()

    def edit(p):
        p["iterations"][0]["replicas"][0]["tp"] *= 2

    message = describe_change(text, changed(plan, edit))
    assert "iteration 0" in message and "layout: " in message and "-> " in message


def test_same_plan_other_text_and_equal_text():
    text, plan = pinned()
    assert describe_change(text, text) == ""
    assert "same plans, different text" in describe_change(text, json.dumps(plan))


def test_repin_writes_the_new_plan_and_says_what_changed(tmp_path):
    text, plan = pinned()
    new = changed(plan, lambda p: p["iterations"][2].update(predicted_time_s=1.0))
    pins = {NAME: text}
    saved = []
    failure = check_pin(NAME, new, pins, repin=False, save=saved.append)
    assert failure.startswith(f"the plan of {NAME} changed:") and "iteration 2" in failure and "--repin" in failure
    assert pins[NAME] == text and not saved
    note = check_pin(NAME, new, pins, repin=True, save=saved.append)
    assert note.startswith(f"re-pinned {NAME}:") and "iteration 2" in note
    assert pins[NAME] == new and saved == [pins]
    assert check_pin(NAME, new, pins, repin=False) is None


def test_pins_file_round_trips_byte_for_byte(tmp_path):
    pins = load_pins()
    path = str(tmp_path / "pins.json.gz")
    save_pins(pins, path)
    first = open(path, "rb").read()
    assert load_pins(path) == pins
    save_pins(load_pins(path), path)
    assert open(path, "rb").read() == first  # no timestamp: re-pinning nothing changes nothing
