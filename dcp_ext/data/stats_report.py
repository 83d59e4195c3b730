"""`tools/dataset_stats.py`: length histogram (a table; a PNG where --png says) and padding overhead of a dataset.

Why a module: the tool stays a thin entry point and this stays testable. Lengths come
from the `.idx` files only (the `.bin` is not read), or from a text file of lengths (one
integer a line, like shared/data/lengths), or from the demo corpus (`--demo`).
"""
from __future__ import annotations

import argparse
import json
import os

import numpy as np

from dcp_ext.cli.boundary import CLIError, Parser, check_output, run_tool, writing
from dcp_ext.data.errors import DataError
from dcp_ext.data.lengths import read_lengths
from dcp_ext.data.stats import length_histogram, padding_overhead

PROG = "dataset_stats.py"


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog=PROG, description="Length histogram and padding overhead of a dataset.")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--data-path", nargs="+", help="Megatron blend syntax: prefix, or w1 p1 w2 p2 ...")
    src.add_argument("--lengths-file", help="one token count a line")
    src.add_argument("--demo", action="store_true", help="the demo corpus (built if needed)")
    p.add_argument("--data-cache-path", default="cache", help="where --demo builds its corpus (said in a line)")
    p.add_argument("--seq-length", type=int, default=4096, help="Megatron's fixed sample length")
    p.add_argument("--max-seq-len", type=int, default=None,
                   help="truncation for the variable-length path (default: --seq-length)")
    p.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4], help="context-parallel sizes to report")
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2, 8], help="tensor-parallel sizes (sequence parallel)")
    p.add_argument("--png", default=None, help="draw the histogram into this PNG (default: no image)")
    p.add_argument("--json", default=None, help="also write the figures as JSON here")
    return p


def load_lengths(args) -> tuple[np.ndarray, str]:
    if args.lengths_file:
        # documents of 0 tokens are allowed here (an .idx can hold them); the report skips them
        arr = np.asarray(read_lengths(args.lengths_file, flag="--lengths-file", min_length=0), dtype=np.int64)
        return arr, args.lengths_file
    if args.demo:
        from dcp_ext.data.demo_corpus import ensure_demo_corpus

        prefixes = [ensure_demo_corpus(args.data_cache_path)]
        print(f"demo corpus: {os.path.abspath(prefixes[0])} (--data-cache-path {args.data_cache_path})")
    else:
        from dcp_ext.data.documents import parse_blend

        prefixes, _ = parse_blend(args.data_path)
    from dcp_ext.data.indexed import IndexedDocuments

    arrays = [np.asarray(IndexedDocuments(p).lengths, dtype=np.int64) for p in prefixes]
    arr = np.concatenate(arrays)
    if arr.size == 0 or arr.sum() == 0:
        raise DataError(f"dataset {' '.join(prefixes)} is empty")
    return arr, " ".join(prefixes)


def report(lengths: np.ndarray, name: str, seq_length: int, max_seq_len: int, cps, tps) -> tuple[str, dict]:
    lengths = lengths[lengths > 0]
    truncated = int((lengths > max_seq_len).sum())
    hist = length_histogram(np.minimum(lengths, max_seq_len))
    raw = length_histogram(lengths)
    out = [f"dataset: {name}",
           f"documents: {raw.num_documents}   tokens: {raw.num_tokens}   mean length: {raw.mean:.1f}   "
           f"p50/p90/p99/max: " + "/".join(f"{raw.percentiles[p]:.0f}" for p in (50, 90, 99, 100)),
           "", "length histogram (before truncation):",
           f"  {'length':>17} {'documents':>10} {'% docs':>7} {'% tokens':>8}"]
    for lo, hi, n, pd, pt in raw.rows():
        out.append(f"  {f'[{lo}, {hi})':>17} {n:>10} {pd:>6.1f}% {pt:>7.1f}%")
    if truncated:
        out.append(f"  {truncated} documents longer than {max_seq_len} are truncated to it")
    figures = {"histogram": raw.to_json(), "padding": []}
    base = padding_overhead(lengths, seq_length)
    out += ["", f"padding overhead at --seq-length {seq_length} (extra token slots per real token):",
            f"  Megatron, each document padded to seq-length     {100 * base['pad_to_seq_length']:8.1f}%",
            f"  Megatron, documents packed into seq-length        {100 * base['packed_best_fit']:8.1f}%"
            f"   ({base['packed_bins']} samples, best-fit decreasing)",
            f"  Megatron, concatenated (pretraining GPTDataset)   {0.0:8.1f}%"
            f"   but +{100 * base['concat_attention']:.0f}% causal attention work across documents"]
    for cp in cps:
        for tp in tps:
            f = padding_overhead(np.minimum(lengths, max_seq_len), seq_length=max(max_seq_len, 1), cp=cp, tp=tp)
            figures["padding"].append(f)
            out.append(f"  ours, THD per document, cp={cp} tp={tp} (pad to {f['pad_multiple']:>2})"
                       f"{'':>4}{100 * f['thd_ours']:8.2f}%")
    figures["megatron"] = base
    return "\n".join(out), figures


def plot(lengths: np.ndarray, path: str, name: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    h = length_histogram(lengths[lengths > 0])
    lo = h.edges[:-1]
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.bar(range(len(lo)), 100.0 * h.counts / max(h.num_documents, 1), width=0.4, align="edge", label="% documents")
    ax.bar([i + 0.4 for i in range(len(lo))], 100.0 * h.tokens / max(h.num_tokens, 1), width=0.4, align="edge",
           label="% tokens")
    ax.set_xticks([i + 0.4 for i in range(len(lo))])
    ax.set_xticklabels([f"{v:,}" for v in lo], rotation=60, fontsize=7)
    ax.set_xlabel("document length (tokens), bucket lower edge")
    ax.set_ylabel("%")
    ax.set_title(f"length histogram: {os.path.basename(name)[:60]}", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    return run_tool(lambda: _main(argv), prog=PROG, errors={DataError: 1})


def _main(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    if min(args.cp + args.tp) < 1 or args.seq_length < 1 or (args.max_seq_len is not None and args.max_seq_len < 1):
        raise CLIError("--cp, --tp, --seq-length and --max-seq-len must be >= 1")
    png = args.png
    if png:
        check_output("--png", png)  # before reading the dataset, not after
    if args.json:
        check_output("--json", args.json)
    lengths, name = load_lengths(args)
    max_seq_len = args.max_seq_len or args.seq_length
    text, figures = report(lengths, name, args.seq_length, max_seq_len, args.cp, args.tp)
    print(text)
    if not png:
        print("\nno histogram image (pass --png FILE for one)")
    else:
        try:
            with writing("--png", png, "the histogram image"):
                plot(lengths, png, name)
            print(f"\nhistogram image: {os.path.abspath(png)}")
        except ImportError:
            print("\nno histogram image: `pip install matplotlib` for one")
    if args.json:
        with writing("--json", args.json, "the figures"), open(args.json, "w") as f:
            json.dump(figures, f, indent=1)
    return 0
