#!/usr/bin/env bash
# GPU smoke run on a single-GPU machine without internet (see scripts/gpu_smoke.py for what runs).
# Needs torch (CUDA) and transformers there; installs the wheels prepared by
# scripts/gpu_smoke_wheels.sh from .whl/ (no index), then writes ms/step, tokens/s, peak memory
# and MFU of every case to one JSON (default runs/gpu_smoke.json). ~10 minutes at most.
#
#   bash scripts/gpu_smoke.sh [--out FILE] [--only local_engine,openrlhf_actor_step] [--peak-tflops 989]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
WHEELS="${WHEELS:-$ROOT/.whl}"
cd "$ROOT"
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "[gpu_smoke] no CUDA device visible to $PY: nothing to run" >&2
  exit 2
fi
if [[ -d "$WHEELS" ]] && ! "$PY" -c "import deepspeed, openrlhf" 2>/dev/null; then
  echo "[gpu_smoke] installing the carried wheels from $WHEELS (no index)"
  # DeepSpeed from source without prebuilt ops (they JIT-build on first use against this torch)
  DS_BUILD_OPS=0 "$PY" -m pip install -q --no-index --find-links "$WHEELS" --no-deps --no-build-isolation \
    "$WHEELS"/deepspeed-*.tar.gz
  "$PY" -m pip install -q --no-index --find-links "$WHEELS" --no-deps "$WHEELS"/*.whl
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export TOKENIZERS_PARALLELISM=false
exec "$PY" "$ROOT/scripts/gpu_smoke.py" "$@"
