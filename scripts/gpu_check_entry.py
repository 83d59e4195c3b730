"""`pretrain_gpt_dcp.main(argv)`, observed: host synchronisations per training step and where
the run's tensors live (scripts/gpu_check.py, phase b).

    python scripts/gpu_check_entry.py --report FILE [--scan-at N] [--static-cpu-init] -- <pretrain flags>

- Host syncs: with CUDA, `torch.cuda.set_sync_debug_mode("warn")` from the first training step
  on (setup is not counted): torch then warns at each synchronising CUDA call (`.item()`,
  `.tolist()`, a device-to-host copy, a stream sync, `nonzero`, ...); `torch.cuda.synchronize()`
  and `Event.synchronize()`, which it does not warn at, are counted by wrappers. The
  warnings are caught (never printed) and counted per step and by call site, the first
  frame outside torch (file:line). Syncs inside the backward pass surface at the
  `backward()` call. The per-iteration methods `StaticSteps.run` and `AdaptiveSteps.run` are
  wrapped here (not in their files): "in step" counts what `run` does, "after step" what the
  loop does before the next `run` (the log line, evaluation).
- Tensors: after step `--scan-at` (1-based) every tensor Python can reach (`gc`) is counted
  by device; on a GPU run a CPU tensor that is a parameter, requires grad, or is floating
  point with >= OFFENDER_MIN_NUMEL elements (and not pinned: a host staging buffer) is an
  offender.
- `--static-cpu-init`: the static path initialises its weights on the CPU so that a GPU run
  starts from the CPU run's weights (the --dcp path draws its initial values on the CPU on
  every device already): upstream's `--use-cpu-initialization`. A no-op without CUDA.

The report (JSON) is written when main() returns or exits, whatever its exit code.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import threading
import warnings
from collections import Counter

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SYNC_MESSAGE = "called a synchronizing CUDA operation"
# a CPU tensor this large on a GPU run is model-sized (the smallest weight of gpu_check's model
# has 65,536 elements); a micro-batch's host-side loss mask or positions stay below it
OFFENDER_MIN_NUMEL = 65536


def _torch_dir() -> str:
    import importlib.util

    spec = importlib.util.find_spec("torch")
    return os.path.dirname(os.path.abspath(spec.origin)) + os.sep if spec and spec.origin else os.sep + "torch" + os.sep


def short_path(path: str) -> str:
    """A frame's file relative to this repository, or to the site-packages folder it is in."""
    path = os.path.abspath(path)
    if path.startswith(REPO + os.sep):
        return os.path.relpath(path, REPO)
    for marker in ("site-packages" + os.sep, "dist-packages" + os.sep):
        if marker in path:
            return path.split(marker, 1)[1]
    return path


