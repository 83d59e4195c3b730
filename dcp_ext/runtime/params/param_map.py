"""The canonical parameter space, and where each layout's local parameters sit in it.

Canonical = the parameters of the full model (TP1, PP1), in megatron-core's naming, laid
end to end in one flat vector. The fixed sharding (`sharding.py`) cuts that vector over
all ranks; pull/push move slices of it. A local parameter of a stage built under any
(tp, cp, pp) is described by a few `Runs` (strided runs of canonical elements), derived
from megatron-core's own partition attributes, so a map costs O(tensors), not O(elements):
- layers: `decoder.layers.{i}` -> global layer `layer_number - 1` (PP offsets included);
- TP-split tensors (`tensor_model_parallel`, `partition_dim`, `partition_stride`): the
  full dim is cut into tp*stride chunks and rank t holds chunks t, t+tp, ... (fused QKV is
  per-query-group contiguous, stride 1; SwiGLU fc1 is [gate; up], stride 2). A chunk of
  dim 0 is one contiguous run; a chunk of dim 1 is one run per row;
- a tied output layer on the last stage maps onto `embedding.word_embeddings.weight`.
A gradient is pushed once per distinct contribution: TP-replicated parameters without
sequence parallelism hold identical gradients on every TP rank, so only TP rank 0 sends.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

LAYER_PARAM = re.compile(r"^decoder\.layers\.(\d+)\.")
TIED_OUTPUT = "output_layer.weight"
WORD_EMBEDDINGS = "embedding.word_embeddings.weight"


@dataclass
class CanonicalTensor:
    name: str
    shape: tuple[int, ...]
    offset: int  # start in the flat vector
    no_weight_decay: bool

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class CanonicalSpace:
    """Names, shapes and flat offsets of the full model's parameters."""

    def __init__(self, full_model: torch.nn.Module):
        self.tensors: dict[str, CanonicalTensor] = {}
        offset = 0
        for name, p in full_model.named_parameters():
            self.tensors[name] = CanonicalTensor(name, tuple(p.shape), offset, no_weight_decay(name, p))
            offset += p.numel()
        self.numel = offset

    def flat_index(self, name: str) -> torch.Tensor:
        t = self.tensors[name]
        return torch.arange(t.offset, t.offset + t.numel, dtype=torch.int64).view(t.shape)

    def no_weight_decay_runs(self) -> list[tuple[int, int, bool]]:
        """(start, end, no_weight_decay) over the flat vector, adjacent equal flags merged."""
        out: list[tuple[int, int, bool]] = []
        for t in self.tensors.values():
            if out and out[-1][2] == t.no_weight_decay and out[-1][1] == t.offset:
                out[-1] = (out[-1][0], t.offset + t.numel, t.no_weight_decay)
            else:
                out.append((t.offset, t.offset + t.numel, t.no_weight_decay))
        return out


def no_weight_decay(name: str, param: torch.Tensor) -> bool:
    """Megatron's default: no weight decay on biases and 1-D parameters (norms)."""
    return name.endswith(".bias") or param.dim() == 1


def canonical_name(local_name: str, model: torch.nn.Module, layer_numbers: dict[int, int]) -> str:
    m = LAYER_PARAM.match(local_name)
    if m:
        return f"decoder.layers.{layer_numbers[int(m.group(1))]}." + local_name[m.end() :]
    if local_name == TIED_OUTPUT and getattr(model, "share_embeddings_and_output_weights", False):
        return WORD_EMBEDDINGS
    return local_name


