#!/usr/bin/env bash
# Downloads, where the package index is reachable, the wheels the offline GPU machine (Python
# 3.12, x86-64, its own CUDA torch) may lack, into .gpu_check/wheels (ignored by git), for
# scripts/gpu_check.sh to install there with `pip install --no-index` (only those whose
# distribution that Python lacks; torch is never among them).
#   bash scripts/fetch_gpu_wheels.sh [FOLDER]     # default .gpu_check/wheels
# Then carry the folder to the GPU machine (it is ignored, so name it: carry [".gpu_check/wheels"]).
# Fails if the wheels come to more than 60 MiB (the whole carried tree may hold 64 MiB).
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${1:-.gpu_check/wheels}
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
# megatron-core (setup.py's pin) and every non-torch runtime dependency of this package and of
# megatron-core (setup.py install_requires; megatron-core: numpy, packaging); setuptools for
# `setup.py build_ext`; pytest and its two dependencies for the gpu-marked tests
PACKAGES=(megatron-core==0.16.1 numpy psutil pyyaml pybind11 filelock packaging setuptools pytest pluggy iniconfig)
mkdir -p "$DEST"
rm -f "$DEST"/*.whl  # one version of each: two stop pip
"$PY" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: --dest "$DEST" \
  --python-version 3.12 --implementation cp --abi cp312 \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 "${PACKAGES[@]}"
"$PY" - "$DEST" <<'EOF'
import os, sys
dest = sys.argv[1]
wheels = sorted(f for f in os.listdir(dest) if f.endswith(".whl"))
total = 0
for w in wheels:
    size = os.path.getsize(os.path.join(dest, w))
    total += size
    print(f"{size / 2**20:8.2f} MiB  {w}")
print(f"{total / 2**20:8.2f} MiB  in all, {len(wheels)} wheels in {dest}")
if total > 60 * 2**20:
    sys.exit(f"error: {total / 2**20:.1f} MiB is over the 60 MiB limit (the carried tree holds 64 MiB)")
print(f'carry this folder to the GPU machine: carry ["{dest}"]; then run bash scripts/gpu_check.sh there')
EOF
