"""`pretrain()`: Megatron's entry, on megatron-core parts, CPU (gloo) or GPU (NCCL).

It parses the flags, starts the ranks, turns the flags into the records each part owns (the
door: `flags.records`, `flags.core_configs`, `adaptive.run_config`), sets either step kind up
in one order (`train_run`) and runs the loop; a failure becomes one line and an exit code.
A static layout (TP/PP/CP/DP fixed for the run: `static.training_static`) drives megatron-core
exactly as upstream Megatron does; `--dcp` hands the per-iteration work to the adaptive
runtime (`adaptive.training_adaptive`). Loss is per token over the whole global batch
(docs/contracts.md, "Loss").
"""
from __future__ import annotations

import os
import sys
from typing import Callable, Optional

import torch.distributed as dist

from megatron.training import checkpointing, global_vars
from megatron.training.adaptive import run_config
from megatron.training.adaptive.training_adaptive import AdaptiveRun
from megatron.training.arguments import ArgumentError, parse_args
from megatron.training.errors import AgreedTrainingError, TrainingError
from megatron.training.flags.core_configs import build_lr_scheduler
from megatron.training.flags.records import (feature_options_for, log_config_for, loop_config_for,
                                             memory_budget_for, output_paths_for, static_options_for)
from megatron.training.initialize import initialize_distributed, print_rank_0, shutdown_distributed
from megatron.training.loop.log import TrainingLogger
from megatron.training.loop.loop_features import LoopFeatures
from megatron.training.loop.memory_report import report_memory, start_memory_report
from megatron.training.loop.run import run_training
from megatron.training.startup import preflight
from megatron.training.static.training_static import StaticRun


QUIET_RANK_GRACE_S = 5.0  # how long a rank that does not print an error waits for rank 0 to print it


def _report_error_and_exit(message: str, code: int = 1, every_rank: bool = True) -> None:
    """One line on stderr and a non-zero exit. Errors every rank meets alike (flags) print once."""
    import os

    def env_int(name: str, default: int) -> int:  # the environment may be what is wrong
        try:
            return int(os.environ.get(name, default))
        except ValueError:
            return default

    rank, world = env_int("RANK", 0), env_int("WORLD_SIZE", 1)
    speaks = every_rank or rank == 0 or not 0 <= rank < world
    from megatron.training.startup import liveness

    liveness.stop(message)  # peers that lose contact with this rank quote why it stopped
    if speaks:
        names_its_rank = message.startswith(f"rank {rank} ")
        prefix = f"[rank {rank}] " if every_rank and world > 1 and not names_its_rank else ""
        print(f"{prefix}error: {message}", file=sys.stderr, flush=True)
    from megatron.training.startup import stop_signals

    stop_signals.reason_given()
    if not speaks:
        # a silent rank that exits first makes torchrun stop rank 0 (SIGTERM) before it
        # prints the line: leave rank 0 the time to print and exit first (torchrun then
        # stops this rank, silently: its reason is given)
        import time

        time.sleep(QUIET_RANK_GRACE_S)
    sys.exit(code)


def pretrain(
    train_valid_test_datasets_provider: Callable,
    model_provider: Callable,
    forward_step_func: Callable,
    argv: Optional[list[str]] = None,
    document_datasets_provider: Optional[Callable] = None,
):
    """Megatron's entry: parse flags, initialise, build, (resume), train, evaluate, save.

    `document_datasets_provider(args)` gives one-document-per-sample datasets for `--dcp`.
    Returns the list of (iteration, lm loss) logged, for tests and tools.
    """
    from dcp_ext.data.errors import DataError
    from dcp_ext.planning.planners.errors import PlanningError

    try:
        args = parse_args(argv)
    except ArgumentError as e:
        _report_error_and_exit(str(e), 2, every_rank=False)
    global_vars.set_args(args)
    from megatron.training.startup import stop_signals

    stop_signals.say_why_on_sigterm()  # a rank stopped by torchrun says so in one line
    try:
        logged = _pretrain(args, train_valid_test_datasets_provider, model_provider, forward_step_func,
                           document_datasets_provider)
        from megatron.training.startup import liveness

        liveness.stop("finished")  # peers will not take this rank's silence for a stall
        shutdown_distributed()
        return logged
    except (DataError, TrainingError, checkpointing.CheckpointError, ArgumentError, PlanningError) as e:
        _report_error_and_exit(str(e), getattr(e, "exit_code", 1), every_rank=not isinstance(e, AgreedTrainingError))
    except RuntimeError as e:
        if not _is_lost_peer(e):
            _report_os_error_or_raise(e, args)
        _report_collective_fault(e, args)
    except KeyboardInterrupt:  # SIGINT, Ctrl-C: one line, as SIGTERM ends without --exit-signal-handler
        from megatron.training.startup import liveness

        if liveness.launcher_stop_line():  # the heartbeat stopped this rank: its launcher is gone (line said)
            sys.exit(1)
        _report_error_and_exit(interrupted_message(args), 130, every_rank=False)
    except BaseException as e:  # an OSError (full disk, permissions), or torch's CheckpointException wrapping one
        from megatron.training.startup.collective_faults import find_collective_failure

        inner = find_collective_failure(e) if not isinstance(e, (SystemExit, KeyboardInterrupt)) else None
        if inner is not None:  # a save whose collective failed because of a peer
            _report_collective_fault(inner, args)
        _report_os_error_or_raise(e, args)
    finally:
        from megatron.training.checkpoint import lock as checkpoint_lock

        checkpoint_lock.release()  # the --save lock, however the run ends (a no-op where none is held)


