"""One exception class for bad data, so entry points can print one line and exit non-zero.

Every message names the file (or path prefix) it is about.
"""


class DataError(Exception):
    """A data file, data path or tokenizer input that cannot be used as given."""
