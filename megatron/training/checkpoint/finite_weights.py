"""No checkpoint holds NaN or inf weights.

Why it exists: a step applied with a non-finite update (a bug, a flag that disables the
checks, a kernel fault) poisons every later checkpoint, and the tracker then names a model
that can only produce NaN: a user who resumes loses everything since the last good one.
Both checkpoint kinds ask `refuse_nonfinite` before they write anything; it refuses in
one line naming the last checkpoint that is still good. Also the test hook that makes a
step's gradient or weights non-finite (`DCP_FAULT_INJECT=nan_grad@N` / `nan_weights@N`).
"""
from __future__ import annotations

import os
from typing import Iterable

import torch
import torch.distributed as dist

from megatron.training.errors import AgreedTrainingError


def refuse_nonfinite(tensors: Iterable[torch.Tensor], iteration: int, save_dir: str, device=None) -> None:
    """Collective over the world: raise AgreedTrainingError on every rank if any rank's tensors
    hold a NaN or inf value (nothing has been written yet)."""
    bad = False
    for t in tensors:
        if t is None:
            continue
        device = device or t.device  # the collective runs where the model is (NCCL: the GPU)
        if t.numel() and not bool(torch.isfinite(t).all()):
            bad = True
            break
    flag = torch.tensor([1.0 if bad else 0.0], device=device or _default_device())
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if flag.item() == 0:
        return
    from megatron.training.checkpoint.protocol import read_tracker

    try:
        last = read_tracker(save_dir)
    except Exception:  # an unreadable tracker must not hide the real problem
        last = None
    kept = f"the last checkpoint there (iteration {last}) is kept" if last else "nothing was saved before"
    raise AgreedTrainingError(f"iteration {iteration}: the model's weights hold NaN or inf values; not saving them to "
                        f"--save {save_dir} ({kept}): lower --lr or check the data, then resume from it")


def _default_device() -> torch.device:
    """A rank holding no tensor still joins the collective, on the backend's device."""
    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _injected(kind: str, iteration: int) -> bool:
    return os.environ.get("DCP_FAULT_INJECT") == f"{kind}@{iteration}"


def inject_nan_grad(parameters: Iterable[torch.nn.Parameter], iteration: int) -> None:
    """Test hook: `DCP_FAULT_INJECT=nan_grad@N` makes one gradient element of iteration N NaN
    on every rank (a finite loss with a NaN gradient norm)."""
    if not _injected("nan_grad", iteration):
        return
    for p in parameters:
        grad = getattr(p, "main_grad", None)
        grad = grad if grad is not None else p.grad
        if grad is not None and grad.numel():
            grad.view(-1)[0] = float("nan")
            return


def inject_nan_weights(parameters: Iterable[torch.nn.Parameter], iteration: int) -> None:
    """Test hook: `DCP_FAULT_INJECT=nan_weights@N` makes one weight NaN after iteration N's step."""
    if not _injected("nan_weights", iteration):
        return
    with torch.no_grad():
        for p in parameters:
            if p.numel():
                p.view(-1)[0] = float("nan")
                return
