"""Cluster and model specifications: the numbers the cost model and planners reason with.

Why a module of its own: the planner, the simulator, the CLIs and the runtime all need
the same description of "what hardware" and "what model", built from presets, from
Megatron's arguments, or from a plan file's header. Pure data, no torch.

Units: bytes, seconds, FLOP/s. Bandwidths are per GPU and per direction, as achieved by
collectives (bus bandwidth), not the marketing peak.
"""
from __future__ import annotations

import difflib
import json
import math
import re
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from typing import Any

from dcp_ext.planning.layout import bucket_numel_for  # noqa: F401  (re-exported: the cost model reads it here)

GiB = 1024**3


class SpecError(ValueError):
    """A model or cluster description (a JSON object) that cannot be used; names the field."""


@dataclass(frozen=True)
class GPUKind:
    name: str
    peak_flops: float  # dense bf16 (fp32 for the CPU) FLOP/s per device
    memory_bytes: float
    hbm_bandwidth: float  # bytes/s, for memory-bound work (kept for reporting)
    intra_node_bw: float  # bytes/s per device per direction, collective bus bandwidth
    inter_node_bw: float  # bytes/s per device per direction over the network
    intra_node_latency: float  # seconds per collective step
    inter_node_latency: float
    matmul_efficiency: float  # achieved fraction of peak on large GEMMs
    attention_efficiency: float  # achieved fraction of peak in (flash) attention
    half_efficiency_tokens: float  # rows per GEMM at which throughput is half its maximum
    micro_batch_overhead_s: float  # fixed cost of one micro-batch (launches, scheduling)
    reserved_bytes: float  # runtime context, communicator buffers, fragmentation
    default_gpus_per_node: int = 8
    # per document, per layer, per forward pass, on every device of the replica (kernel
    # or interpreter work that does not shrink with tp or cp: negligible with varlen
    # flash attention, real for a per-document attention loop on the CPU)
    attention_doc_overhead_s: float = 0.0
    # device bytes one communicator (a process group of two or more ranks) holds for its
    # transport buffers: NCCL allocates them per channel and peer connection (ring: two
    # peers; 4 MiB SIMPLE + ~4.6 MiB LL128 + 0.25 MiB LL FIFOs each; ~16 channels on
    # NVLink parts), ~0.25 GiB. 0 where groups hold no device memory (gloo).
    communicator_bytes: float = 0.0
    # communicators `reserved_bytes` already has room for: a static Megatron job's own
    # (tp, cp, pp, dp, tp-cp, dp-cp, model parallel, embedding); the pool's others are charged
    reserved_communicators: int = 8


COMMUNICATOR_BYTES = 0.25 * GiB  # see GPUKind.communicator_bytes

# Published peak numbers; efficiencies are typical Megatron figures on these parts.
GPU_KINDS: dict[str, GPUKind] = {
    "h200": GPUKind("h200", 989e12, 141e9, 4.8e12, 360e9, 40e9, 5e-6, 1.5e-5, 0.72, 0.50, 256, 1.5e-3, 6 * GiB, communicator_bytes=COMMUNICATOR_BYTES),
    "h100": GPUKind("h100", 989e12, 80e9, 3.35e12, 360e9, 40e9, 5e-6, 1.5e-5, 0.72, 0.50, 256, 1.5e-3, 5 * GiB, communicator_bytes=COMMUNICATOR_BYTES),
    "a800": GPUKind("a800", 312e12, 80e9, 2.0e12, 160e9, 20e9, 6e-6, 2e-5, 0.75, 0.60, 192, 1.5e-3, 5 * GiB, communicator_bytes=COMMUNICATOR_BYTES),
    "a100": GPUKind("a100", 312e12, 80e9, 2.0e12, 240e9, 20e9, 6e-6, 2e-5, 0.75, 0.60, 192, 1.5e-3, 5 * GiB, communicator_bytes=COMMUNICATOR_BYTES),
    # One gloo rank on a shared CPU core: fp32 GEMMs at tens of GFLOP/s, loopback TCP
    # collectives at ~1 GB/s with ~0.5 ms per step (Python and gloo overhead). A profile file replaces these.
    "cpu-gloo": GPUKind("cpu-gloo", 40e9, 4 * GiB, 10e9, 1.0e9, 1.0e9, 5e-4, 5e-4, 0.5, 0.3, 32, 5e-3, 0.5 * GiB, 8, 2e-4),
}


