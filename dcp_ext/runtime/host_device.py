"""Host data onto the model's device without making the host wait, and what stays on the host.

Why it exists: on a GPU a host-to-device copy from pageable memory, or a blocking one,
makes the host wait for everything queued on the device, and so does every read of a
device value. The runtime and the static path move their micro-batches through here:
pinned staging and non-blocking copies on CUDA (plain copies elsewhere). Document lengths
stay on the host where the layers read them there: our document attention and
megatron-core's unfused THD RoPE call `.tolist()` on `cu_seqlens` in every layer, one host
round trip each if they lived on the device; transformer-engine's kernels take them on
the device.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

CU_SEQLENS = ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded")


def to_device(t: torch.Tensor, device) -> torch.Tensor:
    """`t` on `device`; on CUDA from pinned memory, non-blocking (the host does not wait)."""
    device = torch.device(device)
    if device.type != "cuda" or t.device.type == "cuda":
        return t.to(device)
    if not t.is_pinned():
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


def values_on_device(values: Sequence[float], device, dtype=torch.float64) -> torch.Tensor:
    """A 1-D tensor of host numbers on `device`, without a host wait on CUDA."""
    return to_device(torch.tensor(list(values), dtype=dtype), device)


def reads_lengths_on_host(model: torch.nn.Module) -> bool:
    """Whether the model's layers read `cu_seqlens` on the host (the local layer spec with
    our document attention) rather than on the device (transformer-engine)."""
    from dcp_ext.runtime.stages.attention import DocumentCausalAttention

    return any(isinstance(m, DocumentCausalAttention) for m in model.modules())


def place_packed_seq_params(params, device, lengths_on_host: bool):
    """PackedSeqParams with its cu_seqlens where the layers read them (see the module's note)."""
    if params is None or lengths_on_host:
        return params
    moved = {name: to_device(getattr(params, name), device) for name in CU_SEQLENS
             if getattr(params, name, None) is not None}
    return dataclasses.replace(params, **moved)
