"""Upstream Megatron's per-iteration services, shared by both training loops.

Why a module of its own: the static loop (`training.train`) and the adaptive loop
(`training_adaptive.AdaptiveRun`) must behave alike for --manual-gc, --empty-unused-memory-level,
--exit-duration-in-mins, --exit-signal-handler, --profile, --timing-log-level and wandb;
each loop calls these hooks with one line apiece, so the loops stay thin.

    features = LoopFeatures(options)       # before the loop: gc off, signal handler, timers
    features.begin_iteration(iteration)    # top of the body: profiler start
    features.end_iteration(iteration)      # after the step: empty_cache, gc, profiler stop
    if features.should_exit(iteration): break   # last in the body; the loop's final save follows
    features.finish()                      # after the loop
"""
from __future__ import annotations

import gc
import os
import signal
import time
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from dcp_ext.runtime.schedule.timing import PHASES
from megatron.training.initialize import print_rank_0, print_rank_last


def process_start_time() -> float:
    """When this process started (upstream counts --exit-duration-in-mins from the start of the job)."""
    try:
        import psutil

        return psutil.Process().create_time()
    except Exception:  # psutil missing or /proc unreadable
        return _IMPORTED_AT


_IMPORTED_AT = time.time()


class _SignalFlag:
    """Remembers that the exit signal arrived; the loop acts on it between iterations."""

    def __init__(self, name: str):
        self.signum = signal.Signals[name]
        self.received = False
        self.previous = signal.signal(self.signum, self._handle)
        signal.siginterrupt(self.signum, False)  # a blocking collective resumes instead of failing with EINTR

    def _handle(self, signum, frame):
        self.received = True

    def restore(self):
        signal.signal(self.signum, self.previous)


def _device():
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


@dataclass(frozen=True)
class WandbOptions:
    project: str  # --wandb-project
    save_dir: str  # --wandb-save-dir, else {--save}/wandb
    exp_name: str | None = None  # --wandb-exp-name
    config: tuple[tuple[str, object], ...] = field(default=(), repr=False)  # the run's flags, for its record


@dataclass(frozen=True)
class FeatureOptions:
    """The upstream services' flags, read once (`flags.records.feature_options_for`)."""

    adaptive: bool = False  # --dcp: the adaptive runtime's timers
    exit_signal: str | None = None  # --exit-signal under --exit-signal-handler
    exit_duration_in_mins: float | None = None
    saving: bool = False  # --save given: an exit says it saves
    manual_gc: bool = False
    manual_gc_interval: int = 0
    manual_gc_eval: bool = True
    empty_unused_memory_level: int = 0
    timing_log_level: int = 0
    timing_log_option: str = "minmax"
    log_interval: int = 100
    profile: bool = False
    profile_ranks: tuple[int, ...] = ()
    profile_step_start: int = 10
    profile_step_end: int = 12
    use_pytorch_profiler: bool = False
    tensorboard_dir: str | None = None  # where the torch profile goes (else the working directory)
    num_workers: int = 0  # said to have no effect under --dcp
    wandb: WandbOptions | None = None


