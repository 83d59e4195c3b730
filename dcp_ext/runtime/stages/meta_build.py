"""Build a megatron-core model stage without allocating its parameters, then give it real ones.

Why it exists: the stage bank builds the full model (for the canonical space's shapes) and
this rank's stage of every replica type it can play, and each stage's parameters are
views of the bank's two shared buffers, filled by the pull. Allocating them at
construction would cost a whole TP1 model per rank for the canonical space, plus each
stage once over. A `torch.device("meta")` context does not prevent it on a GPU:
megatron-core's layers pass `device=torch.cuda.current_device()` explicitly when CPU
initialisation is off, and an explicit device wins over the context. So while a stage is
constructed, `torch.empty` (the one factory megatron-core's and transformer-engine's
layers create parameters with) is sent to the meta device whatever device it asks for;
every other tensor (RoPE's frequencies, small constants) is made where the layer asks.
`check_built` then holds both halves: every parameter is on meta, nothing else is.
`materialize` swaps each meta parameter for a real one (a meta tensor cannot take a
device tensor's data), keeping its attributes and every module that shares it.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch.overrides import TorchFunctionMode


_EMPTY = torch._C._VariableFunctions.empty  # torch.empty itself, whatever wraps the name


class _ParametersOnMeta(TorchFunctionMode):
    def __torch_function__(self, func, types, call_args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _EMPTY:
            kwargs = {k: v for k, v in kwargs.items() if k != "pin_memory"}
            kwargs["device"] = "meta"
        return func(*call_args, **kwargs)


def build_without_parameters(build: Callable[[], torch.nn.Module]) -> torch.nn.Module:
    """`build()` with every parameter on the meta device (no memory), checked."""
    with _ParametersOnMeta():
        model = build()
    check_built(model)
    return model


def check_built(model: torch.nn.Module) -> None:
    """Every parameter on meta and no other tensor of the model there (a buffer that lost its
    values would make a silently wrong model): raise naming the first that is not."""
    for name, p in model.named_parameters():
        if not p.is_meta:
            raise RuntimeError(f"stage parameter {name} was allocated on {p.device} while building: it should "
                               "have been created with torch.empty (see dcp_ext/runtime/stages/meta_build.py)")
    for mod_name, module in model.named_modules():
        tensors = dict(module.named_buffers(recurse=False))
        tensors.update({k: v for k, v in vars(module).items()
                        if isinstance(v, torch.Tensor) and not isinstance(v, torch.nn.Parameter)})
        for key, t in tensors.items():
            if t.is_meta:
                raise RuntimeError(f"{mod_name}.{key} was made with torch.empty while building a stage and has no "
                                   "values on the meta device: make it with another factory or after building")


def materialize(model: torch.nn.Module, like: dict[int, torch.Tensor]) -> dict[int, torch.nn.Parameter]:
    """Replace the meta parameters whose id is in `like` by empty Parameters on the device
    of the given tensor (the caller binds their `.data`, as for every later binding), in
    every module that holds them (tied weights stay tied), with the old ones' attributes
    (tensor_model_parallel, sequence_parallel, shared, ...). Returns id(old) -> new.
    Each new Parameter has a version counter of its own, as a bound parameter had before:
    the pull's writes into the shared buffer are not in-place changes of a saved weight."""
    made: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            if id(p) not in like:
                continue
            new = made.get(id(p))
            if new is None:
                new = torch.nn.Parameter(like[id(p)].new_empty(0, dtype=p.dtype), requires_grad=p.requires_grad)
                for attr, value in vars(p).items():
                    setattr(new, attr, value)
                made[id(p)] = new
            setattr(module, name, new)
    return made
