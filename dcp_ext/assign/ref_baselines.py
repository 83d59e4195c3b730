"""The baselines in pure Python (reference of the C++ ones), each a full plan.

Each packs sequences into micro-batches its own way, then places micro-batches on
replicas. L, the "seq-length" of the packed baselines, is the smallest replica capacity
min(max_seq_len, max_mb_tokens), as one Megatron --seq-length must fit every replica; a
sequence longer than L gets a micro-batch of its own. Round robin deals micro-batches in
order to the next replica (cyclically) that can hold them, as data parallelism deals
equal numbers of micro-batches to every rank.

  megatron   first fit in data order into bins of L tokens; round robin.
  bucketing  sequences sorted by length (ascending, stable), consecutive runs of at most
             L tokens (next fit); round robin.
  isf        OmniBal's iterative sampling-filtering: shuffle, next fit into bins of L,
             keep the bins filled to >= 95% of L, reshuffle and regroup the rest, 10
             rounds (the last keeps everything); round robin.
  hbp        HBP's hierarchy: each sequence goes to the level of the smallest replica
             capacity that holds it; per level, GreedyFill (open a pack with the longest
             remaining sequence, then repeatedly add the longest remaining one that fits)
             with the level's smallest max_mb_tokens as pack length; packs by decreasing
             cost go to the level's replica with the least load (LPT, ties: lower index).
"""
from __future__ import annotations

from bisect import bisect_left

from .model import mb_cost
from .rng import SplitMix64

ISF_FILL = 0.95
ISF_ROUNDS = 10
NAMES = ("megatron", "bucketing", "isf", "hbp")


def seq_length(params) -> int:
    return min(min(p[5], p[6]) for p in params)


def round_robin(lengths, params, bins) -> list[list[list[int]]]:
    R = len(params)
    out: list[list[list[int]]] = [[] for _ in range(R)]
    ptr = 0
    for b in bins:
        tokens = 0
        longest = 0
        for i in b:
            tokens += lengths[i]
            longest = max(longest, lengths[i])
        for k in range(R):
            r = (ptr + k) % R
            p = params[r]
            if longest <= min(p[5], p[6]) and tokens <= p[6]:
                out[r].append(sorted(b))
                ptr = r + 1
                break
    return out


def megatron(lengths, params, seed):
    L = seq_length(params)
    bins: list[list[int]] = []
    room: list[int] = []  # -1: a closed bin holding one over-long sequence
    for i, s in enumerate(lengths):
        if s > L:
            bins.append([i])
            room.append(-1)
            continue
        for k in range(len(bins)):
            if room[k] >= s:
                bins[k].append(i)
                room[k] -= s
                break
        else:
            bins.append([i])
            room.append(L - s)
    return round_robin(lengths, params, bins)


def next_fit(lengths, items, L):
    bins, cur, tok = [], [], 0
    for i in items:
        s = lengths[i]
        if s > L:
            if cur:
                bins.append(cur)
            bins.append([i])
            cur, tok = [], 0
            continue
        if cur and tok + s > L:
            bins.append(cur)
            cur, tok = [], 0
        cur.append(i)
        tok += s
    if cur:
        bins.append(cur)
    return bins


def bucketing(lengths, params, seed):
    L = seq_length(params)
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    return round_robin(lengths, params, next_fit(lengths, order, L))


def isf(lengths, params, seed):
    L = seq_length(params)
    rng = SplitMix64(seed)
    thresh = ISF_FILL * L
    pool = [i for i, s in enumerate(lengths) if s <= L]
    out: list[list[int]] = []
    for rnd in range(ISF_ROUNDS):
        if not pool:
            break
        rng.shuffle(pool)
        groups = next_fit(lengths, pool, L)
        if rnd == ISF_ROUNDS - 1:
            out.extend(groups)
            break
        rest: list[int] = []
        for g in groups:
            tok = 0
            for i in g:
                tok += lengths[i]
            if tok >= thresh:
                out.append(g)
            else:
                rest.extend(g)
        pool = rest
    out.extend([i] for i, s in enumerate(lengths) if s > L)
    return round_robin(lengths, params, out)


def greedy_fill(lengths, items, pack_len):
    """HBP GreedyFill over `items` (indices); returns packs."""
    items = sorted(items, key=lambda i: -lengths[i])
    keys = [-lengths[i] for i in items]
    n = len(items)
    nxt = list(range(n + 1))  # next not-taken position >= p (path-halving union-find)

    def find(p):
        while nxt[p] != p:
            nxt[p] = nxt[nxt[p]]
            p = nxt[p]
        return p

    packs = []
    p0 = find(0)
    while p0 < n:
        nxt[p0] = p0 + 1
        pack = [items[p0]]
        room = pack_len - lengths[items[p0]]
        while True:
            p = find(bisect_left(keys, -room))
            if p >= n:
                break
            nxt[p] = p + 1
            pack.append(items[p])
            room -= lengths[items[p]]
        packs.append(pack)
        p0 = find(0)
    return packs


def hbp(lengths, params, seed):
    R = len(params)
    caps = [min(p[5], p[6]) for p in params]
    levels = sorted(set(caps))
    out: list[list[list[int]]] = [[] for _ in range(R)]
    level_items: list[list[int]] = [[] for _ in levels]
    for i, s in enumerate(lengths):
        level_items[bisect_left(levels, s)].append(i)
    for li, level in enumerate(levels):
        reps = [r for r in range(R) if caps[r] == level]
        pack_len = min(params[r][6] for r in reps)
        packs = greedy_fill(lengths, level_items[li], pack_len)
        p0 = params[reps[0]]
        costs = [mb_cost(p0, lengths, pk) for pk in packs]
        order = sorted(range(len(packs)), key=lambda k: -costs[k])
        load = [0.0] * R
        for k in order:
            best_r, best = -1, 0.0
            for r in reps:
                val = load[r] + mb_cost(params[r], lengths, packs[k])
                if best_r < 0 or val < best:
                    best_r, best = r, val
            load[best_r] = best
            out[best_r].append(sorted(packs[k]))
    return out


def run(name: str, lengths, params, seed):
    fn = {"megatron": megatron, "bucketing": bucketing, "isf": isf, "hbp": hbp}[name]
    return fn(lengths, params, seed)