@dataclass(frozen=True)
class ClusterSpec:
    name: str
    num_gpus: int
    gpus_per_node: int
    gpu: GPUKind

    # convenient views
    @property
    def gpu_kind(self) -> str:
        return self.gpu.name

    @property
    def peak_flops(self) -> float:
        return self.gpu.peak_flops

    @property
    def memory_bytes(self) -> float:
        return self.gpu.memory_bytes

    def link(self, span: int) -> tuple[float, float]:
        """(bandwidth, latency) of a collective over `span` consecutive ranks."""
        if span <= self.gpus_per_node:
            return self.gpu.intra_node_bw, self.gpu.intra_node_latency
        return self.gpu.inter_node_bw, self.gpu.inter_node_latency

    @classmethod
    def from_preset(cls, name: str) -> "ClusterSpec":
        """`h200x64`, `h100x8`, `a800x64`, `cpu-glooxN`, `cpu-gloo x4`, `cpu-gloo-x4`."""
        text = name.strip().lower()
        m = re.fullmatch(r"([a-z0-9]+(?:-gloo)?)\s*[-_ ]?\s*x\s*(\d+)", text)
        if not m:
            raise ValueError(f"cluster preset {name!r}: expected <kind>x<N>, kinds {sorted(GPU_KINDS)}")
        kind, n = m.group(1), int(m.group(2))
        if kind not in GPU_KINDS:
            raise ValueError(f"cluster preset {name!r}: unknown GPU kind {kind!r}, known {sorted(GPU_KINDS)}")
        if n < 1:
            raise ValueError(f"cluster preset {name!r}: needs at least one device")
        if kind == "cpu-gloo":
            return cls.cpu_gloo(n)
        gpu = GPU_KINDS[kind]
        return cls(name=f"{kind}x{n}", num_gpus=n, gpus_per_node=min(gpu.default_gpus_per_node, n), gpu=gpu)

    @classmethod
    def cpu_gloo(cls, world_size: int) -> "ClusterSpec":
        """This machine: `world_size` gloo ranks on the CPU, all on one "node"."""
        return cls(name=f"cpu-gloox{world_size}", num_gpus=world_size, gpus_per_node=world_size, gpu=GPU_KINDS["cpu-gloo"])

    def to_json(self) -> dict[str, Any]:
        d = {"name": self.name, "num_gpus": self.num_gpus, "gpus_per_node": self.gpus_per_node}
        d["gpu"] = asdict(self.gpu)
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "ClusterSpec":
        """A cluster from its JSON object (`to_json`), or a preset's `name` (with, optionally,
        its own num_gpus/gpus_per_node); SpecError names a missing, unknown or bad field."""
        _check_object(d, "ClusterSpec")
        if "gpu" not in d:
            _check_fields(d, ("name",), ("num_gpus", "gpus_per_node"), "")
            _check_str(d, "name", "")
            preset = cls.from_preset(d["name"])
            for key in ("num_gpus", "gpus_per_node"):
                if key in d:
                    _check_number(d, key, "", integer=True)
                    if d[key] != getattr(preset, key):
                        raise SpecError(f"{key} {d[key]} disagrees with preset {d['name']!r} "
                                        f"({getattr(preset, key)}); drop it, or give the whole cluster with its gpu")
            return preset
        _check_fields(d, ("name", "num_gpus", "gpus_per_node", "gpu"), (), "")
        _check_str(d, "name", "")
        for key in ("num_gpus", "gpus_per_node"):
            _check_number(d, key, "", integer=True)
        _check_object(d["gpu"], "GPUKind", "gpu")
        required, optional = _field_names(GPUKind)
        _check_fields(d["gpu"], required, optional, "gpu: ")
        _check_str(d["gpu"], "name", "gpu.")
        for key in required[1:] + optional:
            if key in d["gpu"]:
                _check_number(d["gpu"], key, "gpu.", integer=key in ("default_gpus_per_node", "reserved_communicators"),
                              zero_ok=key in _GPU_MAY_BE_ZERO)
        return cls(name=d["name"], num_gpus=d["num_gpus"], gpus_per_node=d["gpus_per_node"], gpu=GPUKind(**d["gpu"]))

    def with_(self, **changes: Any) -> "ClusterSpec":
        """A copy with cluster fields or GPU fields (e.g. memory_bytes=...) changed."""
        gpu_changes = {k: v for k, v in changes.items() if k in GPUKind.__dataclass_fields__}
        own = {k: v for k, v in changes.items() if k not in gpu_changes}
        return replace(self, gpu=replace(self.gpu, **gpu_changes), **own)


