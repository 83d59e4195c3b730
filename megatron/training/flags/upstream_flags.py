"""Every upstream Megatron-LM flag parses here: honoured, refused with one line, or accepted
without effect.

Launch scripts written for upstream's `pretrain_gpt.py` carry flags this fork does not
implement. Rather than stop at the first one with "unknown flag", `add_upstream_flags`
registers each flag of `upstream_flag_table.ROWS` that our parser does not define, with
upstream's type, nargs and choices (so the line parses exactly as upstream's would), and
`judge_upstream_flags` then judges the ones actually given: each refused flag is returned as
`--flag: why; what to use instead` (`flag_refusals` says every refusal of the line in one
message), an accepted one is listed once at start (`accepted_line`). A refused flag given with
upstream's default value, or in a line that makes it harmless (the table's `CONDITIONS`), asks
for nothing and counts as accepted. The verdicts are data (the table); this module only
applies them.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Optional

from megatron.training.flags.upstream_flag_table import ACCEPT, CONDITIONS, FAMILIES, HARMLESS_VALUES, REFUSE, ROWS

REGISTRY_ATTR = "_upstream_flag_registry"  # parser default: {dest: UpstreamFlag} of the flags registered
ORDER_ATTR = "_upstream_flags_given"  # set while parsing: [(option string typed, dest)], command-line order
DEST_PREFIX = "upstream_"  # only if the natural dest is taken by one of our own flags


class _NotGiven:
    def __repr__(self) -> str:
        return "<not given>"


NOT_GIVEN = _NotGiven()  # default of every registered flag: tells "given" (also via --yaml-cfg) from absent

_TYPES = {"int": int, "float": float, "str": str, "bool": bool, "": None}


@dataclass(frozen=True)
class UpstreamFlag:
    flags: str  # option strings, space-separated (aliases in one row)
    kind: str  # value | store_true | store_false | bool_pair
    type: str
    nargs: str
    default: object
    choices: tuple
    family: str

    @property
    def option_strings(self) -> list[str]:
        return self.flags.split()

    @property
    def name(self) -> str:
        return self.option_strings[0]

    @property
    def dest(self) -> str:  # argparse's rule: the first long option, dashes to underscores
        return self.name[2:].replace("-", "_")

    @property
    def verdict(self) -> str:
        return FAMILIES[self.family][0]

    @property
    def text(self) -> str:
        return FAMILIES[self.family][1]

    def typed_choices(self) -> Optional[list]:
        if not self.choices:
            return None
        convert = _TYPES[self.type] or str
        return [convert(c) for c in self.choices]

    def is_default(self, value) -> bool:
        default = self.default
        if self.nargs and default is not None and not isinstance(default, list):
            default = [default]
        return value == default

    def asks_for_nothing(self, value) -> bool:
        """Upstream's default (or a value listed harmless): nothing would change upstream either."""
        if self.is_default(value):
            return True
        harmless = HARMLESS_VALUES.get(self.name, ())
        return value in harmless or (isinstance(value, list) and len(value) == 1 and value[0] in harmless)


FLAGS = [UpstreamFlag(*row) for row in ROWS]


class _Recording:
    """Remembers which option string was typed, in command-line order, then stores as argparse does."""

    def __call__(self, parser, namespace, values, option_string=None):
        super().__call__(parser, namespace, values, option_string)
        order = getattr(namespace, ORDER_ATTR, None)
        if order is None:
            order = []
            setattr(namespace, ORDER_ATTR, order)
        order.append((option_string, self.dest))


class _Store(_Recording, argparse._StoreAction):
    pass


class _StoreTrue(_Recording, argparse._StoreTrueAction):
    pass


class _StoreFalse(_Recording, argparse._StoreFalseAction):
    pass


class _BoolPair(_Recording, argparse.BooleanOptionalAction):
    def __init__(self, option_strings, dest, **kwargs):
        # upstream spells both forms out (--x --no-x); BooleanOptionalAction adds --no-x itself
        super().__init__([o for o in option_strings if not o.startswith("--no-")], dest, **kwargs)


def _nargs(text: str):
    return int(text) if text.isdigit() else (text or None)