def interrupted_message(args=None) -> str:
    """What a SIGINT (Ctrl-C) stopped, and where the run can resume."""
    from megatron.training.checkpoint.protocol import TRACKER

    save = args.save if args is not None else None
    if not save:
        return "interrupted (SIGINT, Ctrl-C): the run stopped; it saved nothing (no --save)"
    try:
        with open(os.path.join(save, TRACKER)) as f:
            last = f.read().strip()
    except OSError:
        last = None
    where = f"its last checkpoint in --save {save} is iteration {last}" if last else f"nothing is saved in --save {save} yet"
    return (f"interrupted (SIGINT, Ctrl-C): the run stopped; {where}: rerun with the same flags to resume "
            "(--exit-signal-handler saves before stopping)")


def _report_os_error_or_raise(e: BaseException, args=None) -> None:
    """A failure of the operating system (full disk, read-only path) is one line; anything else propagates."""
    from megatron.training.startup.os_errors import explain_failure

    if isinstance(e, (SystemExit, KeyboardInterrupt)):
        raise e
    line = explain_failure(e, output_paths_for(args) if args is not None else ())
    if line is None:
        raise e
    _report_error_and_exit(line)


def _is_lost_peer(e: BaseException) -> bool:
    """A collective failed because a peer died, hangs or stopped (gloo/NCCL), not a bug of this rank."""
    from megatron.training.startup.collective_faults import is_collective_failure

    return is_collective_failure(e)


def _report_collective_fault(e: BaseException, args) -> None:
    """One line naming the rank that stopped answering and the collective (collective_faults),
    worked out while a SIGTERM from torchrun waits; then exit 1."""
    from megatron.training.startup import collective_faults

    with collective_faults.sigterm_deferred():
        try:
            line = collective_faults.fault_line(e, args.distributed_timeout_minutes)
        except Exception:  # noqa: BLE001  (the diagnosis must never hide the fault behind its own traceback)
            first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
            line = (f"lost contact with another rank ({first}): it died, hangs or stopped; see every rank's log, "
                    "then rerun to resume from the last checkpoint")
        _report_error_and_exit(line)


def _pretrain(args, datasets_provider, model_provider, forward_step_func, document_datasets_provider=None):
    initialize_distributed(args.distributed_backend, args.distributed_timeout_minutes)
    from megatron.training.flags import job_agreement
    from megatron.training.startup import liveness

    liveness.start(dist.get_rank(), dist.get_world_size())  # heartbeats: who stopped answering, if one does

    job_agreement.check(args, print_rank_0)  # every rank was given the same flags; where one-rank outputs go
    from megatron.training.flags.upstream_flags import announce

    announce(args, print_rank_0)  # the upstream flags accepted without effect, once, on rank 0
    preflight.check_output_paths(output_paths_for(args))  # both paths (static, --dcp): every output writable, before any work
    from megatron.training.checkpoint import lock as checkpoint_lock

    checkpoint_lock.acquire(args.save)  # one job per --save: rank 0 takes its lock, or every rank stops here
    from megatron.training.flags.model_flags import startup_notes

    for note in startup_notes(args):  # what the model/kernel/precision flags do on this machine
        print_rank_0(f"> {note}")
    if args.dcp:
        if document_datasets_provider is None:
            raise ArgumentError("--dcp needs a document_datasets_provider (one document per sample)")
        cluster = run_config.cluster_for(args.world_size, args)  # an unknown GPU stops here, before any data
        global_vars.build_tokenizer(args, cluster)  # the vocabulary padded for every layout on the cluster
        run = AdaptiveRun(args.seed, cluster, lambda: document_datasets_provider(args),
                          lambda: run_config.configure(args), model_provider, forward_step_func)
    else:
        global_vars.build_tokenizer(args)
        run = StaticRun(static_options_for(args), lambda: datasets_provider(args), model_provider, forward_step_func)
    return train_run(args, run)


def train_run(args, run) -> list:
    """Both ways to train, set up in one order: seed, data (and, adaptive, the plan's
    vocabulary and planner), the memory report from here on, the model and optimizer (the
    engine), the LR schedule, the checkpoint, then the loop. `run` is the seam between the
    static layout (`StaticRun`) and the adaptive runtime (`training_adaptive.AdaptiveRun`)."""
    run.seed()
    run.data()
    budget = memory_budget_for(args)
    peak_memory = start_memory_report(budget)  # every rank's peak from here on, said after training
    optimizer = run.build(peak_memory)
    scheduler = build_lr_scheduler(args, optimizer)
    iteration, consumed_samples = run.load(scheduler) if args.load else (0, 0)
    logger = TrainingLogger(log_config_for(args))
    features = LoopFeatures(feature_options_for(args))
    steps = run.steps(scheduler, consumed_samples, logger, features)
    history = run_training(loop_config_for(args), steps, iteration, features)
    run.finish()
    report_memory(budget, peak_memory)
    logger.close()
    dist.barrier()
    return history
