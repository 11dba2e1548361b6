#!/usr/bin/env bash
# The GPU benchmark's one entry point (what it measures: benchmarks/gpu_bench.py's docstring and
# docs/benchmarks.md, "GPU figures").
#
# On the GPU machine (no network needed; one job of ~10 minutes):
#   bash benchmarks/gpu_bench.sh --results DIR [--cases a,b,...] [--budget-s 540] [--peak-tflops 989]
#       pre-flight (GPU, driver, nvcc / g++ / ninja / Python.h, library versions), then the cases in order;
#       DIR (all that needs to come back) gets gpu_bench.json, gpu_bench.md and the full log gpu_bench.log,
#       rewritten as rows are measured: a job killed at its limit keeps what it measured.
# Where PyPI is reachable, before:
#   bash benchmarks/gpu_bench.sh --kit [--target-packages FILE] [--python-tag cp312]
#       the wheels the target lacks, in .whl/ (FILE: `pip list --format freeze` written on the target;
#       default: the example benchmarks/gpu_device_packages.txt); carry .whl/ with the checkout
#   bash benchmarks/gpu_bench.sh --dry-run --results DIR
#       the rehearsal on this CPU: every case at toy size, seeing only the target's packages + the kit
# After, here:
#   bash benchmarks/gpu_bench.sh --report DIR [DIR...]     # docs/benchmarks.md's section from what came back
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
esac

# ---- a run (GPU or dry): everything printed from here on also goes to DIR/gpu_bench.log
RESULTS=""
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
  case "${args[$i]}" in
    --results) RESULTS="${args[$((i + 1))]:-}" ;;
    --results=*) RESULTS="${args[$i]#--results=}" ;;
  esac
done
if [[ -z "$RESULTS" ]]; then
  RESULTS="$ROOT/runs/gpu_bench$([[ $mode == dry ]] && echo _dry || true)"
  set -- "$@" --results "$RESULTS"
fi
mkdir -p "$RESULTS"
LOG="$RESULTS/gpu_bench.log"
: > "$LOG"
exec > >(tee -a "$LOG") 2>&1
TEE=$!
finish() {  # the log is complete before this script returns
  local rc=$?
  exec >&- 2>&-
  wait "$TEE" 2>/dev/null || true
  exit "$rc"
}
trap finish EXIT
echo "[gpu_bench] $(date -u '+%Y-%m-%d %H:%M:%S UTC') $mode run: bash benchmarks/gpu_bench.sh $([[ $mode == dry ]] && echo "--dry-run " || true)$*"

if [[ "$mode" == dry ]]; then
  if ! "$PY" benchmarks/gpu_kit.py check --out "$WHEELS" >/dev/null 2>&1; then
    echo "[gpu_bench] note: the carry kit in $WHEELS is missing or not ready (bash benchmarks/gpu_bench.sh --kit);" \
         "the dry run itself uses this environment's copies of the kit's packages"
  fi
  # the CPU stand-ins for OpenRLHF's and megatron-core's CUDA-only calls, the ones the end-to-end tests
  # load into every process of their CPU cluster (docs/scaling.md, "CUDA-only seams"); never on a GPU
  export GPU_KIT_SITE="$ROOT/openrlhf_div/compat/cpu_site" OPENRLHF_DIV_CPU_SEAMS=1
  "$PY" benchmarks/gpu_kit.py device-view -- benchmarks/gpu_bench.py --dry-run "$@"
  exit $?
fi

# ---- on the GPU
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "[gpu_bench] no CUDA device visible to $PY: run 'bash benchmarks/gpu_bench.sh --dry-run' on a CPU"
  exit 2
fi
if ! "$PY" -c "import deepspeed, openrlhf, megatron.core, pydantic, torchdata, pylatexenc" >/dev/null 2>&1; then
  if ! compgen -G "$WHEELS/*.whl" >/dev/null; then
    echo "[gpu_bench] DeepSpeed / OpenRLHF / megatron-core are not installed and $WHEELS holds no kit:" \
         "build it where PyPI is reachable (bash benchmarks/gpu_bench.sh --kit) and carry .whl"
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
"$PY" benchmarks/gpu_bench.py "$@"