class SyncRecorder:
    """Counts sync warnings per bucket ("step N" / "after step N") and call site."""

    def __init__(self):
        self.lock = threading.Lock()
        self.bucket: str | None = None  # None: not counting (setup)
        self.counts: dict[str, Counter] = {}
        self.order: list[str] = []
        self.skip_prefixes = (_torch_dir(), os.path.abspath(warnings.__file__), os.path.abspath(__file__))
        self.original_showwarning = warnings.showwarning

    def set_bucket(self, name: str | None) -> None:
        with self.lock:
            self.bucket = name
            if name is not None and name not in self.counts:
                self.counts[name] = Counter()
                self.order.append(name)

    def call_site(self) -> str:
        frame = sys._getframe(1)
        while frame is not None:
            path = os.path.abspath(frame.f_code.co_filename)
            if not path.startswith(self.skip_prefixes) and not path.startswith("<"):
                return f"{short_path(path)}:{frame.f_lineno} ({frame.f_code.co_name})"
            frame = frame.f_back
        return "?"

    def showwarning(self, message, category, filename, lineno, file=None, line=None):
        if SYNC_MESSAGE not in str(message):
            return self.original_showwarning(message, category, filename, lineno, file, line)
        self.record(self.call_site())

    def record(self, site: str) -> None:
        with self.lock:
            if self.bucket is not None:
                self.counts[self.bucket][site] += 1

    def count_explicit_syncs(self, torch) -> None:
        """torch's sync debug mode warns at device-to-host copies and stream syncs, not at
        `torch.cuda.synchronize()` or `Event.synchronize()`: those are counted here (the
        site marked with the call), while the mode is on."""
        def counted(original, what):
            def call(*args, **kwargs):
                if torch.cuda.get_sync_debug_mode() != 0:
                    self.record(f"{self.call_site()} [{what}]")
                return original(*args, **kwargs)

            return call

        torch.cuda.synchronize = counted(torch.cuda.synchronize, "torch.cuda.synchronize")
        torch.cuda.Event.synchronize = counted(torch.cuda.Event.synchronize, "Event.synchronize")

    def install(self) -> None:
        warnings.filterwarnings("always", message=SYNC_MESSAGE)
        warnings.showwarning = self.showwarning

    def summary(self) -> dict:
        steps = [b for b in self.order if b.startswith("step ")]
        per_step = []
        for b in steps:
            after = self.counts.get("after " + b, Counter())
            per_step.append({"step": int(b.split()[1]), "in_step": sum(self.counts[b].values()),
                             "after_step": sum(after.values()),
                             "sites": dict(self.counts[b].most_common()),
                             "sites_after_step": dict(after.most_common())})
        totals = Counter()
        for b in self.order:
            totals.update(self.counts[b])
        in_step = sorted(s["in_step"] for s in per_step[1:] or per_step)
        return {"steps": per_step, "by_site": dict(totals.most_common()),
                "median_in_step_after_first": in_step[len(in_step) // 2] if in_step else None,
                "max_in_step": max((s["in_step"] for s in per_step), default=None)}


def scan_tensors(on_gpu: bool) -> dict:
    """Every tensor gc reaches, by device (storage bytes, each storage once); the CPU ones that
    should be on the device when the run is on a GPU."""
    import torch

    by_device: dict[str, dict] = {}
    seen = set()
    offenders: Counter = Counter()
    offender_bytes: Counter = Counter()
    cpu_kinds: Counter = Counter()
    cpu_bytes: Counter = Counter()
    for obj in gc.get_objects():
        try:
            if not isinstance(obj, torch.Tensor) or obj.is_meta:
                continue
            device = str(obj.device.type)
            storage = obj.untyped_storage()
            key = (device, storage.data_ptr(), storage.nbytes())
            entry = by_device.setdefault(device, {"tensors": 0, "bytes": 0, "parameters": 0})
            entry["tensors"] += 1
            param = isinstance(obj, torch.nn.Parameter)
            entry["parameters"] += int(param)
            if key not in seen:
                seen.add(key)
                entry["bytes"] += storage.nbytes()
            if device == "cpu":
                kind = f"{'parameter ' if param else ''}{str(obj.dtype).replace('torch.', '')}{list(obj.shape)}"
                cpu_kinds[kind] += 1
                cpu_bytes[kind] += obj.numel() * obj.element_size()
                large_float = obj.is_floating_point() and obj.numel() >= OFFENDER_MIN_NUMEL
                if on_gpu and (param or obj.requires_grad or (large_float and not obj.is_pinned())):
                    offenders[kind] += 1
                    offender_bytes[kind] += obj.numel() * obj.element_size()
        except Exception:  # an object that only looks like a tensor, or one being torn down
            continue
    return {"by_device": by_device,
            "largest_cpu_tensors": [{"tensor": k, "count": cpu_kinds[k], "bytes": b}
                                    for k, b in cpu_bytes.most_common(12)],
            "offenders": [{"tensor": k, "count": n, "bytes": offender_bytes[k]} for k, n in offenders.most_common(20)],
            "offender_rule": f"on a GPU run: a CPU tensor that is a parameter, requires grad, or is floating point "
                             f"with >= {OFFENDER_MIN_NUMEL} elements and not pinned"}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        raise SystemExit("usage: gpu_check_entry.py --report FILE [--scan-at N] [--static-cpu-init] -- <flags>")
    cut = argv.index("--")
    ap = argparse.ArgumentParser()
    ap.add_argument("--report", required=True)
    ap.add_argument("--scan-at", type=int, default=3, help="scan the tensors after this step (1-based)")
    ap.add_argument("--static-cpu-init", action="store_true")
    opts = ap.parse_args(argv[:cut])
    flags = argv[cut + 1:]

    sys.path.insert(0, REPO)
    import torch

    on_gpu = torch.cuda.is_available()
    can_count = on_gpu and hasattr(torch.cuda, "set_sync_debug_mode")
    recorder = SyncRecorder()
    recorder.install()
    if can_count:  # before anything imports the functions it wraps
        recorder.count_explicit_syncs(torch)

    import pretrain_gpt_dcp
    from megatron.training.adaptive import training_adaptive
    from megatron.training.static import training_static

    cpu_init = bool(opts.static_cpu_init and on_gpu and "--dcp" not in flags)
    report = {"device": "cuda" if on_gpu else "cpu", "sync_counting": can_count, "sync_debug_mode": "warn",
              "sync_counting_reason": None if can_count else "no CUDA device: torch.cuda.set_sync_debug_mode "
                                                           "needs a GPU (the CPU is always synchronous)",
              "static_cpu_init": cpu_init, "steps_wrapped": 0, "path": None, "tensor_scan": None}
    if cpu_init:
        flags = flags + ["--use-cpu-initialization"]
        report["static_cpu_init"] = "--use-cpu-initialization"

    def wrap(cls, path: str):
        original = cls.run

        def run(self, iteration: int):
            step = iteration + 1  # the loss log's iteration
            report["path"] = path
            if can_count and report["steps_wrapped"] == 0:
                torch.cuda.set_sync_debug_mode("warn")
            recorder.set_bucket(f"step {step}")
            try:
                return original(self, iteration)
            finally:
                recorder.set_bucket(f"after step {step}")
                report["steps_wrapped"] += 1
                if step == opts.scan_at or (report["tensor_scan"] is None and step > opts.scan_at):
                    if can_count:
                        torch.cuda.set_sync_debug_mode("default")
                    report["tensor_scan"] = {"after_step": step, **scan_tensors(on_gpu)}
                    if can_count:
                        torch.cuda.set_sync_debug_mode("warn")

        cls.run = run

    wrap(training_static.StaticSteps, "static")
    wrap(training_adaptive.AdaptiveSteps, "dcp")
    code = 0
    try:
        pretrain_gpt_dcp.main(flags)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        code = 1
        raise
    finally:
        if can_count:
            torch.cuda.set_sync_debug_mode("default")
        recorder.set_bucket(None)
        report["exit_code"] = code
        report["syncs"] = recorder.summary() if can_count else None
        with open(opts.report, "w") as f:
            json.dump(report, f, indent=1)
    return code


if __name__ == "__main__":
    sys.exit(main())
