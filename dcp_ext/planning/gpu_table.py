"""The GPU a `--dcp` job runs on, as the planner's `GPUKind`, from the device's name and memory.

Why it exists: the planner's cost model needs each device's memory and peak FLOP/s. The
memory is what torch reports for the device; the peak is not reported anywhere, so it
comes from this table of known kinds (dense bf16 tensor-core TFLOP/s as the vendors
publish them, without sparsity), or from `--dcp-device-tflops`. A GPU that is neither in
the table nor described by the flag is refused with one line naming the flag: planning it
as some other part (the CPU preset, 4 GiB and 40 GFLOP/s, was the old fallback) would pick
layouts for the wrong machine without a word. Pure: name and bytes in, GPUKind out.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, replace

from dcp_ext.planning.specs import GPU_KINDS, GiB, GPUKind


@dataclass(frozen=True)
class KnownGPU:
    pattern: str  # regex on the lower-cased device name (word boundaries: "h20" is not "h200")
    name: str
    tflops: float  # dense bf16 TFLOP/s per device
    memory_gb: float  # the usual size, used only when the device's own is not given
    hbm_bandwidth: float  # bytes/s
    intra_node_bw: float  # bytes/s per device per direction (collective bus bandwidth)
    inter_node_bw: float


NVLINK4, NVLINK5, NVLINK3, PCIE4, PCIE5 = 360e9, 720e9, 240e9, 20e9, 40e9
# Most specific first: the first pattern that matches names the kind.
KNOWN_GPUS: tuple[KnownGPU, ...] = (
    KnownGPU(r"\bgb200\b", "gb200", 2500, 186, 8.0e12, NVLINK5, 50e9),
    KnownGPU(r"\bb200\b", "b200", 2250, 180, 8.0e12, NVLINK5, 50e9),
    KnownGPU(r"\bb100\b", "b100", 1750, 180, 8.0e12, NVLINK5, 50e9),
    KnownGPU(r"\bh200\b", "h200", 989, 141, 4.8e12, NVLINK4, 40e9),
    KnownGPU(r"\bh100\b.*\bpcie\b", "h100-pcie", 756, 80, 2.0e12, PCIE5, 25e9),
    KnownGPU(r"\bh100\b.*\bnvl\b", "h100-nvl", 835, 94, 3.9e12, PCIE5, 25e9),
    KnownGPU(r"\bh100\b", "h100", 989, 80, 3.35e12, NVLINK4, 40e9),
    KnownGPU(r"\bh800\b", "h800", 989, 80, 3.35e12, 160e9, 40e9),
    KnownGPU(r"\bh20\b", "h20", 148, 96, 4.0e12, NVLINK4, 40e9),
    KnownGPU(r"\bgh200\b", "gh200", 989, 96, 4.0e12, NVLINK4, 40e9),
    KnownGPU(r"\ba800\b", "a800", 312, 80, 2.0e12, 160e9, 20e9),
    KnownGPU(r"\ba100\b", "a100", 312, 80, 2.0e12, NVLINK3, 20e9),
    KnownGPU(r"\bl40s\b", "l40s", 362, 48, 0.86e12, PCIE4, 10e9),
    KnownGPU(r"\bl40\b", "l40", 181, 48, 0.86e12, PCIE4, 10e9),
    KnownGPU(r"\bl20\b", "l20", 119.5, 48, 0.86e12, PCIE4, 10e9),
    KnownGPU(r"\bl4\b", "l4", 121, 24, 0.3e12, PCIE4, 10e9),
    KnownGPU(r"\ba10g\b", "a10g", 70, 24, 0.6e12, PCIE4, 10e9),
    KnownGPU(r"\ba10\b", "a10", 125, 24, 0.6e12, PCIE4, 10e9),
    KnownGPU(r"\ba40\b", "a40", 150, 48, 0.7e12, PCIE4, 10e9),
    KnownGPU(r"\ba30\b", "a30", 165, 24, 0.93e12, PCIE4, 10e9),
    KnownGPU(r"\brtx a6000\b", "rtx-a6000", 155, 48, 0.77e12, PCIE4, 10e9),
    KnownGPU(r"\brtx 6000 ada\b", "rtx-6000-ada", 364, 48, 0.96e12, PCIE4, 10e9),
    KnownGPU(r"\brtx 5090\b", "rtx-5090", 210, 32, 1.8e12, PCIE5, 10e9),
    KnownGPU(r"\brtx 4090\b", "rtx-4090", 165, 24, 1.0e12, PCIE4, 10e9),
    KnownGPU(r"\brtx 3090\b", "rtx-3090", 71, 24, 0.94e12, PCIE4, 10e9),
    KnownGPU(r"\bmi355x\b", "mi355x", 2500, 288, 8.0e12, 400e9, 50e9),
    KnownGPU(r"\bmi325x\b", "mi325x", 1307, 256, 6.0e12, 300e9, 50e9),
    KnownGPU(r"\bmi300x\b", "mi300x", 1307, 192, 5.3e12, 300e9, 50e9),
    KnownGPU(r"\bmi250x?\b", "mi250", 383, 128, 3.2e12, 200e9, 25e9),
)


class UnknownDevice(ValueError):
    """A GPU this table does not know and no flag describes; the message names the flag."""


def known_gpu(device_name: str) -> KnownGPU | None:
    text = " ".join(device_name.lower().replace("_", " ").split())
    for gpu in KNOWN_GPUS:
        if re.search(gpu.pattern, text):
            return gpu
    return None


def gpu_kind_for_device(device_name: str, total_memory_bytes: float | None, *, tflops: float | None = None,
                        memory_gb: float | None = None) -> GPUKind:
    """The GPUKind for a device named `device_name` (torch.cuda.get_device_name) with
    `total_memory_bytes` (torch.cuda.get_device_properties().total_memory).

    `tflops` / `memory_gb` (--dcp-device-tflops / --dcp-device-memory-gb) win over the table
    and the device. Raises UnknownDevice for a GPU without a known peak."""
    gpu = known_gpu(device_name)
    if gpu is None and tflops is None:
        raise UnknownDevice(
            f"GPU '{device_name}' is not in the planner's table of known kinds (dcp_ext/planning/gpu_table.py): give its "
            "dense bf16 peak with --dcp-device-tflops N (TFLOP/s per device; memory is read from the device, "
            "--dcp-device-memory-gb overrides it)")
    if memory_gb is not None:
        memory = float(memory_gb) * GiB
    elif total_memory_bytes:
        memory = float(total_memory_bytes)
    elif gpu is not None:
        memory = gpu.memory_gb * 1e9
    else:
        raise UnknownDevice(f"the memory of GPU '{device_name}' is unknown: give it with --dcp-device-memory-gb N")
    peak = float(tflops if tflops is not None else gpu.tflops) * 1e12
    base = GPU_KINDS.get(gpu.name) if gpu is not None else None
    if base is None:  # efficiencies and latencies of the closest preset: a Hopper-class part
        base = GPU_KINDS["h100"]
        if gpu is not None:
            base = replace(base, hbm_bandwidth=gpu.hbm_bandwidth, intra_node_bw=gpu.intra_node_bw,
                           inter_node_bw=gpu.inter_node_bw)
    name = gpu.name if gpu is not None else re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-") or "gpu"
    return replace(base, name=name, peak_flops=peak, memory_bytes=memory,
                   reserved_bytes=min(base.reserved_bytes, max(1 * GiB, 0.08 * memory)))
