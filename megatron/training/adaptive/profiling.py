"""`dcp-profile`: the profiler's entry point, with the Megatron training side it needs.

Why here: the profiler itself (`dcp_ext.cli.profile`) times the runtime's stage models
and fits the cost model; it also needs Megatron's argument parser and tokenizer, the
TransformerConfig builder and the cluster `--dcp` training assumes. Those belong to
`megatron.training`, which `dcp_ext` never imports, so this module hands them in.

    dcp-profile --yaml-cfg examples/cpu_demo.yaml --out cache/profile-demo.json
"""
from __future__ import annotations

from typing import Sequence

from dcp_ext.cli import profile
from megatron.training.flags.argument_errors import ArgumentError

# Megatron flags that validation requires but profiling never uses.
_UNUSED_REQUIRED = ["--train-iters", "1", "--lr", "1e-4", "--min-lr", "0", "--lr-warmup-iters", "0"]
_NO_STATIC_LAYOUT = ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1",
                     "--context-parallel-size", "1"]


def megatron_args(argv: Sequence[str], world_size: int):
    """Megatron's parsed arguments for the model flags (training-only flags filled in)."""
    from megatron.training.arguments import parse_args
    from megatron.training.global_vars import build_tokenizer

    argv = list(argv)
    if not any(a in argv for a in ("--data-path", "--mock-data", "--demo-corpus")):
        argv.append("--mock-data")
    try:
        args = parse_args(argv + _UNUSED_REQUIRED, world_size=world_size)
    except ArgumentError as e:
        if not str(e).startswith("world size"):
            raise
        # the config's static TP/PP/CP (e.g. the demo's TP2) need not fit the ranks here:
        # the profile picks its own layouts
        args = parse_args(argv + _UNUSED_REQUIRED + _NO_STATIC_LAYOUT, world_size=world_size)
    args.unpadded_vocab_size = build_tokenizer(args).vocab_size
    return args


def transformer_config(args, **overrides):
    from megatron.training.flags.core_configs import transformer_config_from_args

    return transformer_config_from_args(args, **overrides)


def cluster_for(num_gpus: int, args):
    from megatron.training.adaptive.run_config import cluster_for as dcp_cluster

    return dcp_cluster(num_gpus, args)


# Megatron's flag errors (ArgumentError) are bad arguments: one `error:` line and exit 2 at the
# tool's boundary, like our own flags'.
def model_spec(args, name: str):
    from megatron.training.adaptive.run_config import model_spec_for

    return model_spec_for(args, name=name)


SIDE = profile.TrainingSide(parse_args=megatron_args, transformer_config=transformer_config, cluster_for=cluster_for,
                            model_spec=model_spec, argument_errors=(ArgumentError,))


def setup(argv: Sequence[str] | None = None) -> profile.Setup:
    return profile.setup(argv, SIDE)


def main(argv: Sequence[str] | None = None) -> int:
    return profile.main(argv, SIDE)


if __name__ == "__main__":
    raise SystemExit(main())
