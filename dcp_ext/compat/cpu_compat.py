"""Let megatron-core train on a machine without CUDA (gloo, CPU tensors).

megatron-core assumes a GPU in many places: `device="cuda"` factories, `.cuda()`,
`torch.cuda.*` state and stream calls, and asserts that parameters are
`torch.cuda.FloatTensor`. On a CUDA-less machine each of those calls can only fail, so
`install()` redirects them to the CPU; with CUDA present it does nothing. Because every
redirect only changes calls that would otherwise raise, it cannot alter a run that
works without it. One line per redirect below says which megatron-core code needs it.

The redirects patch torch for the whole process, so only entry points call `install()`
(pretrain_gpt_dcp.py, megatron.training.initialize, each rank of dcp-profile and
tools/convert_dcp_checkpoint.py, the tests' rank helper), once, before megatron-core
runs; library code (the model builder, the runtime) never does.

`Tensor.type()` is the one redirect that changes an answer rather than a failure:
megatron-core's optimizers and clip_grads sort parameters (and check gradients) by
comparing `param.type()` with the CUDA names 'torch.cuda.FloatTensor', '...HalfTensor'
and '...BFloat16Tensor' and refuse anything else, with no device-neutral path. So the
patch is as narrow as those checks: only the no-argument call, only CPU tensors of
those three dtypes; every other tensor, and `type(dtype)` conversions, answer as torch
does.
"""
from __future__ import annotations

import contextlib
import functools

import torch

_installed = False
# the names megatron-core's optimizer and clip_grads compare `param.type()` with
_CUDA_TYPE_NAMES = {f"torch.{name}": f"torch.cuda.{name}" for name in ("FloatTensor", "HalfTensor", "BFloat16Tensor")}


def install() -> bool:
    """Apply the CPU redirects once. Returns True when they are active."""
    global _installed
    if _installed:
        return True
    if torch.cuda.is_available():
        return False
    _patch_torch_cuda_module()
    _patch_device_arguments()
    _run_compiled_helpers_eagerly()
    _patch_megatron_rng()
    _installed = True
    return True


def _run_compiled_helpers_eagerly() -> None:
    """megatron-core wraps its fused helpers in torch.compile (`jit_fuser`); inductor spends
    ~20 s per process compiling them for the CPU on the first step, so they run eagerly here
    (dynamo off). Wrapping them at all costs every rank ~2 s of its start (importing dynamo
    and inductor for 38 wrappers that will never compile), so megatron-core is imported with
    `torch.compile` as the identity, which is what a disabled compile amounts to."""
    import os
    import sys

    if "torch._dynamo" in sys.modules:
        sys.modules["torch._dynamo"].config.disable = True
    else:  # read by dynamo's config when something imports it later
        os.environ["TORCH_COMPILE_DISABLE"] = "1"
    if "megatron.core" in sys.modules:
        return  # already imported with its wrappers: they run eagerly, dynamo being off
    real_compile = torch.compile

    def identity(model=None, **options):
        return model if model is not None else (lambda fn: fn)

    torch.compile = identity
    try:
        import megatron.core  # noqa: F401  (its fusions take jit_fuser = the identity)
    finally:
        torch.compile = real_compile


def _cpu_device(device):
    """Map any spelling of a CUDA device ('cuda', 'cuda:1', 0, torch.device('cuda')) to the CPU."""
    if isinstance(device, int) and not isinstance(device, bool):
        return torch.device("cpu")
    if isinstance(device, str) and device.startswith("cuda"):
        return torch.device("cpu")
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    return device


