"""The canonical parameter space, and where each layout's local parameters sit in it.

Canonical = the parameters of the full model (TP1, PP1), in megatron-core's naming, laid
end to end in one flat fp32 vector. The fixed optimizer sharding cuts that vector evenly
over all ranks; pull/push move slices of it. For a model stage built under any
(tp, cp, pp), each local parameter is an index tensor into the flat vector, derived from
megatron-core's own partition attributes:
- layers: `decoder.layers.{i}` -> global layer `layer_number - 1` (PP offsets included);
- TP-split tensors (`tensor_model_parallel`, `partition_dim`, `partition_stride`): the
  full dim is cut into tp*stride chunks and rank t holds chunks t, t+tp, ... (fused QKV is
  per-query-group contiguous, stride 1; SwiGLU fc1 is [gate; up], stride 2);
- a tied output layer on the last stage maps onto `embedding.word_embeddings.weight`.
A gradient is pushed once per distinct contribution: TP-replicated parameters without
sequence parallelism hold identical gradients on every TP rank, so only TP rank 0 sends.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
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

    def no_weight_decay_mask(self) -> torch.Tensor:
        mask = torch.zeros(self.numel, dtype=torch.bool)
        for t in self.tensors.values():
            if t.no_weight_decay:
                mask[t.offset : t.offset + t.numel] = True
        return mask


def no_weight_decay(name: str, param: torch.Tensor) -> bool:
    """Megatron's default: no weight decay on biases and 1-D parameters (norms)."""
    return name.endswith(".bias") or param.dim() == 1


def canonical_name(local_name: str, model: torch.nn.Module, layer_numbers: dict[int, int]) -> str:
    m = _LAYER.match(local_name)
    if m:
        return f"decoder.layers.{layer_numbers[int(m.group(1))]}." + local_name[m.end() :]
    if local_name == TIED_OUTPUT and getattr(model, "share_embeddings_and_output_weights", False):
        return WORD_EMBEDDINGS
    return local_name


@dataclass
class LocalParam:
    name: str  # local parameter name
    param: torch.Tensor
    index: torch.Tensor  # same shape as param: positions in the canonical flat vector
    pushes_grad: bool  # False for TP replicas whose gradient another TP rank sends


def map_stage(model: torch.nn.Module, space: CanonicalSpace, tp: int, tp_rank: int, gated_fc1: bool) -> list[LocalParam]:
    """Index every parameter of one model stage into the canonical space."""
    layer_numbers = {i: layer.layer_number - 1 for i, layer in enumerate(model.decoder.layers)} if hasattr(
        model, "decoder") else {}
    out = []
    for name, p in model.named_parameters():
        cname = canonical_name(name, model, layer_numbers)
        if cname not in space.tensors:
            raise KeyError(f"local parameter {name} ({cname}) has no canonical counterpart")
        full = space.flat_index(cname)
        split = getattr(p, "tensor_model_parallel", False) and tp > 1
        if split:
            dim = p.partition_dim
            stride = getattr(p, "partition_stride", 1)
            if gated_fc1 and ".mlp.linear_fc1." in name:
                stride = 2  # [gate; up]: each rank holds its slice of both halves
            index = _tp_slice(full, dim, stride, tp, tp_rank)
        else:
            index = full
        if tuple(index.shape) != tuple(p.shape):
            raise ValueError(f"{name}: mapped shape {tuple(index.shape)} != local shape {tuple(p.shape)}")
        replicated_identical = not getattr(p, "tensor_model_parallel", False) and not getattr(
            p, "sequence_parallel", False)
        out.append(LocalParam(name, p, index, pushes_grad=not (replicated_identical and tp_rank != 0)))
    return out


def _tp_slice(full: torch.Tensor, dim: int, stride: int, tp: int, tp_rank: int) -> torch.Tensor:
    size = full.shape[dim]
    if size % (tp * stride):
        raise ValueError(f"dimension {size} does not split into tp*stride = {tp}*{stride} chunks")
    chunks = torch.chunk(full, tp * stride, dim=dim)
    return torch.cat([chunks[tp_rank + j * tp] for j in range(stride)], dim=dim)
