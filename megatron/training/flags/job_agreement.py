"""At start, right after the process group: every rank was given the same flags, and outputs
written by one rank are said where they go.

Why it exists: on several nodes each launcher passes its own command line. A flag that differs
between nodes (another --lr, another --save, --dcp on one node only) trains a model no node
asked for, or hangs when the ranks disagree on what to run; an output written by one rank
(`--loss-log`, `--tensorboard-dir`, `--wandb-project`: the last rank; `--dcp-log-plan`:
rank 0) given on another node only is silently never written. One all_gather of a digest,
the host and those outputs per rank (a few hundred bytes each) finds both:

- digests differ: the ranks gather every flag's value once more and stop with one line
  naming the flags that differ, their values and which ranks (and hosts) have each;
- single-writer outputs: rank 0 says in one line each which rank writes it, on which host,
  to which path; and when that rank was not given it, that nothing will be written.

Flags that may differ per node are left out of the digest: those single-writer outputs
(each rank's own copy is what it writes or ignores), `--data-cache-path` (a cache per node
is fine) and `--yaml-cfg` (its path; its values are compared as flags).
"""
from __future__ import annotations

import hashlib
import socket
from typing import Callable, Optional

from megatron.training.startup.collective_faults import rank_list
from megatron.training.errors import AgreedTrainingError

# dest -> (flag, who writes it): outputs written by one rank
SINGLE_WRITER = {
    "loss_log": ("--loss-log", "last"),
    "tensorboard_dir": ("--tensorboard-dir", "last"),
    "wandb_project": ("--wandb-project", "last"),
    "dcp_log_plan": ("--dcp-log-plan", "first"),
}
# may differ per node: the single-writer outputs above and these
PER_NODE = set(SINGLE_WRITER) | {"data_cache_path", "yaml_cfg", "wandb_save_dir", "wandb_exp_name",
                                 "accepted_without_effect"}


class FlagsDisagreeError(AgreedTrainingError):
    """Ranks were given different flags: every rank sees the same gathered values, rank 0 says it once."""

    exit_code = 2


def flag_name(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def compared_values(args) -> dict[str, str]:
    """Every flag that must agree across ranks, as text."""
    return {k: repr(v) for k, v in sorted(vars(args).items()) if k not in PER_NODE}


def digest(values: dict[str, str]) -> str:
    h = hashlib.sha256()
    for k, v in values.items():
        h.update(f"{k}={v}\n".encode())
    return h.hexdigest()[:32]


def this_rank(args) -> dict:
    return {"digest": digest(compared_values(args)), "host": socket.gethostname(),
            "outputs": {k: getattr(args, k) for k in SINGLE_WRITER if getattr(args, k)}}


def _holders(values: list, hosts: list[str]) -> str:
    """'0.001 on ranks 0-1 (node-a) and 0.002 on ranks 2-3 (node-b)'."""
    by_value: dict[str, list[int]] = {}
    for r, v in enumerate(values):
        by_value.setdefault(v, []).append(r)
    several_hosts = len(set(hosts)) > 1
    parts = []
    for v, ranks in by_value.items():
        where = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {rank_list(ranks)}"
        if several_hosts:
            where += f" ({', '.join(sorted({hosts[r] for r in ranks}))})"
        parts.append(f"{_show(v)} on {where}")
    return " and ".join(parts)


def _show(value: str) -> str:
    if value in ("None", "False"):
        return "not given"
    if value == "True":
        return "given"
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":  # a string flag: shown as typed
        value = value[1:-1]
    return value[:80] + ("..." if len(value) > 80 else "")


def disagreement_line(all_values: list[dict[str, str]], hosts: list[str]) -> str:
    """The one line for ranks given different flags (each rank's `compared_values`)."""
    keys = sorted(set().union(*all_values))
    differ = [k for k in keys if len({vals.get(k, "None") for vals in all_values}) > 1]
    first = differ[0]
    line = (f"the ranks were given different flags (every node's launcher must pass the same ones): "
            f"{flag_name(first)} is {_holders([vals.get(first, 'None') for vals in all_values], hosts)}")
    if len(differ) > 1:
        rest = [flag_name(k) for k in differ[1:6]]
        line += f"; also {', '.join(rest)}{', ...' if len(differ) > 6 else ''} differ"
    return line


def output_lines(gathered: list[dict]) -> list[str]:
    """Where each single-writer output goes, given on any rank (rank 0 prints these)."""
    world = len(gathered)
    hosts = [g["host"] for g in gathered]
    lines = []
    for dest, (flag, who) in SINGLE_WRITER.items():
        given = [r for r, g in enumerate(gathered) if dest in g["outputs"]]
        if not given:
            continue
        writer = world - 1 if who == "last" else 0
        role = "the last rank" if who == "last" else "rank 0"
        value = gathered[writer]["outputs"].get(dest)
        if value is not None:
            lines.append(f"> {flag} {value} is written by rank {writer} ({role}) on {hosts[writer]}")
        else:
            shown = gathered[given[0]]["outputs"][dest]
            ranks = f"rank {given[0]}" if len(given) == 1 else f"ranks {rank_list(given)}"
            lines.append(f"WARNING: {flag} {shown} (given to {ranks}) is written only by rank {writer} ({role}, on "
                         f"{hosts[writer]}), which was not given {flag}: it will not be written; pass {flag} to "
                         f"every node's launcher")
    return lines


def check(args, print_rank_0: Callable[[str], None], all_gather: Optional[Callable] = None) -> None:
    """Collective, right after init: refuse ranks given different flags (FlagsDisagreeError, the
    same on every rank), and say where single-writer outputs go (rank 0). A world of one: nothing."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    gather = all_gather or _all_gather
    mine = this_rank(args)
    gathered = gather(mine)
    hosts = [g["host"] for g in gathered]
    if len({g["digest"] for g in gathered}) > 1:
        raise FlagsDisagreeError(disagreement_line(gather(compared_values(args)), hosts))
    for line in output_lines(gathered):
        print_rank_0(line)


def _all_gather(obj) -> list:
    import torch.distributed as dist

    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out