def _patch_torch_cuda_module() -> None:
    cuda = torch.cuda
    # RoPE, GlobalMemoryBuffer, optimizer and schedules place tensors on current_device().
    cuda.current_device = lambda: torch.device("cpu")
    # Grad buffer, p2p and timers synchronise the device; the CPU is always synchronous.
    cuda.synchronize = lambda device=None: None
    cuda.set_device = lambda device: None
    cuda.empty_cache = lambda: None
    # The model-parallel RNG tracker swaps CUDA generator states: use the CPU generator.
    cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    cuda.set_rng_state = lambda state, device="cuda": torch.set_rng_state(state)
    cuda.random.get_rng_state = cuda.get_rng_state
    cuda.random.set_rng_state = cuda.set_rng_state
    cuda.manual_seed = lambda seed: torch.manual_seed(seed)
    cuda.manual_seed_all = lambda seed: None
    # nvtx ranges are profiler annotations only.
    cuda.nvtx.range_push = lambda *a, **k: None
    cuda.nvtx.range_pop = lambda *a, **k: None
    # Side streams for overlapped communication (DDP, p2p, dist-opt): run inline.
    cuda.current_stream = lambda device=None: _NullStream()
    cuda.default_stream = lambda device=None: _NullStream()
    cuda.Stream = _NullStream
    cuda.stream = lambda s=None: contextlib.nullcontext()
    cuda.Event = _NullEvent
    # Memory probes used by logging only.
    cuda.max_memory_allocated = lambda device=None: 0
    cuda.memory_allocated = lambda device=None: 0


def _patch_device_arguments() -> None:
    # device="cuda" in factories: schedules (token counters), grad scaler, optimizer
    # (found_inf, _scale_one), clip_grads, dist-checkpointing exchange, rerun state machine.
    for name in (
        "tensor", "as_tensor", "zeros", "ones", "empty", "full", "arange",
        "zeros_like", "ones_like", "empty_like", "full_like", "rand", "randn", "randint",
    ):
        setattr(torch, name, _with_cpu_device(getattr(torch, name)))

    # .cuda(): rope_utils (CP chunk index), optimizer state reload, tensor_parallel.data.
    torch.Tensor.cuda = lambda self, *a, **k: self

    # .to("cuda") / .to(device=0): dist-checkpointing loads and optimizer state moves.
    original_to = torch.Tensor.to

    @functools.wraps(original_to)
    def to(self, *args, **kwargs):
        if args and isinstance(args[0], (str, int, torch.device)) and not isinstance(args[0], bool):
            args = (_cpu_device(args[0]),) + args[1:]
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        return original_to(self, *args, **kwargs)

    torch.Tensor.to = to

    # Type checks `param.type() == 'torch.cuda.FloatTensor'` in clip_grads, the fp16/bf16
    # optimizer and the distributed optimizer: report CPU tensors of the three dtypes they
    # check under their CUDA names (see the module docstring).
    original_type = torch.Tensor.type

    @functools.wraps(original_type)
    def tensor_type(self, *args, **kwargs):
        result = original_type(self, *args, **kwargs)
        if not args and not kwargs and result in _CUDA_TYPE_NAMES:
            return _CUDA_TYPE_NAMES[result]
        return result

    torch.Tensor.type = tensor_type


def _patch_megatron_rng() -> None:
    # CudaRNGStatesTracker.fork() swaps generator states through these two helpers; on the
    # CPU the swapped generator is the default CPU one, so a fork keeps its meaning
    # (model-parallel dropout draws from its own seeded stream).
    from megatron.core.tensor_parallel import random as mp_random

    mp_random._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: torch.get_rng_state()
    mp_random._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(new_state)


def _with_cpu_device(factory):
    @functools.wraps(factory)
    def wrapped(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        # pin_memory needs an accelerator; pinned host memory means nothing on a CPU run.
        kwargs.pop("pin_memory", None)
        return factory(*args, **kwargs)

    return wrapped


class _NullStream:
    def __init__(self, *a, **k):
        pass

    def wait_stream(self, other):
        pass

    def wait_event(self, event):
        pass

    def synchronize(self):
        pass

    def record_event(self, event=None):
        return _NullEvent()


class _NullEvent:
    def __init__(self, *a, **k):
        pass

    def record(self, stream=None):
        pass

    def wait(self, stream=None):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def elapsed_time(self, other):
        return 0.0
