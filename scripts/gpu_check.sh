#!/usr/bin/env bash
# The GPU check in one command: installs the carried wheels offline (scripts/fetch_gpu_wheels.sh
# fetched them), builds the C++ kernels, then runs the phases of scripts/gpu_check.py in at
# most 8 minutes on one H200, and writes one summary JSON ($OUT/gpu_check_summary.json; path printed):
#   (a) static path and --dcp, fp32 and bf16, GPU losses against the same runs on the CPU
#   (b) every tensor on the device, host syncs per training step by call site
#   (c) tokens/s of --dcp --dcp-planner static against megatron-core's static path (TP1, ~180M, bf16)
#   (d) measured peak memory against the cost model (scripts/gpu_memory_check.py)
#
#   bash scripts/gpu_check.sh              # on the GPU machine (OUT defaults to .gpu_check/out)
#   bash scripts/gpu_check.sh --dry-run    # the same phases on the CPU at tiny sizes (CI runs it)
# Other options: python scripts/gpu_check.py --help. Exit code 0 when no phase failed.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
export PYTHONUNBUFFERED=1
# megatron-core overlaps TP/DDP communication with compute assuming kernels reach the GPU in
# issue order: one hardware queue (tensor_parallel/layers.py, distributed/param_and_grad_buffer.py)
export CUDA_DEVICE_MAX_CONNECTIONS=1
exec "$PY" scripts/gpu_check.py "$@"
