"""The one error every flag check raises.

Why a module of its own: the parser (`arguments`), its checks (`argument_checks`) and the
flag families that define their own flags (`loop_flags`, `model_flags`, `upstream_flags`),
as well as the start-up checks (`initialize`, `preflight`, `global_vars`), all end a bad
configuration the same way. Defining the error here, below all of them, lets each import it
without importing the parser (which imports them).
"""


class ArgumentError(ValueError):
    """An invalid flag or combination; the message is one line that names the fix."""