class LoopFeatures:
    def __init__(self, options: FeatureOptions):
        self.options = o = options
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.start_time = process_start_time()
        self.exit_reason = None
        self.signal = _SignalFlag(o.exit_signal) if o.exit_signal else None
        if o.manual_gc:
            gc.disable()
            gc.collect()
        self.timers = None
        if o.timing_log_level > 0:
            from megatron.core.timers import Timers

            self.timers = Timers(o.timing_log_level, o.timing_log_option)
        self.profiling = o.profile and (not o.profile_ranks or self.rank in o.profile_ranks)
        self.profiler = None
        self.nsys = o.profile and torch.cuda.is_available() and not o.use_pytorch_profiler
        if o.adaptive and o.num_workers:
            print_rank_0(f"note: --num-workers {o.num_workers} has no effect under --dcp (documents are read and "
                         "packed in the main process)")
        self.wandb = open_wandb(o.wandb) if o.wandb else None

    # ---- timers ---------------------------------------------------------------------------
    def timer(self, name: str, level: int = 1):
        """A context manager timing `name` when --timing-log-level >= level."""
        if self.timers is None or level > self.options.timing_log_level:
            return nullcontext()
        return _Timed(self.timers(name, log_level=level))

    def log_timers(self, iteration: int) -> None:
        """At each log line: the timers, averaged over the interval (Megatron's '(min, max) time')."""
        if self.timers is None or iteration % self.options.log_interval:
            return
        names = ["adaptive-step", *PHASES] if self.options.adaptive else [
            "forward-backward", "forward-compute", "backward-compute", "forward-recv", "forward-send",
            "backward-recv", "backward-send", "all-grads-sync", "params-all-gather", "optimizer-copy-to-main-grad",
            "optimizer-unscale-and-check-inf", "optimizer-clip-main-grad", "optimizer-count-zeros",
            "optimizer-inner-step", "optimizer-copy-main-to-model-params", "optimizer"]
        # collective (every rank passes the same names); megatron-core's Timers.log goes to a logger
        text = self.timers.get_all_timers_string(names, normalizer=self.options.log_interval, reset=True)
        if text:
            print_rank_last(text)

    # ---- per iteration ---------------------------------------------------------------------
    def begin_iteration(self, iteration: int) -> None:
        """`iteration`: iterations done so far (upstream's numbering for --profile-step-start)."""
        if self.profiling and iteration == self.options.profile_step_start:
            self._start_profile()

    def end_iteration(self, iteration: int) -> None:
        """`iteration`: iterations done, this one included."""
        o = self.options
        if o.empty_unused_memory_level >= 1 and torch.cuda.is_available():
            torch.cuda.empty_cache()
        if o.manual_gc and o.manual_gc_interval and iteration % o.manual_gc_interval == 0:
            gc.collect()
        if self.profiling and iteration == o.profile_step_end:
            self._stop_profile()
        self.log_timers(iteration)

    def eval_boundary(self) -> None:
        """Before and after evaluation (upstream's --manual-gc-eval)."""
        if self.options.manual_gc and self.options.manual_gc_eval:
            gc.collect()

    def should_exit(self, iteration: int) -> bool:
        """Exit signal or duration: every rank agrees (one all-reduce), then the loop stops and its
        final save runs (if --save)."""
        o = self.options
        if self.signal is None and not o.exit_duration_in_mins:
            return False
        minutes = (time.time() - self.start_time) / 60.0
        flags = torch.tensor([int(bool(self.signal and self.signal.received)),
                              int(bool(o.exit_duration_in_mins) and minutes > o.exit_duration_in_mins)],
                             dtype=torch.int32, device=_device())
        if dist.is_initialized():
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        if flags[0].item():
            self.exit_reason = f"exiting program after receiving {o.exit_signal} at iteration {iteration}" + (
                ", saving a checkpoint" if o.saving else "")
        elif flags[1].item():
            self.exit_reason = f"exiting program after {minutes:.2f} minutes at iteration {iteration}" + (
                ", saving a checkpoint" if o.saving else "")
        if self.exit_reason:
            print_rank_0(self.exit_reason)
        return self.exit_reason is not None

    def finish(self) -> None:
        if self.profiler is not None:
            self._stop_profile()
        if self.signal is not None:
            self.signal.restore()
        if self.options.manual_gc:
            gc.enable()
        if self.wandb is not None:
            self.wandb.finish()

    # ---- profiler --------------------------------------------------------------------------
    def profile_path(self) -> str:
        root = self.options.tensorboard_dir or os.getcwd()
        return os.path.join(root, "torch_profile", f"rank-{self.rank}.json.gz")

    def _start_profile(self) -> None:
        if self.nsys:
            torch.cuda.check_error(torch.cuda.cudart().cudaProfilerStart())
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.profiler = torch.profiler.profile(activities=activities, record_shapes=True)
        self.profiler.start()

    def _stop_profile(self) -> None:
        if self.nsys:
            torch.cuda.check_error(torch.cuda.cudart().cudaProfilerStop())
            return
        if self.profiler is None:
            return
        prof, self.profiler = self.profiler, None
        prof.stop()
        path = self.profile_path()
        os.makedirs(os.path.dirname(path), exist_ok=True)
        prof.export_chrome_trace(path)
        print(f"[rank {self.rank}] profile of iterations {self.options.profile_step_start + 1}-"
              f"{self.options.profile_step_end} written to {path}", flush=True)


class _Timed:
    def __init__(self, timer):
        self.t = timer

    def __enter__(self):
        self.t.start()

    def __exit__(self, *exc):
        self.t.stop()


def open_wandb(options: WandbOptions):
    """wandb on the last rank (upstream's choice), or None elsewhere; the checks ran in validate."""
    if dist.is_initialized() and dist.get_rank() != dist.get_world_size() - 1:
        return None
    import wandb

    os.makedirs(options.save_dir, exist_ok=True)
    wandb.init(dir=options.save_dir, name=options.exp_name, project=options.project, config=dict(options.config))
    return wandb
