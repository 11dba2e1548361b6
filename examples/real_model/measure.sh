#!/usr/bin/env bash
# The scaled-down run whose figures docs/real_model.md reports (nice'd: the machine is shared).
# About 18 CPU-minutes on one thread (measured 1088 CPU-s, docs/real_model.md); pass a different
# --out or more steps as extra arguments.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
exec nice -n 10 "$PY" "$ROOT/examples/real_model/run.py" --out "${OUT:-runs/real_model_small}" --steps 6 \
    --n-train 24 --n-eval 12 --n-samples 4 --max-new-tokens 32 --tau 1 --num-threads 1 "$@"
