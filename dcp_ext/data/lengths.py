"""Document lengths as files of token counts, and the one rounding rule for padded lengths.

Why: the planning CLIs, `tools/dataset_stats.py`, benchmarks and tests all read files of
one token count a line (real distributions ship in data/lengths/, provenance in its
README); one reader keeps their rules and error messages the same. `round_up` is the
padding rule every packer and padding estimate shares (pure Python, works on numpy
arrays too).
"""
from __future__ import annotations

import os

from dcp_ext.data.errors import DataError

# A document's token count as Megatron's .idx stores it (int32): anything longer is a typo or
# garbage, and would overflow the int64 sums of the planners and reports.
MAX_LENGTH = 2**31 - 1

DATA_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "data", "lengths")


def round_up(n, multiple):
    """`n` rounded up to a multiple of `multiple` (ints, or numpy integer arrays)."""
    return -(-n // multiple) * multiple


def lengths_path(name: str) -> str:
    """Path of a shipped length file (`code_python_cl100k.txt`, ...), or `name` if it is a path."""
    if os.path.exists(name):
        return name
    path = os.path.join(DATA_DIR, name)
    if not os.path.exists(path):
        known = sorted(f for f in os.listdir(DATA_DIR) if f.endswith(".txt"))
        raise FileNotFoundError(f"no length file {name!r}; shipped: {', '.join(known)}")
    return path


def read_lengths(name: str, limit: int | None = None, *, flag: str = "--lengths", min_length: int = 1) -> list[int]:
    """One integer in [`min_length`, MAX_LENGTH] a line, from a path or a shipped file's name.

    Bad input raises DataError naming the file and the line (`flag` is the option that
    named the file, for the messages about the file itself).
    """
    shipped = os.path.join(DATA_DIR, name)
    path = shipped if not os.path.exists(name) and os.path.isfile(shipped) else name
    if os.path.isdir(path):
        raise DataError(f"{flag} {name}: is a directory, not a file of lengths")
    if not os.path.isfile(path):
        raise DataError(f"{flag} {name}: no such file")
    values = []
    try:
        with open(path) as f:
            for n, line in enumerate(f):
                if limit is not None and len(values) >= limit:
                    break
                t = line.strip()
                if not t:
                    raise DataError(f"{path}:{n + 1}: empty line (one length per line expected)")
                try:
                    v = int(t)
                except ValueError:
                    raise DataError(f"{path}:{n + 1}: {t[:40]!r} is not an integer length (one per line)") from None
                if v < min_length:
                    raise DataError(f"{path}:{n + 1}: length {v} must be >= {min_length} (tokens of a document)")
                if v > MAX_LENGTH:
                    raise DataError(f"{path}:{n + 1}: length {t[:40]} is too large (a document has at most "
                                    f"{MAX_LENGTH} tokens)")
                values.append(v)
    except UnicodeDecodeError:
        raise DataError(f"{path}: not a text file of lengths (one integer per line)") from None
    except OSError as e:
        raise DataError(f"{flag} {name}: cannot read it ({e.strerror or e})") from None
    if not values:
        raise DataError(f"{path}: no lengths (the file is empty)")
    return values
