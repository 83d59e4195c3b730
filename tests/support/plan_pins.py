"""Pinned plans: the planners' output on the shipped length files, kept whole, and what to
say when a plan changes.

Why it exists: a digest only says "changed". With the old plan kept (gzip, ~100 KB for all
cases) a failing pin names the planner and setting, the first iteration, replica and
micro-batch that differ, and the old and new predicted times, so a deliberate planning
change can be judged and re-pinned in one step (`pytest tests/planning/test_plan_digests.py --repin`).
"""
from __future__ import annotations

import gzip
import json
import os

PINS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures", "pinned_plans.json.gz")


def load_pins(path: str = PINS) -> dict[str, str]:
    """{case key: the plan file's text}; empty when nothing is pinned yet."""
    if not os.path.exists(path):
        return {}
    with gzip.open(path, "rt") as f:
        return json.load(f)


def save_pins(pins: dict[str, str], path: str = PINS) -> None:
    """Deterministic bytes (sorted keys, no gzip timestamp), so a re-pin that changes
    nothing leaves the file as it was."""
    text = json.dumps(pins, indent=0, sort_keys=True).encode()
    tmp = path + ".tmp"
    with open(tmp, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0, filename="") as f:
        f.write(text)
    os.replace(tmp, path)


def _layout(r: dict) -> str:
    first, last = r["ranks"][0], r["ranks"][-1]
    return f"tp{r['tp']}cp{r['cp']}pp{r['pp']} on ranks {first}-{last}"


def _mb(m: dict) -> str:
    ids = m["sample_ids"]
    shown = ids if len(ids) <= 8 else ids[:8] + ["..."]
    extra = {k: v for k, v in m.items() if k not in ("sample_ids",)}
    return f"{len(ids)} samples {shown} {extra}"


def describe_change(old_text: str, new_text: str) -> str:
    """What differs between two plan files, first difference first (empty when equal)."""
    if old_text == new_text:
        return ""
    old, new = json.loads(old_text), json.loads(new_text)
    lines = []
    for field in ("schema", "cluster", "model"):
        if old.get(field) != new.get(field):
            lines.append(f"{field}: {old.get(field)} -> {new.get(field)}")
    old_its, new_its = old.get("iterations", []), new.get("iterations", [])
    old_total = sum(i["predicted_time_s"] for i in old_its)
    new_total = sum(i["predicted_time_s"] for i in new_its)
    lines.append(f"predicted time over {len(old_its)} -> {len(new_its)} iterations: {old_total:.6g} s -> "
                 f"{new_total:.6g} s ({_percent(old_total, new_total)})")
    for a, b in zip(old_its, new_its):
        first = _first_iteration_difference(a, b)
        if first:
            lines.append(f"iteration {a['index']}: predicted {a['predicted_time_s']:.6g} s -> "
                         f"{b['predicted_time_s']:.6g} s ({_percent(a['predicted_time_s'], b['predicted_time_s'])})")
            lines.extend("  " + line for line in first)
            break
    else:
        if len(old_its) == len(new_its):
            lines.append("same plans, different text (number formatting or key order)")
    return "\n".join(lines)


def _percent(a: float, b: float) -> str:
    return f"{(b - a) / a * 100:+.3f}%" if a else "n/a"


def _first_iteration_difference(a: dict, b: dict) -> list[str]:
    if a == b:
        return []
    if a.get("sample_ids") != b.get("sample_ids"):
        return [f"global batch: {len(a['sample_ids'])} samples -> {len(b['sample_ids'])} samples"]
    ra, rb = a["replicas"], b["replicas"]
    layouts_a, layouts_b = [_layout(r) for r in ra], [_layout(r) for r in rb]
    if layouts_a != layouts_b:
        return [f"layout: {len(ra)} replicas [{', '.join(layouts_a)}]",
                f"     -> {len(rb)} replicas [{', '.join(layouts_b)}]"]
    for k, (x, y) in enumerate(zip(ra, rb)):
        if x == y:
            continue
        out = [f"replica {k} ({_layout(x)}): predicted {x['predicted_time_s']:.6g} s -> {y['predicted_time_s']:.6g} s, "
               f"{len(x['micro_batches'])} -> {len(y['micro_batches'])} micro-batches"]
        for field in sorted(set(x) | set(y)):
            if field not in ("micro_batches", "predicted_time_s", "ranks", "tp", "cp", "pp") and x.get(field) != y.get(field):
                out.append(f"{field}: {x.get(field)} -> {y.get(field)}")
        for j, (m, n) in enumerate(zip(x["micro_batches"], y["micro_batches"])):
            if m != n:
                out += [f"micro-batch {j}: {_mb(m)}", f"            -> {_mb(n)}"]
                break
        return out
    return ["replicas equal; the iteration differs elsewhere: "
            + ", ".join(f for f in sorted(set(a) | set(b)) if a.get(f) != b.get(f))]
