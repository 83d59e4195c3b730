"""Arguments and data loading shared by dcp-plan and dcp-simulate.

Why it exists: both tools must read the same length file, cut the same global batches
(docs/contracts.md's rule; sample ids are line numbers from 0) and build specs the same way, or
their outputs would not describe the same run.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Callable

import numpy as np

from dcp_ext.cli import boundary
from dcp_ext.cli.boundary import CLIError, Parser  # noqa: F401  (dcp-plan and dcp-simulate import them here)
from dcp_ext.data.errors import DataError
from dcp_ext.data.lengths import read_lengths
from dcp_ext.planning.batching import global_batches
from dcp_ext.planning.specs import ClusterSpec, ModelSpec


def run_tool(main: Callable[[], int]) -> int:
    """Call a tool's body through the one boundary (dcp_ext.cli.boundary); the planner's own
    refusals and bad data are one line too."""
    from dcp_ext.planning.planners.errors import PlanningError

    return boundary.run_tool(main, errors={PlanningError: 1, DataError: 1})


def validate_common_args(args) -> None:
    """Ranges and relations of the shared flags, as training checks its own (--dcp)."""
    for flag, value in (("--global-batch-tokens", args.global_batch_tokens), ("--max-seq-len", args.max_seq_len),
                        ("--iterations", args.iterations)):
        if value < 1:
            raise CLIError(f"{flag} {value} must be >= 1")
    if args.start < 0:
        raise CLIError(f"--start {args.start} must be >= 0")
    if args.max_seq_len > args.global_batch_tokens:  # the rule training enforces (--dcp-max-seq-len)
        raise CLIError(f"--max-seq-len {args.max_seq_len} exceeds --global-batch-tokens {args.global_batch_tokens}: "
                       "a sequence must fit in one global batch")
    if not 0.0 <= args.memory_margin < 1.0:
        raise CLIError(f"--memory-margin {args.memory_margin:g} must be in [0, 1)")
    if args.profile is not None:
        from dcp_ext.planning.profile import profile_problem

        problem = profile_problem(args.profile)
        if problem:
            raise CLIError(f"--profile {args.profile}: {problem}", 1)


def add_common_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lengths", required=True, help="file with one document length (tokens) per line")
    p.add_argument("--model", required=True, help="preset (llama2-7b, llama2-13b, llama2-70b, gpt-1.3b, demo) or a ModelSpec JSON file")
    p.add_argument("--cluster", required=True, help="preset like h200x64, h100x8, a800x64, cpu-glooxN, or a ClusterSpec JSON file")
    p.add_argument("--global-batch-tokens", type=int, required=True)
    p.add_argument("--max-seq-len", type=int, required=True)
    p.add_argument("--iterations", type=int, default=20)
    p.add_argument("--start", type=int, default=0, help="first sample (line) of the run")
    p.add_argument("--profile", default=None, help="profile file from dcp-profile (default: analytic cost model)")
    p.add_argument("--memory-margin", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--dcp-layer-strategies", choices=["on", "off"], default="off",
                   help="adaptive planner: micro-batches may run layers under other (tp, cp) re-factorings of their "
                        "replica's ranks (plan contract v2; default off)")
    p.add_argument("--dcp-uneven-stages", choices=["on", "off", "even"], default="off",
                   help="adaptive planner: pipelined layouts split their layers by stage time (embedding on the first "
                        "stage, output layer and loss on the last); 'even' writes the even split explicitly, every "
                        "stage priced on its own (the control for what balancing buys); default off")


def planner_options(name: str, args) -> dict:
    """Constructor options of planner `name` from the flags (the v2 features: adaptive only)."""
    if name.strip().lower() != "adaptive":
        return {}
    out = {}
    if getattr(args, "dcp_layer_strategies", "off") != "off":
        out["layer_strategies"] = args.dcp_layer_strategies
    if getattr(args, "dcp_uneven_stages", "off") != "off":
        out["uneven_stages"] = args.dcp_uneven_stages
    return out


def load_lengths(path: str) -> np.ndarray:
    """One positive integer a line; anything else names the file and the line."""
    try:
        return np.asarray(read_lengths(path, flag="--lengths"), dtype=np.int64)
    except DataError as e:
        raise CLIError(str(e), 1) from None


def _json_file(name: str, flag: str, kind: str):
    """The JSON value in file `name`; CLIError (exit 1) says why there is none."""
    if os.path.isdir(name):
        raise CLIError(f"{flag} {name}: is a directory, not a JSON file", 1)
    if not os.path.isfile(name):
        raise CLIError(f"{flag} {name}: no such file", 1)
    try:
        with open(name) as f:
            return json.load(f)
    except OSError as e:
        raise CLIError(f"{flag} {name}: cannot read it ({boundary.os_problem(e)[0]})", 1) from None
    except UnicodeDecodeError:
        raise CLIError(f"{flag} {name}: not a {kind} JSON file: not a text file", 1) from None
    except json.JSONDecodeError as e:
        raise CLIError(f"{flag} {name}: not a {kind} JSON file: not valid JSON ({e.msg} at line {e.lineno} "
                       f"column {e.colno}); fix the file, or name a preset instead", 1) from None


def _spec(kind, name: str, flag: str):
    if name.endswith(".json"):
        data = _json_file(name, flag, kind.__name__)
        try:
            return kind.from_json(data)
        except (ValueError, TypeError, KeyError) as e:  # SpecError names the field; a preset name its presets
            raise CLIError(f"{flag} {name}: {boundary.first_line(e)[:300]}; fix the file, or name a preset "
                           "instead", 1) from None
    try:
        return kind.from_preset(name)
    except (ValueError, KeyError) as e:
        raise CLIError(f"{flag}: {str(e).splitlines()[0]} (or a {kind.__name__} .json file)") from None


def model_spec(name: str) -> ModelSpec:
    return _spec(ModelSpec, name, "--model")


def cluster_spec(name: str) -> ClusterSpec:
    return _spec(ClusterSpec, name, "--cluster")


def batches(args, lengths: np.ndarray, prog: str | None = None) -> list[list[int]]:
    """The run's global batches; with `prog`, every shortfall of the work asked for is said on
    stderr, one line each (`shortfalls`)."""
    if args.start >= len(lengths):
        raise CLIError(f"--start {args.start} is past the end of {args.lengths} ({len(lengths)} lengths)")
    out = global_batches(lengths.tolist(), args.global_batch_tokens, args.max_seq_len, count=args.iterations, start=args.start)
    if not out:
        raise CLIError(f"no global batch in {args.lengths} from --start {args.start}", 1)
    if prog:
        for line in shortfalls(args, lengths, out):
            print(f"{prog}: {line}", file=sys.stderr, flush=True)
    return out


def shortfalls(args, lengths: np.ndarray, out: list[list[int]]) -> list[str]:
    """What the batches `out` do less than the flags ask: fewer iterations than --iterations
    (the file ends), a last batch cut short by the file's end, documents cut to --max-seq-len."""
    lines = []
    gbt, msl = args.global_batch_tokens, args.max_seq_len
    ends = out[-1][-1] == len(lengths) - 1  # the batches reach the file's last line
    last = int(np.minimum(lengths[out[-1]], msl).sum())
    if len(out) < args.iterations or (ends and last < gbt):
        held = float(np.minimum(lengths[args.start:], msl).sum()) / gbt
        what = (f"--iterations {args.iterations}: {args.lengths} holds {held:.1f} global batches of {gbt} tokens from "
                f"--start {args.start}" if len(out) < args.iterations else f"{args.lengths} ends in iteration {len(out) - 1}")
        lines.append(f"{what}; running {len(out)}, the last one {last} tokens ({100 * last / gbt:.0f}% of a batch)")
    ids = np.concatenate([np.asarray(b) for b in out])
    long = lengths[ids] > msl
    if long.any():
        cut = float((lengths[ids][long] - msl).sum())
        lines.append(f"{int(long.sum())} of {len(ids)} documents in these batches are longer than --max-seq-len {msl} "
                     f"and are cut to it: {100 * cut / float(lengths[ids].sum()):.1f}% of their tokens are not planned")
    return lines
