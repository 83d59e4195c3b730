"""`preprocess_data.py --partitions N`: the input cut into N runs of consecutive lines,
each preprocessed in a process of its own, the results merged in order.

Why a module of its own: upstream's flag lets a large JSONL use more cores than one pool of
workers feeds; the driver here (start, collect, merge, clean up) is apart from the encoding
(`preprocess.run`, which each part runs on its line range). The merge appends each part's
.bin/.idx as megatron-core's builder merges partitions (`add_index`), so the output is byte
for byte that of `--partitions 1` (upstream's `--keep-sequential-samples` order; upstream
without it deals lines out round-robin, which reorders the documents). A bad line stops
the run with its line number in the whole file, and no partial dataset is left behind.
"""
from __future__ import annotations

import copy
import json
import math
import multiprocessing
import os
import shutil

from dcp_ext.data.errors import DataError


def line_ranges(path: str, parts: int) -> list[tuple[int, int]]:
    """[first, end) line numbers (1-based) of `parts` runs of consecutive lines, as even as
    upstream's --keep-sequential-samples cuts them (ceil(lines / parts) each; the last ones
    may be empty)."""
    with open(path, "rb") as f:
        total = sum(1 for _ in f)
    size = max(1, math.ceil(total / parts))
    return [(1 + k * size, 1 + min(total, (k + 1) * size)) for k in range(parts)]


def _one_part(run, args, part, queue, index: int) -> None:
    """In a part's process: preprocess its lines, report its outputs' metadata (or the error)."""
    try:
        prefixes = run(args, part)
        metas = {}
        for key, prefix in prefixes.items():
            with open(prefix + ".meta.json") as f:
                metas[key] = (prefix, json.load(f))
        queue.put((index, "ok", metas))
    except BaseException as e:  # reported to the driver, which raises it as one line
        queue.put((index, "error", f"{e}"))


def _collect(procs, queue) -> dict:
    results = {}
    try:
        for _ in procs:
            index, status, payload = queue.get()
            if status == "error":
                raise DataError(payload)
            results[index] = payload
    finally:
        for p in procs:
            if p.is_alive() and len(results) < len(procs):
                p.terminate()
            p.join()
    return results


def run_partitions(args, run, output_meta, report) -> dict[str, str]:
    """Preprocess `args.input` in `args.partitions` parts (`run(args, part)` each) and merge;
    `output_meta(args, tokenizer)` and `report(writers, prefixes)` are preprocess's own (passed
    in: preprocess imports this module)."""
    from dcp_ext.cli.boundary import writing
    from dcp_ext.data.indexed import DocumentWriter
    from dcp_ext.data.tokenizers import build_tokenizer

    tokenizer = build_tokenizer(args.tokenizer_type, args.vocab_file, args.merge_file, args.tokenizer_model,
                                args.vocab_size)
    scratch = f"{args.output_prefix}.partitions.tmp{os.getpid()}"
    with writing("--output-prefix", args.output_prefix, "the dataset"):
        os.makedirs(scratch)
    context = multiprocessing.get_context("fork" if hasattr(os, "fork") else "spawn")
    queue = context.Queue()
    procs, writers = [], {}
    try:
        for k, part in enumerate(line_ranges(args.input, args.partitions)):
            sub = copy.copy(args)
            sub.output_prefix, sub.no_progress = os.path.join(scratch, f"part{k}"), True
            sub.workers = max(1, args.workers // args.partitions)
            procs.append(context.Process(target=_one_part, args=(run, sub, part, queue, k)))
            procs[-1].start()
        results = _collect(procs, queue)
        keys = list(results[0])
        if all(results[k][key][1]["num_tokens"] == 0 for k in results for key in keys):
            raise DataError(f"{args.input} has no non-empty documents")
        prefixes = {key: f"{args.output_prefix}_{key}_document" for key in keys}
        with writing("--output-prefix", args.output_prefix, "the dataset"):
            for key in keys:
                writers[key] = DocumentWriter(prefixes[key], tokenizer.vocab_size, loss_mask=args.sft)
                for k in range(len(procs)):
                    writers[key].add_dataset(*results[k][key])
            meta = output_meta(args, tokenizer)
            for key, w in writers.items():
                w.finalize(dict(meta, json_key=key))
    except BaseException:
        for w in writers.values():
            w.abort()
        raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    report(writers, prefixes)
    return prefixes
