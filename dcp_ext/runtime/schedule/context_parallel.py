"""Which tokens a context-parallel rank holds: the load-balanced 2*cp chunk rule.

Each document (padded to a multiple of 2*cp) is cut into 2*cp equal chunks; CP rank r
holds chunks r and 2*cp-1-r, so causal attention work is balanced. This matches what
megatron-core's RoPE and transformer-engine's THD attention expect. The rule is written
once, in `cp_chunk_positions`; the micro-batch split (`cp_token_indices`) and the CPU
attention's reassembly of a document (`dcp_ext.runtime.stages.attention`) both use it.
"""
from __future__ import annotations

from typing import Sequence

import torch


def cp_chunk_positions(padded_len: int, cp_size: int, cp_rank: int, device=None) -> torch.Tensor:
    """Positions, within one document of `padded_len` tokens, that `cp_rank` holds (in its order)."""
    if cp_size == 1:
        return torch.arange(padded_len, device=device)
    if padded_len % (2 * cp_size):
        raise ValueError(f"document length {padded_len} is not a multiple of 2*cp = {2 * cp_size}")
    chunk = padded_len // (2 * cp_size)
    first = cp_rank * chunk
    second = (2 * cp_size - 1 - cp_rank) * chunk
    return torch.cat([torch.arange(first, first + chunk, device=device),
                      torch.arange(second, second + chunk, device=device)])


def cp_token_indices(padded_lengths: Sequence[int], cp_size: int, cp_rank: int) -> torch.Tensor:
    """Indices, into the concatenation of documents, of the tokens `cp_rank` holds."""
    if cp_size == 1:
        return torch.arange(sum(padded_lengths))
    pieces = []
    offset = 0
    for n in padded_lengths:
        pieces.append(offset + cp_chunk_positions(n, cp_size, cp_rank))
        offset += n
    return torch.cat(pieces)
