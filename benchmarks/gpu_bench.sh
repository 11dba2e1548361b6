#!/usr/bin/env bash
# The GPU benchmark's one entry point (what it measures: benchmarks/gpu_bench.py's docstring and
# docs/benchmarks.md, "GPU figures").
#
#   bash benchmarks/gpu_bench.sh --kit                  # here, with PyPI: build + check the carry kit (.whl/)
#   bash benchmarks/gpu_bench.sh --dry-run              # here, on the CPU: every case at toy size, seeing only
#                                                    #   the GPU machine's packages + the kit (the rehearsal)
#   bash benchmarks/gpu_bench.sh [--results DIR] [--cases a,b] [--budget-s 540] [--peak-tflops 989]
#                                                    # on a GPU: installs .whl/ if needed, runs every case,
#                                                    #   writes DIR/gpu_bench.json + .md and docs/benchmarks.md
#   bash benchmarks/gpu_bench.sh --report A.json [B.json]   # write the docs section from results brought back
#
# On a lent GPU (device tool, no network, 10 minutes a command): carry [".whl"] and run
#   bash benchmarks/gpu_bench.sh --results "$OUT"        (timeout_s 590; ~9 minutes by estimate, not yet measured)
# then here: bash benchmarks/gpu_bench.sh --report <files_at>/gpu_bench.json
# Extra arguments go to benchmarks/gpu_bench.py (--help lists them).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
WHEELS="${GPU_BENCH_WHEELS:-$ROOT/.whl}"
SITE="${GPU_BENCH_SITE:-/tmp/gpu_bench_site}"
mode=gpu
case "${1:-}" in
  --kit) mode=kit; shift ;;
  --dry-run) mode=dry; shift ;;
  --report) mode=report ;;
esac
if [[ -n "${PYTHON:-}" ]]; then
  PY="$PYTHON"
elif [[ "$mode" != gpu && -x "$ROOT/.venv/bin/python" ]]; then
  PY="$ROOT/.venv/bin/python"
else
  PY=python3
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1

case "$mode" in
  kit)
    exec "$PY" benchmarks/gpu_kit.py build --out "$WHEELS" "$@" ;;
  report)
    exec "$PY" benchmarks/gpu_bench.py "$@" ;;
  dry)
    if ! "$PY" benchmarks/gpu_kit.py check --out "$WHEELS" >/dev/null 2>&1; then
      echo "[gpu_bench] note: the carry kit in $WHEELS is missing or not ready (bash benchmarks/gpu_bench.sh --kit);" \
           "the dry run itself uses this environment's copies of the kit's packages" >&2
    fi
    exec "$PY" benchmarks/gpu_kit.py device-view -- benchmarks/gpu_bench.py --dry-run "$@" ;;
esac

# ---- on the GPU
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "[gpu_bench] no CUDA device visible to $PY: run 'bash benchmarks/gpu_bench.sh --dry-run' on a CPU" >&2
  exit 2
fi
if ! "$PY" -c "import deepspeed, openrlhf, megatron.core, pydantic, torchdata, pylatexenc" >/dev/null 2>&1; then
  if ! compgen -G "$WHEELS/*.whl" >/dev/null; then
    echo "[gpu_bench] DeepSpeed / OpenRLHF / megatron-core are not installed and $WHEELS holds no kit:" \
         "build it where PyPI is reachable (bash benchmarks/gpu_bench.sh --kit) and carry .whl" >&2
    exit 2
  fi
  if ! cmp -s "$WHEELS/kit.json" "$SITE/.kit.json" 2>/dev/null; then
    echo "[gpu_bench] installing the carried kit from $WHEELS into $SITE (no index, no dependencies)"
    rm -rf "$SITE"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$WHEELS"/*.whl
    cp "$WHEELS/kit.json" "$SITE/.kit.json"
  fi
  export PYTHONPATH="$PYTHONPATH:$SITE"
fi
exec "$PY" benchmarks/gpu_bench.py "$@"
