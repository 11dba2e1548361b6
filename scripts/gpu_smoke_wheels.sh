#!/usr/bin/env bash
# Prepare, on a machine with the package index, what scripts/gpu_smoke.sh installs on a GPU
# machine without internet (torch and transformers are there; vLLM, Ray, DeepSpeed and
# megatron-core are not; at most 64 MiB can be carried). Writes .whl/ (git-ignored):
# DeepSpeed's source archive (it builds on the GPU machine with DS_BUILD_OPS=0, its ops JIT-built
# there), openrlhf 0.11.2 without dependencies, and their small pure-Python dependencies.
# Ray (~74 MB) does not fit: the smoke run uses OpenRLHF's actor without Ray.
#
#   bash scripts/gpu_smoke_wheels.sh [OUT_DIR]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${1:-$ROOT/.whl}"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
LIMIT_MIB="${LIMIT_MIB:-64}"
GPU_PYTHON_VERSION="${GPU_PYTHON_VERSION:-3.11}"  # the GPU machine's Python (binary wheels must match)
mkdir -p "$OUT"
# pure-Python or manylinux wheels, no dependency resolution (the GPU machine has torch/transformers)
"$PY" -m pip download -q --no-deps -d "$OUT" --no-binary deepspeed "deepspeed==0.19.6"
"$PY" -m pip download -q --no-deps -d "$OUT" --python-version "$GPU_PYTHON_VERSION" --only-binary=:all: \
  "openrlhf==0.11.2" hjson py-cpuinfo msgpack ninja \
  "nvidia-ml-py" einops jsonlines loralib optree pylatexenc math-verify "latex2sympy2_extended" \
  "antlr4-python3-runtime==4.13.2" torchmetrics lightning-utilities peft
size_kib="$(du -sk "$OUT" | cut -f1)"
echo "[gpu_smoke_wheels] $(find "$OUT" -type f | wc -l) files, $((size_kib / 1024)) MiB in $OUT"
if (( size_kib > LIMIT_MIB * 1024 )); then
  echo "[gpu_smoke_wheels] over the ${LIMIT_MIB} MiB that can be carried" >&2
  exit 1
fi
