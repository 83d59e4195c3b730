"""Which tokens a context-parallel rank holds: the load-balanced 2*cp chunk rule.

Each document (padded to a multiple of 2*cp) is cut into 2*cp equal chunks; CP rank r
holds chunks r and 2*cp-1-r, so causal attention work is balanced. This matches what
megatron-core's RoPE and transformer-engine's THD attention expect, and what
`dcp_ext.runtime.attention` reassembles.
"""
from __future__ import annotations

from typing import Sequence

import torch


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def cp_token_indices(padded_lengths: Sequence[int], cp_size: int, cp_rank: int) -> torch.Tensor:
    """Indices, into the concatenation of documents, of the tokens `cp_rank` holds."""
    if cp_size == 1:
        return torch.arange(sum(padded_lengths))
    pieces = []
    offset = 0
    for n in padded_lengths:
        if n % (2 * cp_size):
            raise ValueError(f"document length {n} is not a multiple of 2*cp = {2 * cp_size}")
        chunk = n // (2 * cp_size)
        first = offset + cp_rank * chunk
        second = offset + (2 * cp_size - 1 - cp_rank) * chunk
        pieces += [torch.arange(first, first + chunk), torch.arange(second, second + chunk)]
        offset += n
    return torch.cat(pieces)
