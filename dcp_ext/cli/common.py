"""Arguments and data loading shared by dcp-plan and dcp-simulate.

Why it exists: both tools must read the same length file, cut the same global batches
(DESIGN.md's rule; sample ids are line numbers from 0) and build specs the same way, or
their outputs would not describe the same run.
"""
from __future__ import annotations

import argparse
import json
import os

import numpy as np

from dcp_ext.batching import global_batches
from dcp_ext.specs import ClusterSpec, ModelSpec


def add_common_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lengths", required=True, help="file with one document length (tokens) per line")
    p.add_argument("--model", required=True, help="preset (llama2-7b, llama2-13b, llama2-70b, gpt-1.3b, demo) or a ModelSpec JSON file")
    p.add_argument("--cluster", required=True, help="preset like h200x64, h100x8, a800x64, cpu-glooxN, or a ClusterSpec JSON file")
    p.add_argument("--global-batch-tokens", type=int, required=True)
    p.add_argument("--max-seq-len", type=int, required=True)
    p.add_argument("--iterations", type=int, default=20)
    p.add_argument("--start", type=int, default=0, help="first sample (line) of the run")
    p.add_argument("--profile", default=None, help="profile file from dcp-profile (default: analytic cost model)")
    p.add_argument("--memory-margin", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def load_lengths(path: str) -> np.ndarray:
    vals = []
    with open(path) as f:
        for n, line in enumerate(f):
            t = line.strip()
            if not t:
                raise SystemExit(f"{path}:{n + 1}: empty line (one length per line expected)")
            vals.append(int(t))
    if not vals:
        raise SystemExit(f"{path}: no lengths")
    return np.asarray(vals, dtype=np.int64)


def model_spec(name: str) -> ModelSpec:
    if os.path.exists(name) and name.endswith(".json"):
        with open(name) as f:
            return ModelSpec.from_json(json.load(f))
    return ModelSpec.from_preset(name)


def cluster_spec(name: str) -> ClusterSpec:
    if os.path.exists(name) and name.endswith(".json"):
        with open(name) as f:
            return ClusterSpec.from_json(json.load(f))
    return ClusterSpec.from_preset(name)


def batches(args, lengths: np.ndarray) -> list[list[int]]:
    out = global_batches(lengths.tolist(), args.global_batch_tokens, args.max_seq_len, count=args.iterations, start=args.start)
    if not out:
        raise SystemExit("no global batch: the length file is empty after --start")
    return out