@dataclass(frozen=True)
class Runs:
    """`count` runs of `length` elements: run k is canonical [canon + k*canon_step, +length)
    and local [local + k*local_step, +length) (local: offset in the parameter, flat)."""
    canon: int
    local: int
    length: int
    count: int = 1
    canon_step: int = 0
    local_step: int = 0

    @property
    def numel(self) -> int:
        return self.length * self.count

    @property
    def canon_end(self) -> int:
        return self.canon + (self.count - 1) * self.canon_step + self.length

    def shifted(self, local: int) -> "Runs":
        return Runs(self.canon, self.local + local, self.length, self.count, self.canon_step, self.local_step)

    def clip(self, start: int, end: int) -> list["Runs"]:
        """The parts of these runs inside canonical [start, end), in run order (at most a
        partial run, a block of whole runs, and another partial run)."""
        if self.count == 1:
            lo, hi = max(start, self.canon), min(end, self.canon + self.length)
            return [Runs(lo, self.local + lo - self.canon, hi - lo)] if lo < hi else []
        step, n = self.canon_step, self.length
        # runs that intersect: canon + k*step < end and canon + k*step + n > start
        k0 = max(0, _ceil_div(start - self.canon - n + 1, step))
        k1 = min(self.count - 1, (end - 1 - self.canon) // step)
        if k0 > k1:
            return []
        # runs entirely inside
        f0 = max(k0, _ceil_div(start - self.canon, step))
        f1 = min(k1, (end - n - self.canon) // step)
        out = []
        if f0 > f1:  # no whole run: one or two partial ones
            for k in sorted({k0, k1}):
                out += self._run(k).clip(start, end)
            return out
        if k0 < f0:
            out += self._run(k0).clip(start, end)
        out.append(Runs(self.canon + f0 * step, self.local + f0 * self.local_step, n, f1 - f0 + 1, step,
                        self.local_step))
        if k1 > f1:
            out += self._run(k1).clip(start, end)
        return out

    def _run(self, k: int) -> "Runs":
        return Runs(self.canon + k * self.canon_step, self.local + k * self.local_step, self.length)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class LocalParam:
    name: str  # local parameter name
    param: torch.Tensor
    canonical: str  # the canonical tensor it is a part of
    runs: tuple[Runs, ...]  # where its elements sit in the canonical vector
    pushes_grad: bool  # False for TP replicas whose gradient another TP rank sends
    offset: int = 0  # start of the parameter in the rank's parameter / main-grad buffers

    @property
    def numel(self) -> int:
        return sum(r.numel for r in self.runs)

    @property
    def index(self) -> torch.Tensor:
        """Canonical position of every element, shaped like the parameter (tools and tests;
        O(elements): the runtime never builds it)."""
        flat = torch.empty(self.numel, dtype=torch.int64)
        for r in self.runs:
            k = torch.arange(r.count, dtype=torch.int64)[:, None]
            j = torch.arange(r.length, dtype=torch.int64)[None, :]
            flat[(r.local + k * r.local_step + j).flatten()] = (r.canon + k * r.canon_step + j).flatten()
        return flat.view(tuple(self.param.shape))


def describe(name: str, param: torch.Tensor, tensor, tp: int, tp_rank: int, stride: int) -> tuple[Runs, ...]:
    """Runs of one local parameter: the whole canonical tensor, or this TP rank's chunks."""
    split = getattr(param, "tensor_model_parallel", False) and tp > 1
    if not split:
        if tuple(param.shape) != tuple(tensor.shape):
            raise ValueError(f"{name}: local shape {tuple(param.shape)} != canonical shape {tuple(tensor.shape)}")
        return (Runs(tensor.offset, 0, tensor.numel),)
    dim = param.partition_dim
    shape = tensor.shape
    size = shape[dim]
    if size % (tp * stride):
        raise ValueError(f"dimension {size} does not split into tp*stride = {tp}*{stride} chunks")
    width = size // (tp * stride)
    outer, inner = math.prod(shape[:dim]), math.prod(shape[dim + 1 :])
    local_shape = tuple(shape[:dim]) + (width * stride,) + tuple(shape[dim + 1 :])
    if tuple(param.shape) != local_shape:
        raise ValueError(f"{name}: mapped shape {local_shape} != local shape {tuple(param.shape)}")
    runs = []
    for j in range(stride):
        chunk = tp_rank + j * tp
        canon = tensor.offset + chunk * width * inner
        local = j * width * inner
        if outer == 1:
            runs.append(Runs(canon, local, width * inner))
        else:
            runs.append(Runs(canon, local, width * inner, outer, size * inner, stride * width * inner))
    return tuple(runs)


def map_stage(model: torch.nn.Module, space: CanonicalSpace, tp: int, tp_rank: int, gated_fc1: bool) -> list[LocalParam]:
    """Describe every parameter of one model stage in the canonical space; `offset`s lay
    the parameters end to end (the rank's shared buffers)."""
    layer_numbers = {i: layer.layer_number - 1 for i, layer in enumerate(model.decoder.layers)} if hasattr(
        model, "decoder") else {}
    out = []
    offset = 0
    for name, p in model.named_parameters():
        cname = canonical_name(name, model, layer_numbers)
        if cname not in space.tensors:
            raise KeyError(f"local parameter {name} ({cname}) has no canonical counterpart")
        stride = getattr(p, "partition_stride", 1)
        if gated_fc1 and ".mlp.linear_fc1." in name:
            stride = 2  # [gate; up]: each rank holds its slice of both halves
        runs = describe(name, p, space.tensors[cname], tp, tp_rank, stride)
        replicated_identical = not getattr(p, "tensor_model_parallel", False) and not getattr(
            p, "sequence_parallel", False)
        out.append(LocalParam(name, p, cname, runs, pushes_grad=not (replicated_identical and tp_rank != 0),
                              offset=offset))
        offset += p.numel()
    return out