def add_upstream_flags(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Register every table flag our parser does not define (rows it defines are skipped; a row
    whose other spellings it lacks gets them as aliases of our flag)."""
    group = parser.add_argument_group(
        "upstream Megatron-LM flags not implemented here",
        "The other flags of upstream's pretrain_gpt.py parse as there: each is refused with a reason and "
        "what to use instead, or accepted without effect (listed at start). See "
        "megatron/training/flags/upstream_flag_table.py.")
    existing = parser._option_string_actions
    dests = {a.dest for a in parser._actions}
    registry = {}
    for flag in FLAGS:
        ours = [o for o in flag.option_strings if o in existing]
        if ours:
            action = existing[ours[0]]
            for alias in flag.option_strings:
                if alias not in existing:
                    action.option_strings.append(alias)
                    existing[alias] = action
            continue
        dest = flag.dest if flag.dest not in dests else DEST_PREFIX + flag.dest
        kwargs = dict(dest=dest, default=NOT_GIVEN, help=argparse.SUPPRESS)
        if flag.kind == "value":
            kwargs.update(action=_Store, type=_TYPES[flag.type], nargs=_nargs(flag.nargs), choices=flag.typed_choices())
        else:
            kwargs["action"] = {"store_true": _StoreTrue, "store_false": _StoreFalse, "bool_pair": _BoolPair}[flag.kind]
        group.add_argument(*flag.option_strings, **kwargs)
        dests.add(dest)
        registry[dest] = flag
    parser.set_defaults(**{REGISTRY_ATTR: registry})
    return parser


@dataclass(frozen=True)
class Given:
    shown: str  # the spelling the user typed (or the first spelling, for a --yaml-cfg key)
    flag: UpstreamFlag
    value: object
    harmless_here: bool = False  # the line makes this refused flag ask for nothing (the table's CONDITIONS)

    @property
    def refused(self) -> bool:
        return self.flag.verdict == REFUSE and not self.flag.asks_for_nothing(self.value) and not self.harmless_here

    @property
    def reason(self) -> str:
        if self.flag.verdict == REFUSE:  # not refused: upstream's default, a value listed harmless, or the line
            if self.harmless_here and not self.flag.asks_for_nothing(self.value):
                return CONDITIONS[self.flag.name][1]
            said = "is upstream's default: asks" if self.flag.is_default(self.value) else "asks"
            return f"{_show(self.value)} {said} for nothing"
        return self.flag.text

    @property
    def refusal(self) -> str:
        return f"{self.shown}: {self.flag.text}"


def _show(value) -> str:
    if isinstance(value, list):
        return " ".join(map(str, value)) or "[]"
    return {True: "on", False: "off"}.get(value, str(value)) if isinstance(value, bool) else str(value)


def given_flags(args: argparse.Namespace) -> list[Given]:
    """The table flags given, command-line ones in their order, then --yaml-cfg ones. Removes the
    bookkeeping and the flags not given from `args` (once; later calls return [])."""
    values = vars(args)
    registry = values.pop(REGISTRY_ATTR, None)
    order = values.pop(ORDER_ATTR, [])
    if registry is None:
        return []
    typed = {}
    for option, dest in order:
        typed.setdefault(dest, option)
    found = []
    for dest in list(typed) + [d for d in registry if d not in typed]:
        value = values.get(dest, NOT_GIVEN)
        if value is NOT_GIVEN:
            values.pop(dest, None)
            continue
        flag = registry[dest]
        found.append(Given(typed.get(dest, flag.name), flag, value))
    return found


def judge_upstream_flags(args: argparse.Namespace) -> list[Given]:
    """The refused upstream flags given, in command-line order (each says `refusal`); keep the
    accepted ones in `args.accepted_without_effect` as [flag, reason] pairs (for `accepted_line`).
    A second call returns [] and keeps the list."""
    given = given_flags(args)
    if not given and hasattr(args, "accepted_without_effect"):
        return []  # already judged
    given = [_in_this_line(g, args) for g in given]
    args.accepted_without_effect = [[g.shown, g.reason] for g in given if not g.refused]
    return [g for g in given if g.refused]


def _in_this_line(g: Given, args: argparse.Namespace) -> Given:
    condition = CONDITIONS.get(g.flag.name)
    if condition is None or g.flag.verdict != REFUSE or not condition[0](args):
        return g
    return Given(g.shown, g.flag, g.value, harmless_here=True)


def accepted_line(args: argparse.Namespace) -> Optional[str]:
    """The one line printed at start (rank 0) naming the flags accepted without effect, or None."""
    accepted = args.accepted_without_effect
    if not accepted:
        return None
    return "accepted without effect here: " + ", ".join(f"{flag} ({reason})" for flag, reason in accepted)


def announce(args: argparse.Namespace, printer=print) -> None:
    """Print `accepted_line` if there is one (the entry point passes its rank-0 printer)."""
    line = accepted_line(args)
    if line:
        printer(line)


def counts(parser: argparse.ArgumentParser, rows: list[list[str]]) -> dict[str, int]:
    """Over upstream's rows (each a list of option strings): honoured (our flag, or an alias of
    one), refused, accepted without effect, unknown (should be 0). For the closing note and tests."""
    registry = parser.get_default(REGISTRY_ATTR) or {}
    by_option = {o: flag for flag in registry.values() for o in flag.option_strings}
    out = {"honoured": 0, "refused": 0, "accepted": 0, "unknown": 0}
    for options in rows:
        flag = by_option.get(options[0])
        if flag is not None:
            out["refused" if flag.verdict == REFUSE else "accepted"] += 1
        elif all(o in parser._option_string_actions for o in options):
            out["honoured"] += 1
        else:
            out["unknown"] += 1
    return out


__all__ = ["ACCEPT", "REFUSE", "FLAGS", "NOT_GIVEN", "UpstreamFlag", "add_upstream_flags",
           "judge_upstream_flags",
           "accepted_line", "announce", "given_flags", "counts"]


def is_table_flag(action: argparse.Action) -> bool:
    """An upstream flag registered from the table (refused or accepted), not one this fork defines:
    its value is never restored from a checkpoint's stored args."""
    return isinstance(action, _Recording)
