"""The command line: upstream Megatron's flags and this fork's, their checks and their refusals.

`megatron.training.arguments.parse_args` is the door; the modules here define, derive and check.
"""