@dataclass(frozen=True)
class ModelSpec:
    name: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    ffn_hidden_size: int
    vocab_size: int
    seq_length: int
    swiglu: bool = True
    untie_embeddings_and_output_weights: bool = True
    param_bytes: int = 2  # bf16 parameters
    grad_bytes: int = 4  # main gradients: accumulated in fp32 over micro-batches (Megatron's main_grad)
    optimizer_bytes_per_param: int = 16  # fp32 master + fp32 gradient shard + Adam m, v (sharded over all ranks)
    activation_bytes: int = 2
    grad_reduce_bytes: int = 4  # gradients as pushed to the fixed sharding (2 with --grad-reduce-in-bf16)
    bucket_numel: int = 0  # elements per exchange bucket (0: the runtime's default rule)
    exchange_slots: int = 1  # exchange buffers in flight: 2 when pull/push overlap compute
    sequence_parallel: bool = True  # with tp > 1
    hidden_dropout: bool = False  # keeps 1-byte masks per dropout site when True
    cpu_attention: str = "math"  # local layers' document attention (--dcp-cpu-attention): "math" keeps probabilities
    # The kernels the layers run (megatron/training/adaptive/run_config.py sets them from what the engine builds);
    # None, in all three: by the cluster, as presets and earlier plan files are priced (cost_memory.act_terms).
    layer_kernels: str | None = None  # "te": transformer-engine layers; "local": megatron-core's local spec
    #                                   with our document attention and torch norms (CPU ranks, GPUs without TE)
    fused_swiglu: bool | None = None  # fused bias-SwiGLU (None: on GPU clusters)
    fused_rope: bool | None = None  # fused RoPE, TE's (None: with TE layers)
    gated_linear_unit: bool = field(default=False, repr=False)  # alias kept for Megatron args

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def kv_size(self) -> int:
        return self.num_query_groups * self.head_dim

    @property
    def layer_params(self) -> int:
        h, f = self.hidden_size, self.ffn_hidden_size
        attn = h * (h + 2 * self.kv_size) + h * h
        mlp = h * f * (3 if self.swiglu else 2)
        norms = 2 * h
        return attn + mlp + norms

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def num_params(self) -> int:
        out = self.embedding_params if self.untie_embeddings_and_output_weights else 0
        return self.num_layers * self.layer_params + self.embedding_params + out + self.hidden_size

    def stage_params(self, pp: int) -> int:
        """Parameters of the heaviest pipeline stage (layers split evenly; embedding on the
        first stage, output layer on the last; both on the one stage when pp == 1)."""
        layers = self.num_layers // pp * self.layer_params
        emb = self.embedding_params
        if pp == 1:
            return self.num_params
        # the last stage holds the output layer (a synced copy of the embedding when tied)
        return layers + emb + self.hidden_size

    def local_stage_params(self, tp: int, pp: int) -> float:
        """Parameters one rank holds for the heaviest stage of (tp, pp): matrices and the
        vocabulary split over tp, norms replicated."""
        h = self.hidden_size
        layer = (self.layer_params - 2 * h) / tp + 2 * h
        emb = self.embedding_params / tp
        layers = self.num_layers // pp * layer
        if pp == 1:
            return layers + emb * (2 if self.untie_embeddings_and_output_weights else 1) + h
        return layers + emb + h  # the last stage: output layer (or the tied copy) + final norm

    def valid_tp(self, tp: int) -> bool:
        return self.num_attention_heads % tp == 0 and self.num_query_groups % tp == 0

    def valid_pp(self, pp: int) -> bool:
        return self.num_layers % pp == 0

    @classmethod
    def from_preset(cls, name: str) -> "ModelSpec":
        key = name.strip().lower()
        if key not in MODEL_PRESETS:
            raise ValueError(f"model preset {name!r}: known {sorted(MODEL_PRESETS)}")
        return MODEL_PRESETS[key]

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("gated_linear_unit", None)
        if d["cpu_attention"] == "math":
            d.pop("cpu_attention")  # the default: JSON of earlier runs and pins stay as they were
        for key in _MODEL_KERNELS:
            if d[key] is None:
                d.pop(key)  # by the cluster: likewise
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "ModelSpec":
        """A model from its JSON object (`to_json`), or a preset's `name` alone; SpecError
        names a missing, unknown or bad field."""
        _check_object(d, "ModelSpec")
        if d and set(d) <= {"name"}:
            _check_str(d, "name", "")
            return cls.from_preset(d["name"])
        required, optional = _field_names(cls)
        _check_fields(d, required, optional, "")
        _check_str(d, "name", "")
        for key in required[1:] + optional:
            if key not in d:
                continue
            if key in _MODEL_FLAGS:
                if not isinstance(d[key], bool):
                    raise SpecError(f"{key} must be true or false (got {_show(d[key])})")
            elif key == "cpu_attention":
                if d[key] not in ("math", "flash"):
                    raise SpecError(f"cpu_attention must be \"math\" or \"flash\" (got {_show(d[key])})")
            elif key == "layer_kernels":
                if d[key] not in ("te", "local"):
                    raise SpecError(f"layer_kernels must be \"te\" or \"local\" (got {_show(d[key])}); "
                                    "leave it out to follow the cluster")
            elif key in _MODEL_KERNELS:
                if not isinstance(d[key], bool):
                    raise SpecError(f"{key} must be true or false (got {_show(d[key])}); leave it out to follow "
                                    "the cluster")
            else:
                _check_number(d, key, "", integer=True, zero_ok=key in _MODEL_MAY_BE_ZERO)
        if d["num_attention_heads"] % d["num_query_groups"]:
            raise SpecError(f"num_attention_heads {d['num_attention_heads']} is not a multiple of "
                            f"num_query_groups {d['num_query_groups']}")
        return cls(**d)

    def with_(self, **changes: Any) -> "ModelSpec":
        return replace(self, **changes)


