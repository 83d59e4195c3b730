"""JSONL -> Megatron `.bin/.idx`, with Megatron's `tools/preprocess_data.py` flags (+ SFT).

Why here and not in tools/: the logic is tested directly; `tools/preprocess_data.py`
only calls `main()`. Output, as Megatron: `{output_prefix}_{key}_document.bin/.idx` per
`--json-keys` key. With `--sft`, one dataset `{output_prefix}_sft_document` plus its loss
mask `{output_prefix}_sft_document_loss_mask` (see dcp_ext.data.sft). Every bad input
(missing file, bad JSON with its line number, unknown tokenizer, token id out of the
vocabulary, an output folder that cannot be written or a disk that fills) ends with one
line on stderr and exit status 1 (2 for a bad flag), with no partial dataset left behind.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys

import numpy as np

from dcp_ext.cli.boundary import CLIError, Parser, check_output, run_tool, writing
from dcp_ext.data.errors import DataError
from dcp_ext.data.progress import Progress
from dcp_ext.data.tokenizers import TOKENIZER_TYPES, build_tokenizer

PROG = "preprocess_data.py"


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog=PROG, description=__doc__.splitlines()[0])
    g = p.add_argument_group("input data")
    g.add_argument("--input", required=True, help="JSONL file, one JSON object a line")
    g.add_argument("--json-keys", nargs="+", default=["text"], help="keys to extract (default: text)")
    g.add_argument("--split-sentences", action="store_true", help="not supported (kept for flag compatibility)")
    g.add_argument("--keep-newlines", action="store_true", help="accepted; newlines are always kept")
    g = p.add_argument_group("tokenizer")
    g.add_argument("--tokenizer-type", required=True, help=", ".join(TOKENIZER_TYPES))
    g.add_argument("--vocab-file", default=None)
    g.add_argument("--merge-file", default=None)
    g.add_argument("--tokenizer-model", default=None)
    g.add_argument("--vocab-size", type=int, default=None, help="for NullTokenizer")
    g.add_argument("--append-eod", action="store_true", help="append EOD to each document")
    g.add_argument("--lang", default="english", help="accepted for compatibility; unused")
    g = p.add_argument_group("SFT (loss on the response only)")
    g.add_argument("--sft", action="store_true", help="prompt/response or chat messages; stores a loss mask")
    g.add_argument("--prompt-key", default="prompt")
    g.add_argument("--response-key", default="response")
    g.add_argument("--messages-key", default="messages")
    g = p.add_argument_group("output data")
    g.add_argument("--output-prefix", required=True)
    g = p.add_argument_group("runtime")
    g.add_argument("--workers", type=int, default=1)
    g.add_argument("--partitions", type=int, default=1,
                   help="split the input into N parts by lines, preprocess them in parallel (--workers shared "
                        "among them) and merge: the output is the same as one part's, byte for byte")
    g.add_argument("--keep-sequential-samples", action="store_true",
                   help="accepted: the parts of --partitions are always consecutive lines, merged in order")
    g.add_argument("--log-interval", type=int, default=1000, help="accepted; progress is time-based")
    g.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    return p


# ---- worker side (also used in-process with --workers 1) ------------------------------------

_STATE: dict = {}


def _init_worker(tok_kwargs: dict, opts: dict) -> None:
    _STATE["tok"] = build_tokenizer(**tok_kwargs)
    _STATE["opts"] = opts


def _start_pool(workers: int, tok_kwargs: dict, opts: dict):
    """The --workers processes, started with Ctrl-C ignored: it reaches the whole process
    group, and the driver alone answers it (one line, the pool terminated). A worker that
    took it would die mid-task and leave the pool waiting for its result forever."""
    import signal
    import threading

    context = multiprocessing.get_context("fork" if hasattr(os, "fork") else "spawn")
    if threading.current_thread() is not threading.main_thread():  # signal dispositions: main thread only
        return context.Pool(workers, initializer=_init_worker, initargs=(tok_kwargs, opts))
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # inherited by the workers from their start
    try:
        return context.Pool(workers, initializer=_init_worker, initargs=(tok_kwargs, opts))
    finally:
        signal.signal(signal.SIGINT, previous)


def _encode(item: tuple[int, bytes]):
    """(line number, raw line) -> (line number, {key: (tokens, mask|None)} or error text)."""
    lineno, raw = item
    tok, o = _STATE["tok"], _STATE["opts"]
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return lineno, f"not UTF-8 ({e.reason} at byte {e.start})"
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        return lineno, f"bad JSON ({e.msg}: column {e.colno})"
    try:
        if o["sft"]:
            from dcp_ext.data.sft import SFTFormatError, encode_example

            try:
                ids, mask = encode_example(obj, tok, o["prompt_key"], o["response_key"], o["messages_key"])
            except SFTFormatError as e:
                return lineno, str(e)
            out = {"sft": (ids, mask)}
        else:
            if not isinstance(obj, dict):
                return lineno, "expected a JSON object"
            out = {}
            for key in o["json_keys"]:
                if key not in obj:
                    return lineno, f"no key {key!r}"
                encoded = _encode_field(obj[key], key, tok, o["append_eod"])
                if isinstance(encoded, str):
                    return lineno, encoded
                out[key] = encoded
    except (ValueError, KeyError) as e:
        return lineno, f"cannot tokenize: {e}"
    result = {}
    for key, (ids, mask, *lengths) in out.items():
        arr = np.asarray(ids, dtype=np.int64)
        if arr.size and (arr.min() < 0 or arr.max() >= tok.vocab_size):
            return lineno, f"token id {int(arr.max())} outside the vocabulary of {tok.vocab_size}"
        result[key] = (arr, None if mask is None else np.asarray(mask, dtype=np.uint8), *lengths)
    return lineno, result


def _encode_field(value, key: str, tok, append_eod: bool):
    """One --json-keys field as upstream encodes it: a string is one sequence, a list of
    strings one sequence per non-empty item (the EOD after the last); an empty document stays,
    with no sequence. -> (ids, None, sequence lengths), or the error text."""
    if isinstance(value, str):
        parts = [value]
    elif isinstance(value, list) and all(isinstance(x, str) for x in value):
        parts = value
    else:
        return f"key {key!r} is not a string or a list of strings"
    ids, lengths = [], []
    for part in parts:
        part_ids = tok.tokenize(part)
        if part_ids:
            ids.extend(part_ids)
            lengths.append(len(part_ids))
    if ids and append_eod:
        ids.append(tok.eod)
        lengths[-1] += 1
    return ids, None, lengths


# ---- driver -----------------------------------------------------------------------------------

def _wind_down(pool, results, stop: list) -> None:
    """End the --workers pool, also after an error or a Ctrl-C: stop feeding it lines, take the
    few results in flight, then close and join. (Pool.terminate() while a worker is sending a
    large result can deadlock in CPython's pool; it is only the fallback for a second Ctrl-C.)"""
    stop.append(True)
    try:
        for _ in results or ():
            pass
        pool.close()
    except BaseException:
        pool.terminate()
        raise
    finally:
        pool.join()

def _lines(path: str, counter: list, stop: list, first: int = 1, end: int | None = None):
    """(line number, raw line) of the non-blank lines numbered first..end-1 (all by default);
    ends early once `stop` is non-empty."""
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            if stop or (end is not None and lineno >= end):
                return
            if lineno < first:
                continue
            counter[0] += len(raw)
            if raw.strip():
                yield lineno, raw


def run(args, part: tuple[int, int] | None = None) -> dict[str, str]:
    """Preprocess; return {key: output prefix}. Raises DataError. `part`: only the input's
    lines first..end-1, into `args.output_prefix` (one of --partitions; may be empty)."""
    if not os.path.isfile(args.input):
        raise DataError(f"--input not found: {args.input}")
    if args.split_sentences:
        raise CLIError("--split-sentences is not supported (GPT data needs whole documents)")
    if args.partitions < 1:
        raise CLIError(f"--partitions {args.partitions} must be >= 1")
    if args.workers < 1:
        raise CLIError(f"--workers {args.workers} must be >= 1")
    if args.sft and part is None:
        print(f"{PROG}: --sft writes one dataset, {args.output_prefix}_sft_document (.bin/.idx, with its loss mask "
              f"{args.output_prefix}_sft_document_loss_mask), from the prompt/response or chat messages of each line"
              + (f"; --json-keys {' '.join(args.json_keys)} is not used" if args.json_keys != ["text"] else ""),
              file=sys.stderr, flush=True)
    if args.partitions > 1 and part is None:
        from dcp_ext.data.preprocess_partitions import run_partitions

        return run_partitions(args, run, output_meta, report)
    tok_kwargs = dict(tokenizer_type=args.tokenizer_type, vocab_file=args.vocab_file,
                      merge_file=args.merge_file, tokenizer_model=args.tokenizer_model,
                      vocab_size=args.vocab_size)
    tokenizer = build_tokenizer(**tok_kwargs)  # fails here, once, on a bad tokenizer
    opts = dict(sft=args.sft, json_keys=list(args.json_keys), append_eod=args.append_eod,
                prompt_key=args.prompt_key, response_key=args.response_key, messages_key=args.messages_key)
    keys = ["sft"] if args.sft else list(args.json_keys)

    from dcp_ext.data.indexed import DocumentWriter

    prefixes = {k: f"{args.output_prefix}_{k}_document" for k in keys}
    out = ("--output-prefix", args.output_prefix, "the dataset")
    check_output(out[0], prefixes[keys[0]] + ".bin", make_folder=True)  # before tokenizing, not after
    writers = {}
    counter, stop = [0], []
    total = os.path.getsize(args.input)
    pool = results = None
    try:
        with writing(*out):
            for k in keys:
                writers[k] = DocumentWriter(prefixes[k], tokenizer.vocab_size, loss_mask=args.sft)
        if args.workers > 1:
            pool = _start_pool(args.workers, tok_kwargs, opts)
            results = pool.imap(_encode, _lines(args.input, counter, stop, *(part or ())), chunksize=32)
        else:
            _init_worker(tok_kwargs, opts)
            results = map(_encode, _lines(args.input, counter, stop, *(part or ())))
        with Progress(f"tokenizing {os.path.basename(args.input)}", total=total, unit="B",
                      enabled=not (args.no_progress or part)) as bar:
            for lineno, res in results:
                if isinstance(res, str):
                    raise DataError(f"line {lineno} of {args.input}: {res}")
                with writing(*out):  # a disk that fills: the flag and the prefix, not a traceback
                    for k, (ids, mask, *lengths) in res.items():
                        writers[k].add(ids, mask, *lengths)
                bar.n = counter[0]
                bar.update(0, extra=f"{writers[keys[0]].num_documents} docs")
        if all(w.num_tokens == 0 for w in writers.values()) and not part:
            raise DataError(f"{args.input} has no non-empty documents")
        meta = output_meta(args, tokenizer)
        with writing(*out):
            for k, w in writers.items():
                w.finalize(dict(meta, json_key=k))
    except BaseException:
        for w in writers.values():
            w.abort()
        raise
    finally:
        if pool is not None:
            _wind_down(pool, results, stop)
    if part is None:
        report(writers, prefixes)
    return prefixes


def report(writers: dict, prefixes: dict) -> None:
    for k, w in writers.items():
        print(f"{PROG}: wrote {w.num_documents} documents, {w.num_tokens} tokens to {prefixes[k]}.bin/.idx",
              file=sys.stderr)
    sft = "sft" in prefixes
    print(f"{PROG}: train on it with --data-path {' '.join(prefixes.values())}"
          + (" (the loss mask beside it is read too: only the responses are trained)" if sft else ""),
          file=sys.stderr)


def output_meta(args, tokenizer) -> dict:
    """What every output's .meta.json records besides the counts."""
    return {"tokenizer": dict(tokenizer.unique_identifiers), "eod": tokenizer.eod,
            "source": os.path.abspath(args.input), "append_eod": bool(args.append_eod or args.sft)}


def main(argv: list[str] | None = None) -> int:
    return run_tool(lambda: _main(argv), prog=PROG, errors={DataError: 1},
                    interrupted="interrupted (Ctrl-C); no output written")


def _main(argv: list[str] | None) -> int:
    run(build_parser().parse_args(argv))
    return 0
