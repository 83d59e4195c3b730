"""Every flag a launch line asks for that this fork refuses, said at once, in one message.

Why a module of its own: a line carries flags refused for different reasons, judged in
different places: flags no parser here knows (`arguments.parse_flags` keeps them; older
Megatron-LM's and ModelOpt's are explained by `upstream_flag_legacy`), upstream's flags this
fork does not implement (`upstream_flags`), and flags this machine or build cannot run
(`model_flags`: fp8, kernels; `loop_flags`: checkpoint format; `sft_flags`: SFT's tokenizer).
Stopping at the first one made a user launch once per refused flag (upstream's FSDP script:
five launches). `check(args)` gathers them all, right after parsing and before any other
check, and raises one `ArgumentError`:

    --flag: why; what to use instead                                   (one refused flag)
    3 flags are refused here (--a, --b, --c); for each, why and what to use instead:
    --a, --b: why; instead | --c: why; instead                         (several, one line)

Flags refused for the same reason are named together.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Optional

from megatron.training.flags.argument_errors import ArgumentError

UNKNOWN_ATTR = "_unknown_flags"  # set by arguments.parse_flags: (tokens not parsed, hint, the parser's flags)


@dataclass(frozen=True)
class Refusal:
    flags: tuple  # the flags refused, as typed
    text: str  # "<why>; <what to use instead>", or the whole sentence when `sentence`
    sentence: bool = False  # text already names the flags

    @property
    def line(self) -> str:
        return self.text if self.sentence else f"{', '.join(self.flags)}: {self.text}"


def unknown_refusals(tokens: list, hint: str, known) -> list[Refusal]:
    """Tokens no parser took: flags (with the values after them) and stray values."""
    from megatron.training.flags.upstream_flag_legacy import closest, explain

    out, stray, flag = [], [], None
    for token in tokens:
        if token.startswith("--"):
            flag = token.split("=", 1)[0]
            why = explain(flag)
            if why is not None:
                out.append(Refusal((flag,), why))
            else:
                near = closest(flag, known)
                out.append(Refusal((flag,), f"unknown flag {flag} ({f'did you mean {near}? ' if near else ''}{hint})",
                                   sentence=True))
        elif flag is None:
            stray.append(token)
    if stray:
        out.append(Refusal((), f"values without a flag: {' '.join(stray)} (a value needs its --flag before it; "
                               "quote a value that holds spaces)", sentence=True))
    return out


def collect(args: argparse.Namespace) -> list[Refusal]:
    """Every refusal of the line (and, once, the upstream flags accepted without effect)."""
    from megatron.training.flags import loop_flags, model_flags, sft_flags
    from megatron.training.flags.upstream_flags import judge_upstream_flags

    found = []
    unknown = vars(args).pop(UNKNOWN_ATTR, None)
    if unknown:
        found += unknown_refusals(*unknown)
    found += [Refusal((g.shown,), g.flag.text) for g in judge_upstream_flags(args)]
    for flags, line in model_flags.refusals(args) + loop_flags.refusals(args) + sft_flags.refusals(args):
        found.append(Refusal(tuple(flags), line, sentence=True))
    return found


def message(refusals: list[Refusal]) -> Optional[str]:
    """One line for all of them (None when there are none); same-reason flags named together."""
    if not refusals:
        return None
    merged: dict = {}
    for r in refusals:
        key = (r.text, r.sentence)
        merged[key] = Refusal(merged[key].flags + r.flags, r.text, r.sentence) if key in merged else r
    groups = list(merged.values())
    flags = [f for r in groups for f in r.flags]
    if len(groups) == 1 and len(flags) <= 1:
        return groups[0].line
    return (f"{len(flags)} flag{'s are' if len(flags) != 1 else ' is'} refused here ({', '.join(flags)}); "
            f"for each, why and what to use instead: " + " | ".join(r.line for r in groups))


def check(args: argparse.Namespace) -> None:
    """Raise one ArgumentError naming every refused flag of the line (no-op once judged)."""
    line = message(collect(args))
    if line:
        raise ArgumentError(line)


def check_upstream_flags(args: argparse.Namespace) -> None:
    """`judge_upstream_flags`, raising one line that names every refused flag given."""
    from megatron.training.flags.upstream_flags import judge_upstream_flags

    refused = judge_upstream_flags(args)
    if refused:
        raise ArgumentError(message([Refusal((g.shown,), g.flag.text) for g in refused]))