# ---- validation of the JSON forms (from_json): one message a problem, naming the field
_GPU_MAY_BE_ZERO = ("intra_node_latency", "inter_node_latency", "half_efficiency_tokens", "micro_batch_overhead_s",
                    "reserved_bytes", "attention_doc_overhead_s", "communicator_bytes", "reserved_communicators")
_MODEL_FLAGS = ("swiglu", "untie_embeddings_and_output_weights", "sequence_parallel", "hidden_dropout",
                "gated_linear_unit")
_MODEL_KERNELS = ("layer_kernels", "fused_swiglu", "fused_rope")  # None (by the cluster): left out of the JSON
_MODEL_MAY_BE_ZERO = ("seq_length", "bucket_numel", "optimizer_bytes_per_param")


def _show(v: Any) -> str:
    return repr(v) if isinstance(v, str) else json.dumps(v)


def _field_names(kind) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(fields without a default, in order; fields with one) of a dataclass."""
    fs = fields(kind)
    required = tuple(f.name for f in fs if f.default is MISSING and f.default_factory is MISSING)
    return required, tuple(f.name for f in fs if f.name not in required)


def _check_object(d: Any, kind: str, where: str = "") -> None:
    if not isinstance(d, dict):
        raise SpecError(f"{where + ': ' if where else ''}expected a JSON object (a {kind}), got {type(d).__name__}")


def _check_fields(d: dict, required, optional, where: str) -> None:
    missing = [k for k in required if k not in d]
    if missing:
        raise SpecError(f"{where}missing field{'s' if len(missing) > 1 else ''} {', '.join(missing)}")
    known = tuple(required) + tuple(optional)
    unknown = [k for k in d if k not in known]
    if unknown:
        close = difflib.get_close_matches(str(unknown[0]), known, n=1)
        raise SpecError(f"{where}unknown field {unknown[0]!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))


def _check_str(d: dict, key: str, where: str) -> None:
    if not isinstance(d[key], str) or not d[key].strip():
        raise SpecError(f"{where}{key} must be a non-empty string (got {_show(d[key])})")


def _check_number(d: dict, key: str, where: str, integer: bool, zero_ok: bool = False) -> None:
    v = d[key]
    kind = "integer" if integer else "number"
    ok = not isinstance(v, bool) and isinstance(v, int if integer else (int, float))
    ok = ok and (isinstance(v, int) or math.isfinite(v)) and (v >= 0 if zero_ok else v > 0)
    if not ok:
        raise SpecError(f"{where}{key} must be a {'non-negative' if zero_ok else 'positive'} {kind} (got {_show(v)})")


MODEL_PRESETS: dict[str, ModelSpec] = {
    "llama2-7b": ModelSpec("llama2-7b", 32, 4096, 32, 32, 11008, 32000, 4096),
    "llama2-13b": ModelSpec("llama2-13b", 40, 5120, 40, 40, 13824, 32000, 4096),
    "llama2-70b": ModelSpec("llama2-70b", 80, 8192, 64, 8, 28672, 32000, 4096),
    # a large vocabulary (128256): its output layer and loss weigh ~2.4 layers, so pipelines
    # gain from uneven stages (dcp_ext.planning.planners.stage_split)
    "llama3-8b": ModelSpec("llama3-8b", 32, 4096, 32, 8, 14336, 128256, 8192),
    "gpt-1.3b": ModelSpec(
        "gpt-1.3b", 24, 2048, 16, 16, 8192, 50304, 2048, swiglu=False,
        untie_embeddings_and_output_weights=False, hidden_dropout=True,
    ),
    # The CPU demo (examples/cpu_demo.yaml): fp32 on gloo ranks, byte-level vocabulary
    # (megatron-core's ByteLevelTokenizer, 512), tied embeddings.
    "demo": ModelSpec(
        "demo", 4, 128, 8, 4, 352, 512, 2048, swiglu=True, untie_embeddings_and_output_weights=False,
        param_bytes=4, grad_bytes=4, optimizer_bytes_per_param=16, activation_bytes=4,
    ),
}
