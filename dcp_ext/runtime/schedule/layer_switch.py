"""ParaDySe's layer-wise strategy switching inside one pipeline stage.

Why it exists: a plan may run each layer of a micro-batch under its own (tp, cp), a
re-factoring of the replica's tp*cp ranks of the stage (plan contract v2,
`layer_strategies`). The stage's own model (the replica's "home" strategy) keeps the
embedding, the final norm, the output layer and the pipeline boundaries; a layer whose
strategy differs runs the same canonical layer built under that strategy's groups (its
weights pulled in that shape). Between two layers of different strategies the hidden
states are re-laid with one all-to-all over the stage's ranks: every strategy holds, on
each rank, the CP load-balanced chunks of its CP rank (`context_parallel`), cut into
contiguous TP pieces with sequence parallelism, or replicated over TP without it.

The backward of a re-layout is the re-layout the other way: a token held by several TP
ranks (no SP) is one logical value, so its gradient goes to every holder, and a token
received by several holders has the same gradient on each, taken from one of them.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist

from dcp_ext.runtime.host_device import to_device

from dcp_ext.runtime.schedule.context_parallel import cp_token_indices

Strategy = tuple[int, int]  # (tp, cp)


def factorizations(n: int, heads: int, groups: int) -> list[Strategy]:
    """Every (tp, cp) with tp*cp == n that the attention heads allow."""
    return [(a, n // a) for a in range(1, n + 1) if n % a == 0 and heads % a == 0 and groups % a == 0]


def positions(padded_lengths: Sequence[int], strategy: Strategy, sequence_parallel: bool, index: int) -> torch.Tensor:
    """Token indices (into the packed micro-batch) the stage's `index`-th rank holds under
    `strategy`, in its local order (index = tp_rank + tp * cp_rank, Megatron's order)."""
    tp, cp = strategy
    t, c = index % tp, index // tp
    pos = cp_token_indices(padded_lengths, cp, c)
    if sequence_parallel and tp > 1:
        n = pos.numel() // tp
        pos = pos[t * n : (t + 1) * n]
    return pos


@dataclass
class Route:
    """One rank's side of one re-layout: what it sends to / receives from each group rank."""
    send_index: torch.Tensor  # local rows of the input, grouped by destination (group order)
    send_counts: list[int]
    recv_index: torch.Tensor  # local rows of the output, grouped by source (group order)
    recv_counts: list[int]
    out_rows: int


def build_route(held_from: list[torch.Tensor], held_to: list[torch.Tensor], me: int, order: list[int]) -> Route:
    """held_*[i]: tokens stage rank i holds before / after; `order[g]`: the stage index of
    group rank g. A token a destination already holds comes from itself; otherwise from its
    first holder."""
    total = 1 + max(int(p.max()) for p in held_from + held_to if p.numel())
    n = len(held_from)
    local = torch.full((n, total), -1, dtype=torch.int64)
    for i, p in enumerate(held_from):
        local[i, p] = torch.arange(p.numel())
    held = local >= 0
    first_holder = torch.where(held.any(0), held.to(torch.int8).argmax(0), torch.full((total,), -1))
    sources = []
    for d in range(n):
        need = held_to[d]
        src = torch.where(local[d, need] >= 0, torch.full_like(need, d), first_holder[need])
        if (src < 0).any():
            raise ValueError("re-layout: a token is held by no rank of the stage")
        sources.append(src)
    send_index, send_counts = [], []
    for d in order:
        pick = held_to[d][sources[d] == me]
        send_index.append(local[me, pick])
        send_counts.append(pick.numel())
    recv_index, recv_counts = [], []
    for s in order:
        rows = torch.nonzero(sources[me] == s).flatten()
        recv_index.append(rows)
        recv_counts.append(rows.numel())
    return Route(torch.cat(send_index), send_counts, torch.cat(recv_index), recv_counts, held_to[me].numel())


def _apply(route: Route, x: torch.Tensor, group) -> torch.Tensor:
    rows = x.reshape(x.shape[0], -1)
    width = rows.shape[1]
    if route.send_index.device != x.device:  # once per route: the indices live on the model's device
        route.send_index, route.recv_index = to_device(route.send_index, x.device), to_device(route.recv_index,
                                                                                              x.device)
    send = rows[route.send_index].contiguous()
    recv = torch.empty(sum(route.recv_counts), width, dtype=x.dtype, device=x.device)
    dist.all_to_all_single(recv, send, route.recv_counts, route.send_counts, group=group)
    out = torch.empty(route.out_rows, width, dtype=x.dtype, device=x.device)
    out[route.recv_index] = recv
    return out.view(route.out_rows, *x.shape[1:])


class _Relayout(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, forward_route, backward_route, group):
        ctx.backward_route, ctx.group = backward_route, group
        return _apply(forward_route, x, group)

    @staticmethod
    def backward(ctx, grad):
        return _apply(ctx.backward_route, grad.contiguous(), ctx.group), None, None, None


class StageRelayout:
    """Re-layouts between the strategies of one stage, for one packed micro-batch shape."""

    def __init__(self, padded_lengths: Sequence[int], sequence_parallel: bool, me: int, group_order: list[int],
                 group, n: int):
        self.padded = list(padded_lengths)
        self.sp = sequence_parallel
        self.me, self.order, self.group, self.n = me, group_order, group, n
        self._held: dict[Strategy, list[torch.Tensor]] = {}
        self._routes: dict[tuple[Strategy, Strategy], Route] = {}

    def held(self, s: Strategy) -> list[torch.Tensor]:
        if s not in self._held:
            self._held[s] = [positions(self.padded, s, self.sp, i) for i in range(self.n)]
        return self._held[s]

    def route(self, a: Strategy, b: Strategy) -> Route:
        if (a, b) not in self._routes:
            self._routes[(a, b)] = build_route(self.held(a), self.held(b), self.me, self.order)
        return self._routes[(a, b)]

    def __call__(self, x: torch.Tensor, a: Strategy, b: Strategy) -> torch.Tensor:
        """Hidden states [tokens, 1, h] held as `a` -> held as `b` (differentiable)."""
        if a == b:
            return x
        return _Relayout.apply(x, self.route(a, b), self.route(b, a), self.group)


class _SwitchedLayer(torch.nn.Module):
    """Stands in for layer k of the home block during one forward: re-lays the input into
    the layer's strategy, runs that strategy's layer (checkpointed when recomputed), and
    hands the last layer's output back in the home strategy."""

    def __init__(self, switch: "LayerSwitch", k: int):
        super().__init__()
        self.switch, self.k = switch, k
        self.layer_number = switch.home_layers[k].layer_number

    def forward(self, hidden_states, **kwargs):
        sw = self.switch
        s = sw.strategies[self.k]
        hidden_states = sw.relayout(hidden_states, sw.current, s)
        sw.current = s
        layer = sw.layer_for(self.k, s)
        if self.k < sw.recompute:
            run = lambda h: layer(hidden_states=h, **kwargs)[0]
            out = torch.utils.checkpoint.checkpoint(run, hidden_states, use_reentrant=False)
            context = None
        else:
            out, context = layer(hidden_states=hidden_states, **kwargs)
        if self.k == len(sw.strategies) - 1:
            out = sw.relayout(out, s, sw.home)
            sw.current = sw.home
        return out, context


class LayerSwitch:
    """One micro-batch's per-layer strategies on one stage, installed for its forward."""

    def __init__(self, home: Strategy, home_layers, alt_layers: dict, strategies: Sequence[Strategy],
                 relayout: StageRelayout, recompute: int):
        self.home, self.home_layers, self.alt_layers = home, home_layers, alt_layers
        self.strategies, self.relayout, self.recompute = list(strategies), relayout, recompute
        self.current = home

    def layer_for(self, k: int, s: Strategy):
        return self.home_layers[k] if s == self.home else self.alt_layers[s][k]

    @contextmanager
    def installed(self, decoder):
        """The home block runs the switched layers for one forward (megatron-core's own
        recompute is off for it: the switched layers checkpoint themselves)."""
        saved = decoder.layers
        decoder.layers = torch.nn.ModuleList([_SwitchedLayer(self, k) for k in range(len(saved))])
        self.current = self.home
        try:
            yield
        finally:
            decoder.layers = saved


class SwitchContext:
    """What a stage needs to switch its layers: the home strategy and layers, every
    alternative's layers, and the stage's group of tp*cp ranks for the re-layouts."""

    def __init__(self, home: Strategy, home_layers, alt_layers: dict, group, me: int, order: list[int], n: int,
                 sequence_parallel: bool):
        self.home, self.home_layers, self.alt_layers = home, home_layers, alt_layers
        self.group, self.me, self.order, self.n, self.sp = group, me, order, n, sequence_parallel

    @classmethod
    def for_stage(cls, rep, home_layers, alternatives: dict, registry, rank: int,
                  sequence_parallel: bool) -> "SwitchContext":
        """rep: the stage's replica type; home_layers: its decoder's layers; alternatives:
        strategy -> that strategy's decoder-only stage (stages.alternatives.AltStage)."""
        p = rep.coords(rank)[2]
        ranks = rep.tp_cp_ranks(p)  # stage index order (tp fastest)
        group_ranks = sorted(ranks)
        order = [ranks.index(g) for g in group_ranks]
        return cls((rep.tp, rep.cp), home_layers, {s: alt.model.decoder.layers for s, alt in alternatives.items()},
                   registry.group(ranks), ranks.index(rank), order, len(ranks), sequence_parallel)

    def for_micro_batch(self, mb, recompute: int) -> LayerSwitch:
        if getattr(mb, "relayout", None) is None:
            cu = mb.packed_seq_params.cu_seqlens_q_padded
            if cu is None:
                cu = mb.packed_seq_params.cu_seqlens_q
            mb.relayout = StageRelayout(torch.diff(cu).tolist(), self.sp, self.me, self.order, self.group, self.n)
        return LayerSwitch(self.home, self.home_layers, self.alt_layers, mb.strategies, mb.relayout, recompute)
